"""The ceilings a kvoffload row is held against, measured in the same run: the CPU
stages (memcpy, AES-256-GCM, XXH3-128, one thread) and raw file I/O of the very
object bytes the store writes (buffered or O_DIRECT, one stream or several).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt
import xxhash
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from benchlib.chunks import Shape, mv, object_image, random_payload, split_layers, touched
from benchlib.method import Timing, interleaved, write_all
from benchlib.results import Result
from kvoffload.layouts import v1

O_DIRECT: int = getattr(os, "O_DIRECT", 0)
COLD_METHOD = (
    "cold = os.sync() (untimed), then posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) on every "
    "file of the row; the page-cache residency of the timed files is then measured with "
    "mincore(2) and shown as 'cached'. Only object files are dropped: the LMDB index, key "
    "files and directories stay cached (as in a running sidecar). The RAM tier (sealed "
    "images of large objects, ram_cache) is emptied too (Store.drop_cache; a sidecar's "
    "drop_cache verb), after it mapped its memory before the rows."
)


def timed(op: Callable[[int], object], *, n: int, budget_s: float, min_ops: int) -> Timing:
    """Run ``op(0)`` untimed, then ``op(1..n)`` until ``budget_s`` is spent (>= min_ops)."""
    return interleaved([op], n=n, budget_s=budget_s, min_ops=min_ops)[0]


def cpu_ceilings(shape: Shape, budget_s: float) -> dict[str, Result]:
    """memcpy of a whole chunk; AES-GCM and XXH3 per layer, one thread."""
    out: dict[str, Result] = {}
    n_cap = 1 << 30

    def record(name: str, nbytes: int, op: Callable[[int], object]) -> None:
        ops, wall, p50 = timed(op, n=n_cap, budget_s=budget_s, min_ops=8)
        out[name] = Result("ceiling", name, shape.key, None, ops, nbytes, 0, wall, p50 * 1e3)

    src = random_payload(shape.payload, 1)
    dst = touched(shape.payload)
    record("memcpy", shape.payload, lambda _i: np.copyto(dst, src))

    # A fixed nonce is fine here: a throwaway key, and nothing is kept.
    aead = AESGCM(os.urandom(32))
    nonce = os.urandom(v1.NONCE_SIZE)
    aad = os.urandom(160)  # about the size of a v1 layer AAD
    layer = mv(src)[: shape.layer_bytes]
    sealed = mv(touched(shape.layer_bytes + v1.TAG_SIZE))
    sealed = sealed[: shape.layer_bytes + v1.TAG_SIZE]
    plain = mv(touched(shape.layer_bytes))[: shape.layer_bytes]
    record(
        "aes-gcm encrypt_into",
        shape.layer_bytes,
        lambda _i: aead.encrypt_into(nonce, layer, aad, sealed),
    )
    record(
        "aes-gcm decrypt_into",
        shape.layer_bytes,
        lambda _i: aead.decrypt_into(nonce, sealed, aad, plain),
    )
    if bytes(plain) != bytes(layer):
        raise AssertionError("AES-GCM round trip differs")
    record("xxh3-128", shape.layer_bytes, lambda _i: xxhash.xxh3_128_digest(layer))
    return out


@dataclass
class Prepared:
    """A shape, the chunks per op of its rows (``batch``), the bytes every row moves
    (the payload, its layers, the exact object image per format; ``padded``: the
    same zero-padded to 4 KiB, for O_DIRECT writes), and the CPU ceilings of the
    shape, which the rows are held against."""

    shape: Shape
    batch: int
    payload: npt.NDArray[np.uint8]
    layers: list[memoryview]
    images: dict[str, memoryview]
    cpu: dict[str, Result]
    padded: dict[str, memoryview] = field(default_factory=dict)

    def ops(self, least: int) -> int:
        """Ops per row (upper bound): the shape's chunks in batches, at least ``least``."""
        return max(least, self.shape.chunks // self.batch)

    def file_bytes(self, fmt: str) -> int:
        return len(self.images[fmt])


def prepare(
    shape: Shape, batch: int, formats: Sequence[str], budget_s: float, *, padded: bool = False
) -> Prepared:
    """The CPU ceilings of ``shape`` (at most 0.3 s each), its payload and the object
    image of each format (``padded``: and their 4 KiB-padded copies)."""
    cpu = cpu_ceilings(shape, min(budget_s, 0.3))
    payload = random_payload(shape.payload, 2)
    layers = split_layers(payload, shape)
    images = {fmt: object_image(shape, layers, fmt) for fmt in formats}
    pads: dict[str, memoryview] = {}
    for fmt, img in images.items() if padded else ():
        pads[fmt] = mv(touched(v1.align_up(len(img), v1.ALIGN)))
        pads[fmt][: len(img)] = img
    return Prepared(shape, batch, payload, layers, images, cpu, pads)


def write_file(
    tmp: Path,
    final: Path,
    data: memoryview,
    *,
    sync: bool,
    direct: bool = False,
    size: int | None = None,
) -> None:
    """A file written the way the store writes an object, minus its bookkeeping:
    open(O_EXCL[, O_DIRECT]) + write + [ftruncate to ``size``: the bytes of a
    4 KiB-padded ``data``] + [fsync] + close + rename to ``final`` + [fsync(dir)]."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (O_DIRECT if direct else 0)
    fd = os.open(tmp, flags, 0o640)
    try:
        write_all(fd, data)
        if size is not None:
            os.ftruncate(fd, size)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, final)
    if sync:
        dfd = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def read_file(path: Path, buf: memoryview, *, direct: bool = False) -> None:
    """open[O_DIRECT] + fstat + readv of the whole file into ``buf`` + close (the
    store's read_file); with O_DIRECT the size rounded up to 4 KiB (layout v1
    objects are 4 KiB-padded, so O_DIRECT reads them whole)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (O_DIRECT if direct else 0))
    try:
        size = os.fstat(fd).st_size
        want = v1.align_up(size) if direct else size
        done = 0
        while done < size:
            got = os.readv(fd, [buf[done:want]])
            if got == 0:
                raise OSError(f"{path}: short read")
            done += got
    finally:
        os.close(fd)


