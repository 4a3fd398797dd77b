"""The store's pool of I/O streams (``StoreConfig.io_streams``): a batch saved or
loaded on several threads gives the same bytes, the same results and the same
misses as one stream; a chunk that fails its checks in the middle of a parallel
batch is a miss that withholds nothing before it; and the streams really run at
once (a barrier that only opens with two writes, or two reads, in flight)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload.errors import StoreFull, StoreIOError
from kvoffload.layouts import v1
from kvoffload.sidecar.config import ConfigError, load_config
from kvoffload.store import Store, StoreConfig, writes
from kvoffload.store import files as fileio
from kvoffload.store.config import MAX_DEFAULT_IO_STREAMS, default_io_streams
from kvoffload.store.keys.keyring import Kek

NS = bytes(range(32))
N = 8


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def layers(i: int) -> list[bytes]:
    # Random bytes of odd sizes: a chunk placed in another's buffer would show.
    return [os.urandom(3000 + 911 * j + 17 * i) for j in range(3)]


def open_store(root: Path, kek_file: Path, streams: int, **kw: Any) -> Store:
    kw.setdefault("durability", "none")
    cfg = StoreConfig(root=root, io_streams=streams, **kw)
    return Store(cfg, Kek.from_file(kek_file), create=True)


@pytest.fixture
def chunks() -> list[tuple[bytes, list[bytes]]]:
    return [(key(i), layers(i)) for i in range(N)]


def _flip(s: Store, k: bytes) -> Path:
    p = s._path("acme", k)
    raw = bytearray(p.read_bytes())
    raw[-100] ^= 1  # in the last layer's bytes (or its tag): only the full check sees it
    p.write_bytes(bytes(raw))
    return p


def _run(
    s: Store, chunks: list[tuple[bytes, list[bytes]]], *, encrypt: bool
) -> tuple[list[bool], list[Any], list[Any], list[bytes]]:
    first = s.put_many("acme", NS, chunks[:3], encrypt=encrypt)
    again = s.put_many("acme", NS, chunks, encrypt=encrypt)
    _flip(s, key(5))
    keys = [k for k, _ in chunks]
    outs = [memoryview(bytearray(sum(map(len, lay)) + 64)) for _, lay in chunks]
    prefix = s.get_many_into("acme", keys, outs)
    got = [bytes(o[: sum(n)]) if n else b"" for o, n in zip(outs, prefix, strict=True)]
    rest = s.get_many_into("acme", keys, outs, stop_at_miss=False)
    return first + again, prefix, rest, got


@pytest.mark.parametrize("encrypt", [True, False], ids=["sealed", "plain"])
def test_a_parallel_batch_matches_one_stream(
    tmp_path: Path, kek_file: Path, chunks: list[tuple[bytes, list[bytes]]], encrypt: bool
) -> None:
    runs = []
    for streams in (1, N):
        s = open_store(tmp_path / f"s{streams}", kek_file, streams)
        try:
            assert s.io_streams == streams
            runs.append(_run(s, chunks, encrypt=encrypt))
            assert s.reserved_bytes == 0
            assert not list((s.root / "objects").rglob(v1.TMP_PREFIX + "*"))
        finally:
            s.close()
    assert runs[0] == runs[1]
    saved, prefix, rest, got = runs[1]
    assert saved == [True] * 3 + [False] * 3 + [True] * (N - 3)
    want = [[len(x) for x in lay] for _, lay in chunks]
    assert prefix == want[:5] + [None] * (N - 5)
    assert got[:5] == [b"".join(lay) for _, lay in chunks[:5]]
    # The corrupt chunk was dropped by the first load: a miss, the rest still there.
    assert rest == [*want[:5], None, *want[6:]]


def test_a_corrupt_chunk_in_a_parallel_batch_withholds_nothing_before_it(
    tmp_path: Path, kek_file: Path, chunks: list[tuple[bytes, list[bytes]]]
) -> None:
    s = open_store(tmp_path / "s", kek_file, N)
    try:
        assert s.put_many("acme", NS, chunks) == [True] * N
        bad = _flip(s, key(3))
        keys = [k for k, _ in chunks]
        outs = [memoryview(bytearray(sum(map(len, lay)))) for _, lay in chunks]
        hits = s.counters.hits
        got = s.get_many_into("acme", keys, outs)
        assert got[3:] == [None] * (N - 3)
        for i in range(3):
            assert got[i] == [len(x) for x in chunks[i][1]]
            assert bytes(outs[i]) == b"".join(chunks[i][1])
        assert not bad.exists() and s.payload_info("acme", key(3)) is None
        # Chunks read past the hole are neither handed out nor counted as hits,
        # and stay stored (they are fine).
        assert s.counters.hits - hits == 3
        assert s.lookup("acme", keys[4:]) == N - 4
    finally:
        s.close()


def _barrier_on(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> threading.Barrier:
    """Make ``module.name`` wait until two calls are in it at once (10 s guard)."""
    barrier = threading.Barrier(2, timeout=10)
    real = getattr(module, name)

    def meet(*a: Any, **kw: Any) -> Any:
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait()
        return real(*a, **kw)

    monkeypatch.setattr(module, name, meet)
    return barrier


def test_the_streams_run_at_once(
    tmp_path: Path,
    kek_file: Path,
    chunks: list[tuple[bytes, list[bytes]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = open_store(tmp_path / "s", kek_file, 2)
    try:
        with monkeypatch.context() as m:
            barrier = _barrier_on(m, fileio, "_write_all")
            assert s.put_many("acme", NS, chunks[:2]) == [True, True]
            assert not barrier.broken, "the two writes of the batch never overlapped"
        keys = [key(0), key(1)]
        outs = [memoryview(bytearray(sum(map(len, lay)))) for _, lay in chunks[:2]]
        with monkeypatch.context() as m:
            barrier = _barrier_on(m, fileio, "_pread_into")
            got = s.get_many_into("acme", keys, outs)
            assert not barrier.broken, "the two reads of the batch never overlapped"
        assert got == [[len(x) for x in lay] for _, lay in chunks[:2]]
        assert [bytes(o) for o in outs] == [b"".join(lay) for _, lay in chunks[:2]]
    finally:
        s.close()


def test_io_streams_setting(tmp_path: Path) -> None:
    assert 4 <= default_io_streams() <= MAX_DEFAULT_IO_STREAMS
    assert StoreConfig(root=tmp_path).io_streams == 0  # 0: the default above
    with pytest.raises(ValueError, match="io_streams"):
        StoreConfig(root=tmp_path, io_streams=-1)
    cfg = tmp_path / "c.toml"
    cfg.write_text("[store]\nio_streams = 6\n", encoding="utf-8")
    assert load_config(cfg, env={}).store_config().io_streams == 6
    assert load_config(cfg, env={"KVOFFLOAD_STORE_IO_STREAMS": "3"}).io_streams == 3
    for bad in ("-1", "many"):
        with pytest.raises(ConfigError, match=r"\[store\] io_streams"):
            load_config(None, env={"KVOFFLOAD_STORE_IO_STREAMS": bad})


@pytest.fixture(autouse=True)
def _parallel_at_any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """These chunks are small: without this, their batches run inline."""
    monkeypatch.setattr(writes, "PARALLEL_MIN_BYTES", 0)


def test_a_small_unsynced_save_runs_inline_and_the_rest_on_the_streams(
    tmp_path: Path,
    kek_file: Path,
    chunks: list[tuple[bytes, list[bytes]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Below PARALLEL_MIN_BYTES a save without fsync never touches the pool (no
    thread hops for Python-bound work); a fsync'd save and every load of more
    than one chunk (a cold read waits on the device) run on the streams."""
    monkeypatch.setattr(writes, "PARALLEL_MIN_BYTES", 1 << 20)
    threads: set[str] = set()
    real = fileio._write_all

    def spy(fd: int, data: memoryview) -> None:
        threads.add(threading.current_thread().name)
        real(fd, data)

    monkeypatch.setattr(fileio, "_write_all", spy)
    s = open_store(tmp_path / "s", kek_file, N)
    try:
        assert s.put_many("acme", NS, chunks[:4]) == [True] * 4
        assert threads == {threading.current_thread().name} and s._state.streams.pool is None
        outs = [memoryview(bytearray(sum(map(len, lay)))) for _, lay in chunks[:4]]
        got = s.get_many_into("acme", [k for k, _ in chunks[:4]], outs)
        assert got == [[len(x) for x in lay] for _, lay in chunks[:4]]
        assert s._state.streams.pool is not None  # loads: on the streams
    finally:
        s.close()
    threads.clear()
    s = open_store(tmp_path / "o", kek_file, N, durability="object")
    try:
        assert s.put_many("acme", NS, chunks[:4]) == [True] * 4
        assert threads and all(t.startswith("kvoffload-io") for t in threads)
    finally:
        s.close()


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Iterator[None]:
    before = {t.ident for t in threading.enumerate()}
    yield
    left = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert not [t.name for t in left if t.name.startswith("kvoffload-io")]


