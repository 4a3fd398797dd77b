"""The write verbs of a connection (protocol-v1.md §5.4, §5.5, §5.14, §5.21, §8).

One flow for both media: a region of the staging buffer (``prepare_store``,
or ``store`` in one round trip) or a file of the store handed to the worker
(``lease_store``, the direct path). Only the step that claims the medium for
one chunk, and the step that commits a completed write, differ. The flow is
composed into the session (session.py), which gives it the connection's
handle table (handles.py) and isolation checks.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from typing import TypeVar

from kvoffload.errors import (
    LeaseInvalid,
    Reject,
    StoreError,
    StoreFull,
    StoreIOError,
    TransferCancelled,
)
from kvoffload.protocol import (
    ChunkSpec,
    CompleteStore,
    CompleteStoreReply,
    Delete,
    DeleteReply,
    ErrorCode,
    LeaseSlot,
    LeaseStore,
    LeaseStoreReply,
    PrepareStore,
    PrepareStoreReply,
    Reply,
    StoreBatch,
    StoreChunk,
    StoreReply,
    StoreSlot,
    StoreStatus,
    packed_layout,
    region_size,
)

from .handles import (
    LEASE_ENTRY_BYTES,
    REPLY_ROOM,
    Access,
    Handles,
    LeasedWrite,
    StagedWrite,
    WriteHandle,
)
from .ports import TenantSettings
from .service import Service

log = logging.getLogger("kvoffload.server")

_W = TypeVar("_W", StoreSlot, LeaseSlot)

#: ``claim(handle, index, chunk, settings)``: the medium for one chunk to be written.
ClaimFn = Callable[[WriteHandle, int, ChunkSpec, TenantSettings], _W]


class Writes:
    """``prepare_store``/``lease_store`` → ``complete_store``, and ``store`` (§5.21)."""

    def __init__(self, service: Service, handles: Handles, access: Access) -> None:
        self.service = service
        self.handles = handles
        self.access = access

    def __repr__(self) -> str:
        return repr(self.access)

    # -- the two-step verbs (§5.4, §5.14) ----------------------------------------------

    def prepare_store(self, req: PrepareStore) -> Reply:
        """§5.4, §7: a region of the staging buffer and a reservation per new chunk."""
        self.handles.open_slot()
        staging, _ = self.handles.registered()
        align = self.service.config.alignment

        def claim(h: WriteHandle, i: int, c: ChunkSpec, settings: TenantSettings) -> StoreSlot:
            need = region_size(c.layers, align)
            if need > staging.size:
                return StoreSlot(StoreStatus.REJECTED, code=ErrorCode.TOO_LARGE)
            off = self.handles.alloc_region(need)
            if off is None:
                return StoreSlot(StoreStatus.REJECTED, code=ErrorCode.BUSY)
            return self._reserve(h, i, c, settings, off)

        handle, slots = self._prepare_write(
            req, StoreSlot, self.access.may_use, "write tenant", claim
        )
        return PrepareStoreReply(handle, slots)

    def lease_store(self, req: LeaseStore) -> Reply:
        """§5.14: a leased temp file of the store per new chunk, for the worker to write."""
        self.handles.open_slot()
        store = self.service.store
        used = 64  # of the reply frame

        def claim(h: WriteHandle, i: int, c: ChunkSpec, settings: TenantSettings) -> LeaseSlot:
            nonlocal used
            need = LEASE_ENTRY_BYTES + 9 * len(c.layers) + 256
            if used + need > REPLY_ROOM:  # the reply must fit one frame
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
            req, LeaseSlot, self.access.direct_ok, "use the direct path for tenant", claim
        )
        return LeaseStoreReply(handle, store.alignment, slots, store.durability)

    def _prepare_write(
        self,
        req: PrepareStore,
        slot: type[_W],
        allowed: Callable[[str], bool],
        right: str,
        claim: ClaimFn[_W],
    ) -> tuple[int, tuple[_W, ...]]:
        """§5.4, §5.14, §6: the flow of both write verbs; a handle only if a chunk
        is to be written."""
        h, slots = self._plan_write(req, slot, allowed, right, claim)
        if not h.staged and not h.leased:
            return 0, slots
        return self.handles.add(h), slots

    def _plan_write(
        self,
        req: PrepareStore | StoreBatch,
        slot: type[_W],
        allowed: Callable[[str], bool],
        right: str,
        claim: ClaimFn[_W],
    ) -> tuple[WriteHandle, tuple[_W, ...]]:
        """§5.4, §5.14, §5.21, §6: permission, then per chunk ``exists`` or a claim
        on the medium. The handle returned is not registered."""
        self.access.listed(req.tenant)
        if not allowed(req.tenant):
            # §6: refused before any store access, for every forbidden name alike.
            raise Reject(ErrorCode.FORBIDDEN, f"this connection may not {right} {req.tenant!r}")
        if isinstance(req, PrepareStore) and req.contract is not None:  # store (5.21): none
            self.access.register_contract(req.tenant, req.namespace, req.contract)
        settings = self.service.policy.tenant(req.tenant)
        ttl_s = req.ttl_s if req.ttl_s is not None else settings.ttl_s
        encrypt = settings.encryption and slot is StoreSlot
        h = WriteHandle(req.tenant, req.namespace, encrypt, ttl_s, (), [], [], 0.0)
        store = self.service.store
        slots: list[_W] = []
        try:
            for i, c in enumerate(req.chunks):
                if not store.shape_ok(c.layers, encrypt):
                    # §5.4: padding beyond the bound of layout-v1.md §3.2.
                    slots.append(slot(StoreStatus.REJECTED, code=ErrorCode.TOO_LARGE))
                elif store.lookup(req.tenant, [c.key]) == 1:
                    slots.append(slot(StoreStatus.EXISTS))
                else:
                    slots.append(claim(h, i, c, settings))
        except BaseException:
            self.handles.release(h)
            raise
        h.slots = tuple(slots)
        h.blocks = {i: c.blocks for i, c in enumerate(req.chunks) if c.blocks is not None}
        # A chunk present already may still lack its hashes (saved without them).
        exists = [sl.status is StoreStatus.EXISTS for sl in slots]
        self.record_blocks(h, exists, {i: c.key for i, c in enumerate(req.chunks)}, completed=False)
        return h, tuple(slots)

    def _reserve(
        self, h: WriteHandle, i: int, c: ChunkSpec, settings: TenantSettings, offset: int
    ) -> StoreSlot:
        """Store space for one chunk whose region is ``offset`` (freed again on failure)."""
        try:
            res = self.service.store.reserve_chunk(
                h.tenant, c.layers, encrypt=h.encrypt, quota=settings.quota_bytes
            )
        except StoreFull:
            self.handles.free(offset)
            return StoreSlot(StoreStatus.REJECTED, code=ErrorCode.NO_SPACE)
        except Exception:
            log.exception("%r: reserving space failed", self)
            self.handles.free(offset)
            return StoreSlot(StoreStatus.REJECTED, code=ErrorCode.INTERNAL)
        h.staged.append(StagedWrite(i, c.key, c.layers, offset, res))
        return StoreSlot(StoreStatus.WRITE, offset=offset)

    # -- one-round-trip writes (§5.21) --------------------------------------------------

    def store(self, req: StoreBatch) -> Reply:
        """§5.21: ``prepare_store`` + ``complete_store`` of chunks the client already
        put at regions of its staging buffer it chose; they are read, sealed and
        written before the reply, and each region is the server's until then."""
        if self.service.draining:
            raise Reject(ErrorCode.SHUTTING_DOWN, "the sidecar is shutting down")
        staging, _ = self.handles.registered()
        self._store_regions(req, staging.size)
        h, slots = self._plan_write(
            req, StoreSlot, self.access.may_use, "write tenant", self._claim_for_store
        )
        stored = [sl.status is StoreStatus.EXISTS for sl in slots]
        cancelled = False
        try:
            if h.staged:
                cancelled = self._write_staged(h, stored)
        finally:
            self.handles.release(h)
        if cancelled:  # purged meanwhile: none of it stands; a retry after it lands
            stored = [False] * len(stored)
        unstored = ErrorCode.BUSY if cancelled else ErrorCode.INTERNAL
        codes = [
            0 if ok else int(sl.code if sl.status is StoreStatus.REJECTED else unstored)
            for ok, sl in zip(stored, slots, strict=True)
        ]
        keys = {sw.index: sw.key for sw in h.staged}
        written = [stored[i] and i in keys for i in range(len(stored))]
        self.record_blocks(h, written, keys, completed=True)
        return StoreReply(tuple(stored), tuple(codes))

    def _store_regions(self, req: StoreBatch, size: int) -> None:
        """§5.21: the chunks' regions, aligned, inside the buffer and apart, sorted;
        anything else is the client's mistake (BAD_REQUEST), before any effect."""
        align = self.service.config.alignment
        spans = sorted((c.offset, region_size(c.layers, align)) for c in req.chunks)
        end = 0
        for off, n in spans:
            if off % align:
                raise Reject(ErrorCode.BAD_REQUEST, f"region {off} is not {align}-aligned")
            if off + n > size:
                raise Reject(ErrorCode.BAD_REQUEST, f"region {off}+{n} exceeds the staging buffer")
            if off < end:
                raise Reject(ErrorCode.BAD_REQUEST, f"region {off} overlaps the one before it")
            end = off + n

    def _claim_for_store(
        self, h: WriteHandle, i: int, c: ChunkSpec, settings: TenantSettings
    ) -> StoreSlot:
        """§5.21: the region the client chose for one chunk of ``store``, and store
        space for it; ``BUSY`` if an open handle of the connection holds any of it."""
        assert isinstance(c, StoreChunk)
        if not self.handles.claim_region(
            c.offset, region_size(c.layers, self.service.config.alignment)
        ):
            return StoreSlot(StoreStatus.REJECTED, code=ErrorCode.BUSY)
        return self._reserve(h, i, c, settings, c.offset)

    # -- removing (§5.35) ----------------------------------------------------------------

    def delete(self, req: Delete) -> Reply:
        """§5.35 (revision 18): remove chunks of the tenant, each as an eviction
        would (RAM image, file, index entry with its ``BlockRemoved``, accounting,
        a shared root's journal); how many it held. A write right is needed, as
        for ``store``; another tenant's chunk of the same key is never reached
        (the store is keyed by tenant). Per key, whether it was held."""
        if self.service.draining:
            raise Reject(ErrorCode.SHUTTING_DOWN, "the sidecar is shutting down")
        self.access.listed(req.tenant)
        if not self.access.may_use(req.tenant):
            raise Reject(
                ErrorCode.FORBIDDEN, f"this connection may not write tenant {req.tenant!r}"
            )
        store = self.service.store
        return DeleteReply(tuple(store.delete(req.tenant, k) for k in req.keys))

    # -- completing (§5.5, §8) ----------------------------------------------------------

    def complete_store(self, req: CompleteStore) -> Reply:
        """§5.5, §5.14, §8: write (or verify and publish) every chunk of the handle,
        then release its regions, reservations and leftover leased files."""
        revoked = self.handles.revoked(req.handle)
        if revoked:  # §6.1: released by a revocation or purge: nothing was stored
            return CompleteStoreReply(tuple(False for _ in range(revoked)))
        h = self.handles.take(req.handle, WriteHandle)
        stored = [s.status is StoreStatus.EXISTS for s in h.slots]
        access = self.access
        if not (access.direct_ok(h.tenant) if h.leased else access.may_use(h.tenant)):
            # §6.1: access revoked since prepare: nothing is written or published.
            self.handles.release(h)
            return CompleteStoreReply(tuple(False for _ in stored))
        try:
            if h.leased:
                self._publish_leases(h, stored)
            elif self._write_staged(h, stored):
                stored = [False] * len(stored)  # purged meanwhile: none of it stands
        finally:
            self.handles.release(h)
        keys = {sw.index: sw.key for sw in h.staged} | {
            lw.index: lw.lease.chunk_key for lw in h.leased
        }
        written = [stored[i] and i in keys for i in range(len(stored))]
        self.record_blocks(h, written, keys, completed=True)
        return CompleteStoreReply(tuple(stored))

    def record_blocks(
        self, h: WriteHandle, which: list[bool], keys: dict[int, bytes], *, completed: bool
    ) -> None:
        """Hand the engine hashes of stored chunks to the KV-event feed, before
        the reply: a worker that got ``stored`` can rely on the event being out.

        ``completed``: ``which`` are the chunks a completed write stored, and the
        feed also counts those it will not announce (no hashes, events off).
        """
        events = self.service.events
        if events is None:
            return
        if completed:
            written = [i for i, w in enumerate(which) if w]
            try:
                events.saved(h.tenant, len(written), sum(i in h.blocks for i in written))
            except Exception:  # the feed must never fail a save
                log.exception("%r: counting a save for the KV events failed", self)
        for i, blocks in h.blocks.items():
            key = keys.get(i)
            if not which[i] or key is None:
                continue
            try:
                events.record(h.tenant, key, blocks)
            except Exception:  # the feed must never fail a save
                log.exception("%r: publishing a KV event failed", self)

    def _write_staged(self, h: WriteHandle, stored: list[bool]) -> bool:
        """Write the staged chunks (``stored[i]`` True for each stored); True if a
        purge or revocation cancelled the batch: then none of the request stands."""
        staging, _ = self.handles.registered()
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
        except TransferCancelled as exc:
            log.info("%r: chunks not stored: %s", self, exc)
            return True
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
        return False

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


__all__ = ["Writes"]
