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
from typing import TYPE_CHECKING

from ..layouts import CorruptObject, ObjectMismatch, UnknownKeyEpoch, v1
from . import files as fileio
from .api import ChunkRecord
from .pipeline import PARALLEL_MIN_BYTES
from .ramtier import Image, RamTier
from .state import log

if TYPE_CHECKING:
    from .pipeline import Pipeline

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


def _open(store: Pipeline, tenant: str, rec: ChunkRecord, out: memoryview) -> _Opened:
    """Open one object and make every check that comes before its layers."""
    key = rec.chunk_key
    fd = os.open(store._path(tenant, key), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if st.st_size != rec.size:
            raise CorruptObject(f"object is {st.st_size} bytes, its index record says {rec.size}")
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
            tk = store.keyring.get(tenant)
            aead = store.keyring.aead_for(tenant, tk)(h.key_epoch)
            if aead is None:
                raise UnknownKeyEpoch(f"no key for epoch {h.key_epoch} (purged, unknown or newer)")
        starts, at = [], 0
        widest = 0
        for i, le in enumerate(h.layers):
            starts.append(at)
            at += le.length
            lo, hi = v1.layer_slot(h, i)
            widest = max(widest, hi - lo)
        o = _Opened(key, fd, h, aead, starts, widest)
        ram = store._ram
        if ram is not None and ram.admits(rec.size):
            o.image = ram.pinned(tenant, key, st)  # the file just opened
            if o.image is not None:
                o.ram = ram
                return o
        if getattr(store.io, "map_reads", False):
            # The size just checked is the size mapped; only a file no other
            # descriptor can shrink is mapped at all (fileio.map_opened).
            o.mapped = fileio.map_opened(fd, st)
        if o.mapped is not None:
            o.view = memoryview(o.mapped)
        with contextlib.suppress(OSError):  # a hint: the layers come next
            os.posix_fadvise(fd, h.data_offset, 0, os.POSIX_FADV_WILLNEED)
        return o
    except BaseException:
        os.close(fd)
        raise


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


def get_layerwise_into(
    store: Pipeline,
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
    """
    if len(outs) != len(keys):
        raise ValueError("one output buffer per key")
    recs: list[ChunkRecord] = []
    for key in keys:
        rec = store._record(tenant, key)
        if rec is None:
            store.counters.miss()
            break
        recs.append(rec)
    got = load_layerwise(store, tenant, recs, outs[: len(recs)], plan, report, cancelled)
    return got + [None] * (len(keys) - len(got))


def load_layerwise(
    store: Pipeline,
    tenant: str,
    recs: Sequence[ChunkRecord],
    outs: Sequence[memoryview],
    plan: PlanFn,
    report: ReportFn,
    cancelled: Callable[[int], bool],
) -> list[list[int] | None]:
    """:func:`get_layerwise_into` of chunks whose index records the caller looked
    up (in order, up to the first miss); one result per record."""
    if len(outs) != len(recs):
        raise ValueError("one output buffer per record")
    opened: list[_Opened] = []
    try:
        for rec, out in zip(recs, outs, strict=True):
            try:
                opened.append(_open(store, tenant, rec, out))
            except Exception as exc:
                _failed(store, tenant, rec.chunk_key, exc)
                break
        live = len(opened)
        plan([tuple(le.length for le in o.header.layers) for o in opened])
        layers = max((len(o.header.layers) for o in opened), default=0)
        pool = store._state.streams.executor() if live > 1 else None
        # The report of the layer before, sent while this layer is verified on
        # the pool (sending waits for the client's socket): it names only
        # bytes already checked, and always goes out before any later report.
        pending: tuple[int, int] | None = None

        def flush() -> None:
            nonlocal pending
            if pending is not None:
                report(*pending)
                pending = None

        for i in range(layers):
            if live == 0:
                break
            # The cancel point: nothing of layer i has been copied yet.
            if cancelled(i):
                log.info("layer-wise load of %s stopped before layer %d", tenant, i)
                flush()
                live = 0
                report(i, 0)
                break
            # A layer of a few small slots is verified here: the hop to a pool
            # thread and back costs more than the work (their reads were asked
            # for at open, POSIX_FADV_WILLNEED, so they come in together).
            if pool is None or _layer_bytes(opened, i, live) < PARALLEL_MIN_BYTES:
                flush()
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
                    flush()
                finally:  # never close an object a pool thread still reads
                    errors = [f.exception() for f in futs]
            for c, err in enumerate(errors):
                if err is not None:
                    _failed(store, tenant, opened[c], err)
                    live = c
                    break
            pending = (i + 1, live)
        flush()
        results: list[list[int] | None] = [None] * len(recs)
        for c in range(live):
            h = opened[c].header
            store._hit(tenant, opened[c].key, h.payload_size)
            results[c] = [le.length for le in h.layers]
        return results
    finally:
        for o in opened:
            o.close()


def _layer_bytes(opened: Sequence[_Opened], i: int, live: int) -> int:
    """The bytes of layer ``i`` of the first ``live`` opened chunks."""
    return sum(o.header.layers[i].length for o in opened[:live] if i < len(o.header.layers))


def _failed(store: Pipeline, tenant: str, o: _Opened | bytes, exc: BaseException) -> None:
    """A chunk that failed (``o``: opened, or the key of one that failed to open)."""
    if isinstance(o, _Opened) and o.image is not None and o.ram is not None:
        # The RAM tier's failure, not the file's: the image goes, the file stays.
        log.warning("chunk %s of %s: its RAM image %s; a miss", o.key.hex()[:16], tenant, exc)
        o.ram.failed(o.image)
        store.counters.miss()
        return
    key = o.key if isinstance(o, _Opened) else o
    if isinstance(exc, ObjectMismatch) and "index record" in str(exc):
        # The object may be whole and the record stale: the record goes, the
        # file stays for fsck (or a re-save) to sort out. A miss either way.
        store.counters.miss()
        store._removal.drop_quietly(tenant, key, "record-mismatch", remove_file=False)
        return
    store._removal.read_failed(tenant, key, exc)


__all__ = ["PlanFn", "ReportFn", "get_layerwise_into", "load_layerwise"]
