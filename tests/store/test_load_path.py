"""The sidecar's load path (issue 12): a real Store, real files, real AES-GCM,
behind a real server socket where the client is involved.

What must hold while loads get faster:

- the chunks of one ``prepare_load`` are read on the store's I/O streams at
  once, each straight into its own region, byte for byte, and nothing outside
  those regions is written;
- a chunk that fails its checks in the middle of such a batch fails alone;
- ``prepare_load`` reads the records it planned with (no second index lookup
  per chunk), and a purge or revocation after that lookup still stops the load;
- a small object whose bytes are all in the page cache is verified in the
  calling thread, one that is not is read on the pool, with the same checks;
- a layer-wise load verifies and decrypts each layer straight from the page
  cache (the object mapped once, never read into a scratch buffer), and a
  corrupt layer *k* hands out nothing of layer *k*.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvoffload.client import SidecarClient
from kvoffload.client.session import Session as ClientSession
from kvoffload.layouts import v1
from kvoffload.sidecar.connection import Connection
from kvoffload.sidecar.reads import Reads as SidecarReads
from kvoffload.sidecar.session import Session
from kvoffload.store import Store
from kvoffload.store import files as fileio
from kvoffload.store import layerwise as lw
from kvoffload.store.api import ChunkRecord
from kvoffload.store.files import Durability
from kvoffload.store.iobackend import local_fs
from kvoffload.store.reads import Reads
from tests.helpers.server import ServerThread, start
from tests.helpers.stores import evict, make_store, nowait_reads_miss

TENANT = "acme"
NS = b"\x5a" * 32
LAYERS = 4
CHUNKS = 8
#: Bytes written around every region: a load that strays out of its region shows.
FENCE = 0xA5


def key(i: int) -> bytes:
    return bytes([i + 1]) * 32


def chunk(i: int) -> list[bytes]:
    rng = random.Random(1000 + i)
    return [rng.randbytes(5000 + 700 * j + i) for j in range(LAYERS)]


@pytest.fixture
def store(tmp_path: Path, kek_file: Path) -> Iterator[Store]:
    if not local_fs(tmp_path):
        pytest.skip(f"{tmp_path} is not on a local file system: loads read, never map")
    s = make_store(tmp_path / "root", kek_file, durability=Durability.NONE, io_streams=4)
    assert getattr(s.io, "map_reads", False)
    yield s
    s.close()


@pytest.fixture
def server(sock_dir: Path, store: Store) -> Iterator[ServerThread]:
    st = start(sock_dir, store)
    yield st
    st.stop()


@pytest.fixture
def client(server: ServerThread) -> Iterator[SidecarClient]:
    path = server.server.config.socket_path
    assert path is not None
    c = SidecarClient(path, TENANT, staging_bytes=4 << 20)
    yield c
    c.close()


def save_all(store: Store, n: int = CHUNKS, *, encrypt: bool = True) -> None:
    got = store.put_many(TENANT, NS, [(key(i), chunk(i)) for i in range(n)], encrypt=encrypt)
    assert got == [True] * n


def fenced_regions(n: int) -> tuple[bytearray, list[memoryview], list[tuple[int, int]]]:
    """One buffer holding ``n`` regions, 4 KiB-aligned, with fenced gaps between them."""
    spans: list[tuple[int, int]] = []
    at = v1.ALIGN
    for i in range(n):
        size = sum(len(x) for x in chunk(i))
        spans.append((at, size))
        at = v1.align_up(at + size + 1) + v1.ALIGN
    buf = bytearray([FENCE]) * at
    view = memoryview(buf)
    return buf, [view[a : a + size] for a, size in spans], spans


def assert_landed(buf: bytearray, spans: list[tuple[int, int]], which: Sequence[int]) -> None:
    """Regions of ``which`` hold their chunk exactly; every byte outside all regions
    still holds the fence."""
    for i in which:
        a, size = spans[i]
        assert bytes(buf[a : a + size]) == b"".join(chunk(i)), f"chunk {i}"
    outside = bytearray(buf)
    for a, size in spans:
        outside[a : a + size] = bytes([FENCE]) * size
    assert outside == bytearray([FENCE]) * len(buf)


def records(store: Store, n: int) -> list[ChunkRecord]:
    recs = [store.payload_info(TENANT, key(i)) for i in range(n)]
    assert all(r is not None for r in recs)
    return [r for r in recs if r is not None]


def flip(store: Store, i: int, layer: int) -> None:
    """Flip one ciphertext byte of ``layer`` of chunk ``i`` (the file stays sidecar-written)."""
    path = store.root / v1.object_relpath(TENANT, key(i))
    h = v1.decode_header(path.read_bytes())
    mode = path.stat().st_mode
    os.chmod(path, 0o600)
    with open(path, "r+b") as f:
        f.seek(h.layers[layer].offset + 33)
        b = f.read(1)
        f.seek(h.layers[layer].offset + 33)
        f.write(bytes([b[0] ^ 0x08]))
    os.chmod(path, mode & 0o777)


class Threads:
    """Which threads ran ``Reads._load_one`` (the pool's per-chunk read). With
    ``overlap``, the first ``overlap`` reads each wait until all of them are
    running at once: a batch read one chunk after the other breaks the barrier."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, overlap: int = 0) -> None:
        self.names: list[str] = []
        self.overlapped = True
        barrier = threading.Barrier(overlap) if overlap > 1 else None
        real = Reads._load_one

        def spy(self_: Reads, *a: Any, **kw: Any) -> Any:
            self.names.append(threading.current_thread().name)
            if barrier is not None and len(self.names) <= overlap:
                try:
                    barrier.wait(timeout=10)
                except threading.BrokenBarrierError:
                    self.overlapped = False
            return real(self_, *a, **kw)

        monkeypatch.setattr(Reads, "_load_one", spy)


def cold(store: Store, n: int) -> bool:
    """Drop the objects of chunks [0, n) from the page cache; False where the
    kernel kept them (then the test cannot tell a cold read from a warm one)."""
    return drop_cached(store, range(n))


# -- whole-chunk loads: parallel, each chunk in its own region -------------------------


@pytest.mark.parametrize("encrypt", [True, False], ids=["sealed", "plain"])
def test_a_parallel_batch_lands_each_chunk_in_its_own_region(
    store: Store, monkeypatch: pytest.MonkeyPatch, encrypt: bool
) -> None:
    save_all(store, encrypt=encrypt)
    monkeypatch.setattr(fileio, "MAP_MIN_BYTES", 1)  # these objects are small: map them
    threads = Threads(monkeypatch, overlap=store.io_streams)
    buf, outs, spans = fenced_regions(CHUNKS)
    got = store.load_planned(TENANT, records(store, CHUNKS), outs, store.load_guard(TENANT))
    assert got == [[len(x) for x in chunk(i)] for i in range(CHUNKS)]
    assert_landed(buf, spans, range(CHUNKS))
    # Read on the store's pool (never the caller's thread), by more than one stream.
    assert len(threads.names) == CHUNKS
    assert all(n.startswith("kvoffload-io") for n in threads.names)
    assert threads.overlapped and len(set(threads.names)) >= store.io_streams


def test_a_corrupt_chunk_in_the_middle_of_a_parallel_batch_fails_alone(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_all(store)
    monkeypatch.setattr(fileio, "MAP_MIN_BYTES", 1)
    bad = 3
    flip(store, bad, 2)
    buf, outs, spans = fenced_regions(CHUNKS)
    got = store.get_many_into(TENANT, [key(i) for i in range(CHUNKS)], outs, stop_at_miss=False)
    assert [g is not None for g in got] == [i != bad for i in range(CHUNKS)]
    good = [i for i in range(CHUNKS) if i != bad]
    assert_landed(buf, spans, good)
    # The corrupt object left its name and the index; the others are still there.
    assert not (store.root / v1.object_relpath(TENANT, key(bad))).exists()
    assert store.lookup(TENANT, [key(i) for i in range(CHUNKS)]) == bad
    assert store.lookup(TENANT, [key(i) for i in good[bad:]]) == len(good) - bad


def test_a_corrupt_chunk_through_the_sidecar_ends_the_prefix_there(
    store: Store, client: SidecarClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_all(store)
    monkeypatch.setattr(fileio, "MAP_MIN_BYTES", 1)
    flip(store, 5, 0)
    seen: dict[int, bytes] = {}

    def into(idx: int, _key: bytes, layers: Sequence[memoryview]) -> None:
        seen[idx] = b"".join(bytes(v) for v in layers)

    got = client.load([key(i) for i in range(CHUNKS)], into=into)
    assert [r.ok for r in got] == [i < 5 for i in range(CHUNKS)]
    assert seen == {i: b"".join(chunk(i)) for i in range(5)}


# -- prepare_load: the planned records, the guard taken before them ----------------------


def test_prepare_load_looks_each_chunk_up_once(
    store: Store, client: SidecarClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_all(store)
    asked: list[bytes] = []
    real, real_cached = Reads._record, Reads.payload_info_cached

    def spy(self_: Reads, tenant: str, k: bytes) -> Any:
        asked.append(k)
        return real(self_, tenant, k)

    def spy_cached(self_: Reads, tenant: str, k: bytes) -> Any:
        asked.append(k)
        return real_cached(self_, tenant, k)

    # The pool's path (_record) and the loop's (payload_info_cached, for chunks
    # in the page cache) alike.
    monkeypatch.setattr(Reads, "_record", spy)
    monkeypatch.setattr(Reads, "payload_info_cached", spy_cached)
    got = client.load([key(i) for i in range(CHUNKS)])
    assert [r.ok for r in got] == [True] * CHUNKS
    assert [b"".join(r.layers or []) for r in got] == [b"".join(chunk(i)) for i in range(CHUNKS)]
    assert sorted(asked) == sorted(key(i) for i in range(CHUNKS))  # once each, not twice


@pytest.mark.parametrize(
    ("layerwise", "on_loop"),
    [(False, False), (True, False), (False, True)],
    ids=["whole", "layerwise", "whole-on-the-loop"],
)
def test_a_purge_after_the_lookup_still_stops_the_load(
    store: Store,
    client: SidecarClient,
    monkeypatch: pytest.MonkeyPatch,
    layerwise: bool,
    on_loop: bool,
) -> None:
    """The load generation is taken before prepare_load looks the chunks up: a
    revocation or purge (``cancel_loads``) while it plans makes every chunk a miss.
    On the pool every chunk is looked up before the first read; on the loop
    (small chunks in the page cache) each is read as soon as it is looked up, so
    the purge comes after the first lookup there."""
    save_all(store)
    if not on_loop:
        monkeypatch.setattr(fileio, "MAP_MIN_BYTES", 1)  # every object is "large"
    real, real_cached = Reads.payload_info, Reads.payload_info_cached
    last = key(0) if on_loop else key(CHUNKS - 1)

    def info(self_: Reads, tenant: str, k: bytes) -> Any:
        rec = real(self_, tenant, k)
        if k == last:
            store.cancel_loads(tenant)  # after the lookup, before any read
        return rec

    def info_cached(self_: Reads, tenant: str, k: bytes) -> Any:
        got = real_cached(self_, tenant, k)
        if k == last:
            store.cancel_loads(tenant)
        return got

    monkeypatch.setattr(Reads, "payload_info", info)
    monkeypatch.setattr(Reads, "payload_info_cached", info_cached)
    handed: list[int] = []
    keys = [key(i) for i in range(CHUNKS)]
    if layerwise:
        got = client.load_layerwise(keys, lambda layer, first, views: handed.append(layer))
    else:
        got = client.load(keys, into=lambda idx, _k, _v: handed.append(idx))
    assert not any(r.ok for r in got)
    assert handed == []
    monkeypatch.undo()
    assert all(r.ok for r in client.load(keys))  # nothing was dropped: a miss, not damage


# -- small objects: page-cache hits verified in the calling thread ----------------------


def test_small_objects_are_read_in_the_calling_thread_cached_or_cold(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small object never hops to a pool thread and back (which costs more than
    its read): a page-cache hit is verified at once, without the ordinary read;
    a cold one is read in its turn, its read started (readahead) when it joined
    the batch's window (test_streamed_loads: the readahead and the damage cases)."""
    save_all(store)
    threads = Threads(monkeypatch)
    keys = [key(i) for i in range(CHUNKS)]
    buf, outs, spans = fenced_regions(CHUNKS)
    got = store.get_many_into(TENANT, keys, outs)  # just written: in the page cache
    assert all(g is not None for g in got)
    assert_landed(buf, spans, range(CHUNKS))
    assert threads.names == []
    if not cold(store, CHUNKS):
        pytest.skip("this file system keeps the pages after POSIX_FADV_DONTNEED")
    nowait_reads_miss(monkeypatch)
    buf, outs, spans = fenced_regions(CHUNKS)
    got = store.get_many_into(TENANT, keys, outs)
    assert all(g is not None for g in got)
    assert_landed(buf, spans, range(CHUNKS))
    assert threads.names == [threading.current_thread().name] * CHUNKS


# -- through the sidecar: cached small loads answered on the event loop ------------------


class Paths:
    """Which verbs the sidecar ran on the pool (Connection._spawn) and which it
    answered on its loop (Session.execute_inline), with what each answered."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.pool: list[str] = []
        self.loop: list[tuple[str, int, str]] = []  # (verb, chunks, stop)
        real_spawn, real_inline = Connection._spawn, Session.execute_inline

        def spawn(self_: Connection, rid: int, req: Any, *a: Any) -> None:
            self.pool.append(req.OP.value)
            real_spawn(self_, rid, req, *a)

        def inline(self_: Session, req: Any) -> Any:
            reply = real_inline(self_, req)
            if reply is not None:
                chunks = sum(1 for c in getattr(reply, "chunks", ()) if c.verified)
                stop = getattr(reply, "stop", None)
                self.loop.append((req.OP.value, chunks, "-" if stop is None else stop.name))
            return reply

        monkeypatch.setattr(Connection, "_spawn", spawn)
        monkeypatch.setattr(Session, "execute_inline", inline)


def drop_cached(store: Store, which: Sequence[int]) -> bool:
    """:func:`cold` of the chunks ``which`` alone."""
    return evict(store.root / v1.object_relpath(TENANT, key(i)) for i in which)


def loaded_bytes(client: SidecarClient, n: int) -> list[bytes | None]:
    got = client.load([key(i) for i in range(n)])
    return [b"".join(bytes(v) for v in r.layers or []) if r.ok else None for r in got]


def test_a_cached_small_load_is_answered_on_the_loop_and_a_cold_one_on_the_pool(
    store: Store, client: SidecarClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_all(store)
    paths = Paths(monkeypatch)
    assert loaded_bytes(client, CHUNKS) == [b"".join(chunk(i)) for i in range(CHUNKS)]
    client.stats()  # a round trip: the posted complete_load was answered before it
    assert ("prepare_load", CHUNKS, "OK") in paths.loop
    assert [v for v, _n, _s in paths.loop].count("complete_load") == 1
    assert "prepare_load" not in paths.pool and "complete_load" not in paths.pool
    if not drop_cached(store, range(CHUNKS)):
        pytest.skip("this file system keeps the pages after POSIX_FADV_DONTNEED")
    paths.loop.clear()
    assert loaded_bytes(client, CHUNKS) == [b"".join(chunk(i)) for i in range(CHUNKS)]
    assert paths.pool.count("prepare_load") == 1  # cold: read on the pool
    assert not [x for x in paths.loop if x[0] == "prepare_load"]


def test_a_batch_cached_only_in_part_is_answered_in_two_steps(
    store: Store, client: SidecarClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cached prefix on the loop with BUSY (ask again), the rest read when
    asked again: on the pool, or on the loop where the refused RWF_NOWAIT read
    started the kernel's readahead and the pages came in meanwhile. Every chunk
    reaches the client, each verified once."""
    save_all(store)
    if not drop_cached(store, range(5, CHUNKS)):
        pytest.skip("this file system keeps the pages after POSIX_FADV_DONTNEED")
    paths = Paths(monkeypatch)
    asked: list[int] = []
    opened: list[bytes] = []
    real, real_open = SidecarReads.prepare_load, Reads._open_into

    def spy(self_: SidecarReads, req: Any, emit: Any = None, **kw: Any) -> Any:
        asked.append(len(req.keys))
        return real(self_, req, emit, **kw)

    def open_spy(self_: Reads, tenant: str, k: bytes, *a: Any, **kw: Any) -> Any:
        opened.append(k)
        return real_open(self_, tenant, k, *a, **kw)

    monkeypatch.setattr(SidecarReads, "prepare_load", spy)
    monkeypatch.setattr(Reads, "_open_into", open_spy)
    assert loaded_bytes(client, CHUNKS) == [b"".join(chunk(i)) for i in range(CHUNKS)]
    assert paths.loop[0] == ("prepare_load", 5, "BUSY")
    assert asked[:2] == [CHUNKS, CHUNKS - 5]
    assert sorted(opened) == [key(i) for i in range(CHUNKS)]


def test_a_load_waits_for_one_reply_per_batch(
    server: ServerThread, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prepare_load is a call, complete_load is posted; with staging for exactly
    one batch, the next batch's regions are free when its prepare_load arrives."""
    save_all(store)
    path = server.server.config.socket_path
    assert path is not None
    need = sum(v1.align_up(sum(len(x) for x in chunk(i))) for i in range(CHUNKS))
    calls: list[str] = []
    real_call, real_post, real_send = ClientSession.call, ClientSession.post, ClientSession.send

    def name(req: Any) -> str:  # §5.32: a load that completes the one before
        return req.OP.value + (" +complete" if getattr(req, "complete", ()) else "")

    def call(self_: ClientSession, req: Any, fds: Any = ()) -> Any:
        calls.append("call " + name(req))
        return real_call(self_, req, fds)

    def send(self_: ClientSession, req: Any) -> int:  # then its replies are waited for
        calls.append("call " + name(req))
        return real_send(self_, req)

    def post(self_: ClientSession, req: Any) -> None:
        calls.append("post " + req.OP.value)
        real_post(self_, req)

    monkeypatch.setattr(ClientSession, "call", call)
    monkeypatch.setattr(ClientSession, "post", post)
    monkeypatch.setattr(ClientSession, "send", send)
    with SidecarClient(path, TENANT, staging_bytes=need) as c:
        for _ in range(20):
            assert loaded_bytes(c, CHUNKS) == [b"".join(chunk(i)) for i in range(CHUNKS)]
        loads = [x for x in calls if "load" in x]
        # Never BUSY; each load completes the one before on the way (§5.32).
        assert loads == ["call prepare_load"] + ["call prepare_load +complete"] * 19
        assert c.stats()["chunks"] == CHUNKS  # the posted Acks were read on the way
        # The last load's complete went out on its own, before stats.
        assert [x for x in calls if "load" in x][20:] == ["post complete_load"]


def test_a_corrupt_small_page_cache_hit_is_a_miss_and_leaves(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_all(store)
    flip(store, 2, 1)
    threads = Threads(monkeypatch)
    buf, outs, spans = fenced_regions(CHUNKS)
    got = store.get_many_into(TENANT, [key(i) for i in range(CHUNKS)], outs)
    assert [g is not None for g in got] == [i < 2 for i in range(CHUNKS)]
    assert_landed(buf, spans, [0, 1])
    assert threads.names == []  # the flipped object was in the page cache too
    assert not (store.root / v1.object_relpath(TENANT, key(2))).exists()
    assert store.lookup(TENANT, [key(i) for i in range(CHUNKS)]) == 2


def test_read_cached_refuses_what_is_not_all_in_the_page_cache(tmp_path: Path) -> None:
    p = tmp_path / "obj"
    data = os.urandom(3 << 20)
    p.write_bytes(data)
    bufs: list[memoryview] = []

    def alloc(n: int) -> memoryview:
        bufs.append(memoryview(bytearray(n)))
        return bufs[-1]

    got = fileio.read_cached(p, alloc, 1 << 30)
    assert got is not None and bytes(got) == data
    evict([p])
    assert fileio.read_cached(p, alloc, 1 << 30) is None
    with pytest.raises(OSError):
        fileio.read_cached(p, alloc, 1 << 20)  # over the object limit: EFBIG
    with pytest.raises(FileNotFoundError):
        fileio.read_cached(tmp_path / "absent", alloc, 1 << 30)


# -- layer-wise loads: one pass from the mapping ----------------------------------------


class Recorder:
    """``on_layer``: every (layer, chunk, bytes) handed out, in call order."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, bytes]] = []

    def __call__(self, layer: int, first: int, views: Sequence[memoryview]) -> None:
        for j, v in enumerate(views):
            self.calls.append((layer, first + j, bytes(v)))


class NoScratchReads:
    """Counts layer slots faulted in from a mapping; a layer read with ``preadv``
    (into a scratch buffer, then copied) fails the test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, forbid_reads: bool = True) -> None:
        self.populated = 0
        self.reads = 0
        real_populate: Callable[..., bool] = fileio.populate
        real_preadv = os.preadv

        def populate(m: Any, start: int = 0, length: int = 0) -> bool:
            ok = real_populate(m, start, length)
            self.populated += ok
            return ok

        def preadv(fd: int, bufs: Any, offset: int, *a: Any) -> int:
            self.reads += 1
            if forbid_reads:
                raise AssertionError("a layer was read into a scratch buffer")
            return real_preadv(fd, bufs, offset, *a)

        monkeypatch.setattr(fileio, "populate", populate)
        monkeypatch.setattr(os, "preadv", preadv)  # what the layer-wise reads use


def test_a_layerwise_load_decrypts_each_layer_from_the_mapping(
    store: Store, client: SidecarClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_all(store)
    monkeypatch.setattr(fileio, "MAP_MIN_BYTES", 1)
    spy = NoScratchReads(monkeypatch)
    rec = Recorder()
    got = client.load_layerwise([key(i) for i in range(CHUNKS)], rec)
    assert [r.ok for r in got] == [True] * CHUNKS
    assert sorted((layer, c) for layer, c, _ in rec.calls) == [
        (layer, c) for layer in range(LAYERS) for c in range(CHUNKS)
    ]
    for layer, c, data in rec.calls:
        assert data == chunk(c)[layer]
    assert spy.populated == CHUNKS * LAYERS


@pytest.mark.parametrize("bad_layer", [0, 2, LAYERS - 1])
def test_a_one_pass_layerwise_load_hands_nothing_of_a_corrupt_layer(
    store: Store, client: SidecarClient, monkeypatch: pytest.MonkeyPatch, bad_layer: int
) -> None:
    save_all(store)
    monkeypatch.setattr(fileio, "MAP_MIN_BYTES", 1)
    bad = 4
    flip(store, bad, bad_layer)
    spy = NoScratchReads(monkeypatch)
    rec = Recorder()
    got = client.load_layerwise([key(i) for i in range(CHUNKS)], rec)
    assert [r.ok for r in got] == [i < bad for i in range(CHUNKS)]
    for layer, c, data in rec.calls:
        assert data == chunk(c)[layer]  # every byte handed out is a verified byte
    # Nothing of the bad layer, or after it, of the bad chunk or a later one.
    assert not [(lay, c) for lay, c, _ in rec.calls if lay >= bad_layer and c >= bad]
    for c in range(bad):
        assert [lay for lay, cc, _ in rec.calls if cc == c] == list(range(LAYERS))
    assert spy.populated > 0
    assert client.lookup([key(i) for i in range(CHUNKS)]) == bad


def test_a_layerwise_load_reads_what_may_not_be_mapped(
    store: Store, client: SidecarClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file another descriptor could shrink (not sidecar-written) is never
    mapped: its layers are read, with the same checks and bytes."""
    save_all(store, encrypt=False)
    monkeypatch.setattr(fileio, "MAP_MIN_BYTES", 1)
    for i in (1, 6):
        os.chmod(store.root / v1.object_relpath(TENANT, key(i)), 0o440)  # a published lease
    spy = NoScratchReads(monkeypatch, forbid_reads=False)
    rec = Recorder()
    got = client.load_layerwise([key(i) for i in range(CHUNKS)], rec)
    assert all(r.ok for r in got)
    for layer, c, data in rec.calls:
        assert data == chunk(c)[layer]
    assert spy.populated == (CHUNKS - 2) * LAYERS
    assert spy.reads == 2 * LAYERS


def test_a_kernel_without_populate_read_reads_layers_instead(
    store: Store, client: SidecarClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_all(store)
    monkeypatch.setattr(fileio, "MAP_MIN_BYTES", 1)
    monkeypatch.setattr(fileio, "_populate_ok", True)
    monkeypatch.setattr(fileio, "MADV_POPULATE_READ", 0x7FFF)  # EINVAL, as before Linux 5.14
    spy = NoScratchReads(monkeypatch, forbid_reads=False)
    rec = Recorder()
    got = client.load_layerwise([key(i) for i in range(CHUNKS)], rec)
    assert all(r.ok for r in got)
    for layer, c, data in rec.calls:
        assert data == chunk(c)[layer]
    assert spy.populated == 0 and spy.reads == CHUNKS * LAYERS
    assert fileio._populate_ok is False


def test_a_layer_is_reported_while_the_next_one_is_verified(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sending layer *i*'s report waits for the client's socket: the pool verifies
    layer *i+1* meanwhile. Layer *i*'s report waits here until a layer *i+1*
    read has started; a load that sends it before starting layer *i+1* times out."""
    save_all(store)
    monkeypatch.setattr(fileio, "MAP_MIN_BYTES", 1)
    monkeypatch.setattr(lw, "PARALLEL_MIN_BYTES", 1)  # every layer on the pool
    started = [threading.Event() for _ in range(LAYERS)]
    real = lw._layer

    def layer(o: Any, i: int, out: memoryview) -> None:
        started[i].set()
        real(o, i, out)

    monkeypatch.setattr(lw, "_layer", layer)
    reports: list[tuple[int, int]] = []
    overlapped: list[bool] = []

    def report(done: int, verified: int) -> None:
        if done < LAYERS and verified:
            overlapped.append(started[done].wait(timeout=10))
        reports.append((done, verified))

    buf, outs, spans = fenced_regions(CHUNKS)
    got = store.load_planned_layerwise(
        TENANT,
        records(store, CHUNKS),
        outs,
        lambda layers: None,
        report,
        lambda layer: False,
        store.load_guard(TENANT),
    )
    assert all(g is not None for g in got)
    assert_landed(buf, spans, range(CHUNKS))
    assert reports == [(i + 1, CHUNKS) for i in range(LAYERS)]
    assert overlapped == [True] * (LAYERS - 1)
