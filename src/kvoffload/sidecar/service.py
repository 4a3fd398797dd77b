"""The sidecar's verb layer, shared part: :class:`Service`.

::

    Server (server.py)        listen, accept, sweep, drain
      └─ Connection           the asyncio frame loop of one socket (connection.py)
           └─ Session         every verb of protocol v1, synchronous (session.py)
                └─ Service    what all sessions share: store, policy, secret,
                              byte budget, configuration (this module)

Nothing here or in ``session.py`` knows about asyncio or sockets: a verb is a
plain method call that may block (it runs on the server's thread pool), so
the protocol's rules (``docs/spec/protocol-v1.md`` §5 to §8) can be tested
without a socket.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol

from kvoffload.errors import Reject
from kvoffload.protocol import EngineBlocks

from .access.padding import LookupPadding
from .access.revocation import PolicyState, RevokedSet
from .handles import Handle
from .metrics import Metrics
from .peer import Peer
from .ports import PolicyAPI, RetentionSettings, StoreAPI

if TYPE_CHECKING:
    from .config import ServerConfig

log = logging.getLogger("kvoffload.server")

#: The tenant under which a forbidden tenant's lookups, touches and loads run
#: (protocol-v1 §6): the same code path and store calls as a real, empty
#: tenant's, so that timing does not tell the two apart. "~" is outside the
#: tenant-id alphabet, so no request can name it and it never holds a chunk.
DECOY_TENANT: Final = "~forbidden"


#: A table's mark for "not decided yet" (None is an answer).
_UNKNOWN: Final = object()
#: Decisions kept per policy generation; beyond it, each is made afresh.
_MAX_DECIDED: Final = 4096


class ByteBudget:
    """Payload bytes the pool may be sealing, writing, reading or opening at once.

    Data verbs wait here (in a pool thread) until their bytes fit, so a burst
    of large requests queues as small control messages, never as payload
    copies: the payload itself stays in the clients' staging buffers. A
    request larger than the whole budget waits until it runs alone.
    """

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError("the in-flight byte budget must be positive")
        self.limit = limit
        self.in_use = 0
        self._cv = threading.Condition()

    @contextlib.contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        n = min(nbytes, self.limit)
        with self._cv:
            self._cv.wait_for(lambda: self.in_use + n <= self.limit)
            self.in_use += n
        try:
            yield
        finally:
            with self._cv:
                self.in_use -= n
                self._cv.notify_all()


class InplaceCounts:
    """Chunks and bytes the in-place verbs moved (protocol-v1 §5.34), for ``stats``."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self.counts: dict[str, int] = {}

    def add(self, **n: int) -> None:
        with self._mu:
            for k, v in n.items():
                self.counts[k] = self.counts.get(k, 0) + v

    def snapshot(self) -> dict[str, int]:
        with self._mu:
            return dict(self.counts)


