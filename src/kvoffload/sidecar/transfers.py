"""The write and read flows of :class:`~.session.Session`, for both media.

Writes and reads each have one flow for both media: a region of the staging
buffer (``prepare_store``/``prepare_load``) or a file of the store handed to
the worker (``lease_store``/``lease_load``, the direct path). Only the step
that claims the medium for one chunk, and the step that commits a completed
write, differ.

:class:`Transfers` is a mixin of :class:`~.session.Session`: it uses the
session's handle table, staging buffer and isolation checks, which stay in
``session.py``; the names below ``TYPE_CHECKING`` are what it needs of them.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from kvoffload.protocol import (
    MAX_FRAME,
    Ack,
    ChunkSpec,
    CompleteLoad,
    CompleteStore,
    CompleteStoreReply,
    ErrorCode,
    LayerExtent,
    LeaseLoad,
    LeaseLoadReply,
    LeaseSlot,
    LeaseStore,
    LeaseStoreReply,
    LoadPlan,
    LoadProgress,
    LoadSlot,
    Op,
    PrepareLoad,
    PrepareLoadReply,
    PrepareStore,
    PrepareStoreReply,
    ReadSlot,
    Reply,
    Store,
    StoreChunk,
    StoreReply,
    StoreSlot,
    StoreStatus,
    align_up,
    packed_layout,
    region_size,
)
from kvoffload.staging import RegionAllocator, StagingBuffer

from ..layouts import v1
from .cancel import PutCancelled
from .errors import LeaseInvalid, StoreError, StoreFull, StoreIOError
from .ports import CachedLoadsAPI, PlannedLoadsAPI, TenantSettings, implements
from .service import (
    DECOY_TENANT,
    Handle,
    LeasedWrite,
    LoadHandle,
    Reject,
    Service,
    StagedWrite,
    WriteHandle,
    payload_of,
)

if TYPE_CHECKING:
    from .index import ChunkRecord

log = logging.getLogger("kvoffload.server")

_H = TypeVar("_H", WriteHandle, LoadHandle)
_W = TypeVar("_W", StoreSlot, LeaseSlot)
_R = TypeVar("_R", LoadSlot, ReadSlot)
#: A reply frame's room for lease entries, and what one costs besides its path.
_REPLY_ROOM = MAX_FRAME - 4096
_LEASE_ENTRY_BYTES = 96
_EXTENT_BYTES = 40

#: Sends one interim frame of the request being served (§5.26); False when the
#: connection is closing or gone, which stops a layer-wise load.
EmitFn = Callable[[LoadProgress], bool]


class _WouldWait(Exception):
    """An inline ``prepare_load`` that would wait on the device or the disk."""


#: A chunk frame (protocol-v1 §5.30) once at least this much more is verified:
#: a frame costs a hop to the event loop and a wake-up of the client, worth it
#: where the client's copy of what it reports takes longer.
CHUNK_FRAME_MIN_BYTES = 4 << 20


class _ChunkFrames:
    """The chunk frames of one chunk-wise ``prepare_load`` (§5.30), sent from the
    thread that reads it as the verified prefix grows; never one for the
    request's last planned chunk (the reply reports it as soon)."""

    def __init__(self, h: LoadHandle, emit: EmitFn, planned: int) -> None:
        self.h = h
        self.emit: EmitFn | None = emit
        self.planned = planned
        #: Layer lengths of the chunks reported so far (a prefix).
        self.reported: list[list[int] | None] = []
        self.pending: list[list[int]] = []
        self.pending_bytes = 0

    def verified(self, i: int, lengths: list[int]) -> None:
        if i != len(self.reported) + len(self.pending):
            return  # not the next of the prefix: report nothing more
        self.pending.append(lengths)
        self.pending_bytes += sum(lengths)
        if self.pending_bytes < CHUNK_FRAME_MIN_BYTES or i + 1 >= self.planned:
            return
        first = len(self.reported)
        slots = tuple(
            LoadSlot(True, self.h.offsets[first + j], tuple(ls))
            for j, ls in enumerate(self.pending)
        )
        if self.emit is not None and not self.emit(
            LoadProgress(0, first + len(slots), slots, first)
        ):
            self.emit = None  # the client left: the reply goes nowhere either
        # Reported or not (a client that left reads nothing more), these stay
        # loaded: the read's result keeps them.
        self.reported.extend(self.pending)
        self.pending, self.pending_bytes = [], 0


