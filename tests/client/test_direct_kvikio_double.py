"""The workers' kvikio direct-path backend against a TEST DOUBLE of kvikio.

kvikio cannot do I/O on a node without ``libcuda.so.1`` (not even in compat
mode), so here ``kvikio`` is replaced by ``FakeKvikio``: a stand-in with
kvikio's Python API as documented for ``kvikio.CuFile`` (``CuFile(path,
flags)`` with flags ``r``/``w``/``a`` and ``+``, ``pwrite``/``pread(buf,
size, file_offset)`` returning a future whose ``get()`` is the byte count),
doing real POSIX I/O on real files from host numpy arrays. What this checks
is the logic of :class:`kvoffload.client.direct.KvikioDirectIO` itself:
flags, offsets, sizes, futures, failure mapping and checksum verification.
The GPU path itself runs in ``tests/client/test_direct_path.py``'s ``gds`` test.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from kvoffload.client import direct
from kvoffload.layouts import v1
from kvoffload.store import leasefiles

NS = bytes(range(32))
KEY = bytes(range(32, 64))


class _Future:
    def __init__(self, n: int) -> None:
        self._n = n

    def get(self) -> int:
        return self._n


class FakeCuFile:
    """Test double of ``kvikio.CuFile`` (host buffers only)."""

    opened: ClassVar[list[tuple[str, str]]] = []

    def __init__(self, file: str | Path, flags: str = "r") -> None:
        base, plus = flags[:1], "+" in flags
        if base not in ("r", "w", "a") or set(flags) - {"r", "w", "a", "+"}:
            raise ValueError(f"unknown flags {flags!r}")
        mode = os.O_RDWR if plus else {"r": os.O_RDONLY, "w": os.O_WRONLY, "a": os.O_WRONLY}[base]
        if base == "w":
            mode |= os.O_CREAT | os.O_TRUNC
        elif base == "a":
            mode |= os.O_CREAT | os.O_APPEND
        self.fd = os.open(file, mode)
        FakeCuFile.opened.append((str(file), flags))

    def __enter__(self) -> FakeCuFile:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    @staticmethod
    def _host(buf: Any) -> memoryview:
        if not isinstance(buf, np.ndarray):
            raise TypeError(f"the double takes host numpy arrays, not {type(buf).__name__}")
        return memoryview(buf).cast("B")

    def pwrite(self, buf: Any, size: int | None = None, file_offset: int = 0) -> _Future:
        mv = self._host(buf)
        n = mv.nbytes if size is None else size
        try:
            return _Future(os.pwrite(self.fd, mv[:n], file_offset))
        except OSError as exc:
            raise RuntimeError(f"cuFile-like failure: {exc}") from exc

    def pread(self, buf: Any, size: int | None = None, file_offset: int = 0) -> _Future:
        mv = self._host(buf)
        n = mv.nbytes if size is None else size
        return _Future(os.preadv(self.fd, [mv[:n]], file_offset))


@pytest.fixture
def fake_kvikio(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    mod = types.ModuleType("kvikio")
    mod.CuFile = FakeCuFile  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvikio", mod)
    FakeCuFile.opened = []
    return mod


def leased(tmp_path: Path, lengths: list[int]) -> tuple[Path, int, list[int]]:
    final = tmp_path / "objects" / "t" / "ab" / "cd" / "x.kvo"
    size = v1.object_size(lengths, False)
    tmp = leasefiles.create_lease_file(final, size, durable_dirs=False, gid=None)
    return tmp, size, v1.plan_offsets(len(lengths), lengths, False)[1]


@pytest.mark.parametrize("lengths", [[5000, 8192, 1], [4096 * 3]])
def test_kvikio_backend_writes_the_same_object_as_seal_into(
    tmp_path: Path, fake_kvikio: types.ModuleType, lengths: list[int]
) -> None:
    rng = np.random.default_rng(1)
    layers = [rng.integers(0, 256, n, dtype=np.uint8) for n in lengths]
    tmp, size, offsets = leased(tmp_path, lengths)
    header = v1.plain_header_block(
        tenant="t",
        namespace=NS,
        chunk_key=KEY,
        lengths=lengths,
        checks=direct.checks_of(layers),
        created_ns=42,
    )
    io = direct.KvikioDirectIO()
    io.write_object(str(tmp), header, layers, offsets)
    assert FakeCuFile.opened == [(str(tmp), "r+")]  # update in place: no create, no truncate

    want = bytearray(size)
    v1.seal_into(
        memoryview(want),
        tenant="t",
        namespace=NS,
        chunk_key=KEY,
        layers=[x.tobytes() for x in layers],
        aead=None,
        created_ns=42,
    )
    assert tmp.read_bytes() == bytes(want)

    h = v1.verify_plain(memoryview(want), tenant="t", namespace=NS, chunk_key=KEY)
    extents = [direct.Extent(le.offset, le.length, le.check) for le in h.layers]
    dests = [np.zeros(n, dtype=np.uint8) for n in lengths]
    assert io.read_layers(str(tmp), extents, dests)
    assert all((a == b).all() for a, b in zip(dests, layers, strict=True))

    # A flipped byte on disk: the layer fails its checksum.
    with open(tmp, "r+b") as f:
        f.seek(offsets[-1])
        b = f.read(1)
        f.seek(offsets[-1])
        f.write(bytes([b[0] ^ 1]))
    assert not io.read_layers(str(tmp), extents, [np.zeros(n, dtype=np.uint8) for n in lengths])


def test_kvikio_failures_become_direct_io_errors(
    tmp_path: Path, fake_kvikio: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp, _size, offsets = leased(tmp_path, [100])
    io = direct.KvikioDirectIO()
    ro = tmp.with_name("ro")
    ro.write_bytes(bytes(8192))
    # A short read (the object ends early) is an error, not a silent partial layer.
    with pytest.raises(direct.DirectIOError, match="short"):
        io.read_layers(str(ro), [direct.Extent(8000, 4096, bytes(16))], [np.zeros(4096, np.uint8)])

    def broken(self: Any, buf: Any, size: int | None = None, file_offset: int = 0) -> Any:
        raise RuntimeError("cuFileWrite failed: simulated")

    monkeypatch.setattr(FakeCuFile, "pwrite", broken)
    with pytest.raises(direct.DirectIOError, match="kvikio write"):
        io.write_object(str(tmp), bytes(4096), [np.zeros(100, np.uint8)], offsets)


def test_select_uses_kvikio_when_the_probe_says_it_works(
    monkeypatch: pytest.MonkeyPatch, fake_kvikio: types.ModuleType
) -> None:
    from kvoffload import gpu_probe

    rep = gpu_probe.GpuReport(kvikio_usable=True, gds_available=False, kvikio_reason="probe ok")
    monkeypatch.setattr(gpu_probe, "probe", lambda *a, **k: rep)
    monkeypatch.delenv(direct.ENV_VAR, raising=False)
    direct.reset_selection()
    try:
        chosen = direct.select()
        assert isinstance(chosen, direct.KvikioDirectIO)
        assert direct.select() is chosen  # decided once per process
        backend, why = direct.decide(rep)
        assert backend == "kvikio" and "compat mode" in why
    finally:
        direct.reset_selection()
