"""Streamed loads: where reads go through the page cache of a local file
system, the store reads a large object one layer slot at a time into a small
per-thread buffer and verifies and decrypts it from there into the output
(``fileio.streamed_object``, ``v1.open_read_into``), and reads a small one
whole. Same bytes, same misses, every byte checked; no mapping of the object,
so no SIGBUS to guard against. (Layer-wise loads still map: test_load_path.)"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import random
import threading
from pathlib import Path
from typing import Any

import pytest

from kvoffload.layouts import v1
from kvoffload.store import Store, StoreConfig
from kvoffload.store import files as fileio
from kvoffload.store.iobackend import PosixBackend, local_fs
from kvoffload.store.keys.keyring import Kek
from tests.helpers.stores import evict, nowait_reads_miss

NS = bytes(range(32))


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def layers(i: int) -> list[bytes]:
    rng = random.Random(i)  # the same bytes every call
    return [rng.randbytes(4000 + 1000 * j + i) for j in range(3)]


def open_store(root: Path, kek_file: Path, **kw: Any) -> Store:
    kw.setdefault("durability", "none")
    return Store(StoreConfig(root=root, **kw), Kek.from_file(kek_file), create=True)


class LoadSpy:
    """Objects loaded streamed and read whole, and each piece read streamed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.streamed: list[Path] = []
        self.read: list[Path] = []
        self.pieces: list[tuple[int, int]] = []  # (offset, length)
        real_stream = fileio.streamed_object
        real_read, real_pread = fileio.read_file, fileio.pread_all

        @contextlib.contextmanager
        def spy_stream(path: Path, max_size: int) -> Any:
            with real_stream(path, max_size) as reader:
                if reader is not None:
                    self.streamed.append(path)
                yield reader

        def spy_read(path: Path, *a: Any, **kw: Any) -> Any:
            self.read.append(path)
            return real_read(path, *a, **kw)

        def spy_pread(fd: int, buf: Any, offset: int = 0, **kw: Any) -> int:
            self.pieces.append((offset, memoryview(buf).nbytes))
            return real_pread(fd, buf, offset, **kw)

        monkeypatch.setattr(fileio, "streamed_object", spy_stream)
        monkeypatch.setattr(fileio, "read_file", spy_read)
        monkeypatch.setattr(fileio, "pread_all", spy_pread)


@pytest.fixture(autouse=True)
def _stream_any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """These objects are small: without this, they are read whole, never streamed
    (and a batch verifies a small page-cache hit in the calling thread)."""
    monkeypatch.setattr(fileio, "STREAM_MIN_BYTES", 1)
    monkeypatch.setattr(fileio, "MAP_MIN_BYTES", 1)


@pytest.fixture
def local_store(tmp_path: Path, kek_file: Path) -> Any:
    if not local_fs(tmp_path):
        pytest.skip(f"{tmp_path} is not on a local file system: loads read whole")
    s = open_store(tmp_path / "store", kek_file)
    assert isinstance(s.io, PosixBackend) and s.io.map_reads
    yield s
    s.close()


@pytest.mark.parametrize("encrypt", [True, False], ids=["sealed", "plain"])
def test_streamed_loads_give_the_bytes_and_misses_of_reads(
    local_store: Store, monkeypatch: pytest.MonkeyPatch, encrypt: bool
) -> None:
    s = local_store
    chunks = [(key(i), layers(i)) for i in range(4)]
    for k, lay in chunks:
        assert s.put("acme", NS, k, lay, encrypt=encrypt)
    spy = LoadSpy(monkeypatch)
    for k, lay in chunks:
        assert s.get("acme", k) == lay
    outs = [memoryview(bytearray(sum(map(len, lay)))) for _k, lay in chunks]
    got = s.get_many_into("acme", [k for k, _ in chunks], outs)  # on the I/O streams
    assert got == [[len(x) for x in lay] for _k, lay in chunks]
    assert [bytes(o) for o in outs] == [b"".join(lay) for _k, lay in chunks]
    paths = [s._path("acme", k) for k, _ in chunks]
    assert spy.streamed[:4] == paths and sorted(spy.streamed[4:]) == sorted(paths)
    assert spy.read == []
    # A flipped byte anywhere in a streamed object is a miss, and the object goes.
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


@pytest.mark.parametrize("encrypt", [True, False], ids=["sealed", "plain"])
def test_a_large_object_is_read_one_layer_slot_at_a_time(
    local_store: Store, monkeypatch: pytest.MonkeyPatch, encrypt: bool
) -> None:
    """The header block, then each layer's slot (data, tag, padding) in turn:
    never more than a slot in one read."""
    s = local_store
    lay = [random.Random(j).randbytes(v1.ALIGN * 3 + j) for j in range(5)]
    assert s.put("acme", NS, key(0), lay, encrypt=encrypt)
    spy = LoadSpy(monkeypatch)
    assert s.get("acme", key(0)) == lay
    h = v1.decode_header(s._path("acme", key(0)).read_bytes())
    slots = [v1.layer_slot(h, i) for i in range(len(lay))]
    assert spy.pieces == [(0, v1.ALIGN)] + [(lo, hi - lo) for lo, hi in slots]
    assert spy.read == []


