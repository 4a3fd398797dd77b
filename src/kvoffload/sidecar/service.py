"""The sidecar's verb layer, shared part: :class:`Service` and the handle types.

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
import fcntl
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol, cast

from kvoffload.errors import Reject
from kvoffload.posix import atomic_create
from kvoffload.protocol import EngineBlocks, LeaseSlot, StoreSlot

from .metrics import Metrics
from .padding import LookupPadding
from .ports import PolicyAPI, RetentionSettings, StoreAPI
from .revocation import PolicyState, RevokedSet

if TYPE_CHECKING:
    from .server import ServerConfig
    from .session import Session
    from .store import Reservation, StoreLease

log = logging.getLogger("kvoffload.server")

SECRET_SIZE = 32

#: The tenant under which a forbidden tenant's lookups, touches and loads run
#: (protocol-v1 §6): the same code path and store calls as a real, empty
#: tenant's, so that timing does not tell the two apart. "~" is outside the
#: tenant-id alphabet, so no request can name it and it never holds a chunk.
DECOY_TENANT: Final = "~forbidden"


@dataclass(frozen=True)
class Peer:
    """The credentials of a connection's peer (``SO_PEERCRED``), read at accept time."""

    pid: int
    uid: int
    gids: tuple[int, ...]


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


# ---------------------------------------------------------------------------
# Handles (protocol-v1.md §7): what a prepare_* holds until complete, abort or expiry


@dataclass
class StagedWrite:
    """One chunk of a ``prepare_store`` with status ``write``: its region and reservation."""

    index: int
    key: bytes
    layers: tuple[int, ...]
    offset: int
    reservation: Reservation


@dataclass
class LeasedWrite:
    """One chunk of a ``lease_store`` with status ``write``: its leased temp file."""

    index: int
    lease: StoreLease


class EventsAPI(Protocol):
    """The KV-event feed as the verbs use it (kvoffload.sidecar.events.SidecarEvents)."""

    def record(self, tenant: str, chunk_key: bytes, blocks: EngineBlocks) -> bool: ...

    def policy_changed(self) -> None: ...


@dataclass
class WriteHandle:
    """A ``prepare_store`` (``staged``) or a ``lease_store`` (``leased``); one list is empty."""

    tenant: str
    namespace: bytes
    encrypt: bool
    ttl_s: float | None
    slots: tuple[StoreSlot, ...] | tuple[LeaseSlot, ...]
    staged: list[StagedWrite]
    leased: list[LeasedWrite]
    created: float
    #: ``blocks`` of the request's chunks by index (protocol-v1 §5.4), for KV events.
    blocks: dict[int, EngineBlocks] = field(default_factory=dict)


@dataclass
class LoadHandle:
    """A ``prepare_load`` (regions in ``offsets``) or a ``lease_load`` (``direct``):
    the pinned keys, and the regions holding their bytes."""

    tenant: str
    keys: list[bytes]
    offsets: list[int]
    created: float
    direct: bool = False


Handle = WriteHandle | LoadHandle


# ---------------------------------------------------------------------------
# The shared state


#: Whether a policy's tenant-settings class has the retention limits, decided
#: once per class. The store asks for every chunk it reads (``_is_expired``),
#: and an isinstance check against a runtime-checkable Protocol walks the
#: Protocol's members each time: 10-30 µs, a tenth of a lookup's budget.
_RETENTION_TYPES: dict[type, bool] = {}


