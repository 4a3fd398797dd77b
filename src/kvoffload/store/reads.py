"""Reading chunks: lookups, load plans, and get / get_many_into / load (read,
verify, decrypt).

Read rule: a chunk is returned only after every byte of its object has been
verified (structure, zero padding, every tag or checksum). Any failure —
missing file, torn or flipped bytes, another object's file, a purged key —
is a miss, and the index entry (and a corrupt file) is dropped (removal.py).

A load is planned (:meth:`Reads.plan_load`: its cancel check, then the index
records of the leading chunks found) and carried out (:meth:`Reads.load`), on
the pool or, for the leading chunks wholly in the page cache, inline
(:meth:`Reads.load_planned_cached`). A batch runs on the store's I/O streams:
up to ``io_streams`` chunks are read, verified and decrypted at once, each
straight into its own output; the calling thread takes the records and the
results in chunk order, so a batch answers as a one-at-a-time one would. A
chunk that fails its read or its checks is dropped on the thread that found
it, exactly as :meth:`Reads.get_into` drops it.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from ..layouts import ObjectMismatch, v1
from . import files as fileio
from .api import ChunkRecord, LoadPlan
from .cancel import LoadCancelled, may_wait_between_layers
from .config import MAX_OBJECT_BYTES
from .files import ScratchBuffers
from .maintenance import Maintenance
from .ramtier import RamTier, Slot
from .removal import Removal
from .state import StoreState, log

#: Each I/O thread's buffer for one layer slot of a streamed load
#: (:func:`fileio.streamed_object`), apart from the object-sized scratch the
#: saves use, so that neither shrinks the other.
_SLOTS = ScratchBuffers()

Guard = Callable[[int], None]
OnChunk = Callable[[int, list[int]], None]


class _Done:
    """A read finished in the calling thread, where a pool read has a Future:
    ``result()`` alike, without a Future's lock and condition (a small cached
    object's whole read costs a few times what a Future does)."""

    __slots__ = ("value",)

    def __init__(self, value: list[int] | None) -> None:
        self.value = value

    def result(self) -> list[int] | None:
        return self.value


class _Deferred:
    """A read to run in the calling thread when its turn comes (``result()``):
    its device read was started when it was queued, so the reads of a batch
    overlap on the device while one thread verifies them in order."""

    __slots__ = ("args", "fn")

    def __init__(self, fn: Callable[..., list[int] | None], *args: Any) -> None:
        self.fn, self.args = fn, args

    def result(self) -> list[int] | None:
        return self.fn(*self.args)


_Job = Future[list[int] | None] | _Done | _Deferred


