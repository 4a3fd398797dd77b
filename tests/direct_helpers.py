"""Shared builders of the direct-path unit tests: worker-built layout-v1 objects,
leased files and the host buffer kinds a worker hands in."""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvoffload.client import direct
from kvoffload.client.direct import Extent, PosixDirectIO
from kvoffload.layouts import v1
from kvoffload.store import leasefiles

REPO = Path(__file__).resolve().parent.parent
NS = bytes(range(32))
OTHER_NS = bytes(range(32, 64))
TENANT = "acme"


def key(i: int) -> bytes:
    return hashlib.blake2b(f"direct/{i}".encode(), digest_size=32).digest()


def rand_layers(seed: int, sizes: Sequence[int]) -> list[bytes]:
    rng = random.Random(seed)
    # Never all-zero: a zero layer would pass for the padding a lease file starts with.
    return [bytes([1 + i % 254]) + rng.randbytes(n - 1) if n else b"" for i, n in enumerate(sizes)]


def sealed_plain(
    layers: Sequence[bytes], *, chunk_key: bytes, created_ns: int, tenant: str = TENANT
) -> bytes:
    """The reference object: what v1.seal_into writes for a plaintext tenant."""
    out = bytearray(v1.object_size([len(x) for x in layers], False))
    n = v1.seal_into(
        memoryview(out),
        tenant=tenant,
        namespace=NS,
        chunk_key=chunk_key,
        layers=layers,
        aead=None,
        created_ns=created_ns,
    )
    assert n == len(out)
    return bytes(out)


def header_block(
    layers: Sequence[bytes],
    *,
    chunk_key: bytes,
    created_ns: int = 0,
    tenant: str = TENANT,
    namespace: bytes = NS,
) -> bytes:
    return v1.plain_header_block(
        tenant=tenant,
        namespace=namespace,
        chunk_key=chunk_key,
        lengths=[len(x) for x in layers],
        checks=[v1.layer_check(x) for x in layers],
        created_ns=created_ns,
    )


def assembled(layers: Sequence[bytes], *, chunk_key: bytes, created_ns: int = 0) -> bytearray:
    """An object as a direct-path writer makes it: a zeroed file, the header block at
    0, each layer at its planned offset, nothing else written."""
    lengths = [len(x) for x in layers]
    buf = bytearray(v1.object_size(lengths, False))
    head = header_block(layers, chunk_key=chunk_key, created_ns=created_ns)
    data_offset, offsets = v1.plan_offsets(len(layers), lengths, False)
    assert len(head) == data_offset
    buf[: len(head)] = head
    for x, off in zip(layers, offsets, strict=True):
        buf[off : off + len(x)] = x
    return buf


def verify(buf: bytes | bytearray, *, chunk_key: bytes, **kw: Any) -> v1.ObjectHeader:
    args: dict[str, Any] = {"tenant": TENANT, "namespace": NS, "chunk_key": chunk_key}
    args.update(kw)
    return v1.verify_plain(memoryview(buf), **args)


def lease_file(directory: Path, layers: Sequence[Any], name: str = "obj") -> Path:
    """A temp file as the sidecar leases it: created, allocated, all zeros."""
    size = v1.object_size([direct.nbytes(x) for x in layers], False)
    final = directory / "objects" / f"{name}{v1.OBJECT_SUFFIX}"
    tmp = leasefiles.create_lease_file(final, size, durable_dirs=False, gid=None)
    assert tmp.parent == final.parent and tmp.name.startswith(v1.TMP_PREFIX)
    assert tmp.stat().st_size == size and tmp.read_bytes() == bytes(size)
    return tmp


def write_leased(
    io: PosixDirectIO, tmp: Path, layers: Sequence[Any], *, chunk_key: bytes, created_ns: int = 0
) -> list[Extent]:
    """What the client does with a lease: header block and layers at the planned offsets."""
    lengths = [direct.nbytes(x) for x in layers]
    checks = direct.checks_of(layers)
    head = v1.plain_header_block(
        tenant=TENANT,
        namespace=NS,
        chunk_key=chunk_key,
        lengths=lengths,
        checks=checks,
        created_ns=created_ns,
    )
    _, offsets = v1.plan_offsets(len(layers), lengths, False)
    io.write_object(str(tmp), head, layers, offsets)
    return [Extent(o, n, c) for o, n, c in zip(offsets, lengths, checks, strict=True)]


def _as_bytes(x: bytes) -> Any:
    return x


def _as_numpy(x: bytes) -> Any:
    np = pytest.importorskip("numpy")
    return np.frombuffer(x, dtype=np.uint8).copy()


def _as_numpy_f32(x: bytes) -> Any:
    # A multi-byte dtype: the layer is its bytes, not its element count.
    np = pytest.importorskip("numpy")
    return np.frombuffer(x, dtype=np.float32).copy()


def _as_torch(x: bytes) -> Any:
    torch = pytest.importorskip("torch")
    return torch.frombuffer(bytearray(x), dtype=torch.uint8).clone()


def _as_torch_bf16(x: bytes) -> Any:
    torch = pytest.importorskip("torch")
    return torch.frombuffer(bytearray(x), dtype=torch.bfloat16).clone().reshape(2, -1)


HOST_KINDS: dict[str, Callable[[bytes], Any]] = {
    "bytes": _as_bytes,
    "bytearray": bytearray,
    "memoryview": lambda x: memoryview(bytearray(x)),
    "numpy-u8": _as_numpy,
    "numpy-f32": _as_numpy_f32,
    "torch-cpu-u8": _as_torch,
    "torch-cpu-bf16": _as_torch_bf16,
}
# Even sizes, multiples of 4 (the f32 / 2-row bf16 views need it), most not of 4096.
IO_SIZES = [5000, 4096, 8, 12_292, 8192]


class OpenFlags:
    """The flags of every os.open of one path (the real call runs)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
        self.flags: list[int] = []
        real = os.open

        def spy(p_: Any, flags: int, *a: Any, **kw: Any) -> int:
            if str(p_) == str(path):
                self.flags.append(flags)
            return real(p_, flags, *a, **kw)

        monkeypatch.setattr(os, "open", spy)