def test_a_truncated_object_is_a_miss_not_a_crash(
    local_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = local_store
    for i in range(4):
        assert s.put("acme", NS, key(i), layers(i))
    spy = LoadSpy(monkeypatch)
    p = [s._path("acme", key(i)) for i in range(3)]
    os.truncate(p[0], v1.ALIGN + 100)  # shorter than its header says: streamed, then refused
    os.truncate(p[1], 0)  # nothing to stream (under STREAM_MIN_BYTES): read, then refused
    os.truncate(p[2], 100)  # not even a header block
    assert [s.get("acme", key(i)) for i in range(3)] == [None] * 3
    assert spy.streamed == [p[0], p[2]] and spy.read == [p[1]]
    assert not any(x.exists() for x in p)
    assert s.get("acme", key(3)) == layers(3)


def test_small_objects_are_read_whole(local_store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    s = local_store
    assert s.put("acme", NS, key(0), layers(0))
    size = s._path("acme", key(0)).stat().st_size
    monkeypatch.setattr(fileio, "STREAM_MIN_BYTES", size + 1)
    spy = LoadSpy(monkeypatch)
    assert s.get("acme", key(0)) == layers(0)
    monkeypatch.setattr(fileio, "STREAM_MIN_BYTES", size)
    assert s.get("acme", key(0)) == layers(0)
    assert spy.read == [s._path("acme", key(0))] == spy.streamed


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


class _ColdSmallSpy:
    """Which thread read each chunk the ordinary way, and the readahead asked first."""

    def __init__(self, s: Store, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads: list[tuple[bytes, int]] = []  # (chunk key, thread id)
        self.will_need: list[int] = []  # file sizes
        real_one, real_advise = s._reads._load_one, os.posix_fadvise

        def load_one(tenant: str, rec: Any, *a: Any, **kw: Any) -> Any:
            self.reads.append((rec.chunk_key, threading.get_ident()))
            return real_one(tenant, rec, *a, **kw)

        def advise(fd: int, offset: int, length: int, advice: int) -> None:
            if advice == os.POSIX_FADV_WILLNEED:
                self.will_need.append(length)
            real_advise(fd, offset, length, advice)

        monkeypatch.setattr(s._reads, "_load_one", load_one)
        monkeypatch.setattr(os, "posix_fadvise", advise)


def _four_small_objects(s: Store, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Chunks 0-3 saved, small again (read whole, never streamed or mapped)."""
    monkeypatch.setattr(fileio, "MAP_MIN_BYTES", 1 << 20)
    monkeypatch.setattr(fileio, "STREAM_MIN_BYTES", 1 << 20)
    keys = [key(i) for i in range(4)]
    for i, k in enumerate(keys):
        assert s.put("acme", NS, k, layers(i))
    return keys


def test_a_cold_batch_of_small_objects_is_read_in_the_calling_thread_after_readahead(
    local_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small objects not in the page cache: each one's read is started (readahead)
    as it enters the batch's window and read and verified in the calling thread
    in its turn: no hop to a pool thread and back, which costs more than the read."""
    s, keys = local_store, _four_small_objects(local_store, monkeypatch)
    if not evict([s._path("acme", k) for k in keys]):
        pytest.skip("this file system keeps the objects in memory: no cold read here")
    nowait_reads_miss(monkeypatch)
    spy = _ColdSmallSpy(s, monkeypatch)
    outs = [memoryview(bytearray(sum(map(len, layers(i))))) for i in range(4)]
    got = s.get_many_into("acme", keys, outs)
    assert got == [[len(x) for x in layers(i)] for i in range(4)]
    assert [bytes(o) for o in outs] == [b"".join(layers(i)) for i in range(4)]
    assert [k for k, _ in spy.reads] == keys
    assert {t for _, t in spy.reads} == {threading.get_ident()}
    sizes = [s._path("acme", k).stat().st_size for k in keys]
    assert spy.will_need == sizes  # each object's read started before it is read


def test_a_damaged_small_object_in_a_cold_batch_ends_the_prefix_unread_after_it(
    local_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reads started for the objects after a damaged one are never finished
    or verified: the prefix ends at the damage, as with reads on the pool."""
    s, keys = local_store, _four_small_objects(local_store, monkeypatch)
    bad = s._path("acme", keys[1])
    with open(bad, "r+b") as f:  # one bit of layer 0's ciphertext
        f.seek(v1.decode_header(f.read(8192)).layers[0].offset)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 1]))
    if not evict([s._path("acme", k) for k in keys]):
        pytest.skip("this file system keeps the objects in memory: no cold read here")
    nowait_reads_miss(monkeypatch)
    spy = _ColdSmallSpy(s, monkeypatch)
    hits = s.counters.hits
    outs = [memoryview(bytearray(sum(map(len, layers(i))))) for i in range(4)]
    got = s.get_many_into("acme", keys, outs)
    assert got == [[len(x) for x in layers(0)], None, None, None]
    assert bytes(outs[0]) == b"".join(layers(0))
    assert [k for k, _ in spy.reads] == keys[:2]  # 2 and 3 never read
    assert s.counters.hits == hits + 1
    assert not bad.exists()  # the damaged object was taken out of the store
    assert s.get("acme", keys[2]) == layers(2)  # the others are whole
