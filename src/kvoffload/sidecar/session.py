"""One connection's verbs: :class:`Session`, synchronous, without asyncio or sockets.

Every verb of protocol v1 (``docs/spec/protocol-v1.md`` §5) is a method here
that takes the parsed request and returns the reply; ``connection.py`` reads
the frames, decides what runs where (§3.3) and calls these. Verbs that touch
the store run on a pool thread, so the state shared with the event loop (the
region allocator and the handles) is guarded by ``mu``.

Isolation (§6) is decided per request from the peer's credentials and the
service's *current* policy. A tenant the connection may not use gets the
empty-tenant answer; its ``lookup``, ``touch``, ``prepare_load`` and
``lease_load`` do the empty tenant's work too (the same store calls, under
:data:`~.service.DECOY_TENANT`, which never holds a chunk), so that neither
content nor timing tells a forbidden tenant from an empty one
(``scripts/bench_timing.py`` measures it; docs/threat-model.md).

A session is composed of its parts, each in its own module: the handle
table with the staging buffer (handles.py), the write flow (writes.py:
``prepare_store``/``lease_store``/``store`` → ``complete_store``), the read
flow (reads.py: ``prepare_load``/``lease_load`` → ``complete_load``) and the
admin verbs (admin.py). What stays here: hello and bye, isolation, the index
verbs, stats, the audit trail of verbs, and dispatch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvoffload.errors import ContractError
from kvoffload.keys import group_salt
from kvoffload.protocol import (
    MAX_FRAME,
    MAX_PROTOCOL_VERSION,
    MIN_PROTOCOL_VERSION,
    Abort,
    Ack,
    CompleteLoad,
    CompleteStore,
    Delete,
    DropCache,
    ErrorCode,
    ErrorReply,
    Fsck,
    Hello,
    HelloReply,
    Inspect,
    Invalidate,
    LeaseLoad,
    LeaseStore,
    Lookup,
    LookupLoad,
    LookupLoadReply,
    LookupReply,
    Ls,
    Namespaces,
    Op,
    PrepareLoad,
    PrepareLoadReply,
    PrepareStore,
    ProtocolError,
    Purge,
    PurgeOlder,
    RegionLoad,
    RegionStore,
    RegisterRegion,
    RegisterStaging,
    Reply,
    Request,
    SealedLoad,
    Stats,
    StatsReply,
    StoreBatch,
    Touch,
    close_fds,
    fake_salt,
    negotiate_version,
)
from kvoffload.staging import StagingBuffer, StagingError

from .access.padding import Pad, pads
from .admin import Admin
from .handles import Handle, Handles, WriteHandle
from .inplace import MAX_REGION_BYTES, Regions
from .peer import Peer
from .ports import TenantSettings
from .reads import EmitFn, Reads
from .service import DECOY_TENANT, Reject, Service, plainify
from .writes import Writes

log = logging.getLogger("kvoffload.server")

#: §6.1, §5.28: whether the peer may use a tenant, and the settings of its
#: lookup padding (None: its lookups are not padded).
_Decision = tuple[bool, "TenantSettings | None"]

#: The admin verbs (§6): each leaves an "admin" audit record, allowed or not.
_ADMIN_REQUESTS = (Purge, Fsck, Inspect, Ls, PurgeOlder, Invalidate, Namespaces, DropCache)


class Session:
    """The verb state of one connection: its peer, the tenants named in ``hello``,
    and its parts: the handle table with the staging buffer, the write and read
    flows, the admin verbs."""

    def __init__(self, service: Service, peer: Peer) -> None:
        self.service = service
        self.peer = peer
        self.version: int | None = None
        #: The revision of version 1 the client named in ``hello`` (0: none, §5.1).
        self.client_revision = 0
        self.tenants: frozenset[str] = frozenset()
        #: (tenant, namespace) whose contract this connection registered (§5.19).
        self.contracts_seen: set[tuple[str, bytes]] = set()
        # §6.1, §5.28: per tenant, whether the peer may use it and its lookup
        # padding, decided once per policy generation: (generation, decisions).
        self._decided: tuple[int, dict[str, _Decision]] = (-1, {})
        self.handles = Handles(service.store, service.config.max_handles, lambda: service.draining)
        self.writes = Writes(service, self.handles, self)
        self.reads = Reads(service, self.handles, self)
        self.admin = Admin(service, self.is_admin, self.peer_details)
        #: Region files addressed in place (§5.34), closed with the connection.
        self.regions = Regions(service, self)
        service.enter(self)

    def __repr__(self) -> str:
        return f"<connection pid={self.peer.pid} uid={self.peer.uid}>"

    # -- set-up (§5.1, §5.2) and the end (§5.13, §7) ---------------------------

    def hello(self, req: Hello) -> Reply:
        """§5.1: negotiate the version; real salts for permitted tenants, stable fake
        salts (§6) for the others. An error reply means: close the connection."""
        try:
            version = negotiate_version(req.min_version, req.max_version)
        except ProtocolError as exc:
            versions = (MIN_PROTOCOL_VERSION, MAX_PROTOCOL_VERSION)
            return ErrorReply("hello", exc.code, exc.message, versions)
        try:
            secret = self.service.config.secret
            salts = {
                t: self.chunk_salt(t) if self.may_use(t) else fake_salt(secret, t)
                for t in req.tenants
            }
            direct = {t: self.direct_ok(t) for t in req.tenants}
            for t in sorted(t for t in req.tenants if not self.may_use(t)):
                # Coalesced per (peer, tenant) by the log: a flood costs lines, not disk.
                self.service.audit(
                    "refused_access",
                    {**self.peer_details(), "verb": "hello", "tenant": t, "result": "refused"},
                )
        except Exception:
            log.exception("%r: hello failed", self)
            return ErrorReply("hello", ErrorCode.INTERNAL, "keyring failure")
        self.version = version
        self.client_revision = req.revision
        self.tenants = frozenset(req.tenants)
        log.info("%r: hello from %r, tenants %s", self, req.client, sorted(req.tenants))
        cfg = self.service.config
        return HelloReply(
            version=version,
            server_id=cfg.server_id,
            store_id=self.service.store_id,
            salts=salts,
            alignment=cfg.alignment,
            max_frame=MAX_FRAME,
            max_batch=cfg.max_batch,
            max_inflight=cfg.max_inflight,
            max_staging=cfg.max_staging,
            handle_ttl_s=cfg.handle_ttl_s,
            direct=direct,
            layerwise=True,
            store=True,
            complete_in_order=True,  # connection.py answers it on the loop (§5.29)
            chunkwise=True,
            lookup_load=True,  # §5.32: connection.py completes a request's handles first
            sealed_load=True,
            max_region=MAX_REGION_BYTES,  # §5.34, for a client of revision 17
        )

    def register_staging(self, req: RegisterStaging, fds: list[int]) -> Reply:
        """§5.2: map the sealed memfd once; every descriptor not kept is closed."""
        op = Op.REGISTER_STAGING.value
        max_staging = self.service.config.max_staging
        problem = None
        if self.handles.staging is not None:
            problem = "a staging buffer is already registered"
        elif len(fds) != 1:
            problem = f"register_staging takes exactly one fd, got {len(fds)}"
        elif req.size > max_staging:
            problem = f"staging of {req.size} bytes exceeds {max_staging}"
        if problem is not None:
            close_fds(fds)
            return ErrorReply(op, ErrorCode.BAD_REQUEST, problem)
        try:
            staging = StagingBuffer.from_fd(fds[0], req.size)
        except StagingError as exc:
            return ErrorReply(op, ErrorCode.BAD_REQUEST, str(exc))
        self.handles.register(staging, self.service.config.alignment)
        return Ack(Op.REGISTER_STAGING)

    def register_region(self, req: RegisterRegion, fds: list[int]) -> Reply:
        """§5.34: keep the peer's region file for positional I/O (inplace.py)."""
        return self.regions.register(req, fds)

    def bye(self) -> Reply:
        """§5.13: the reply; the connection sends it after every earlier reply, then closes."""
        return Ack(Op.BYE)

    def expire_handles(self, cutoff: float) -> list[Handle]:
        """§7: take the handles created before ``cutoff`` (monotonic); they are
        ``BAD_HANDLE`` from now on. The caller releases them (:meth:`release_all`)."""
        return self.handles.expire(cutoff)

    def open_handles(self) -> int:
        """§7: how many handles the session holds."""
        return self.handles.count()

    def release_all(self, handles: Sequence[Handle] | None = None) -> None:
        """§7, "a disconnect releases everything": release ``handles``, or all the
        session's (as by ``abort``). Call only once no verb of the session runs."""
        self.handles.release_all(handles, self)

    def close(self) -> None:
        """§7: unmap the staging buffer (after :meth:`release_all`) and leave the service."""
        self.handles.close()
        self.regions.close()
        self.service.forget(self)

    # -- isolation (§6) ----------------------------------------------------------

    def chunk_salt(self, tenant: str) -> bytes:
        """§5.1: the salt a permitted tenant's keys are derived with: its stored salt,
        bound to its trust group when it has one (keys-v1.md §12)."""
        group = self.service.policy.tenant(tenant).trust_group
        return group_salt(self.service.store.tenant_salt(tenant), group)

    def may_use(self, tenant: str) -> bool:
        """§6: does the *current* policy map this peer to ``tenant``?

        §6.1: decided once per policy generation (one integer compared per
        request); a revoked tenant is usable by no one.
        """
        return self._decide(tenant)[0]

    def _decide(self, tenant: str) -> _Decision:
        """``tenant``'s decisions under the current policy: taken from the table
        of the current generation, or made now and kept there.

        The generation is read before the policy, and a decision is kept only
        in the table of the generation read: a decision made while a swap runs
        (from the old policy or the new) lands in a table the swap's new
        generation has already superseded, never in the new one.
        """
        svc = self.service
        gen = svc.generation
        seen, table = self._decided
        if seen != gen:
            table = {}
            self._decided = (gen, table)
        d = table.get(tenant)
        if d is None:
            policy = svc.policy
            allowed = tenant not in svc.revoked and policy.may_use(
                self.peer.uid, self.peer.gids, tenant
            )
            try:
                settings: TenantSettings | None = policy.tenant(tenant)
            except ValueError:  # not a tenant id: nothing to pad (§5.28 pads listed tenants)
                settings = None
            d = (allowed, settings if settings is not None and pads(settings) else None)
            if len(table) < 1024:
                table[tenant] = d
        return d

    def revoke_tenants(self, tenants: frozenset[str], namespace: bytes | None = None) -> int:
        """§6.1: release every handle of ``tenants`` now (pending stores aborted with
        their reservations and leased files, load pins and regions freed); the
        handle numbers answer ``BAD_HANDLE`` from now on. With ``namespace``
        (a namespace purge), stores of the tenant's other namespaces are kept.
        How many were released."""

        def hit(v: Handle) -> bool:
            if v.tenant not in tenants:
                return False
            return namespace is None or not isinstance(v, WriteHandle) or v.namespace == namespace

        taken = self.handles.revoke(hit)
        self.release_all(taken)
        if taken:
            log.warning("%r: %d handle(s) of %s released: access revoked or purged",
                        self, len(taken), sorted(tenants))  # fmt: skip
        return len(taken)

    def direct_ok(self, tenant: str) -> bool:
        """§5.14: may this connection use the direct path for ``tenant``?

        The policy must allow it (``direct = true``, which implies no
        encryption), and the peer must be able to open the leased files: a
        member of the tenant's ``direct_group``, or the sidecar's own uid, or
        root. Handing out paths a worker cannot open would only turn every
        save into a failure.
        """
        if not self.may_use(tenant):
            return False
        settings = self.service.policy.tenant(tenant)
        if not settings.direct:
            return False
        if self.peer.uid in (0, os.geteuid()):
            return True
        return settings.direct_gid is not None and settings.direct_gid in self.peer.gids

    def is_admin(self) -> bool:
        """§6: the admin right of ``purge`` and ``fsck``."""
        return self.service.policy.is_admin(self.peer.uid, self.peer.gids)

    def listed(self, tenant: str) -> None:
        """§5: a tenant not named in ``hello`` is the client's own mistake."""
        if tenant not in self.tenants:
            raise Reject(ErrorCode.BAD_REQUEST, f"tenant {tenant!r} was not named in hello")

    # -- dispatch ------------------------------------------------------------------

    def execute(self, req: Request, emit: EmitFn | None = None) -> Reply:
        """Every verb after ``hello`` but ``register_staging`` and ``bye`` (§5);
        admin verbs and refusals leave an audit record (docs/spec/audit-v1.md §3).

        ``emit`` sends an interim frame of this request (a layer-wise
        ``prepare_load``, §5.26); without it such a load is answered whole."""
        return self._audited(req, self._execute(req, emit))

    def execute_inline(self, req: Request) -> Reply | None:
        """:meth:`execute` of a verb that can be answered without a wait, on the
        event loop (a hop to a pool thread and back costs more than its work),
        or None: then the caller runs :meth:`execute` on the pool. Inline are a
        ``complete_load`` that reports no corrupt chunk (it only releases what
        the handle holds) and a ``prepare_load`` answered from the index and the
        page cache (:meth:`prepare_load_inline`)."""
        try:
            if type(req) is CompleteLoad and not req.corrupt:
                reply: Reply | None = self.reads.complete_load(req)
            elif type(req) is PrepareLoad:
                reply = self.reads.prepare_load_inline(req)
            elif type(req) is LookupLoad:
                reply = self.lookup_load_inline(req)
            else:
                return None
        except Reject as exc:
            reply = ErrorReply(req.OP.value, exc.code, exc.message)
        return None if reply is None else self._audited(req, reply)

    def _audited(self, req: Request, reply: Reply) -> Reply:
        refused = isinstance(reply, ErrorReply) and reply.code is ErrorCode.FORBIDDEN
        if refused or isinstance(req, _ADMIN_REQUESTS):
            self._audit_verb(req, reply, refused)
        return reply

    # -- the audit log (docs/spec/audit-v1.md §3) ----------------------------------

    def peer_details(self) -> dict[str, object]:
        """Who, for an audit record: the peer's credentials (never data, keys or salts)."""
        p = self.peer
        return {"uid": p.uid, "gid": p.gids[0] if p.gids else None, "pid": p.pid}

    def _audit_verb(self, req: Request, reply: Reply, refused: bool) -> None:
        details: dict[str, object] = {**self.peer_details(), "verb": req.OP.value}
        tenant = getattr(req, "tenant", None)
        if tenant is not None:
            details["tenant"] = tenant
        namespace = getattr(req, "namespace", None)
        if isinstance(namespace, bytes):
            details["namespace"] = namespace.hex()
        if refused:
            details["result"] = "refused"
            self.service.audit("refused_access", details)
            return
        if isinstance(reply, ErrorReply):
            details["result"] = f"error {reply.code.name}"
        else:
            details["result"] = "ok"
            removed = getattr(reply, "removed", None)
            if isinstance(removed, int):
                details["chunks"] = removed
        for name in ("repair", "verify_data", "older_than_s"):
            value = getattr(req, name, None)
            if value is not None:
                details[name] = value
        self.service.audit("admin", details)

    def _execute(self, req: Request, emit: EmitFn | None) -> Reply:
        op = req.OP.value
        verb = _VERBS.get(type(req))
        try:
            if verb is None:
                raise Reject(ErrorCode.UNSUPPORTED, f"{op} is not served here")
            return verb(self, req, emit)
        except Reject as exc:
            return ErrorReply(op, exc.code, exc.message)

    # -- index verbs (§5.3, §5.9, §5.10) ---------------------------------------------

    def lookup_inline(self, req: Lookup) -> Reply | None:
        """§5.3 from the index alone, or None when the answer needs the disk.

        The engine's scheduler calls lookup per request: answered on the event
        loop when the index alone can (an LMDB read of microseconds, less than
        the hop to a pool thread and back). Anything needing the disk (a miss
        that probes for another node's file) or an unlisted tenant gets None and
        goes to the pool, so a slow filesystem never stalls the loop. A forbidden
        tenant takes the same path as an empty one, under the decoy tenant (§6);
        a padded tenant's lookups all go to the pool (connection.py, §5.28).
        """
        if req.tenant not in self.tenants:
            return None
        allowed = self.may_use(req.tenant)
        found = self.service.store.lookup_cached(req.tenant if allowed else DECOY_TENANT, req.keys)
        if found is None:
            return None
        return LookupReply(found if allowed else 0)

    def lookup(self, req: Lookup) -> Reply:
        """§5.3; a forbidden tenant finds 0, after the empty tenant's index walk (§6)."""
        self.listed(req.tenant)
        allowed = self.may_use(req.tenant)
        found = self.service.store.lookup(req.tenant if allowed else DECOY_TENANT, req.keys)
        return LookupReply(max(0, min(found, len(req.keys))) if allowed else 0)

    # -- lookup and load in one request, completes on the way (§5.32) ---------------

    def complete_piggyback(self, handles: Sequence[int]) -> tuple[int, ...]:
        """§5.32: complete each load handle of a request's ``complete`` as a
        ``complete_load`` without ``corrupt`` would (a handle released by a
        revocation or purge counts as completed); the handles that were no
        live load handle of this connection, for the reply's ``complete_failed``."""
        failed: list[int] = []
        for h in handles:
            try:
                self.reads.complete_load(CompleteLoad(h))
            except Reject:
                failed.append(h)
        return tuple(failed)

    def lookup_load_inline(self, req: LookupLoad) -> Reply | None:
        """:meth:`lookup_load` on the event loop where both halves can be
        answered there (:meth:`lookup_inline`, ``prepare_load_inline``), else None."""
        if req.tenant not in self.tenants:
            return None
        allowed = self.may_use(req.tenant)
        found = self.service.store.lookup_cached(req.tenant if allowed else DECOY_TENANT, req.keys)
        if found is None:
            return None
        prep = self.reads.prepare_load_inline(PrepareLoad(req.tenant, req.keys))
        if prep is None:
            return None
        return _folded(found if allowed else 0, prep)

    def lookup_load(self, req: LookupLoad) -> Reply:
        """§5.32: what ``lookup`` and then ``prepare_load`` of ``req.keys`` answer,
        in one reply (a whole-request error of the load is the request's error)."""
        found = self.lookup(Lookup(req.tenant, req.keys))
        assert isinstance(found, LookupReply)
        return _folded(found.found, self.reads.prepare_load(PrepareLoad(req.tenant, req.keys)))

    def lookup_pad(self, tenant: str) -> Pad | None:
        """§5.28: the padding of a lookup of ``tenant`` (its policy's ``lookup_floor``),
        for a permitted and a forbidden tenant alike; None for none or an unlisted one."""
        if tenant not in self.tenants:
            return None
        settings = self._decide(tenant)[1]
        return None if settings is None else self.service.padding.pad(tenant, settings)

    def lookup_fast(self, tenant: str, keys: Sequence[bytes]) -> int | None:
        """§5.3 as :meth:`lookup_inline` answers it, for a tenant named in ``hello``
        (the caller checked): the ``found`` of the reply, or None when the
        generic path must answer (a padded tenant, §5.28; an answer that needs
        the disk). Nothing is done before a None."""
        allowed, padding = self._decide(tenant)
        if padding is not None:
            return None
        found = self.service.store.lookup_cached(tenant if allowed else DECOY_TENANT, keys)
        if found is None:
            return None
        return found if allowed else 0

    def touch(self, req: Touch) -> Reply:
        """§5.9; for a forbidden tenant it succeeds, touching nothing (§6)."""
        self.listed(req.tenant)
        allowed = self.may_use(req.tenant)
        self.service.store.touch(req.tenant if allowed else DECOY_TENANT, req.keys)
        return Ack(Op.TOUCH)

    def stats(self) -> Reply:
        """§5.10: the tenant count is about other tenants, so for admins only."""
        svc = self.service
        stats = dict(svc.store.stats())
        admin = self.is_admin()
        if not admin:
            stats.pop("tenants", None)
        # §5.10: usage of the tenants this connection may use (an admin: all).
        stats["tenant_usage"] = {
            t: {"chunks": u.count, "bytes": u.bytes}
            for t, u in sorted(svc.store.tenant_usage().items())
            if admin or self.may_use(t)
        }
        # §5.28: padded lookups and floor overruns of the tenants it may see.
        stats["lookup_padding"] = svc.padding.summary(lambda t: admin or self.may_use(t))
        stats["server"] = {
            "server_id": svc.config.server_id,
            "connections": svc.session_count(),
            "protocol_version": self.version,
        }
        # §6.1: the policy in force and the last reload's outcome (revoked
        # tenant names are about other tenants: admins only).
        policy = svc.policy_state.to_stats(svc.revoked.tenants if admin else ())
        if not admin:
            policy.pop("revoked_tenants")
        stats["policy"] = policy
        # The KV-event feed: whether it is on; its counters are about every tenant's
        # saves, so for admins only (events-v1 §9).
        if svc.events is None:
            stats["events"] = {"enabled": False}
        else:
            stats["events"] = svc.events.stats() if admin else {"enabled": True}
        # §5.34: what the in-place verbs moved (every tenant's: counts only).
        stats["inplace"] = svc.inplace.snapshot()
        if svc.metrics is not None:
            stats.update(svc.metrics.summary())
        return StatsReply(plainify(stats))

    # -- contracts (§5.19) ---------------------------------------------------------------

    def register_contract(self, tenant: str, namespace: bytes, fields: Mapping[str, Any]) -> None:
        """§5.19: record a namespace's contract fields once they hash to it; fields that
        do not are BAD_REQUEST, and nothing of them is kept."""
        store = self.service.store
        if (tenant, namespace) in self.contracts_seen:
            return
        try:
            store.record_contract(tenant, namespace, fields)
        except ContractError as exc:
            raise Reject(ErrorCode.BAD_REQUEST, f"contract: {exc}") from None
        self.contracts_seen.add((tenant, namespace))

    # -- handles (§7) -------------------------------------------------------------------

    def abort(self, req: Abort) -> Reply:
        """§5.6: release whatever the handle holds; nothing is written (§8)."""
        handle = self.handles.take_any(req.handle)
        if handle is None and self.handles.revoked(req.handle) is not None:
            return Ack(Op.ABORT)  # §6.1: released already
        if handle is None:
            raise Reject(ErrorCode.BAD_HANDLE, f"no such handle {req.handle}")
        self.handles.release(handle)
        return Ack(Op.ABORT)