def test_a_failed_write_in_a_parallel_batch_stores_the_chunks_before_it_only(
    tmp_path: Path,
    kek_file: Path,
    chunks: list[tuple[bytes, list[bytes]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = open_store(tmp_path / "s", kek_file, N)
    real = fileio._write_all

    def enospc_for_chunk_2(fd: int, data: memoryview) -> None:
        if bytes(data[: v1.header_length(3)]).find(key(2)) >= 0:
            raise OSError(28, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(fileio, "_write_all", enospc_for_chunk_2)
    try:
        with pytest.raises(StoreIOError, match="permanent"):
            s.put_many("acme", NS, chunks)
        # Chunks 3.. were written at the same time: their files are removed
        # again, or a lookup would adopt them.
        assert [s.contains("acme", k) for k, _ in chunks] == [True, True] + [False] * (N - 2)
        assert s.reserved_bytes == 0
        assert s.used_bytes == sum(
            v1.object_size(list(map(len, lay)), True) for _, lay in chunks[:2]
        )
        assert len(list((s.root / "objects").rglob("*" + v1.OBJECT_SUFFIX))) == 2
        assert not list((s.root / "objects").rglob(v1.TMP_PREFIX + "*"))
    finally:
        s.close()


def test_store_full_mid_batch_keeps_the_chunks_in_flight_before_it(
    tmp_path: Path, kek_file: Path, chunks: list[tuple[bytes, list[bytes]]]
) -> None:
    sizes = [v1.object_size(list(map(len, lay)), True) for _, lay in chunks]
    s = open_store(
        tmp_path / "s",
        kek_file,
        N,
        capacity_bytes=sum(sizes[:3]),
        high_watermark=1.0,
        low_watermark=1.0,
    )
    try:
        with pytest.raises(StoreFull):
            s.put_many("acme", NS, chunks)
        assert [s.contains("acme", k) for k, _ in chunks] == [True] * 3 + [False] * (N - 3)
        assert s.reserved_bytes == 0 and s.used_bytes == sum(sizes[:3])
    finally:
        s.close()
