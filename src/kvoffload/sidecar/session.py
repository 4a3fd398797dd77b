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

The write and read verbs (``prepare_store``/``lease_store`` →
``complete_store``, ``prepare_load``/``lease_load`` → ``complete_load``) with
their two media live in ``transfers.py``, a mixin of :class:`Session`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

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
    DropCache,
    DropCacheReply,
    ErrorCode,
    ErrorReply,
    Fsck,
    FsckReply,
    Hello,
    HelloReply,
    Inspect,
    InspectReply,
    Invalidate,
    InvalidateReply,
    LeaseLoad,
    LeaseStore,
    Lookup,
    LookupReply,
    Ls,
    LsReply,
    Namespaces,
    NamespacesReply,
    Op,
    PrepareLoad,
    PrepareStore,
    ProtocolError,
    Purge,
    PurgeOlder,
    PurgeOlderReply,
    PurgeReply,
    RegisterStaging,
    Reply,
    Request,
    Stats,
    StatsReply,
    Store,
    Touch,
    close_fds,
    fake_salt,
    negotiate_version,
)
from kvoffload.staging import RegionAllocator, StagingBuffer, StagingError

from .access.padding import Pad
from .admin import LS_PAGE, inspect_report, ls_rows, purge_tiers
from .peer import Peer
from .ports import CacheAPI, ContractsAPI, StoreViewsAPI
from .service import DECOY_TENANT, Handle, LoadHandle, Reject, Service, WriteHandle, plainify
from .transfers import EmitFn, Transfers

log = logging.getLogger("kvoffload.server")

#: Namespace rows per reply of ``namespaces`` / ``invalidate`` (§5.20): a row with
#: its contract is under 1 KiB, so a page stays well inside MAX_FRAME.
NAMESPACES_PAGE = 500

_H = TypeVar("_H", WriteHandle, LoadHandle)
#: The admin verbs (§6): each leaves an "admin" audit record, allowed or not.
_ADMIN_REQUESTS = (Purge, Fsck, Inspect, Ls, PurgeOlder, Invalidate, Namespaces, DropCache)
#: Handles released by revocation whose complete/abort is still awaited, per connection.
_MAX_REVOKED_HANDLES = 4096