class Transfers:
    """§5.4–§5.8, §5.14, §5.15: ``prepare_store``/``lease_store`` →
    ``complete_store`` and ``prepare_load``/``lease_load`` → ``complete_load``."""

    if TYPE_CHECKING:
        # Provided by Session (session.py).
        service: Service
        mu: threading.Lock
        tenants: frozenset[str]

        def may_use(self, tenant: str) -> bool: ...
        def direct_ok(self, tenant: str) -> bool: ...
        def _register_contract(
            self, tenant: str, namespace: bytes, fields: Mapping[str, Any]
        ) -> None: ...
        def _listed(self, tenant: str) -> None: ...
        def _open_handle_slot(self) -> None: ...
        def _registered(self) -> tuple[StagingBuffer, RegionAllocator]: ...
        def _add_handle(self, handle: Handle) -> int: ...
        def _take_handle(self, h: int, kind: type[_H]) -> _H: ...
        def _free(self, offset: int) -> None: ...
        def _release(self, h: Handle) -> None: ...
        def revoked_handle(self, h: int) -> int | None: ...

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
        """§5.4, §5.14, §6: the flow of both write verbs; a handle only if a chunk
        is to be written."""
        h, slots = self._plan_write(req, slot, allowed, right, claim)
        if not h.staged and not h.leased:
            return 0, slots
        h.created = time.monotonic()
        return self._add_handle(h), slots

    def _plan_write(
        self,
        req: PrepareStore | Store,
        slot: type[_W],
        allowed: Callable[[str], bool],
        right: str,
        claim: Callable[[WriteHandle, int, ChunkSpec, TenantSettings], _W],
    ) -> tuple[WriteHandle, tuple[_W, ...]]:
        """§5.4, §5.14, §5.21, §6: permission, then per chunk ``exists`` or a claim
        on the medium. The handle returned is not registered."""
        self._listed(req.tenant)
        if not allowed(req.tenant):
            # §6: refused before any store access, for every forbidden name alike.
            raise Reject(ErrorCode.FORBIDDEN, f"this connection may not {right} {req.tenant!r}")
        contract = getattr(req, "contract", None)  # store (5.21) carries none
        if contract is not None:
            self._register_contract(req.tenant, req.namespace, contract)
        settings = self.service.policy.tenant(req.tenant)
        ttl_s = req.ttl_s if req.ttl_s is not None else settings.ttl_s
        encrypt = settings.encryption and slot is StoreSlot
        h = WriteHandle(req.tenant, req.namespace, encrypt, ttl_s, (), [], [], 0.0)
        slots: list[_W] = []
        try:
            for i, c in enumerate(req.chunks):
                if not v1.shape_ok(c.layers, encrypt):
                    # §5.4: padding beyond the bound of layout-v1.md §3.2.
                    slots.append(slot(StoreStatus.REJECTED, code=ErrorCode.TOO_LARGE))
                elif self.service.store.lookup(req.tenant, [c.key]) == 1:
                    slots.append(slot(StoreStatus.EXISTS))
                else:
                    slots.append(claim(h, i, c, settings))
        except BaseException:
            self._release(h)
            raise
        h.slots = tuple(slots)
        h.blocks = {i: c.blocks for i, c in enumerate(req.chunks) if c.blocks is not None}
        # A chunk present already may still lack its hashes (saved without them).
        self._record_blocks(h, [sl.status is StoreStatus.EXISTS for sl in slots], req.chunks)
        return h, tuple(slots)

    # -- one-round-trip writes (§5.21) --------------------------------------------------

    def store(self, req: Store) -> Reply:
        """§5.21: ``prepare_store`` + ``complete_store`` of chunks the client already
        put at regions of its staging buffer it chose; they are read, sealed and
        written before the reply, and each region is the server's until then."""
        if self.service.draining:
            raise Reject(ErrorCode.SHUTTING_DOWN, "the sidecar is shutting down")
        staging, _ = self._registered()
        self._store_regions(req, staging.size)
        h, slots = self._plan_write(
            req, StoreSlot, self.may_use, "write tenant", self._claim_for_store
        )
        stored = [sl.status is StoreStatus.EXISTS for sl in slots]
        cancelled = False
        try:
            if h.staged:
                cancelled = self._write_staged(h, stored)
        finally:
            self._release(h)
        if cancelled:  # purged meanwhile: none of it stands; a retry after it lands
            stored = [False] * len(stored)
        unstored = ErrorCode.BUSY if cancelled else ErrorCode.INTERNAL
        codes = [
            0 if ok else int(sl.code if sl.status is StoreStatus.REJECTED else unstored)
            for ok, sl in zip(stored, slots, strict=True)
        ]
        keys = {sw.index: sw.key for sw in h.staged}
        self._record_blocks(h, [stored[i] and i in keys for i in range(len(stored))], None, keys)
        return StoreReply(tuple(stored), tuple(codes))

    def _store_regions(self, req: Store, size: int) -> None:
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
        _, alloc = self._registered()
        with self.mu:
            ok = alloc.claim(c.offset, region_size(c.layers, self.service.config.alignment))
        if not ok:
            return StoreSlot(StoreStatus.REJECTED, code=ErrorCode.BUSY)
        try:
            nbytes = v1.object_size(c.layers, h.encrypt)
            res = self.service.store.reserve(h.tenant, nbytes, quota=settings.quota_bytes)
        except StoreFull:
            self._free(c.offset)
            return StoreSlot(StoreStatus.REJECTED, code=ErrorCode.NO_SPACE)
        except Exception:
            log.exception("%r: reserving space failed", self)
            self._free(c.offset)
            return StoreSlot(StoreStatus.REJECTED, code=ErrorCode.INTERNAL)
        h.staged.append(StagedWrite(i, c.key, c.layers, c.offset, res))
        return StoreSlot(StoreStatus.WRITE, offset=c.offset)

    def complete_store(self, req: CompleteStore) -> Reply:
        """§5.5, §5.14, §8: write (or verify and publish) every chunk of the handle,
        then release its regions, reservations and leftover leased files."""
        revoked = self.revoked_handle(req.handle)
        if revoked:  # §6.1: released by a revocation or purge: nothing was stored
            return CompleteStoreReply(tuple(False for _ in range(revoked)))
        h = self._take_handle(req.handle, WriteHandle)
        stored = [s.status is StoreStatus.EXISTS for s in h.slots]
        if not (self.direct_ok(h.tenant) if h.leased else self.may_use(h.tenant)):
            # §6.1: access revoked since prepare: nothing is written or published.
            self._release(h)
            return CompleteStoreReply(tuple(False for _ in stored))
        try:
            if h.leased:
                self._publish_leases(h, stored)
            elif self._write_staged(h, stored):
                stored = [False] * len(stored)  # purged meanwhile: none of it stands
        finally:
            self._release(h)
        keys = {sw.index: sw.key for sw in h.staged} | {
            lw.index: lw.lease.chunk_key for lw in h.leased
        }
        written = [stored[i] and i in keys for i in range(len(stored))]
        self._record_blocks(h, written, None, keys)
        return CompleteStoreReply(tuple(stored))

    def _record_blocks(
        self,
        h: WriteHandle,
        which: list[bool],
        chunks: tuple[ChunkSpec, ...] | None,
        keys: dict[int, bytes] | None = None,
    ) -> None:
        """Hand the engine hashes of stored chunks to the KV-event feed, before
        the reply: a worker that got ``stored`` can rely on the event being out."""
        events = self.service.events
        if events is None or not h.blocks:
            return
        for i, blocks in h.blocks.items():
            if not which[i]:
                continue
            key = chunks[i].key if chunks is not None else (keys or {}).get(i)
            if key is None:
                continue
            try:
                events.record(h.tenant, key, blocks)
            except Exception:  # the feed must never fail a save
                log.exception("%r: publishing a KV event failed", self)

    def _write_staged(self, h: WriteHandle, stored: list[bool]) -> bool:
        """Write the staged chunks (``stored[i]`` True for each stored); True if a
        purge or revocation cancelled the batch: then none of the request stands."""
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
        except PutCancelled as exc:
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

    # -- reads (§5.7, §5.8, §5.15) ------------------------------------------------------

    def load_cancelled(self, tenant: str) -> bool:
        """Whether a layer-wise load of ``tenant`` must stop before its next layer
        (§5.27): this connection lost the tenant (§6.1; one integer compared
        while the policy generation holds). A purge or a revocation also stops
        it through the store's load generation (sidecar/cancel.py)."""
        return not self.may_use(tenant)

    def prepare_load_inline(self, req: PrepareLoad) -> Reply | None:
        """:meth:`prepare_load` on the event loop, or None where it would wait.

        A batch of small chunks wholly in the page cache costs less to read and
        verify than the hop to a pool thread and back: it is answered here, with
        the same checks (the index alone, ``RWF_NOWAIT`` reads, every tag or
        checksum verified). Anything that needs the device or the disk (a
        large or cold object, a miss that may be another node's file, an
        expired entry, a layer-wise load, an unlisted tenant) returns None and
        the caller runs :meth:`prepare_load` on the pool. A batch whose leading
        chunks are cached and the rest not answers those chunks with ``BUSY``
        (§5.7: ask again), and the client asks for the rest."""
        if req.layerwise or req.tenant not in self.tenants:
            return None
        try:
            return self.prepare_load(req, inline=True)
        except _WouldWait:
            return None

    def prepare_load(
        self, req: PrepareLoad, emit: EmitFn | None = None, *, inline: bool = False
    ) -> Reply:
        """§5.7, §7: read and verify the leading chunks into regions, pinned.

        With ``layerwise`` (§5.26) and a connection that can send interim
        frames, the plan and every verified layer are reported as ``load_progress``
        frames through ``emit`` before this reply. ``inline``: see
        :meth:`prepare_load_inline` (raises :class:`_WouldWait` having released
        everything, where no chunk could be answered without a wait)."""
        self._open_handle_slot()
        layerwise = emit if req.layerwise else None
        chunkwise = emit if req.chunkwise and not req.layerwise else None
        staging, alloc = self._registered()
        store = self.service.store
        align = self.service.config.alignment

        planned = cast("PlannedLoadsAPI", store) if implements(store, PlannedLoadsAPI) else None
        cached = (
            cast("CachedLoadsAPI", store) if inline and implements(store, CachedLoadsAPI) else None
        )
        if inline and (cached is None or planned is None):
            raise _WouldWait

        def record(tenant: str, key: bytes) -> ChunkRecord | None:
            if cached is None:
                return store.payload_info(tenant, key)
            known, rec = cached.payload_info_cached(tenant, key)
            if not known:
                raise _WouldWait
            return rec

        def fill(h: LoadHandle, keys: Sequence[bytes]) -> tuple[list[LoadSlot], ErrorCode]:
            stop = ErrorCode.OK
            waits = False  # stop is BUSY because the rest would wait (inline)
            payloads: list[int] = []
            recs: list[ChunkRecord] = []
            inline: list[list[int] | None] = []  # inline: the chunks read as planned
            # A purge or revocation from now on stops the load (cancel.py): taken
            # before the records are looked up, which the read then uses as they are.
            guard = planned.load_guard(h.tenant) if planned is not None else None
            # Plan: regions for the leading chunks the index has, pinned before any
            # read so eviction cannot remove a file under it.
            for key in keys:
                try:
                    rec = record(h.tenant, key)
                except _WouldWait:
                    if not h.keys:
                        raise
                    stop, waits = ErrorCode.BUSY, True  # the rest on the pool (§5.7)
                    break
                payload = payload_of(rec)
                if not payload or rec is None:
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
                recs.append(rec)
                if cached is not None and guard is not None:
                    # On the loop, chunk by chunk as planned: only what needs no
                    # wait on the device (no budget: nothing waits on the pool).
                    out = staging.view[off : off + payload]
                    try:
                        got = cached.load_planned_cached(h.tenant, [rec], [out], guard)
                    finally:
                        out.release()
                    if not got:  # would wait: this chunk and the rest go to the pool
                        del h.keys[-1], h.offsets[-1], payloads[-1], recs[-1]
                        store.unpin(h.tenant, [key])
                        self._free(off)
                        stop, waits = ErrorCode.BUSY, True
                        break
                    inline.append(got[0])
                    if got[0] is None:
                        break  # a miss ends the prefix
            # Read: one batch, up to io_streams chunks at once, each straight into
            # its region (sidecar/store/pipeline.py).
            outs = [staging.view[off : off + n] for off, n in zip(h.offsets, payloads, strict=True)]
            served = len(recs)  # chunks the read below answers (a hit or a miss)
            frames = _ChunkFrames(h, chunkwise, len(recs)) if chunkwise is not None else None
            try:
                if cached is not None:
                    results = inline  # read above
                else:
                    with self.service.budget.hold(sum(payloads)):
                        if layerwise is not None:
                            results = self._read_layerwise(h, recs, outs, layerwise, guard)
                        elif planned is not None and guard is not None:
                            # One pass per chunk, on the store's I/O streams, with the
                            # records just read: no second index lookup.
                            results = planned.load_planned(
                                h.tenant,
                                recs,
                                outs,
                                guard,
                                on_chunk=None if frames is None else frames.verified,
                            )
                        else:
                            results = store.get_many_into(h.tenant, list(h.keys), outs)
            except Exception:
                log.exception("%r: reading chunks failed", self)
                # A chunk already reported in a chunk frame stays loaded (§5.30).
                done = [] if frames is None else frames.reported
                results = [*done, *[None] * (len(payloads) - len(done))]
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
                if stop is ErrorCode.OK or waits:
                    stop = ErrorCode.NOT_FOUND  # a miss ends the prefix
                n = len(loaded)
                keys_left, offs_left = h.keys[n:], h.offsets[n:]
                del h.keys[n:], h.offsets[n:]
                store.unpin(h.tenant, keys_left)
                for off in offs_left:
                    self._free(off)
            if not served and waits:
                raise _WouldWait  # nothing answered here, nothing held: the pool reads it
            return loaded, stop

        handle, stop, slots = self._prepare_read(req, LoadSlot(False), False, fill)
        return PrepareLoadReply(handle, stop, slots)

    def _read_layerwise(
        self,
        h: LoadHandle,
        recs: list[ChunkRecord],
        outs: list[memoryview],
        emit: EmitFn,
        guard: Callable[[int], None] | None,
    ) -> list[list[int] | None]:
        """§5.26, §5.27: read the planned chunks layer-major, one frame per layer."""
        gone = False

        def send(msg: LoadProgress) -> None:
            nonlocal gone
            if not gone and not emit(msg):
                gone = True  # the client left: stop before the next layer

        def plan(layers: list[tuple[int, ...]]) -> None:
            slots = tuple(
                LoadSlot(True, off, ls) for off, ls in zip(h.offsets, layers, strict=False)
            )
            send(LoadPlan(0, len(slots), slots))

        def report(done: int, verified: int) -> None:
            send(LoadProgress(done, verified))

        def cancelled(layer: int) -> bool:
            return gone or self.load_cancelled(h.tenant)

        store = self.service.store
        if isinstance(store, PlannedLoadsAPI) and guard is not None:
            return store.load_planned_layerwise(
                h.tenant, recs, outs, plan, report, cancelled, guard
            )
        return store.get_layerwise_into(h.tenant, list(h.keys), outs, plan, report, cancelled)

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
        allowed = self.may_use(req.tenant)
        if allowed and direct and not self.direct_ok(req.tenant):
            raise Reject(
                ErrorCode.FORBIDDEN,
                f"this connection may not use the direct path for tenant {req.tenant!r}",
            )
        # §6: a forbidden tenant gets the empty tenant's answer after the empty
        # tenant's work, under the decoy tenant (which holds nothing).
        h = LoadHandle(req.tenant if allowed else DECOY_TENANT, [], [], 0.0, direct)
        try:
            found, stop = fill(h, req.keys)
        except BaseException:
            self._release(h)
            raise
        if not allowed:
            self._release(h)  # nothing, unless the decoy ever held a chunk
            return 0, ErrorCode.NOT_FOUND, tuple(misses)
        if not found:
            return 0, stop, tuple(misses)
        h.created = time.monotonic()
        return self._add_handle(h), stop, tuple(found) + tuple(misses[len(found) :])

    def complete_load(self, req: CompleteLoad) -> Reply:
        """§5.8: release the regions and pins; check chunks the worker reports corrupt."""
        if self.revoked_handle(req.handle) == 0:
            return Ack(Op.COMPLETE_LOAD)  # §6.1: released by a revocation or purge
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


__all__ = ["Transfers"]
