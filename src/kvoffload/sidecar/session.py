"""One connection's verbs: :class:`Session`, synchronous, without asyncio or sockets.

Every verb of protocol v1 (``docs/spec/protocol-v1.md`` §5) is a method here
that takes the parsed request and returns the reply; ``connection.py`` reads
the frames, decides what runs where (§3.3) and calls these. Verbs that touch
the store run on a pool thread, so the state shared with the event loop (the
region allocator and the handles) is guarded by ``mu``.

Isolation (§6) is decided per request from the peer's credentials and the
service's *current* policy. A tenant the connection may not use gets the
empty-tenant answer before the store is consulted, so neither content nor
timing tells whether it exists.

Writes and reads each have one flow for both media: a region of the staging
buffer (``prepare_store``/``prepare_load``) or a file of the store handed to
the worker (``lease_store``/``lease_load``, the direct path). Only the step
that claims the medium for one chunk, and the step that commits a completed
write, differ.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvoffload.protocol import (
    MAX_FRAME,
    MAX_PROTOCOL_VERSION,
    MIN_PROTOCOL_VERSION,
    Abort,
    Ack,
    ChunkSpec,
    CompleteLoad,
    CompleteStore,
    CompleteStoreReply,
    ErrorCode,
    ErrorReply,
    Fsck,
    FsckReply,
    Hello,
    HelloReply,
    LayerExtent,
    LeaseLoad,
    LeaseLoadReply,
    LeaseSlot,
    LeaseStore,
    LeaseStoreReply,
    LoadSlot,
    Lookup,
    LookupReply,
    Op,
    PrepareLoad,
    PrepareLoadReply,
    PrepareStore,
    PrepareStoreReply,
    ProtocolError,
    Purge,
    PurgeReply,
    ReadSlot,
    RegisterStaging,
    Reply,
    Request,
    Stats,
    StatsReply,
    StoreSlot,
    StoreStatus,
    Touch,
    align_up,
    close_fds,
    fake_salt,
    negotiate_version,
    packed_layout,
    region_size,
)
from kvoffload.staging import RegionAllocator, StagingBuffer, StagingError

from ..layouts import v1
from .errors import LeaseInvalid, StoreError, StoreFull, StoreIOError
from .ports import TenantSettings
from .service import (
    Handle,
    LeasedWrite,
    LoadHandle,
    Peer,
    Reject,
    Service,
    StagedWrite,
    WriteHandle,
    payload_of,
    plainify,
)

log = logging.getLogger("kvoffload.server")

_H = TypeVar("_H", WriteHandle, LoadHandle)
_W = TypeVar("_W", StoreSlot, LeaseSlot)
_R = TypeVar("_R", LoadSlot, ReadSlot)
#: A reply frame's room for lease entries, and what one costs besides its path.
_REPLY_ROOM = MAX_FRAME - 4096
_LEASE_ENTRY_BYTES = 96
_EXTENT_BYTES = 40


class Session:
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
        self.next_handle = 1
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
                t: self.service.store.tenant_salt(t) if self.may_use(t) else fake_salt(secret, t)
                for t in req.tenants
            }
            direct = {t: self.direct_ok(t) for t in req.tenants}
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

    def may_use(self, tenant: str) -> bool:
        """§6: does the *current* policy map this peer to ``tenant``?"""
        return self.service.policy.may_use(self.peer.uid, self.peer.gids, tenant)

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

    def execute(self, req: Request) -> Reply:
        """Every verb after ``hello`` but ``register_staging`` and ``bye`` (§5)."""
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
                case PrepareLoad():
                    return self.prepare_load(req)
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
        that probes for another node's file), an unlisted or a forbidden tenant
        gets None and goes to the pool, so a slow filesystem never stalls the loop.
        """
        if req.tenant not in self.tenants or not self.may_use(req.tenant):
            return None
        found = self.service.store.lookup_cached(req.tenant, req.keys)
        return None if found is None else LookupReply(found)

    def lookup(self, req: Lookup) -> Reply:
        """§5.3; a forbidden tenant finds 0 without the index being read (§6)."""
        self._listed(req.tenant)
        if not self.may_use(req.tenant):
            return LookupReply(0)
        found = self.service.store.lookup(req.tenant, req.keys)
        return LookupReply(max(0, min(found, len(req.keys))))

    def touch(self, req: Touch) -> Reply:
        """§5.9; for a forbidden tenant it succeeds doing nothing (§6)."""
        self._listed(req.tenant)
        if self.may_use(req.tenant):
            self.service.store.touch(req.tenant, req.keys)
        return Ack(Op.TOUCH)

    def stats(self) -> Reply:
        """§5.10: the tenant count is about other tenants, so for admins only."""
        svc = self.service
        stats = dict(svc.store.stats())
        if not self.is_admin():
            stats.pop("tenants", None)
        stats["server"] = {
            "server_id": svc.config.server_id,
            "connections": svc.session_count(),
            "protocol_version": self.version,
        }
        if svc.metrics is not None:
            stats.update(svc.metrics.summary())
        return StatsReply(plainify(stats))

    # -- admin verbs (§5.11, §5.12) ------------------------------------------------------

    def purge(self, req: Purge) -> Reply:
        """§5.11 (admin); the tenant need not be named in ``hello``."""
        if not self.is_admin():
            raise Reject(ErrorCode.FORBIDDEN, "purge needs the admin right")
        store = self.service.store
        if req.namespace is not None:
            return PurgeReply(store.purge_namespace(req.tenant, req.namespace))
        return PurgeReply(store.purge_tenant(req.tenant))

    def fsck(self, req: Fsck) -> Reply:
        """§5.12 (admin)."""
        if not self.is_admin():
            raise Reject(ErrorCode.FORBIDDEN, "fsck needs the admin right")
        report = self.service.store.fsck(repair=req.repair)
        return FsckReply(plainify(report.to_dict()))

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

    def abort(self, req: Abort) -> Reply:
        """§5.6: release whatever the handle holds; nothing is written (§8)."""
        with self.mu:
            handle = self.handles.pop(req.handle, None)
        if handle is None:
            raise Reject(ErrorCode.BAD_HANDLE, f"no such handle {req.handle}")
        self._release(handle)
        return Ack(Op.ABORT)

    # -- writes (§5.4, §5.5, §5.14, §8) -----------------------------------------------

    def prepare_store(self, req: PrepareStore) -> Reply:
        """§5.4, §7: a region of the staging buffer and a reservation per new chunk."""
        self._open_handle_slot()
        staging, alloc = self._registered()
        align = self.service.config.alignment
        store = self.service.store

        def claim(h: WriteHandle, i: int, c: ChunkSpec, settings: TenantSettings) -> StoreSlot:
            need = region_size(c.layers, align)
            if need > staging.size:
                return StoreSlot(StoreStatus.REJECTED, code=ErrorCode.TOO_LARGE)
            with self.mu:
                off = alloc.alloc(need)
            if off is None:
                return StoreSlot(StoreStatus.REJECTED, code=ErrorCode.BUSY)
            try:
                nbytes = v1.object_size(c.layers, h.encrypt)
                res = store.reserve(h.tenant, nbytes, quota=settings.quota_bytes)
            except StoreFull:
                self._free(off)
                return StoreSlot(StoreStatus.REJECTED, code=ErrorCode.NO_SPACE)
            except Exception:
                log.exception("%r: reserving space failed", self)
                self._free(off)
                return StoreSlot(StoreStatus.REJECTED, code=ErrorCode.INTERNAL)
            h.staged.append(StagedWrite(i, c.key, c.layers, off, res))
            return StoreSlot(StoreStatus.WRITE, offset=off)

        handle, slots = self._prepare_write(req, StoreSlot, self.may_use, "write tenant", claim)
        return PrepareStoreReply(handle, slots)

    def lease_store(self, req: LeaseStore) -> Reply:
        """§5.14: a leased temp file of the store per new chunk, for the worker to write."""
        self._open_handle_slot()
        store = self.service.store
        used = 64  # of the reply frame

        def claim(h: WriteHandle, i: int, c: ChunkSpec, settings: TenantSettings) -> LeaseSlot:
            nonlocal used
            need = _LEASE_ENTRY_BYTES + 9 * len(c.layers) + 256
            if used + need > _REPLY_ROOM:  # the reply must fit one frame
                return LeaseSlot(StoreStatus.REJECTED, code=ErrorCode.BUSY)
            try:
                lease = store.lease_store(
                    h.tenant,
                    h.namespace,
                    c.key,
                    c.layers,
                    ttl_s=h.ttl_s,
                    gid=settings.direct_gid,
                    quota=settings.quota_bytes,
                )
            except StoreFull:
                return LeaseSlot(StoreStatus.REJECTED, code=ErrorCode.NO_SPACE)
            except StoreIOError as exc:
                full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
                log.log(logging.INFO if full else logging.ERROR, "%r: lease: %s", self, exc)
                code = ErrorCode.NO_SPACE if full else ErrorCode.INTERNAL
                return LeaseSlot(StoreStatus.REJECTED, code=code)
            if lease is None:
                return LeaseSlot(StoreStatus.EXISTS)
            data_offset, offsets = lease.offsets
            path = str(lease.tmp)
            used += need + len(path.encode())
            h.leased.append(LeasedWrite(i, lease))
            return LeaseSlot(StoreStatus.WRITE, path, lease.size, data_offset, tuple(offsets))

        handle, slots = self._prepare_write(
            req, LeaseSlot, self.direct_ok, "use the direct path for tenant", claim
        )
        durability = str(getattr(store, "durability", ""))
        return LeaseStoreReply(handle, v1.ALIGN, slots, durability)

    def _prepare_write(
        self,
        req: PrepareStore,
        slot: type[_W],
        allowed: Callable[[str], bool],
        right: str,
        claim: Callable[[WriteHandle, int, ChunkSpec, TenantSettings], _W],
    ) -> tuple[int, tuple[_W, ...]]:
        """§5.4, §5.14, §6: the flow of both write verbs: permission, then per chunk
        ``exists`` or a claim on the medium; a handle only if a chunk is to be written."""
        self._listed(req.tenant)
        if not allowed(req.tenant):
            # §6: refused before any store access, for every forbidden name alike.
            raise Reject(ErrorCode.FORBIDDEN, f"this connection may not {right} {req.tenant!r}")
        settings = self.service.policy.tenant(req.tenant)
        ttl_s = req.ttl_s if req.ttl_s is not None else settings.ttl_s
        encrypt = settings.encryption and slot is StoreSlot
        h = WriteHandle(req.tenant, req.namespace, encrypt, ttl_s, (), [], [], 0.0)
        slots: list[_W] = []
        try:
            for i, c in enumerate(req.chunks):
                if self.service.store.lookup(req.tenant, [c.key]) == 1:
                    slots.append(slot(StoreStatus.EXISTS))
                else:
                    slots.append(claim(h, i, c, settings))
        except BaseException:
            self._release(h)
            raise
        h.slots = tuple(slots)
        if not h.staged and not h.leased:
            return 0, tuple(slots)
        h.created = time.monotonic()
        return self._add_handle(h), tuple(slots)

    def complete_store(self, req: CompleteStore) -> Reply:
        """§5.5, §5.14, §8: write (or verify and publish) every chunk of the handle,
        then release its regions, reservations and leftover leased files."""
        h = self._take_handle(req.handle, WriteHandle)
        stored = [s.status is StoreStatus.EXISTS for s in h.slots]
        try:
            if h.leased:
                self._publish_leases(h, stored)
            else:
                self._write_staged(h, stored)
        finally:
            self._release(h)
        return CompleteStoreReply(tuple(stored))

    def _write_staged(self, h: WriteHandle, stored: list[bool]) -> None:
        staging, _ = self._registered()
        store = self.service.store
        views: list[list[memoryview]] = []
        for sw in h.staged:
            offs, _ = packed_layout(sw.layers)
            views.append(
                [
                    staging.view[sw.offset + lo : sw.offset + lo + n]
                    for lo, n in zip(offs, sw.layers, strict=True)
                ]
            )
        try:
            # One batch: the store seals chunk n+1 while chunk n is written.
            with self.service.budget.hold(sum(sum(sw.layers) for sw in h.staged)):
                store.put_many(
                    h.tenant,
                    h.namespace,
                    [(sw.key, v) for sw, v in zip(h.staged, views, strict=True)],
                    encrypt=h.encrypt,
                    ttl_s=h.ttl_s,
                    reservations=[sw.reservation for sw in h.staged],
                )
            for sw in h.staged:
                stored[sw.index] = True  # False from put means "already present": success
        except Exception as exc:
            if isinstance(exc, StoreFull):
                log.info("%r: chunks not stored: %s", self, exc)
            else:
                log.exception("%r: storing chunks failed", self)
            # The chunks before the failing one are stored; ask the index which.
            for sw in h.staged:
                stored[sw.index] = store.payload_info(h.tenant, sw.key) is not None
        finally:
            for v in views:
                for m in v:
                    m.release()

    def _publish_leases(self, h: WriteHandle, stored: list[bool]) -> None:
        store = self.service.store
        for lw in h.leased:
            with self.service.budget.hold(lw.lease.size):
                try:
                    stored[lw.index] = store.publish_lease(lw.lease)
                except LeaseInvalid as exc:
                    log.warning("%r: direct-path object refused: %s", self, exc)
                except StoreError as exc:
                    log.error("%r: direct-path object not stored: %s", self, exc)

    # -- reads (§5.7, §5.8, §5.15) ------------------------------------------------------

    def prepare_load(self, req: PrepareLoad) -> Reply:
        """§5.7, §7: read and verify the leading chunks into regions, pinned."""
        self._open_handle_slot()
        staging, alloc = self._registered()
        store = self.service.store
        align = self.service.config.alignment

        def fill(h: LoadHandle, keys: Sequence[bytes]) -> tuple[list[LoadSlot], ErrorCode]:
            stop = ErrorCode.OK
            payloads: list[int] = []
            # Plan: regions for the leading chunks the index has, pinned before any
            # read so eviction cannot remove a file under it.
            for key in keys:
                payload = payload_of(store.payload_info(h.tenant, key))
                if not payload:
                    stop = ErrorCode.NOT_FOUND
                    break
                need = align_up(payload, align)
                if need > staging.size:
                    stop = ErrorCode.TOO_LARGE
                    break
                with self.mu:
                    off = alloc.alloc(need)
                if off is None:
                    stop = ErrorCode.BUSY
                    break
                h.offsets.append(off)
                store.pin(h.tenant, [key])
                h.keys.append(key)
                payloads.append(payload)
            # Read: one batch, so chunk n+1 is read while chunk n is verified.
            outs = [staging.view[off : off + n] for off, n in zip(h.offsets, payloads, strict=True)]
            try:
                with self.service.budget.hold(sum(payloads)):
                    results = store.get_many_into(h.tenant, list(h.keys), outs)
            except Exception:
                log.exception("%r: reading chunks failed", self)
                results = [None] * len(payloads)
                stop = ErrorCode.INTERNAL
            finally:
                for o in outs:
                    o.release()
            loaded: list[LoadSlot] = []
            for off, payload, lengths in zip(h.offsets, payloads, results, strict=True):
                if not lengths or sum(lengths) != payload:
                    break  # a miss ends the prefix: this chunk and all after it
                loaded.append(LoadSlot(True, off, tuple(lengths)))
            if len(loaded) < len(h.keys):
                if stop is ErrorCode.OK:
                    stop = ErrorCode.NOT_FOUND
                n = len(loaded)
                keys_left, offs_left = h.keys[n:], h.offsets[n:]
                del h.keys[n:], h.offsets[n:]
                store.unpin(h.tenant, keys_left)
                for off in offs_left:
                    self._free(off)
            return loaded, stop

        handle, stop, slots = self._prepare_read(req, LoadSlot(False), False, fill)
        return PrepareLoadReply(handle, stop, slots)

    def lease_load(self, req: LeaseLoad) -> Reply:
        """§5.15: the leading objects' paths and checks, header checked, pinned."""
        self._open_handle_slot()
        store = self.service.store

        def fill(h: LoadHandle, keys: Sequence[bytes]) -> tuple[list[ReadSlot], ErrorCode]:
            used = 64  # of the reply frame
            found: list[ReadSlot] = []
            for key in keys:
                # Pinned before the header is read, so eviction cannot remove
                # the file between this reply and the worker's read.
                store.pin(h.tenant, [key])
                try:
                    lease = store.lease_load(h.tenant, key)
                except Exception:
                    store.unpin(h.tenant, [key])
                    log.exception("%r: lease_load failed", self)
                    return found, ErrorCode.INTERNAL
                if lease is None:
                    store.unpin(h.tenant, [key])
                    return found, ErrorCode.NOT_FOUND
                path = str(lease.path)
                layers = lease.header.layers
                need = _LEASE_ENTRY_BYTES + len(path.encode()) + _EXTENT_BYTES * len(layers)
                if used + need > _REPLY_ROOM:
                    store.unpin(h.tenant, [key])
                    return found, ErrorCode.BUSY
                used += need
                h.keys.append(key)
                extents = tuple(LayerExtent(le.offset, le.length, le.check) for le in layers)
                found.append(ReadSlot(True, path, lease.size, extents))
            return found, ErrorCode.OK

        handle, stop, slots = self._prepare_read(req, ReadSlot(False), True, fill)
        return LeaseLoadReply(handle, stop, slots)

    def _prepare_read(
        self,
        req: PrepareLoad,
        miss: _R,
        direct: bool,
        fill: Callable[[LoadHandle, Sequence[bytes]], tuple[list[_R], ErrorCode]],
    ) -> tuple[int, ErrorCode, tuple[_R, ...]]:
        """§5.7, §5.15, §6: the flow of both read verbs. ``fill`` records in the handle
        what it pins and allocates, and leaves there exactly the found prefix."""
        self._listed(req.tenant)
        misses = [miss] * len(req.keys)
        if not self.may_use(req.tenant):
            # §6: exactly the empty tenant's answer, before any index access.
            return 0, ErrorCode.NOT_FOUND, tuple(misses)
        if direct and not self.direct_ok(req.tenant):
            raise Reject(
                ErrorCode.FORBIDDEN,
                f"this connection may not use the direct path for tenant {req.tenant!r}",
            )
        h = LoadHandle(req.tenant, [], [], 0.0, direct)
        try:
            found, stop = fill(h, req.keys)
        except BaseException:
            self._release(h)
            raise
        if not found:
            return 0, stop, tuple(misses)
        h.created = time.monotonic()
        return self._add_handle(h), stop, tuple(found) + tuple(misses[len(found) :])

    def complete_load(self, req: CompleteLoad) -> Reply:
        """§5.8: release the regions and pins; check chunks the worker reports corrupt."""
        h = self._take_handle(req.handle, LoadHandle)
        try:
            if h.direct:  # a staging load's bytes the sidecar verified itself
                for i in req.corrupt:
                    if i < len(h.keys) and self.service.store.check_reported(h.tenant, h.keys[i]):
                        log.warning(
                            "%r: chunk %s reported and found corrupt", self, h.keys[i].hex()[:16]
                        )
        finally:
            self._release(h)
        return Ack(Op.COMPLETE_LOAD)


__all__ = ["Session"]