class Session(Transfers):
    """The verb state of one connection: its peer, the tenants named in ``hello``,
    the registered staging buffer with its region allocator, and the open handles."""

    def __init__(self, service: Service, peer: Peer) -> None:
        self.service = service
        self.peer = peer
        self.version: int | None = None
        self.tenants: frozenset[str] = frozenset()
        self.staging: StagingBuffer | None = None
        self.alloc: RegionAllocator | None = None
        # Pool threads and the loop both touch alloc and handles.
        self.mu = threading.Lock()
        self.handles: dict[int, Handle] = {}
        #: (tenant, namespace) whose contract this connection registered (§5.19).
        self.contracts_seen: set[tuple[str, bytes]] = set()
        self.next_handle = 1
        # §6.1: decisions of may_use, valid while the service's generation is _gen.
        self._gen = -1
        self._allowed: dict[str, bool] = {}
        # §6.1: handles released by a revocation or purge → their chunk count
        # (0 for a load): their complete/abort answers "nothing stored" once.
        self.revoked_handles: dict[int, int] = {}
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
        )

    def register_staging(self, req: RegisterStaging, fds: list[int]) -> Reply:
        """§5.2: map the sealed memfd once; every descriptor not kept is closed."""
        op = Op.REGISTER_STAGING.value
        max_staging = self.service.config.max_staging
        problem = None
        if self.staging is not None:
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
        self.staging = staging
        self.alloc = RegionAllocator(staging.size, self.service.config.alignment)
        return Ack(Op.REGISTER_STAGING)

    def bye(self) -> Reply:
        """§5.13: the reply; the connection sends it after every earlier reply, then closes."""
        return Ack(Op.BYE)

    def expire_handles(self, cutoff: float) -> list[Handle]:
        """§7: take the handles created before ``cutoff`` (monotonic); they are
        ``BAD_HANDLE`` from now on. The caller releases them (:meth:`release_all`)."""
        with self.mu:
            old = [h for h, v in self.handles.items() if v.created < cutoff]
            return [self.handles.pop(h) for h in old]

    def open_handles(self) -> int:
        """§7: how many handles the session holds."""
        with self.mu:
            return len(self.handles)

    def release_all(self, handles: Sequence[Handle] | None = None) -> None:
        """§7, "a disconnect releases everything": release ``handles``, or all the
        session's (as by ``abort``). Call only once no verb of the session runs."""
        if handles is None:
            with self.mu:
                handles = list(self.handles.values())
                self.handles.clear()
        for h in handles:
            try:
                self._release(h)
            except Exception:
                log.exception("%r: releasing a handle failed", self)

    def close(self) -> None:
        """§7: unmap the staging buffer (after :meth:`release_all`) and leave the service."""
        if self.staging is not None:
            self.staging.close()
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
        svc = self.service
        gen = svc.generation
        if gen != self._gen:
            self._allowed = {}
            self._gen = gen
        ok = self._allowed.get(tenant)
        if ok is None:
            ok = tenant not in svc.revoked and svc.policy.may_use(
                self.peer.uid, self.peer.gids, tenant
            )
            if len(self._allowed) < 1024:
                self._allowed[tenant] = ok
        return ok

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

        with self.mu:
            gone = [h for h, v in self.handles.items() if hit(v)]
            taken = [self.handles.pop(h) for h in gone]
            for h, v in zip(gone, taken, strict=True):
                if len(self.revoked_handles) < _MAX_REVOKED_HANDLES:
                    self.revoked_handles[h] = len(v.slots) if isinstance(v, WriteHandle) else 0
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

    def _listed(self, tenant: str) -> None:
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
                reply: Reply | None = self.complete_load(req)
            elif type(req) is PrepareLoad:
                reply = self.prepare_load_inline(req)
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
        try:
            match req:
                case Lookup():
                    return self.lookup(req)
                case Touch():
                    return self.touch(req)
                # The lease verbs subclass the prepare verbs: match them first.
                case LeaseStore():
                    return self.lease_store(req)
                case LeaseLoad():
                    return self.lease_load(req)
                case PrepareStore():
                    return self.prepare_store(req)
                case CompleteStore():
                    return self.complete_store(req)
                case Store():
                    return self.store(req)
                case PrepareLoad():
                    return self.prepare_load(req, emit)
                case CompleteLoad():
                    return self.complete_load(req)
                case Abort():
                    return self.abort(req)
                case Stats():
                    return self.stats()
                case Purge():
                    return self.purge(req)
                case Fsck():
                    return self.fsck(req)
                case Inspect():
                    return self.inspect()
                case Ls():
                    return self.ls(req)
                case PurgeOlder():
                    return self.purge_older(req)
                case Invalidate():
                    return self.invalidate(req)
                case Namespaces():
                    return self.namespaces(req)
                case DropCache():
                    return self.drop_cache()
                case _:
                    raise Reject(ErrorCode.UNSUPPORTED, f"{op} is not served here")
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
        self._listed(req.tenant)
        allowed = self.may_use(req.tenant)
        found = self.service.store.lookup(req.tenant if allowed else DECOY_TENANT, req.keys)
        return LookupReply(max(0, min(found, len(req.keys))) if allowed else 0)

    def lookup_pad(self, tenant: str) -> Pad | None:
        """§5.28: the padding of a lookup of ``tenant`` (its policy's ``lookup_floor``),
        for a permitted and a forbidden tenant alike; None for none or an unlisted one."""
        if tenant not in self.tenants:
            return None
        return self.service.padding.pad(tenant, self.service.policy.tenant(tenant))

    def touch(self, req: Touch) -> Reply:
        """§5.9; for a forbidden tenant it succeeds, touching nothing (§6)."""
        self._listed(req.tenant)
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
        store = svc.store
        if isinstance(store, StoreViewsAPI):
            # §5.10: usage of the tenants this connection may use (an admin: all).
            stats["tenant_usage"] = {
                t: {"chunks": u.count, "bytes": u.bytes}
                for t, u in sorted(store.tenant_usage().items())
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
        if svc.metrics is not None:
            stats.update(svc.metrics.summary())
        return StatsReply(plainify(stats))

    # -- admin verbs (§5.11, §5.12) ------------------------------------------------------

    def _admin(self, verb: str) -> None:
        if not self.is_admin():
            raise Reject(ErrorCode.FORBIDDEN, f"{verb} needs the admin right")

    def _views(self, verb: str) -> StoreViewsAPI:
        store = self.service.store
        if not isinstance(store, StoreViewsAPI):
            raise Reject(ErrorCode.UNSUPPORTED, f"{verb}: this store has no views")
        return store

    def purge(self, req: Purge) -> Reply:
        """§5.11 (admin); the tenant need not be named in ``hello``.

        A whole-tenant purge replies once the tenant's chunks are out of the
        index too (its keys are destroyed first), so that the next answer of
        this sidecar no longer counts them.
        """
        self._admin("purge")
        svc = self.service
        store = svc.store
        reached: tuple[str, ...] = ()  # a store without views does not say
        if isinstance(store, StoreViewsAPI):
            report = store.purge(req.tenant, req.namespace)
            removed, reached = report.removed, report.tiers
        elif req.namespace is not None:
            removed = store.purge_namespace(req.tenant, req.namespace)
        else:
            removed = store.purge_tenant(req.tenant)
        svc.purged(req.tenant, req.namespace)
        tiers = purge_tiers(reached, events=svc.events is not None) if req.tiers else {}
        return PurgeReply(removed, tiers)

    def fsck(self, req: Fsck) -> Reply:
        """§5.12 (admin)."""
        self._admin("fsck")
        store = self.service.store
        if req.verify_data and isinstance(store, StoreViewsAPI):
            report = store.fsck(req.repair, verify_data=True)
        else:
            report = store.fsck(repair=req.repair)
        out = plainify(report.to_dict())
        out["verified_data"] = bool(req.verify_data and isinstance(store, StoreViewsAPI))
        return FsckReply(out)

    def inspect(self) -> Reply:
        """§5.16 (admin): what ``kvoffload inspect`` prints."""
        self._admin("inspect")
        store = self._views("inspect")
        return InspectReply(plainify(inspect_report(store, store.config.root)))

    def ls(self, req: Ls) -> Reply:
        """§5.17 (admin): one page of what ``kvoffload ls`` prints."""
        self._admin("ls")
        store = self._views("ls")
        limit = LS_PAGE if req.limit == 0 else min(req.limit, LS_PAGE)
        rows, more = ls_rows(
            store,
            tenant=req.tenant,
            namespace=req.namespace,
            older_than_s=req.older_than_s,
            newer_than_s=req.newer_than_s,
            skip=req.skip,
            limit=limit,
        )
        return LsReply({"chunks": plainify(rows), "more": more})

    def _register_contract(self, tenant: str, namespace: bytes, fields: Mapping[str, Any]) -> None:
        """§5.19: record a namespace's contract fields once they hash to it; fields that
        do not are BAD_REQUEST, and nothing of them is kept."""
        store = self.service.store
        if (tenant, namespace) in self.contracts_seen or not isinstance(store, ContractsAPI):
            return
        try:
            store.record_contract(tenant, namespace, fields)
        except ContractError as exc:
            raise Reject(ErrorCode.BAD_REQUEST, f"contract: {exc}") from None
        self.contracts_seen.add((tenant, namespace))

    def _contracts(self, verb: str) -> ContractsAPI:
        store = self.service.store
        if not isinstance(store, ContractsAPI):
            raise Reject(ErrorCode.UNSUPPORTED, f"{verb}: this store keeps no contracts")
        return store

    def invalidate(self, req: Invalidate) -> Reply:
        """§5.20 (admin): purge the namespaces built under the selected contract field."""
        self._admin("invalidate")
        store = self._contracts("invalidate")
        actor = {
            "uid": self.peer.uid,
            "gid": self.peer.gids[0] if self.peer.gids else None,
            "pid": self.peer.pid,
            "verb": "invalidate",
        }
        try:
            report = store.invalidate(
                req.selector(), tenant=req.tenant, dry_run=req.dry_run, actor=actor
            )
        except ContractError as exc:
            raise Reject(ErrorCode.BAD_REQUEST, str(exc)) from None
        # The counts cover everything; the lists are cut to fit a frame (§5.20).
        for key in ("namespaces", "unknown_contract"):
            rows = report[key]
            report[f"{key}_total"] = len(rows)
            report[key] = rows[:NAMESPACES_PAGE]
        return InvalidateReply(plainify(report))

    def namespaces(self, req: Namespaces) -> Reply:
        """§5.20 (admin): the namespaces with their contract fields, sizes and ages."""
        self._admin("namespaces")
        store = self._contracts("namespaces")
        rows = store.namespaces_report(req.tenant)
        page = rows[req.skip : req.skip + NAMESPACES_PAGE]
        more = len(rows) > req.skip + NAMESPACES_PAGE
        return NamespacesReply({"namespaces": plainify(page), "more": more})

    def drop_cache(self) -> Reply:
        """§5.31 (admin): empty the RAM tier; the next load of every chunk reads its file."""
        self._admin("drop_cache")
        store = self.service.store
        if not isinstance(store, CacheAPI):
            raise Reject(ErrorCode.UNSUPPORTED, "drop_cache: this store has no RAM tier")
        dropped, held = store.drop_cache()
        return DropCacheReply(dropped, held)

    def purge_older(self, req: PurgeOlder) -> Reply:
        """§5.18 (admin): remove chunks older than ``older_than_s``, of one tenant or all."""
        self._admin("purge_older")
        store = self._views("purge_older")
        return PurgeOlderReply(store.purge_older_than(req.older_than_s, req.tenant))

    # -- handles (§7) -------------------------------------------------------------------

    def _open_handle_slot(self) -> None:
        if self.service.draining:
            raise Reject(ErrorCode.SHUTTING_DOWN, "the sidecar is shutting down")
        with self.mu:
            if len(self.handles) >= self.service.config.max_handles:
                raise Reject(ErrorCode.BUSY, "too many open handles")

    def _registered(self) -> tuple[StagingBuffer, RegionAllocator]:
        if self.staging is None or self.alloc is None:
            raise Reject(ErrorCode.NOT_REGISTERED, "register a staging buffer first")
        return self.staging, self.alloc

    def _add_handle(self, handle: Handle) -> int:
        with self.mu:
            h = self.next_handle
            self.next_handle += 1
            self.handles[h] = handle
        return h

    def _take_handle(self, h: int, kind: type[_H]) -> _H:
        """Remove and return the handle: whoever takes it (a complete, an abort,
        the expiry sweep) is the only one to release it."""
        with self.mu:
            handle = self.handles.get(h)
            if not isinstance(handle, kind):
                raise Reject(ErrorCode.BAD_HANDLE, f"no such handle {h}")
            del self.handles[h]
        return handle

    def _free(self, offset: int) -> None:
        assert self.alloc is not None
        with self.mu:
            self.alloc.free(offset)

    def _release(self, h: Handle) -> None:
        """Everything a handle holds: regions, reservations, leased files, pins."""
        store = self.service.store
        if isinstance(h, WriteHandle):
            for lw in h.leased:
                store.cancel_lease(lw.lease)  # a no-op for a published one
            for sw in h.staged:
                sw.reservation.release()
                self._free(sw.offset)
            return
        for off in h.offsets:
            self._free(off)
        if h.keys:
            store.unpin(h.tenant, h.keys)

    def revoked_handle(self, h: int) -> int | None:
        """§6.1: the chunk count of a handle a revocation or purge released (once)."""
        with self.mu:
            return self.revoked_handles.pop(h, None)

    def abort(self, req: Abort) -> Reply:
        """§5.6: release whatever the handle holds; nothing is written (§8)."""
        with self.mu:
            handle = self.handles.pop(req.handle, None)
        if handle is None and self.revoked_handle(req.handle) is not None:
            return Ack(Op.ABORT)  # §6.1: released already
        if handle is None:
            raise Reject(ErrorCode.BAD_HANDLE, f"no such handle {req.handle}")
        self._release(handle)
        return Ack(Op.ABORT)


__all__ = ["DECOY_TENANT", "Session"]
