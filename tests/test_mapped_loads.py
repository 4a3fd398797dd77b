"""One-pass loads: the store verifies and decrypts an object straight from its
page-cache mapping (``fileio.mapped_object``) where that is safe, and reads it
into a buffer everywhere else. Same bytes, same misses, every byte checked;
never a mapping of a file another descriptor could shrink (a SIGBUS would take
the daemon down), nor on a shared file system."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import random
from pathlib import Path
from typing import Any

import pytest

from kvoffload.layouts import v1
from kvoffload.sidecar import fileio
from kvoffload.sidecar.iobackend import PosixBackend, local_fs
from kvoffload.sidecar.keyring import Kek
from kvoffload.sidecar.store import Store, StoreConfig

NS = bytes(range(32))


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def layers(i: int) -> list[bytes]:
    rng = random.Random(i)  # the same bytes every call
    return [rng.randbytes(4000 + 1000 * j + i) for j in range(3)]


def open_store(root: Path, kek_file: Path, **kw: Any) -> Store:
    kw.setdefault("durability", "none")
    return Store(StoreConfig(root=root, **kw), Kek.from_file(kek_file), create=True)


class MapSpy:
    """Counts objects loaded through a mapping, and through a read."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.mapped: list[Path] = []
        self.read: list[Path] = []
        real_map, real_read = fileio.mapped_object, fileio.read_file

        @contextlib.contextmanager
        def spy_map(path: Path, max_size: int) -> Any:
            with real_map(path, max_size) as view:
                if view is not None:
                    self.mapped.append(path)
                yield view

        def spy_read(path: Path, *a: Any, **kw: Any) -> Any:
            self.read.append(path)
            return real_read(path, *a, **kw)

        monkeypatch.setattr(fileio, "mapped_object", spy_map)
        monkeypatch.setattr(fileio, "read_file", spy_read)


@pytest.fixture(autouse=True)
def _map_any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """These objects are small: without this, they are read, never mapped."""
    monkeypatch.setattr(fileio, "MAP_MIN_BYTES", 1)


@pytest.fixture
def mapped_store(tmp_path: Path, kek_file: Path) -> Any:
    if not local_fs(tmp_path):
        pytest.skip(f"{tmp_path} is not on a local file system: loads read, never map")
    s = open_store(tmp_path / "store", kek_file)
    assert isinstance(s.io, PosixBackend) and s.io.map_reads
    yield s
    s.close()


@pytest.mark.parametrize("encrypt", [True, False], ids=["sealed", "plain"])
def test_mapped_loads_give_the_bytes_and_misses_of_reads(
    mapped_store: Store, monkeypatch: pytest.MonkeyPatch, encrypt: bool
) -> None:
    s = mapped_store
    chunks = [(key(i), layers(i)) for i in range(4)]
    for k, lay in chunks:
        assert s.put("acme", NS, k, lay, encrypt=encrypt)
    spy = MapSpy(monkeypatch)
    for k, lay in chunks:
        assert s.get("acme", k) == lay
    assert spy.mapped == [s._path("acme", k) for k, _ in chunks] and spy.read == []
    # A flipped byte anywhere in a mapped object is a miss, and the object goes.
    p = s._path("acme", key(1))
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    p.write_bytes(bytes(raw))
    assert s.get("acme", key(1)) is None
    assert not p.exists() and s.lookup("acme", [key(1)]) == 0
    s.io.map_reads = False  # type: ignore[attr-defined]
    for k, lay in chunks[2:]:
        assert s.get("acme", k) == lay  # the read path agrees
    assert spy.read == [s._path("acme", k) for k, _ in chunks[2:]]


