"""The chunks the benchmarks move: their shapes, payloads, object images and keys.

Every buffer is page-aligned (an anonymous mmap, as the store's scratch
buffers): on some CPUs the kernel's copy to or from a buffer that is not
64-byte aligned runs several times slower, which would make the raw ceilings
too low.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from benchlib.method import choices
from kvoffload.layouts import v1

MiB = 1 << 20
KiB = 1 << 10
GB = 1e9
TENANT = "bench"
NAMESPACE = hashlib.blake2b(b"bench-namespace", digest_size=32).digest()

FORMATS = ("sealed", "plain")
DURABILITIES = ("object", "batch", "none")
DEFAULT_DURABILITIES = ("object", "none")


@dataclass(frozen=True)
class Shape:
    key: str  # "large" | "small": the ids in the JSON
    layers: int
    layer_bytes: int
    note: str
    chunks: int  # timed ops per row (upper bound; the row budget may stop earlier)

    @property
    def payload(self) -> int:
        return self.layers * self.layer_bytes

    def describe(self) -> str:
        return f"{self.layers} layers x {size(self.layer_bytes)} = {size(self.payload)}/chunk"

    def fact(self, more: str = "") -> tuple[str, str]:
        """The shape's row of a machine table."""
        return f"shape {self.key}", f"{self.describe()} - {self.note}{more}"

    def shrunk(self, chunks: int) -> Shape:
        """This shape with ``chunks`` per row, where the file system cannot hold more."""
        note = self.note + " (shrunk to fit disk)"
        return Shape(self.key, self.layers, self.layer_bytes, note, chunks)


def parse_durabilities(
    p: argparse.ArgumentParser, values: list[str] | None, default: Sequence[str] | None = None
) -> list[str]:
    """``--durability`` values (repeatable, comma-separated) in order, without repeats."""
    try:
        return choices(values, DURABILITIES, default or DEFAULT_DURABILITIES)
    except ValueError as exc:
        p.error(f"--durability: {exc}")


def make_shapes(quick: bool, large_mib_per_row: int, small_ops: int) -> list[Shape]:
    if quick:
        return [
            Shape("large", 32, 64 * KiB, "Llama-3-8B layer count, layers shrunk (--quick)", 4),
            Shape("small", 4, 16 * KiB, "small chunk", 16),
        ]
    large = Shape(
        "large",
        32,
        1 * MiB,
        "Llama-3-8B: 256 tok x 8 KV heads x 128 dim x K,V x bf16 per layer",
        max(1, large_mib_per_row // 32),
    )
    return [large, Shape("small", 4, 16 * KiB, "small chunk", max(1, small_ops))]


def fit_to_disk(shapes: Sequence[Shape], d: Path, files: int, slack: int) -> list[Shape]:
    """``shapes``, each shrunk (to 3 chunks at least) where the file system under ``d``
    cannot hold, in half its free space, ``files`` sealed objects of each of the
    shape's chunks and of ``slack`` chunks more (warm-up ops, spares)."""
    free = shutil.disk_usage(d).free
    out: list[Shape] = []
    for s in shapes:
        per_chunk = v1.object_size([s.layer_bytes] * s.layers, True)
        if files * (s.chunks + slack) * per_chunk > free // 2:
            s = s.shrunk(max(3, (free // 2) // (files * per_chunk) - slack))
        out.append(s)
    return out


def size(n: int) -> str:
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    if n >= KiB and n % KiB == 0:
        return f"{n // KiB} KiB"
    return f"{n} B"


# --------------------------------------------------------------------------- buffers


def touched(n: int) -> npt.NDArray[np.uint8]:
    """A page-aligned, fully faulted-in buffer (no page faults in timed loops).

    An anonymous mmap, like the store's ScratchBuffers: numpy's own allocations
    sit 16 bytes into a page, and the kernel's copy_to_user into such a buffer
    can be several times slower (measured 1-2 vs 7-9 GB/s on AMD EPYC).
    """
    a = np.frombuffer(mmap.mmap(-1, max(n, 1)), dtype=np.uint8)
    a.fill(0)
    return a


def mv(a: npt.NDArray[np.uint8]) -> memoryview:
    """A flat byte view of a numpy buffer (numpy's stubs do not declare the buffer protocol)."""
    return a.data.cast("B")


def random_payload(n: int, seed: int) -> npt.NDArray[np.uint8]:
    a = touched(n)
    a[:] = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return a


def split_layers(payload: npt.NDArray[np.uint8], shape: Shape) -> list[memoryview]:
    m = mv(payload)
    return [m[i * shape.layer_bytes : (i + 1) * shape.layer_bytes] for i in range(shape.layers)]


def object_image(shape: Shape, layers: Sequence[memoryview], fmt: str) -> memoryview:
    """The exact bytes of a stored object of this shape (a throwaway key for 'sealed')."""
    sealed = fmt == "sealed"
    n = v1.object_size([shape.layer_bytes] * shape.layers, sealed)
    buf = mv(touched(n))[:n]
    v1.seal_into(
        buf,
        tenant=TENANT,
        namespace=NAMESPACE,
        chunk_key=chunk_key(shape, fmt, 0),
        layers=layers,
        aead=AESGCM(os.urandom(32)) if sealed else None,
        key_epoch=1 if sealed else 0,
        created_ns=time.time_ns(),
    )
    return buf


def chunk_key(shape: Shape, fmt: str, i: int) -> bytes:
    return hashlib.blake2b(f"{shape.key}/{fmt}/{i}".encode(), digest_size=32).digest()
