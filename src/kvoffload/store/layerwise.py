"""Layer-wise loads (protocol-v1.md §5.26): every chunk's layer *l* verified before layer *l+1*.

A chunk object holds its layers one after the other, each 4 KiB-aligned with
its own tag (layout-v1.md §3), so a load can go layer-major over a batch:
open every object and check its header and identity first (the checks
:func:`~kvoffload.layouts.v1.open_into` makes before the layers), then for each
layer read that layer's slot of every chunk, check padding and tag, decrypt it
into the chunk's output, and only then report the layer. An engine that
computes layer by layer starts on layer 0 while layer 1 is still being read.

One loop, one place for each rule:

- ``cancelled()`` is asked before each layer is copied: a disconnected client,
  or a tenant whose access was revoked, stops the load there, before the next
  byte goes into staging; every chunk is then a miss.
- ``report(layers_done, verified)`` is called after each layer, once every
  byte it reports was checked; ``verified`` never grows.
- A chunk that fails (read error, tag, padding) is a miss and ends the prefix:
  it and every later chunk are dropped from the loop, and the failure is
  handled as any failed read is (entry dropped, file quarantined).

From memory: an object with an image in the RAM tier (ramtier.py) taken from
the very file just opened (its identity checked against the descriptor's
``fstat``) is verified and decrypted layer by layer from that image; an image
that fails is dropped and the chunk is a miss, its file left alone.

One pass: an object the store may map (``fileio.map_opened``: written by the
sidecar, so no descriptor can shrink it under the mapping; large enough; a
kernel with MADV_POPULATE_READ) is mapped once, at open, from the descriptor
whose size was just checked, and each layer's slot is faulted in
(``fileio.populate``, an EIO instead of a SIGBUS) and verified and decrypted
straight from the page cache into its place in the output. Any other object
is read layer by layer into a scratch buffer. Every object is asked of the
kernel in full when it is opened (``POSIX_FADV_WILLNEED``), so later layers
come off the device while earlier ones are verified; a layer of a few small
slots (under ``PARALLEL_MIN_BYTES`` in all) is verified in the calling thread,
a wider one on the I/O streams.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import TransferCancelled
from ..layouts import CorruptObject, ObjectMismatch, UnknownKeyEpoch, v1
from . import files as fileio
from .api import ChunkRecord
from .config import PARALLEL_MIN_BYTES
from .ramtier import Image, RamTier
from .reads import Reads
from .removal import Removal
from .state import StoreState, log

#: ``report(layers_done, verified)``: layers [0, layers_done) of the first
#: ``verified`` chunks are in their outputs, verified.
ReportFn = Callable[[int, int], None]
#: ``plan(layers)``: the layer lengths of the leading chunks whose headers
#: passed, before any layer is read.
PlanFn = Callable[[list[tuple[int, ...]]], None]


@dataclass
class _Opened:
    key: bytes
    fd: int
    header: v1.ObjectHeader
    aead: v1.Aead | None
    #: Where each layer's plaintext starts in the chunk's output.
    starts: list[int]
    #: The widest layer slot (data, tag, padding): the scratch buffer's size.
    widest: int
    #: The object mapped (one pass), or None: read through ``scratch``.
    mapped: mmap.mmap | None = None
    view: memoryview | None = None
    scratch: bytearray | None = None
    #: The object's RAM image, pinned until :meth:`close` (then nothing is mapped).
    image: Image | None = None
    ram: RamTier | None = None

    def unmap(self) -> None:
        view, mapped = self.view, self.mapped
        self.view = self.mapped = None
        if view is not None:
            with contextlib.suppress(BufferError):
                view.release()
        if mapped is not None:
            fileio.unmap(mapped)

    def close(self) -> None:
        try:
            self.unmap()
            if self.image is not None and self.ram is not None:
                self.ram.unpin(self.image)
                self.image = None
        finally:
            os.close(self.fd)


def _layer(o: _Opened, i: int, out: memoryview) -> None:
    """Verify and decrypt layer ``i`` of an opened object into its place in ``out``:
    from the mapping (one pass), or read into the scratch buffer first."""
    h = o.header
    if i >= len(h.layers):
        return
    lo, hi = v1.layer_slot(h, i)
    start = o.starts[i]
    dst = out[start : start + h.layers[i].length]
    if o.image is not None:
        v1.open_layer(h, i, o.image.data[lo:hi], dst, o.aead)
        return
    if o.mapped is not None and o.view is not None:
        # Faulted in before it is touched: a page that cannot be read is an
        # OSError here (a miss), never a SIGBUS in the decrypt.
        if fileio.populate(o.mapped, lo, hi - lo):
            v1.open_layer(h, i, o.view[lo:hi], dst, o.aead)
            return
        o.unmap()  # this kernel refuses MADV_POPULATE_READ (found out now): read
    if o.scratch is None:
        o.scratch = bytearray(o.widest)
    slot = memoryview(o.scratch)[: hi - lo]
    got = os.preadv(o.fd, [slot], lo)
    if got != hi - lo:
        raise CorruptObject(f"layer {i}: short read ({got} of {hi - lo} bytes)")
    v1.open_layer(h, i, slot, dst, o.aead)


def _layer_bytes(opened: Sequence[_Opened], i: int, live: int) -> int:
    """The bytes of layer ``i`` of the first ``live`` opened chunks."""
    return sum(o.header.layers[i].length for o in opened[:live] if i < len(o.header.layers))


class _Reports:
    """The reports of one load: the one of the layer before is sent while this
    layer is verified on the pool (sending waits for the client's socket); it
    names only bytes already checked, and always goes out before any later one."""

    __slots__ = ("pending", "report")

    def __init__(self, report: ReportFn) -> None:
        self.report = report
        self.pending: tuple[int, int] | None = None

    def flush(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.report(*pending)


class Layerwise:
    """Layer-wise loads of one store (see the module docstring)."""

    def __init__(self, state: StoreState, reads: Reads, removal: Removal) -> None:
        self._state = state
        self._reads = reads
        self._removal = removal

    def get_into(
        self,
        tenant: str,
        keys: Sequence[bytes],
        outs: Sequence[memoryview],
        plan: PlanFn,
        report: ReportFn,
        cancelled: Callable[[int], bool],
    ) -> list[list[int] | None]:
        """Load ``keys`` layer-major into ``outs``; per chunk its layer lengths, or None.

        The non-None results form a prefix. Layers are reported through ``report``
        as they complete (see the module's notes); the final ``report`` has
        ``layers_done`` equal to the most layers of any chunk, unless the load
        stopped (cancelled, or no chunk left), after which nothing more is reported.
        ``cancelled(layer)`` is asked before each layer; a purge or revocation
        of ``tenant`` from the start of this call on stops the load there too
        (the same load generation as a whole-chunk load's, cancel.py).
        """
        if len(outs) != len(keys):
            raise ValueError("one output buffer per key")
        stop = stop_check(cancelled, self._state.load_gens.guard(tenant))
        recs: list[ChunkRecord] = []
        for key in keys:
            rec = self._reads.record(tenant, key)
            if rec is None:
                self._state.counters.miss()
                break
            recs.append(rec)
        got = self._load(tenant, recs, outs[: len(recs)], plan, report, stop)
        return got + [None] * (len(keys) - len(got))

    def load_planned(
        self,
        tenant: str,
        recs: Sequence[ChunkRecord],
        outs: Sequence[memoryview],
        plan: PlanFn,
        report: ReportFn,
        cancelled: Callable[[int], bool],
        guard: Callable[[int], None],
    ) -> list[list[int] | None]:
        """:meth:`get_into` of chunks whose index records the caller looked up
        (in order, up to the first miss) after taking ``guard`` (reads.py
        ``load_guard``): no second lookup per chunk; one result per record."""
        return self._load(tenant, recs, outs, plan, report, stop_check(cancelled, guard))

    def _load(
        self,
        tenant: str,
        recs: Sequence[ChunkRecord],
        outs: Sequence[memoryview],
        plan: PlanFn,
        report: ReportFn,
        cancelled: Callable[[int], bool],
    ) -> list[list[int] | None]:
        """The layer-wise load of ``recs``; ``cancelled(layer)``: whether to stop
        before that layer."""
        if len(outs) != len(recs):
            raise ValueError("one output buffer per record")
        opened: list[_Opened] = []
        try:
            for rec, out in zip(recs, outs, strict=True):
                try:
                    opened.append(self._open(tenant, rec, out))
                except Exception as exc:
                    self._failed(tenant, rec.chunk_key, exc)
                    break
            plan([tuple(le.length for le in o.header.layers) for o in opened])
            live = self._layers(tenant, opened, outs, report, cancelled)
            results: list[list[int] | None] = [None] * len(recs)
            for c in range(live):
                h = opened[c].header
                self._reads.hit(tenant, opened[c].key, h.payload_size)
                results[c] = [le.length for le in h.layers]
            return results
        finally:
            for o in opened:
                o.close()

    def _layers(
        self,
        tenant: str,
        opened: list[_Opened],
        outs: Sequence[memoryview],
        report: ReportFn,
        cancelled: Callable[[int], bool],
    ) -> int:
        """Verify the opened chunks layer by layer, reporting each layer; the
        number of leading chunks verified in full (0: cancelled)."""
        live = len(opened)
        layers = max((len(o.header.layers) for o in opened), default=0)
        pool = self._state.streams.executor() if live > 1 else None
        reports = _Reports(report)
        for i in range(layers):
            if live == 0:
                break
            # The cancel point: nothing of layer i has been copied yet.
            if cancelled(i):
                log.info("layer-wise load of %s stopped before layer %d", tenant, i)
                reports.flush()
                report(i, 0)
                return 0
            # A layer of a few small slots is verified here: the hop to a pool
            # thread and back costs more than the work (their reads were asked
            # for at open, POSIX_FADV_WILLNEED, so they come in together).
            if pool is None or _layer_bytes(opened, i, live) < PARALLEL_MIN_BYTES:
                reports.flush()
                errors: list[BaseException | None] = []
                for c in range(live):
                    try:
                        _layer(opened[c], i, outs[c])
                        errors.append(None)
                    except Exception as exc:
                        errors.append(exc)
                        break
            else:
                futs = [pool.submit(_layer, opened[c], i, outs[c]) for c in range(live)]
                try:
                    reports.flush()
                finally:  # never close an object a pool thread still reads
                    errors = [f.exception() for f in futs]
            for c, err in enumerate(errors):
                if err is not None:
                    self._failed(tenant, opened[c], err)
                    live = c
                    break
            reports.pending = (i + 1, live)
        reports.flush()
        return live

    def _open(self, tenant: str, rec: ChunkRecord, out: memoryview) -> _Opened:
        """Open one object and make every check that comes before its layers."""
        st = self._state
        key = rec.chunk_key
        fd = os.open(st.path(tenant, key), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            fst = os.fstat(fd)
            if fst.st_size != rec.size:
                raise CorruptObject(
                    f"object is {fst.st_size} bytes, its index record says {rec.size}"
                )
            hb = os.pread(fd, v1.header_length(rec.num_layers), 0)
            h = v1.decode_header(hb)
            if h.chunk_key != key or h.tenant != tenant or h.namespace != rec.namespace:
                raise ObjectMismatch("object belongs to another chunk key, tenant or namespace")
            if (h.total_size, len(h.layers), h.payload_size, h.key_epoch) != (
                rec.size, rec.num_layers, rec.payload, rec.key_epoch,
            ):  # fmt: skip
                raise ObjectMismatch("object differs from its index record (size or layers)")
            if h.payload_size > len(out):
                raise ObjectMismatch(f"object holds {h.payload_size} bytes, {len(out)} expected")
            pad = os.pread(fd, h.data_offset - len(hb), len(hb))
            if pad.count(0) != len(pad):
                raise CorruptObject("non-zero padding after header")
            aead: v1.Aead | None = None
            if h.sealed:
                tk = st.keyring.get(tenant)
                aead = (
                    st.keyring.object_aead_for(tenant, tk)(h)
                    if h.flags & v1.FLAG_OBJECT_KEY
                    else st.keyring.aead_for(tenant, tk)(h.key_epoch)
                )
                if aead is None:
                    raise UnknownKeyEpoch(
                        f"no key for epoch {h.key_epoch} (purged, unknown or newer)"
                    )
            return self._source(_opened(key, fd, h, aead), tenant, rec, fst)
        except BaseException:
            os.close(fd)
            raise

    def _source(self, o: _Opened, tenant: str, rec: ChunkRecord, fst: os.stat_result) -> _Opened:
        """Where an opened object's layers come from: its RAM image, taken from
        the very file just opened; else the file mapped (one pass); else read."""
        st = self._state
        ram = st.ram
        if ram is not None and ram.admits(rec.size):
            o.image = ram.pinned(tenant, o.key, fst)  # the file just opened
            if o.image is not None:
                o.ram = ram
                return o
        if getattr(st.io, "map_reads", False):
            # The size just checked is the size mapped; only a file no other
            # descriptor can shrink is mapped at all (fileio.map_opened).
            o.mapped = fileio.map_opened(o.fd, fst)
        if o.mapped is not None:
            o.view = memoryview(o.mapped)
        with contextlib.suppress(OSError):  # a hint: the layers come next
            os.posix_fadvise(o.fd, o.header.data_offset, 0, os.POSIX_FADV_WILLNEED)
        return o

    def _failed(self, tenant: str, o: _Opened | bytes, exc: BaseException) -> None:
        """A chunk that failed (``o``: opened, or the key of one that failed to open)."""
        if isinstance(o, _Opened) and o.image is not None and o.ram is not None:
            # The RAM tier's failure, not the file's: the image goes, the file stays.
            log.warning("chunk %s of %s: its RAM image %s; a miss", o.key.hex()[:16], tenant, exc)
            o.ram.failed(o.image)
            self._state.counters.miss()
            return
        key = o.key if isinstance(o, _Opened) else o
        if isinstance(exc, ObjectMismatch) and "index record" in str(exc):
            # The object may be whole and the record stale: the record goes, the
            # file stays for fsck (or a re-save) to sort out. A miss either way.
            self._state.counters.miss()
            self._removal.drop_quietly(tenant, key, "record-mismatch", remove_file=False)
            return
        self._removal.read_failed(tenant, key, exc)


def stop_check(
    cancelled: Callable[[int], bool], guard: Callable[[int], None]
) -> Callable[[int], bool]:
    """A layer-wise load's check before each layer: the caller's, then the load
    generation of its tenant (a purge or revocation since ``guard`` was taken)."""

    def stop(layer: int) -> bool:
        if cancelled(layer):
            return True
        try:
            guard(layer)
        except TransferCancelled:
            return True
        return False

    return stop


def _opened(key: bytes, fd: int, h: v1.ObjectHeader, aead: v1.Aead | None) -> _Opened:
    """An object opened and checked, with where each layer's plaintext starts."""
    starts, at = [], 0
    widest = 0
    for i, le in enumerate(h.layers):
        starts.append(at)
        at += le.length
        lo, hi = v1.layer_slot(h, i)
        widest = max(widest, hi - lo)
    return _Opened(key, fd, h, aead, starts, widest)


__all__ = ["Layerwise", "PlanFn", "ReportFn"]