class Reads:
    """Lookups and loads of one store (see the module docstring)."""

    def __init__(self, state: StoreState, removal: Removal, maintenance: Maintenance) -> None:
        self._state = state
        self._removal = removal
        self._maintenance = maintenance

    # ----------------------------------------------------------------- lookups

    def record(self, tenant: str, key: bytes) -> ChunkRecord | None:
        """The chunk's index record (another writer's object adopted on a miss,
        where the store probes files); None if absent or expired (then dropped)."""
        return self._record(tenant, key)

    def _record(self, tenant: str, key: bytes) -> ChunkRecord | None:
        st = self._state
        if st.tenant_writes.purging(tenant):
            return None  # its key is gone and its records are going (purge.py)
        rec = st.index.get(tenant, key)
        if rec is None and st.config.probe_files_on_miss and self._maintenance.adopt(tenant, key):
            rec = st.index.get(tenant, key)
        if rec is not None and st.is_expired(rec, time.time_ns()):
            self._removal.drop_quietly(tenant, key, "expired")
            return None
        return rec

    def lookup(self, tenant: str, keys: Sequence[bytes]) -> int:
        """How many leading keys are present (per the index, plus files on a miss).
        None of a tenant being purged: its key is gone and its records are going."""
        st = self._state
        if st.tenant_writes.purging(tenant):
            return 0
        index = st.index
        now = time.time_ns()
        created_after, accessed_after = st.cutoffs(tenant, now)
        n = index.lookup(
            tenant, keys, now, created_after_ns=created_after, accessed_after_ns=accessed_after
        )
        # The prefix ends at an absent or expired key; an absent one may be another
        # node's object (shared FS): adopt it and go on, which costs a stat per miss.
        while n < len(keys):
            rec = index.get(tenant, keys[n])
            if rec is not None:  # present but expired (or saved since the lookup began)
                if st.is_expired(rec, now):
                    self._removal.drop_quietly(tenant, keys[n], "expired")
                return n
            if not (st.config.probe_files_on_miss and self._maintenance.adopt(tenant, keys[n])):
                return n
            # An adopted chunk past its limits ends the prefix here, and goes next round.
            n += index.lookup(
                tenant, keys[n:], now,
                created_after_ns=created_after, accessed_after_ns=accessed_after,
            )  # fmt: skip
        return n

    def lookup_cached(self, tenant: str, keys: Sequence[bytes]) -> int | None:
        """:meth:`lookup` from the index alone, or None where that needs the disk
        (a miss that may be another node's file, or an expired entry to drop)."""
        st = self._state
        if st.tenant_writes.purging(tenant):
            return 0
        now = time.time_ns()
        created_after, accessed_after = st.cutoffs(tenant, now)
        n = st.index.lookup(
            tenant, keys, now, created_after_ns=created_after, accessed_after_ns=accessed_after
        )
        if n == len(keys):
            return n
        if st.config.probe_files_on_miss or st.index.get(tenant, keys[n]) is not None:
            return None
        return n

    def contains(self, tenant: str, key: bytes) -> bool:
        return self.lookup(tenant, [key]) == 1

    def payload_info(self, tenant: str, key: bytes) -> ChunkRecord | None:
        """Index record of a chunk (sizes, layers), no data I/O."""
        return self._record(tenant, key)

    def payload_info_cached(self, tenant: str, key: bytes) -> tuple[bool, ChunkRecord | None]:
        """:meth:`payload_info` from the index alone: (True, the record or None),
        or (False, None) where the answer needs the disk (a miss that may be
        another node's file, or an expired entry to drop), which the caller then
        asks on a thread that may wait."""
        st = self._state
        if st.tenant_writes.purging(tenant):
            return True, None
        rec = st.index.get(tenant, key)
        if rec is None:
            return (not st.config.probe_files_on_miss), None
        if st.is_expired(rec, time.time_ns()):
            return False, None
        return True, rec

    def touch(self, tenant: str, keys: Sequence[bytes]) -> None:
        touch = self._state.access.touch
        for k in keys:
            touch(tenant, k)  # the index ignores keys it does not hold

    def hit(self, tenant: str, key: bytes, payload: int) -> None:
        """A chunk handed out: its access time and the counters."""
        self._state.access.touch(tenant, key)
        self._state.counters.hit(payload)

    # ------------------------------------------------------------------- plans

    def load_guard(self, tenant: str) -> Guard:
        """The cancel check of a load of ``tenant`` that starts now (cancel.py):
        take it before looking up the records :meth:`load_planned` is given, so
        a purge or revocation after the lookup still stops the load."""
        return self._state.load_gens.guard(tenant)

    def plan_load(self, tenant: str, keys: Sequence[bytes]) -> LoadPlan:
        """The plan of a load of ``keys``: its cancel check, then the records of
        the leading chunks found (a miss ends them, and counts)."""
        guard = self._state.load_gens.guard(tenant)
        recs: list[ChunkRecord] = []
        for key in keys:
            rec = self._record(tenant, key)
            if rec is None:
                self._state.counters.miss()
                break
            recs.append(rec)
        return LoadPlan(tenant, guard, tuple(recs), len(keys))

    def load(
        self,
        plan: LoadPlan,
        outs: Sequence[memoryview],
        *,
        on_chunk: OnChunk | None = None,
        inline: bool = False,
    ) -> list[list[int] | None]:
        """Carry out ``plan`` into ``outs`` (one per planned record): on the pool
        (:meth:`load_planned`), or with ``inline`` only the leading chunks that
        need no wait on the device (:meth:`load_planned_cached`; shorter then)."""
        if inline:
            return self.load_planned_cached(plan.tenant, plan.records, outs, plan.guard)
        return self.load_planned(plan.tenant, plan.records, outs, plan.guard, on_chunk)

    # ------------------------------------------------------------------- loads

    def get(self, tenant: str, key: bytes) -> list[bytes] | None:
        """Convenience: the verified layers as bytes, or None."""
        rec = self._record(tenant, key)
        if rec is None:
            self._state.counters.miss()
            return None
        out = bytearray(rec.payload)
        lengths = self.get_into(tenant, key, memoryview(out))
        if lengths is None:
            return None
        res, pos = [], 0
        for n in lengths:
            res.append(bytes(out[pos : pos + n]))
            pos += n
        return res

    def get_into(self, tenant: str, key: bytes, out: memoryview) -> list[int] | None:
        """Verify the chunk and write its layers, packed, into ``out``.

        Returns the per-layer lengths, or None (a miss) if the chunk is absent
        or fails any check; then ``out`` holds garbage and the entry is dropped.
        """
        guard = self._state.load_gens.guard(tenant)
        rec = self._record(tenant, key)
        if rec is None:
            self._state.counters.miss()
            return None
        return self._load_one(tenant, rec, out, guard)

    def get_many_into(
        self,
        tenant: str,
        keys: Sequence[bytes],
        outs: Sequence[memoryview],
        *,
        stop_at_miss: bool = True,
    ) -> list[list[int] | None]:
        """:meth:`get_into` for several chunks, up to ``io_streams`` of them
        read, verified and decrypted at once, each on a pool thread straight into
        its ``outs[i]``. Per chunk: its layer lengths, or None (a miss).

        With ``stop_at_miss`` (the default: a prefix cache has no use for the
        chunks after a hole) every chunk after the first miss is None: none is
        started after it is known, and those already in flight (at most
        ``io_streams - 1``) are waited for and disowned (``outs`` of a None
        chunk hold garbage, as ever; a chunk that fails its checks there is
        dropped as any failed read is).
        """
        if len(outs) != len(keys):
            raise ValueError("one output buffer per key")
        if len(keys) < 2:
            return [self.get_into(tenant, k, o) for k, o in zip(keys, outs, strict=True)]
        guard = self._state.load_gens.guard(tenant)  # a purge or revocation from now on cancels
        record = self._record
        return self._load_batch(
            tenant, len(keys), lambda i: record(tenant, keys[i]), outs, guard, stop_at_miss
        )

    def load_planned(
        self,
        tenant: str,
        recs: Sequence[ChunkRecord],
        outs: Sequence[memoryview],
        guard: Guard,
        on_chunk: OnChunk | None = None,
    ) -> list[list[int] | None]:
        """:meth:`get_many_into` of chunks whose index records the caller just
        looked up (``payload_info``, after :meth:`load_guard`): the same reads and
        checks, without a second index lookup per chunk. The object must still be
        the one its record describes, or the chunk is a miss.

        ``on_chunk(i, lengths)`` is called in order for each chunk of the leading
        verified prefix as soon as it is known (protocol-v1 §5.30: the caller
        hands it out while the later chunks are read); such a chunk is in the
        result whatever happens to the chunks after it."""
        if len(outs) != len(recs):
            raise ValueError("one output buffer per record")
        if len(recs) == 1:
            return [self._load_one(tenant, recs[0], outs[0], guard)]
        return self._load_batch(tenant, len(recs), recs.__getitem__, outs, guard, True, on_chunk)

    def load_planned_cached(
        self,
        tenant: str,
        recs: Sequence[ChunkRecord],
        outs: Sequence[memoryview],
        guard: Guard,
    ) -> list[list[int] | None]:
        """:meth:`load_planned` of the leading chunks that need no wait on the
        device: small objects (under :data:`fileio.MAP_MIN_BYTES`) whose every byte
        is in the page cache, read with ``RWF_NOWAIT`` and verified in this thread
        exactly as on the pool. The result is shorter than ``recs`` where the next
        chunk would wait (large, cold, or a backend that does not map reads): the
        caller reads the rest the ordinary way. A miss ends it as ever (None)."""
        if len(outs) != len(recs):
            raise ValueError("one output buffer per record")
        results: list[list[int] | None] = []
        if not getattr(self._state.io, "map_reads", False) or may_wait_between_layers():
            return results
        load_cached = self._load_cached
        for rec, out in zip(recs, outs, strict=True):
            if rec.size >= fileio.MAP_MIN_BYTES:
                break
            job = load_cached(tenant, rec, out, guard)
            if job is None:
                break
            got = job.value
            results.append(got)
            if got is None:
                break
        return results

    def _load_batch(
        self,
        tenant: str,
        n: int,
        record: Callable[[int], ChunkRecord | None],
        outs: Sequence[memoryview],
        guard: Guard,
        stop_at_miss: bool,
        on_chunk: OnChunk | None = None,
    ) -> list[list[int] | None]:
        """The loop of :meth:`get_many_into`: chunk ``i``'s record is ``record(i)``,
        asked in order. A small object is read and verified in this thread (a hop
        to a pool thread and back costs more than the work): at once where every
        byte of it is in the page cache, else in its turn, its device read
        started (readahead) when it joined the window, so that the reads of the
        window overlap on the device. A large object is read on the pool."""
        st = self._state
        results: list[list[int] | None] = [None] * n
        pool = st.streams.executor()
        streams = st.streams.streams
        inline = getattr(st.io, "map_reads", False)
        load_one, load_cached, miss = self._load_one, self._load_cached, st.counters.miss
        # In order: (chunk index, its read+verify on the pool or here). The index
        # is consulted here, in order; each chunk is read, verified and decrypted
        # on a pool thread (or here), straight into its own ``outs[i]``.
        window: deque[tuple[int, _Job]] = deque()
        nxt = 0
        missed = False
        try:
            while True:
                while not missed and nxt < n and len(window) < streams:
                    try:
                        rec = record(nxt)
                    except Exception as exc:
                        if nxt == 0:
                            raise
                        # A failing index after chunk 0: a miss here, never the loss
                        # of the chunks already verified (layout-v1.md §5).
                        log.warning("chunk %d: looking it up failed: %s", nxt, exc)
                        rec = None
                    if rec is None:
                        miss()
                        missed = stop_at_miss
                    else:
                        job: _Job | None = None
                        if inline and rec.size < fileio.MAP_MIN_BYTES:
                            # Cached: read here and now. Not cached: its read is
                            # started (readahead) and it is read here in its turn,
                            # the device working on the next ones meanwhile: a hop
                            # to a pool thread and back costs more than a small
                            # object's whole read and check.
                            job = load_cached(tenant, rec, outs[nxt], guard, prefetch=True)
                            if job is None:
                                job = _Deferred(load_one, tenant, rec, outs[nxt], guard)
                        if job is None:
                            job = pool.submit(load_one, tenant, rec, outs[nxt], guard)
                        window.append((nxt, job))
                    nxt += 1
                if not window:
                    break
                i, fut = window.popleft()
                got = results[i] = fut.result()
                if got is None:
                    if stop_at_miss:
                        missed = True
                        break
                elif on_chunk is not None:
                    on_chunk(i, got)
        finally:
            self._disown(window, missed)
        return results

    def _disown(self, window: deque[tuple[int, _Job]], missed: bool) -> None:
        """The reads still in flight past a miss (or an error): wait for each,
        then disown it (verified after the hole: not handed out, not a hit)."""
        for _i, fut in window:
            if isinstance(fut, _Deferred):
                continue  # never read: nothing to disown
            try:
                lengths = fut.result()
            except Exception as exc:
                log.warning("get_many_into: read of a chunk past a miss failed: %s", exc)
                continue
            if lengths is not None and missed:
                self._state.counters.unhit(sum(lengths))

    def _load_cached(
        self,
        tenant: str,
        rec: ChunkRecord,
        out: memoryview,
        guard: Guard,
        *,
        prefetch: bool = False,
    ) -> _Done | None:
        """:meth:`_load_one` in this thread, as a finished result, if the whole
        object is in the page cache (no wait on the device); None otherwise, and
        then the caller reads it the ordinary way (with ``prefetch``, its read
        from the device is already under way: :func:`fileio.read_cached`)."""
        st = self._state
        key = rec.chunk_key
        try:
            buf = fileio.read_cached(
                st.path_str(tenant, key), st.scratch.get, MAX_OBJECT_BYTES, prefetch=prefetch
            )
        except Exception as exc:  # every failure of a damaged file is a miss (§5)
            self._removal.read_failed(tenant, key, exc)
            buf = None
            got: list[int] | None = None
        else:
            if buf is None:
                return None
            got = self._open_into(tenant, key, rec, buf, out, guard)
        return _Done(got)

    def _load_one(
        self,
        tenant: str,
        rec: ChunkRecord,
        out: memoryview,
        guard: Guard | None = None,
    ) -> list[int] | None:
        """:meth:`get_into` of an indexed chunk (on a pool thread for a batch): from
        its image in the RAM tier where it has one (:meth:`_load_image`); else a
        large object mostly not in the page cache read whole with O_DIRECT where
        the backend asks for it (:func:`fileio.read_uncached`); else one layer
        slot at a time where reads go through the page cache of a local file
        system (:func:`fileio.streamed_object`); else read whole into the
        thread's scratch buffer. Its layer lengths, or None (a miss, handled)."""
        st = self._state
        key = rec.chunk_key
        spath = st.path_str(tenant, key)
        ram = st.ram
        if ram is not None and ram.admits(rec.size):
            got = self._load_image(ram, tenant, rec, spath, out, guard)
            if not isinstance(got, _NoImage):
                return got
        path = Path(spath)
        io = st.io
        try:
            direct_min = getattr(io, "direct_read_min", 0)
            if direct_min and rec.size >= direct_min:
                got = self._load_uncached(tenant, rec, spath, out, guard, direct_min)
                if not isinstance(got, _NoImage):
                    return got
            if getattr(io, "map_reads", False):
                # Layer by layer through the page cache, each slot verified and
                # decrypted into ``out`` while it is in the CPU cache.
                with fileio.streamed_object(path, MAX_OBJECT_BYTES) as reader:
                    if reader is not None:
                        return self._open_into(tenant, key, rec, reader, out, guard)
            buf = io.read_object(path, st.scratch.get, MAX_OBJECT_BYTES)
        except Exception as exc:  # every failure of a damaged file is a miss (§5)
            self._removal.read_failed(tenant, key, exc)
            return None
        return self._open_into(tenant, key, rec, buf, out, guard)

    def _load_image(
        self,
        ram: RamTier,
        tenant: str,
        rec: ChunkRecord,
        path: str,
        out: memoryview,
        guard: Guard | None,
    ) -> list[int] | _NoImage | None:
        """The chunk from its RAM image, verified and decrypted as a read of its
        file would be; :data:`_NO_IMAGE` where there is none (or it failed its
        checks, and is dropped): then the caller reads the file."""
        key = rec.chunk_key
        img = ram.pinned(tenant, key, path)
        if img is None:
            return _NO_IMAGE
        try:
            return self._open_into(tenant, key, rec, img.data, out, guard, image=True)
        except _ImageFailed as exc:
            log.warning("chunk %s of %s: its RAM image %s; reading the file", key.hex()[:16],
                        tenant, exc.__cause__)  # fmt: skip
            ram.failed(img)
            return _NO_IMAGE
        finally:
            ram.unpin(img)

    def _load_uncached(
        self,
        tenant: str,
        rec: ChunkRecord,
        path: str,
        out: memoryview,
        guard: Guard | None,
        direct_min: int,
    ) -> list[int] | _NoImage | None:
        """:meth:`_load_one` of a large object mostly not in the page cache: read
        whole with O_DIRECT (:func:`fileio.read_uncached`), into a buffer of the
        RAM tier where one is ready (the image is then kept). :data:`_NO_IMAGE`
        where it was not read so (cached, or O_DIRECT refused): the caller reads
        it through the page cache. OSError as a read raises it."""
        st = self._state
        key = rec.chunk_key
        ram = st.ram
        slot: Slot | None = None
        gen = st.load_gens.current(tenant)
        got: list[int] | None = None

        def alloc(n: int) -> memoryview:  # asked only once it is to be read so
            nonlocal slot
            slot = ram.lend(rec.size) if ram is not None else None
            return st.scratch.get(n) if slot is None else slot.alloc(n)

        try:
            buf = fileio.read_uncached(
                path, alloc, MAX_OBJECT_BYTES, direct_min, parts=st.streams.part_reader()
            )
            if buf is not None:
                got = self._open_into(tenant, key, rec, buf, out, guard)
                return got
        finally:
            if slot is not None and ram is not None:
                ram.settle(slot, tenant, key, rec.size, path, got is not None,
                           st.load_gens.unchanged(tenant, gen))  # fmt: skip
        return _NO_IMAGE

    def _open_into(
        self,
        tenant: str,
        key: bytes,
        rec: ChunkRecord,
        buf: memoryview | fileio.ObjectReader,
        out: memoryview,
        guard: Guard | None = None,
        *,
        image: bool = False,
    ) -> list[int] | None:
        """Verify and decrypt a read object (or one read layer by layer) into
        ``out``; None (and the entry dropped) if bad.

        The object must also be the one the index describes (size, layers,
        payload, key epoch): anything else is a relabelled or foreign object.
        Every exception here is a miss of this chunk alone (layout-v1.md §5).
        """
        st = self._state
        try:
            tk = st.keyring.get(tenant) if rec.key_epoch else None
            if isinstance(buf, fileio.ObjectReader):
                h = v1.open_read_into(
                    buf.read_at,
                    buf.size,
                    _SLOTS.get,
                    out,
                    tenant=tenant,
                    namespace=rec.namespace,
                    chunk_key=key,
                    aead_for_epoch=st.keyring.aead_for(tenant, tk),
                    object_aead=st.keyring.object_aead_for(tenant, tk),
                    before_layer=guard,
                )
            else:
                h = v1.open_into(
                    buf,
                    out,
                    tenant=tenant,
                    namespace=rec.namespace,
                    chunk_key=key,
                    aead_for_epoch=st.keyring.aead_for(tenant, tk),
                    object_aead=st.keyring.object_aead_for(tenant, tk),
                    before_layer=guard,
                )
            if (h.total_size, len(h.layers), h.payload_size, h.key_epoch) != (
                rec.size, rec.num_layers, rec.payload, rec.key_epoch,
            ):  # fmt: skip
                raise _RecordMismatch("object differs from its index record (size or layers)")
        except LoadCancelled:
            # Purged or revoked while loading (cancel.py): a miss, the object untouched.
            st.counters.miss()
            return None
        except Exception as exc:
            if image:  # the RAM tier's failure, not the file's: the caller reads it
                raise _ImageFailed from exc
            if isinstance(exc, ObjectMismatch) and self._verifies_alone(tenant, key, buf):
                # A whole, valid object that the index describes wrongly (a
                # damaged or stale record): the record goes, the object stays
                # and is indexed from its own header. This read is a miss.
                log.warning("chunk %s of %s: %s; re-indexed", key.hex()[:16], tenant, exc)
                st.counters.miss()
                self._removal.drop_quietly(tenant, key, "record-mismatch", remove_file=False)
                with contextlib.suppress(Exception):
                    self._maintenance.adopt(tenant, key)
                return None
            self._removal.read_failed(tenant, key, exc)
            return None
        self.hit(tenant, key, h.payload_size)
        return [le.length for le in h.layers]

    def _verifies_alone(
        self, tenant: str, key: bytes, buf: memoryview | fileio.ObjectReader
    ) -> bool:
        """Whether ``buf`` is a valid object of (tenant, key) by its own header,
        whatever the index record says."""
        st = self._state
        try:
            if isinstance(buf, fileio.ObjectReader):
                whole = memoryview(bytearray(buf.size))
                if buf.read_at(whole, 0) != buf.size:
                    return False
                buf = whole
            h = v1.decode_header(buf)
            tk = st.keyring.get(tenant) if h.sealed else None
            v1.open_into(
                buf,
                memoryview(bytearray(h.payload_size)),
                tenant=tenant,
                namespace=h.namespace,  # a damaged record may be what is wrong
                chunk_key=key,
                aead_for_epoch=st.keyring.aead_for(tenant, tk),
                object_aead=st.keyring.object_aead_for(tenant, tk),
            )
            return True
        except Exception:
            return False


class _ImageFailed(Exception):
    """A RAM image that failed its checks (its cause): dropped, the file is read."""


class _NoImage:
    """Not served this way (no RAM image; not read with O_DIRECT): read the file
    the ordinary way."""


_NO_IMAGE = _NoImage()


class _RecordMismatch(ObjectMismatch):
    """A verified object whose header disagrees with its index record."""


__all__ = ["Reads"]