def _has_retention(settings: object) -> bool:
    kind = type(settings)
    known = _RETENTION_TYPES.get(kind)
    if known is None:
        known = _RETENTION_TYPES[kind] = isinstance(settings, RetentionSettings)
    return known


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
    ) -> None:
        self.store = store
        self.config = config
        #: Tenants revoked by a reload (revocation.py); persisted beside the index.
        self.revoked = RevokedSet(getattr(config, "revoked_file", None))
        #: Bumped by every policy swap; sessions re-check their decisions on a change.
        self.generation = 0
        self.policy_state = PolicyState(source=str(getattr(policy, "source", "<built-in>")))
        self._policy = policy
        # Tenants the file lost while the daemon was down are revoked now.
        revoked, restored = self.revoked.apply(policy)
        if revoked or restored:
            log.warning("policy at start: revoked %s, restored %s", revoked, restored)
            record = getattr(store, "record_audit", None)
            if record is not None:
                record("revoke", {"trigger": "start", "revoked": revoked,
                                  "restored": restored, "result": "ok"})  # fmt: skip
        self.metrics = metrics
        self.store_id = config.store_id or str(store.stats().get("store_id", "unknown"))
        self.budget = ByteBudget(config.max_inflight_bytes)
        self.draining = False
        #: The KV-event feed (kvoffload.sidecar.events), when ``[events]`` enables it.
        self.events: EventsAPI | None = None
        #: Padded lookups (a tenant's lookup_floor): delays drawn, overruns counted.
        self.padding = LookupPadding(metrics)
        self._mu = threading.Lock()
        self._sessions: set[Session] = set()
        set_retention = getattr(store, "set_retention", None)
        if callable(set_retention):
            # Read through self.policy on every call: a reload applies at once.
            set_retention(self.retention_of)

    def retention_of(self, tenant: str) -> RetentionSettings | None:
        """The tenant's retention limits under the *current* policy."""
        settings = self.policy.tenant(tenant)
        if _has_retention(settings):
            return cast(RetentionSettings, settings)
        return None

    def audit(self, event: str, details: dict[str, Any]) -> None:
        """One audit record (docs/spec/audit-v1.md) through the store; a failure
        to write it is logged, never turned into the client's error."""
        record = getattr(self.store, "record_audit", None)
        if not callable(record):
            return
        try:
            record(event, details)
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
        cancel = getattr(self.store, "cancel_loads", None)
        if cancel is not None:
            for t in sorted(lost_tenants):
                cancel(t)
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

    def enter(self, session: Session) -> None:
        """A new session (``Session.__init__``); :meth:`forget` is its ``close``."""
        with self._mu:
            self._sessions.add(session)

    def forget(self, session: Session) -> None:
        with self._mu:
            self._sessions.discard(session)

    def sessions(self) -> list[Session]:
        with self._mu:
            return list(self._sessions)

    def session_count(self) -> int:
        with self._mu:
            return len(self._sessions)


# ---------------------------------------------------------------------------
# The persistent secret behind fake salts


def load_or_create_secret(path: str | os.PathLike[str]) -> bytes:
    """The persistent secret behind fake salts (protocol-v1.md §5.1), created 0600 on first use.

    It must persist: a fake salt that changed on restart would tell a prober
    the tenant is not real, since real salts never change.

    Creation is atomic: the secret is written and fsync'd under a temp name in
    the same directory, linked to its name (a link never replaces) and the
    directory fsync'd. A crash leaves no file or the whole one; of two first
    starts at once, one creates it and the other reads that one.

    A file shorter than 32 bytes can only be what a creation that crashed
    left (before this, the file was created first and written after), so no
    fake salt was ever derived from it: it is replaced atomically by a new
    secret, with a warning in the log. A longer file was not written by the
    sidecar and is refused (ValueError) with what to do.
    """
    p = Path(path)
    for _ in range(8):
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            secret = os.urandom(SECRET_SIZE)
            try:
                atomic_create(p, secret, mode=0o600)
            except FileExistsError:
                continue  # another start created it first: use that one
            return secret
        if len(data) == SECRET_SIZE:
            return data
        if len(data) > SECRET_SIZE:
            raise ValueError(
                f"{p}: server secret is {len(data)} bytes, not {SECRET_SIZE}, and was not "
                "written by the sidecar; restore the original or delete the file to have a "
                "new one created (fake salts then change once)"
            )
        _replace_torn_secret(p)
    raise RuntimeError(f"{p}: the server secret keeps changing; is another process writing it?")


def _replace_torn_secret(p: Path) -> None:
    """Replace a short secret file, unless another start (holding its lock) did already."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        st = os.fstat(fd)
        try:
            now = os.stat(p)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino) or st.st_size >= SECRET_SIZE:
            return
        log.warning(
            "%s: server secret is %d bytes, left by a start that crashed while creating it; "
            "replacing it with a new one",
            p,
            st.st_size,
        )
        atomic_create(p, os.urandom(SECRET_SIZE), mode=0o600, replace=True)
    finally:
        os.close(fd)


def payload_of(info: object) -> int | None:
    """Plaintext bytes of a chunk from ``payload_info``: an index record or layer sizes."""
    if info is None:
        return None
    if isinstance(info, list | tuple):
        return sum(int(n) for n in info)
    payload = getattr(info, "payload", None)
    return int(payload) if isinstance(payload, int) else None


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
    "SECRET_SIZE",
    "ByteBudget",
    "Handle",
    "LeasedWrite",
    "LoadHandle",
    "Peer",
    "Reject",
    "Service",
    "StagedWrite",
    "WriteHandle",
    "load_or_create_secret",
]