def test_a_truncated_object_is_a_miss_not_a_crash(
    mapped_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = mapped_store
    for i in range(3):
        assert s.put("acme", NS, key(i), layers(i))
    spy = MapSpy(monkeypatch)
    p0, p1 = s._path("acme", key(0)), s._path("acme", key(1))
    os.truncate(p0, v1.ALIGN + 100)  # shorter than its header says: mapped, then refused
    os.truncate(p1, 0)  # nothing to map (under MAP_MIN_BYTES): read, then refused
    assert s.get("acme", key(0)) is None and s.get("acme", key(1)) is None
    assert spy.mapped == [p0] and spy.read == [p1]
    assert not p0.exists() and not p1.exists()
    assert s.get("acme", key(2)) == layers(2)


def test_only_files_no_other_descriptor_can_shrink_are_mapped(
    mapped_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = mapped_store
    for i in range(4):
        assert s.put("acme", NS, key(i), layers(i), encrypt=False)
    p = [s._path("acme", key(i)) for i in range(4)]
    os.chmod(p[0], 0o440)  # a published direct-path object: its writer may hold an fd
    os.chmod(p[1], 0o660)  # group-writable (a leased file's mode)
    os.link(p[2], p[2].with_name("other-name"))  # another name can be opened for writing
    spy = MapSpy(monkeypatch)
    for i in range(4):
        assert s.get("acme", key(i)) == layers(i)
    assert spy.mapped == [p[3]] and spy.read == p[:3]


def test_small_objects_are_read_not_mapped(
    mapped_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = mapped_store
    assert s.put("acme", NS, key(0), layers(0))
    size = s._path("acme", key(0)).stat().st_size
    monkeypatch.setattr(fileio, "MAP_MIN_BYTES", size + 1)
    spy = MapSpy(monkeypatch)
    assert s.get("acme", key(0)) == layers(0)
    monkeypatch.setattr(fileio, "MAP_MIN_BYTES", size)
    assert s.get("acme", key(0)) == layers(0)
    assert spy.read == [s._path("acme", key(0))] == spy.mapped


def test_a_kernel_without_populate_read_falls_back_to_reads(
    mapped_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = mapped_store
    assert s.put("acme", NS, key(0), layers(0))
    monkeypatch.setattr(fileio, "_populate_ok", True)
    monkeypatch.setattr(fileio, "MADV_POPULATE_READ", 0x7FFF)  # EINVAL, as before Linux 5.14
    spy = MapSpy(monkeypatch)
    assert s.get("acme", key(0)) == layers(0)
    assert s.get("acme", key(0)) == layers(0)
    assert spy.mapped == [] and len(spy.read) == 2 and fileio._populate_ok is False


def test_reads_are_not_mapped_with_o_direct_or_on_a_shared_file_system(
    tmp_path: Path, kek_file: Path
) -> None:
    mounts = tmp_path / "mounts"
    root = Path(os.path.realpath(tmp_path))
    for d in ("kv", "local", "fz"):
        (root / d / "objects").mkdir(parents=True)
    mounts.write_text(
        f"/dev/vda / ext4 rw 0 0\nserver:/export {root}/kv nfs4 rw,relatime 0 0\n"
        f"/dev/nvme0n1 {root}/local ext4 rw 0 0\ngw {root}/fz fuse.gcsfuse rw 0 0\n",
        encoding="utf-8",
    )
    assert not local_fs(root / "kv" / "objects", mounts)
    assert not local_fs(root / "fz" / "objects", mounts)
    assert local_fs(root / "local" / "objects", mounts)
    assert not local_fs(root, tmp_path / "no-mount-table")  # unknown: not local
    s = open_store(tmp_path / "d", kek_file, io="posix-buffered")
    try:
        assert s.io.describe()["mapped_reads"] == local_fs(tmp_path)
    finally:
        s.close()
    b = PosixBackend(direct_write=True, direct_read=True)
    assert b.map_reads is False


def test_populate_releases_the_gil(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MADV_POPULATE_READ of a cold object is its device read: it goes through
    libc by ctypes (a CDLL call releases the GIL, so the other I/O streams
    verify and decrypt meanwhile), never ``mmap.madvise`` (which holds it)."""
    p = tmp_path / "obj"
    p.write_bytes(os.urandom(3 * mmap.PAGESIZE))
    real = fileio._get_libc()
    assert isinstance(real, ctypes.CDLL) and not isinstance(real, ctypes.PyDLL)
    calls: list[tuple[int, int]] = []

    class Libc:
        def madvise(self, addr: int, length: int, advice: int) -> int:
            calls.append((length, advice))
            return int(real.madvise(addr, length, advice))

    monkeypatch.setattr(fileio, "_libc", Libc())
    fd = os.open(p, os.O_RDONLY)
    m = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
    os.close(fd)
    try:
        assert fileio.populate(m, mmap.PAGESIZE + 10, 100)
        assert fileio.populate(m)
        assert bytes(m[mmap.PAGESIZE : mmap.PAGESIZE + 8]) == p.read_bytes()[mmap.PAGESIZE :][:8]
    finally:
        m.close()
    advice = fileio.MADV_POPULATE_READ
    assert calls == [(110, advice), (3 * mmap.PAGESIZE, advice)]