def _folded(found: int, prep: Reply) -> Reply:
    """§5.32: a ``lookup_load`` reply from its lookup's ``found`` and its load's reply."""
    if not isinstance(prep, PrepareLoadReply):
        if isinstance(prep, ErrorReply):
            return ErrorReply(Op.LOOKUP_LOAD.value, prep.code, prep.message)
        raise TypeError(f"prepare_load answered {prep!r}")
    return LookupLoadReply(prep.handle, prep.stop, prep.chunks, (), min(found, len(prep.chunks)))


#: How each verb after ``hello`` is served: request type → the part's method.
#: Looked up by the exact type (a lease verb subclasses its prepare verb), and
#: resolved on every call, so that a test can replace a part's method.
_VERBS: dict[type[Request], Callable[[Session, Any, EmitFn | None], Reply]] = {
    Lookup: lambda s, r, _: s.lookup(r),
    LookupLoad: lambda s, r, _: s.lookup_load(r),
    Touch: lambda s, r, _: s.touch(r),
    Delete: lambda s, r, _: s.writes.delete(r),
    PrepareStore: lambda s, r, _: s.writes.prepare_store(r),
    LeaseStore: lambda s, r, _: s.writes.lease_store(r),
    StoreBatch: lambda s, r, _: s.writes.store(r),
    CompleteStore: lambda s, r, _: s.writes.complete_store(r),
    PrepareLoad: lambda s, r, emit: s.reads.prepare_load(r, emit),
    LeaseLoad: lambda s, r, _: s.reads.lease_load(r),
    SealedLoad: lambda s, r, _: s.reads.sealed_load(r),
    CompleteLoad: lambda s, r, _: s.reads.complete_load(r),
    Abort: lambda s, r, _: s.abort(r),
    Stats: lambda s, r, _: s.stats(),
    Purge: lambda s, r, _: s.admin.purge(r),
    Fsck: lambda s, r, _: s.admin.fsck(r),
    Inspect: lambda s, r, _: s.admin.inspect(),
    Ls: lambda s, r, _: s.admin.ls(r),
    PurgeOlder: lambda s, r, _: s.admin.purge_older(r),
    Invalidate: lambda s, r, _: s.admin.invalidate(r),
    Namespaces: lambda s, r, _: s.admin.namespaces(r),
    DropCache: lambda s, r, _: s.admin.drop_cache(r),
    RegionStore: lambda s, r, _: s.regions.store(r),
    RegionLoad: lambda s, r, _: s.regions.load(r),
}


__all__ = ["DECOY_TENANT", "Session"]