def raw_writer(d: Path, image: memoryview, durability: str) -> Callable[[int], None]:
    """Op ``i`` writes ``image`` as file i (:func:`write_file`); fsync and fsync(dir)
    at durability ``object`` only."""
    sync = durability == "object"

    def op(i: int) -> None:
        write_file(d / f".tmp-{i}", raw_path(d, i), image, sync=sync)

    return op


def raw_path(d: Path, i: int) -> Path:
    return d / f"{i:06d}.obj"


def raw_reader(paths: Sequence[Path], buf: memoryview) -> Callable[[int], None]:
    """Op ``i`` reads file i into a pre-touched buffer (:func:`read_file`)."""

    def op(i: int) -> None:
        read_file(paths[i], buf)

    return op


# --------------------------------------------------------------------------- O_DIRECT and batches


def supports_o_direct(d: Path) -> bool:
    """Whether the file system under ``d`` takes an aligned O_DIRECT write."""
    flag = O_DIRECT
    if not flag:
        return False
    probe = d / ".o_direct-probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flag | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        buf = mmap.mmap(-1, v1.ALIGN)
        try:
            os.write(fd, buf)
        except OSError:
            return False
        finally:
            buf.close()
        return True
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def direct_writer(
    d: Path, image: memoryview, padded: memoryview, durability: str
) -> Callable[[int], None]:
    """Op ``i`` writes the object as file i with O_DIRECT: the 4 KiB-padded bytes, then
    ftruncate to the exact size (:func:`write_file`); the fsyncs only at durability
    ``object``."""
    sync = durability == "object"

    def op(i: int) -> None:
        tmp = d / f".tmp-{i}"
        write_file(tmp, raw_path(d, i), padded, sync=sync, direct=True, size=len(image))

    return op


def direct_reader(paths: Sequence[Path], buf: memoryview) -> Callable[[int], None]:
    """Op ``i`` reads file i with O_DIRECT into a page-aligned, pre-touched buffer."""

    def op(i: int) -> None:
        read_file(paths[i], buf, direct=True)

    return op


def batched_slots(ops: Sequence[Callable[[int], object]]) -> Callable[[int], None]:
    """Op ``i`` runs ``ops[j](i * len(ops) + j)`` for each j: one op per slot of a batch."""

    def run(i: int) -> None:
        for j, op in enumerate(ops):
            op(i * len(ops) + j)

    return run


def fanned(
    ops: Sequence[Callable[[int], object]], pool: ThreadPoolExecutor
) -> Callable[[int], None]:
    """:func:`batched_slots` with the slots of a batch run at once on ``pool``: the raw
    ceiling of as many I/O streams as the sidecar's (each slot its own file and buffer)."""

    def run(i: int) -> None:
        futs = [pool.submit(op, i * len(ops) + j) for j, op in enumerate(ops)]
        for f in futs:
            f.result()

    return run


def batched(op: Callable[[int], object], batch: int) -> Callable[[int], None]:
    """Op ``i`` runs ``op(i * batch + j)`` for each j of the batch."""

    def run(i: int) -> None:
        for j in range(batch):
            op(i * batch + j)

    return run
