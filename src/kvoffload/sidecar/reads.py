"""The read verbs of a connection (protocol-v1.md §5.7, §5.8, §5.15, §5.26, §5.30).

One flow for both media: regions of the staging buffer the sidecar reads,
verifies and decrypts into (``prepare_load``; layer-wise or chunk-wise with
interim frames), or the object files handed to the worker (``lease_load``).
Either pins the leading chunks the index has before any read, and keeps
exactly the verified prefix; ``complete_load`` releases it. The flow is
composed into the session (session.py), which gives it the connection's
handle table (handles.py) and isolation checks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from kvoffload.errors import Reject
from kvoffload.protocol import (
    MAX_REPLY_FDS,
    Ack,
    CompleteLoad,
    ErrorCode,
    LayerExtent,
    LeaseLoad,
    LeaseLoadReply,
    LoadPlan,
    LoadProgress,
    LoadSlot,
    Op,
    PrepareLoad,
    PrepareLoadReply,
    ReadSlot,
    Reply,
    SealedLoad,
    SealedLoadReply,
    SealedSlot,
    align_up,
    close_fds,
)

from .handles import LEASE_ENTRY_BYTES, REPLY_ROOM, Access, Handles, LoadHandle
from .ports import Guard
from .service import DECOY_TENANT, Service

if TYPE_CHECKING:
    from ..store import ChunkRecord

log = logging.getLogger("kvoffload.server")

_R = TypeVar("_R", LoadSlot, ReadSlot, SealedSlot)
_EXTENT_BYTES = 40

#: Sends one interim frame of the request being served (§5.26); False when the
#: connection is closing or gone, which stops a layer-wise load.
EmitFn = Callable[[LoadProgress], bool]
#: ``fill(handle, keys)``: pin (and read) the leading chunks found, recorded in the handle.
FillFn = Callable[[LoadHandle, Sequence[bytes]], tuple[list[_R], ErrorCode]]

#: A chunk frame (protocol-v1 §5.30) once at least this much more is verified:
#: a frame costs a hop to the event loop and a wake-up of the client, worth it
#: where the client's copy of what it reports takes longer.
CHUNK_FRAME_MIN_BYTES = 4 << 20


class _WouldWait(Exception):
    """An inline ``prepare_load`` that would wait on the device or the disk."""


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


class _StagedLoad:
    """The ``fill`` of one ``prepare_load`` (§5.7): plan regions for the leading
    chunks the index has, pinned before any read so eviction cannot remove a
    file under it; read them in one batch; keep the verified prefix.

    ``inline`` (on the event loop): records from the index alone and reads
    that need no wait on the device, chunk by chunk as planned; where the next
    would wait, the plan stops there with ``BUSY`` (the client asks for the
    rest), or raises :class:`_WouldWait` having released everything when no
    chunk could be answered."""

    def __init__(
        self,
        reads: Reads,
        h: LoadHandle,
        layerwise: EmitFn | None,
        chunkwise: EmitFn | None,
        inline: bool,
    ) -> None:
        self.reads = reads
        self.h = h
        self.store = reads.service.store
        self.staging, _ = reads.handles.registered()
        self.layerwise = layerwise
        self.chunkwise = chunkwise
        self.inline = inline
        self.stop = ErrorCode.OK
        self.waits = False  # stop is BUSY because the rest would wait (inline)
        self.payloads: list[int] = []
        self.recs: list[ChunkRecord] = []
        self.read_inline: list[list[int] | None] = []
        # A purge or revocation from now on stops the load (store/cancel.py):
        # taken before the records are looked up, which the read then uses as they are.
        self.guard: Guard = self.store.load_guard(h.tenant)

    def run(self, keys: Sequence[bytes]) -> tuple[list[LoadSlot], ErrorCode]:
        for key in keys:
            if not self._plan(key):
                break
        served = len(self.recs)  # chunks the read answers (a hit or a miss)
        loaded = self._keep_prefix(self._read())
        if not served and self.waits:
            raise _WouldWait  # nothing answered here, nothing held: the pool reads it
        return loaded, self.stop

    def _record(self, key: bytes) -> ChunkRecord | None:
        if not self.inline:
            return self.store.payload_info(self.h.tenant, key)
        known, rec = self.store.payload_info_cached(self.h.tenant, key)
        if not known:
            raise _WouldWait
        return rec

    def _plan(self, key: bytes) -> bool:
        """Pin one more chunk into a region (and read it, inline); False: the plan ends."""
        h = self.h
        try:
            rec = self._record(key)
        except _WouldWait:
            if not h.keys:
                raise
            self.stop, self.waits = ErrorCode.BUSY, True  # the rest on the pool (§5.7)
            return False
        if rec is None or not rec.payload:
            self.stop = ErrorCode.NOT_FOUND
            return False
        need = align_up(rec.payload, self.reads.service.config.alignment)
        if need > self.staging.size:
            self.stop = ErrorCode.TOO_LARGE
            return False
        off = self.reads.handles.alloc_region(need)
        if off is None:
            self.stop = ErrorCode.BUSY
            return False
        h.offsets.append(off)
        self.store.pin(h.tenant, [key])
        h.keys.append(key)
        self.payloads.append(rec.payload)
        self.recs.append(rec)
        return self._read_planned_inline(key, rec, off) if self.inline else True

    def _read_planned_inline(self, key: bytes, rec: ChunkRecord, off: int) -> bool:
        """On the loop: only what needs no wait on the device (no budget: nothing
        waits on the pool). False: a miss or a wait ends the plan."""
        out = self.staging.view[off : off + rec.payload]
        try:
            got = self.store.load_planned_cached(self.h.tenant, [rec], [out], self.guard)
        finally:
            out.release()
        if not got:  # would wait: this chunk and the rest go to the pool
            h = self.h
            del h.keys[-1], h.offsets[-1], self.payloads[-1], self.recs[-1]
            self.store.unpin(h.tenant, [key])
            self.reads.handles.free(off)
            self.stop, self.waits = ErrorCode.BUSY, True
            return False
        self.read_inline.append(got[0])
        return got[0] is not None  # a miss ends the prefix

    def _read(self) -> list[list[int] | None]:
        """One batch, up to io_streams chunks at once, each straight into its region,
        with the records just looked up (no second index lookup; store/reads.py)."""
        if self.inline:
            return self.read_inline
        h = self.h
        outs = [self.staging.view[o : o + n] for o, n in zip(h.offsets, self.payloads, strict=True)]
        chunkwise = self.chunkwise
        frames = _ChunkFrames(h, chunkwise, len(self.recs)) if chunkwise is not None else None
        try:
            with self.reads.service.budget.hold(sum(self.payloads)):
                if self.layerwise is not None:
                    return self.reads.read_layerwise(h, self.recs, outs, self.layerwise, self.guard)
                on_chunk = None if frames is None else frames.verified
                return self.store.load_planned(h.tenant, self.recs, outs, self.guard, on_chunk)
        except Exception:
            log.exception("%r: reading chunks failed", self.reads)
            # A chunk already reported in a chunk frame stays loaded (§5.30).
            done = [] if frames is None else frames.reported
            self.stop = ErrorCode.INTERNAL
            return [*done, *[None] * (len(self.payloads) - len(done))]
        finally:
            for o in outs:
                o.release()

    def _keep_prefix(self, results: list[list[int] | None]) -> list[LoadSlot]:
        """The verified prefix as slots; everything after it unpinned and freed."""
        h = self.h
        loaded: list[LoadSlot] = []
        for off, payload, lengths in zip(h.offsets, self.payloads, results, strict=True):
            if not lengths or sum(lengths) != payload:
                break  # a miss ends the prefix: this chunk and all after it
            loaded.append(LoadSlot(True, off, tuple(lengths)))
        if len(loaded) < len(h.keys):
            if self.stop is ErrorCode.OK or self.waits:
                self.stop = ErrorCode.NOT_FOUND  # a miss ends the prefix
            n = len(loaded)
            keys_left, offs_left = h.keys[n:], h.offsets[n:]
            del h.keys[n:], h.offsets[n:]
            self.store.unpin(h.tenant, keys_left)
            for off in offs_left:
                self.reads.handles.free(off)
        return loaded


class Reads:
    """``prepare_load``/``lease_load`` → ``complete_load``."""

    def __init__(self, service: Service, handles: Handles, access: Access) -> None:
        self.service = service
        self.handles = handles
        self.access = access

    def __repr__(self) -> str:
        return repr(self.access)

    def load_cancelled(self, tenant: str) -> bool:
        """Whether a layer-wise load of ``tenant`` must stop before its next layer
        (§5.27): this connection lost the tenant (§6.1; one integer compared
        while the policy generation holds). A purge or a revocation also stops
        it through the store's load generation (store/cancel.py)."""
        return not self.access.may_use(tenant)

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
        if req.layerwise or req.tenant not in self.access.tenants:
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
        self.handles.open_slot()
        self.handles.registered()
        layerwise = emit if req.layerwise else None
        chunkwise = emit if req.chunkwise and not req.layerwise else None

        def fill(h: LoadHandle, keys: Sequence[bytes]) -> tuple[list[LoadSlot], ErrorCode]:
            return _StagedLoad(self, h, layerwise, chunkwise, inline).run(keys)

        handle, stop, slots = self._prepare_read(req, LoadSlot(False), False, fill)
        return PrepareLoadReply(handle, stop, slots)

    def read_layerwise(
        self,
        h: LoadHandle,
        recs: list[ChunkRecord],
        outs: list[memoryview],
        emit: EmitFn,
        guard: Guard,
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

        return self.service.store.load_planned_layerwise(
            h.tenant, recs, outs, plan, report, cancelled, guard
        )

    def lease_load(self, req: LeaseLoad) -> Reply:
        """§5.15: the leading objects' paths and checks, header checked, pinned."""
        self.handles.open_slot()
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
                need = LEASE_ENTRY_BYTES + len(path.encode()) + _EXTENT_BYTES * len(layers)
                if used + need > REPLY_ROOM:
                    store.unpin(h.tenant, [key])
                    return found, ErrorCode.BUSY
                used += need
                h.keys.append(key)
                extents = tuple(LayerExtent(le.offset, le.length, le.check) for le in layers)
                found.append(ReadSlot(True, path, lease.size, extents))
            return found, ErrorCode.OK

        handle, stop, slots = self._prepare_read(req, ReadSlot(False), True, fill)
        return LeaseLoadReply(handle, stop, slots)

    def sealed_load(self, req: SealedLoad) -> Reply:
        """§5.33: the leading objects by descriptor, each with the key of that
        object alone, pinned; the reply carries the descriptors (the connection
        passes and closes them). Stops at the first chunk it cannot hand out:
        a miss (``NOT_FOUND``), an object only the sidecar opens (``UNSUPPORTED``:
        load it with ``prepare_load``), or a full frame (``BUSY``)."""
        self.handles.open_slot()
        store = self.service.store
        fds: list[int] = []

        def fill(h: LoadHandle, keys: Sequence[bytes]) -> tuple[list[SealedSlot], ErrorCode]:
            found: list[SealedSlot] = []
            for key in keys:
                if len(found) >= MAX_REPLY_FDS:
                    return found, ErrorCode.BUSY
                store.pin(h.tenant, [key])  # before the object is opened (eviction)
                try:
                    lease = store.sealed_lease(h.tenant, key)
                except Exception:
                    store.unpin(h.tenant, [key])
                    log.exception("%r: sealed_load failed", self)
                    return found, ErrorCode.INTERNAL
                if lease is None or lease.fd is None:
                    store.unpin(h.tenant, [key])
                    return found, ErrorCode.NOT_FOUND if lease is None else ErrorCode.UNSUPPORTED
                h.keys.append(key)
                fds.append(lease.fd)
                found.append(SealedSlot(True, lease.size, lease.key, lease.namespace))
            return found, ErrorCode.OK

        try:
            handle, stop, slots = self._prepare_read(
                req, SealedSlot(False), True, fill, policy=False
            )
        except BaseException:
            close_fds(fds)
            raise
        if handle and not self.access.may_use(req.tenant):
            # Revoked while the objects were opened: nothing leaves (§6.1).
            held = self.handles.take_any(handle)  # None: the revocation released it
            if held is not None:
                self.handles.release(held)
            handle, stop, slots = 0, ErrorCode.NOT_FOUND, (SealedSlot(False),) * len(req.keys)
        if handle == 0:  # nothing handed out (a forbidden tenant does the decoy's work)
            close_fds(fds)
            fds = []
        return SealedLoadReply(handle, stop, slots, tuple(fds))

    def _prepare_read(
        self,
        req: PrepareLoad | SealedLoad,
        miss: _R,
        direct: bool,
        fill: FillFn[_R],
        *,
        policy: bool = True,
    ) -> tuple[int, ErrorCode, tuple[_R, ...]]:
        """§5.7, §5.15, §5.32, §6: the flow of the read verbs. ``fill`` records in the
        handle what it pins and allocates, and leaves there exactly the found prefix.
        ``direct``: the client reads the bytes itself; ``policy``: and that needs
        the tenant's direct-path policy (a lease's path does, a descriptor not)."""
        self.access.listed(req.tenant)
        misses = [miss] * len(req.keys)
        allowed = self.access.may_use(req.tenant)
        if allowed and direct and policy and not self.access.direct_ok(req.tenant):
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
            self.handles.release(h)
            raise
        if not allowed:
            self.handles.release(h)  # nothing, unless the decoy ever held a chunk
            return 0, ErrorCode.NOT_FOUND, tuple(misses)
        if not found:
            return 0, stop, tuple(misses)
        return self.handles.add(h), stop, tuple(found) + tuple(misses[len(found) :])

    def complete_load(self, req: CompleteLoad) -> Reply:
        """§5.8: release the regions and pins; check chunks the worker reports corrupt."""
        if self.handles.revoked(req.handle) == 0:
            return Ack(Op.COMPLETE_LOAD)  # §6.1: released by a revocation or purge
        h = self.handles.take(req.handle, LoadHandle)
        try:
            if h.direct:  # a staging load's bytes the sidecar verified itself
                for i in req.corrupt:
                    if i < len(h.keys) and self.service.store.check_reported(h.tenant, h.keys[i]):
                        log.warning(
                            "%r: chunk %s reported and found corrupt", self, h.keys[i].hex()[:16]
                        )
        finally:
            self.handles.release(h)
        return Ack(Op.COMPLETE_LOAD)


__all__ = ["CHUNK_FRAME_MIN_BYTES", "EmitFn", "Reads"]