class EventsAPI(Protocol):
    """The KV-event feed as the verbs use it (kvoffload.sidecar.events.SidecarEvents)."""

    def record(self, tenant: str, chunk_key: bytes, blocks: EngineBlocks) -> bool: ...

    def saved(self, tenant: str, written: int, with_hashes: int) -> None: ...

    def policy_changed(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...


# ---------------------------------------------------------------------------
# The shared state


class LiveSession(Protocol):
    """A connection's session as the service and the server's sweep see it
    (session.py's ``Session``; a Protocol so that this module needs no import of it)."""

    peer: Peer
    tenants: frozenset[str]

    def may_use(self, tenant: str) -> bool: ...

    def revoke_tenants(self, tenants: frozenset[str], namespace: bytes | None = None) -> int: ...

    def expire_handles(self, cutoff: float) -> list[Handle]: ...

    def release_all(self, handles: Sequence[Handle] | None = None) -> None: ...


class Service:
    """What every session of one sidecar shares: the store, the policy, the secret
    behind fake salts (§5.1), the in-flight byte budget and the configuration.

    ``policy`` may be replaced at any time (a reload); each request reads it
    afresh (§6), so a revoked grant applies to the next request of an open
    connection. ``draining`` makes new ``prepare_*`` answer ``SHUTTING_DOWN``.
    """

    def __init__(
        self,
        store: StoreAPI,
        policy: PolicyAPI,
        config: ServerConfig,
        metrics: Metrics | None = None,
        events: EventsAPI | None = None,
        revoked: RevokedSet | None = None,
    ) -> None:
        self.store = store
        self.config = config
        #: Tenants revoked by a reload (revocation.py); persisted beside the index.
        self.revoked = revoked if revoked is not None else RevokedSet(config.revoked_file)
        #: Bumped by every policy swap; sessions re-check their decisions on a change.
        self.generation = 0
        self.policy_state = PolicyState(source=policy.source)
        self._policy = policy
        # Tenants the file lost while the daemon was down are revoked now.
        lost, restored = self.revoked.apply(policy)
        if lost or restored:
            log.warning("policy at start: revoked %s, restored %s", lost, restored)
            store.record_audit("revoke", {"trigger": "start", "revoked": lost,
                                          "restored": restored, "result": "ok"})  # fmt: skip
        self.metrics = metrics
        self.store_id = config.store_id or str(store.stats().get("store_id", "unknown"))
        self.budget = ByteBudget(config.max_inflight_bytes)
        self.draining = False
        #: The KV-event feed (kvoffload.sidecar.events), when ``[events]`` enables it.
        self.events = events
        #: Padded lookups (a tenant's lookup_floor): delays drawn, overruns counted.
        self.padding = LookupPadding(metrics)
        #: What the in-place verbs moved (§5.34): ``stats`` reports it.
        self.inplace = InplaceCounts()
        self._mu = threading.Lock()
        self._sessions: set[LiveSession] = set()
        #: retention_of's answers: (the generation they were read in, tenant → settings).
        self._retention: tuple[int, dict[str, object]] = (-1, {})
        # Read through self.policy (per generation): a reload applies at once.
        store.set_retention(self.retention_of)

    def retention_of(self, tenant: str) -> RetentionSettings | None:
        """The tenant's retention limits under the *current* policy; None for what
        is no tenant id (the decoy of §6: nothing of it is stored).

        The store asks on every lookup and read: answered from a table of the
        current policy generation (the generation read before the policy, so
        an answer taken while a swap runs is kept only in a table the swap has
        superseded)."""
        gen = self.generation
        seen, table = self._retention
        if seen != gen:
            table = {}
            self._retention = (gen, table)
        settings = table.get(tenant, _UNKNOWN)
        if settings is _UNKNOWN:
            try:
                settings = self.policy.tenant(tenant)
            except ValueError:
                settings = None
            if len(table) < _MAX_DECIDED:
                table[tenant] = settings
        return settings  # type: ignore[return-value]

    def audit(self, event: str, details: dict[str, Any]) -> None:
        """One audit record (docs/spec/audit-v1.md) through the store; a failure
        to write it is logged, never turned into the client's error."""
        try:
            self.store.record_audit(event, details)
        except Exception as exc:
            log.error("audit record %s not written: %s", event, exc)

    # -- the policy and revocation (protocol-v1.md §6.1) -----------------------------

    @property
    def policy(self) -> PolicyAPI:
        return self._policy

    @policy.setter
    def policy(self, policy: PolicyAPI) -> None:
        self.swap_policy(policy)

    def swap_policy(self, policy: PolicyAPI) -> dict[str, Any]:
        """Put ``policy`` in force now; what it took away, for the log and the audit.

        Tenants the old policy named and the new one does not are revoked
        (persisted first); a tenant a new grant names is restored. Then the
        generation moves, so every session's next request decides afresh, and
        what a connection may no longer hold is taken from it at once: its
        handles of the tenants it lost are released (pending stores aborted,
        their reservations and leased files dropped; load pins and regions
        freed) and every load of such a tenant in flight is cancelled before
        its next layer reaches a staging buffer.
        """
        before = {s: {t: s.may_use(t) for t in s.tenants} for s in self.sessions()}
        revoked, restored = self.revoked.apply(policy)
        with self._mu:
            self._policy = policy
            self.generation += 1
            self.policy_state.generation = self.generation
        lost_tenants: set[str] = set(revoked)
        connections: list[dict[str, Any]] = []
        for session, allowed in before.items():
            lost = sorted(t for t, ok in allowed.items() if ok and not session.may_use(t))
            if not lost:
                continue
            lost_tenants.update(lost)
            released = session.revoke_tenants(frozenset(lost))
            p = session.peer
            connections.append(
                {"pid": p.pid, "uid": p.uid, "gid": p.gids[0] if p.gids else None,
                 "tenants": lost, "handles_released": released}
            )  # fmt: skip
        for t in sorted(lost_tenants):
            self.store.cancel_loads(t)
        if self.events is not None:
            # What the policy no longer publishes is withdrawn from the feed, and
            # every subscriber is checked again (events-v1 §7, §7.1).
            self.events.policy_changed()
        return {
            "generation": self.generation,
            "revoked": revoked,
            "restored": restored,
            "connections": connections,
        }

    def purged(self, tenant: str, namespace: bytes | None = None) -> int:
        """A purge of ``tenant`` (whole or a namespace): every connection's handles of
        it are released (pending stores aborted, leases dropped, pins freed);
        the store cancels the loads in flight. Handles released."""
        return sum(s.revoke_tenants(frozenset((tenant,)), namespace) for s in self.sessions())

    def enter(self, session: LiveSession) -> None:
        """A new session (``Session.__init__``); :meth:`forget` is its ``close``."""
        with self._mu:
            self._sessions.add(session)

    def forget(self, session: LiveSession) -> None:
        with self._mu:
            self._sessions.discard(session)

    def sessions(self) -> list[LiveSession]:
        with self._mu:
            return list(self._sessions)

    def session_count(self) -> int:
        with self._mu:
            return len(self._sessions)


def plainify(value: Any, depth: int = 0) -> Any:
    """Make a stats or fsck value msgpack-safe (paths, enums and such become strings)."""
    if depth > 16:
        return str(value)
    if value is None or isinstance(value, bool | int | float | str | bytes):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**63:
            return str(value)
        return value
    if isinstance(value, Mapping):
        return {str(k): plainify(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [plainify(v, depth + 1) for v in value]
    return str(value)


__all__ = [
    "DECOY_TENANT",
    "ByteBudget",
    "EventsAPI",
    "LiveSession",
    "Reject",
    "Service",
]
