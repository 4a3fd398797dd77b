"""Chunk-wise loads (protocol-v1.md §5.30): a real Store behind a real server socket.

The sidecar reports each verified chunk of a large batch in a frame while it
still reads the chunks after it, and the client hands the chunk out at once:
its copy out of staging overlaps the sidecar's read of the next chunk. What
must hold: a chunk is handed out before the batch's last chunk is read; every
byte handed out is the chunk's own, verified; the reply agrees with every
frame; a small batch gets no frame at all; a read failure after a frame never
unmakes the chunks it reported.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvoffload import protocol as p
from kvoffload.client import SidecarClient
from kvoffload.sidecar import reads
from kvoffload.staging import StagingBuffer
from kvoffload.store import Store
from kvoffload.store.reads import Reads
from tests.helpers.server import Raw, ServerThread, sock_path, start

TENANT = "acme"
NS = b"\x44" * 32
CHUNKS = 4
LAYERS = 4
LAYER_BYTES = 5 << 18  # 1.25 MiB: a chunk of 5 MiB is worth a frame (≥ 4 MiB)
STAGING = 32 << 20


def key(i: int) -> bytes:
    return bytes([i + 1]) * 32


def chunk(i: int, layer_bytes: int = LAYER_BYTES) -> list[bytes]:
    rng = random.Random(i)
    return [rng.randbytes(layer_bytes) for _ in range(LAYERS)]


@pytest.fixture
def saved(store: Store) -> Store:
    """conftest's real store, holding the chunks of these tests."""
    for i in range(CHUNKS):
        assert store.put(TENANT, NS, key(i), chunk(i))
    return store


@pytest.fixture
def server(sock_dir: Path, saved: Store) -> Iterator[ServerThread]:
    st = start(sock_dir, saved)
    yield st
    st.stop()


def client_of(st: ServerThread) -> SidecarClient:
    return SidecarClient(sock_path(st), TENANT, staging_bytes=STAGING, timeout_s=30)


def test_a_chunk_is_handed_out_while_the_next_ones_are_still_read(
    server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunk 2's read is held: chunks 0 and 1 reach ``into`` before it ends (in a
    whole-chunk load nothing would, until the reply)."""
    release = threading.Event()
    real_load_one = Reads._load_one

    def held_load_one(self: Reads, tenant: str, rec: Any, *a: Any, **kw: Any) -> Any:
        if rec.chunk_key == key(2):
            assert release.wait(30)
        return real_load_one(self, tenant, rec, *a, **kw)

    monkeypatch.setattr(Reads, "_load_one", held_load_one)
    got: list[tuple[int, bytes]] = []
    two_in = threading.Event()

    def into(idx: int, _k: bytes, views: Sequence[memoryview]) -> None:
        got.append((idx, b"".join(bytes(v) for v in views)))
        if len(got) == 2:
            two_in.set()

    with client_of(server) as c:
        assert c.uses_direct() is False
        results: list[Any] = []
        t = threading.Thread(
            target=lambda: results.extend(c.load([key(i) for i in range(CHUNKS)], into=into))
        )
        t.start()
        try:
            handed_out_early = two_in.wait(20)
        finally:
            release.set()
            t.join(30)
        assert handed_out_early, "no chunk was handed out while a later one was still read"
        assert [r.ok for r in results] == [True] * CHUNKS
    assert got == [(i, b"".join(chunk(i))) for i in range(CHUNKS)]


def _frames(raw: Raw, rid: int, req: p.PrepareLoad) -> tuple[list[p.LoadProgress], p.Reply]:
    raw.t.send(p.request_message(rid, req))
    frames: list[p.LoadProgress] = []
    while True:
        got, reply = p.parse_reply(raw.t.recv().msg)
        assert got == rid
        if not isinstance(reply, p.LoadProgress):
            return frames, reply
        frames.append(reply)


def test_wire_frames_report_each_chunk_once_and_the_reply_agrees(
    server: ServerThread, store: Store
) -> None:
    raw = Raw(server)
    hello = raw.hello(TENANT)
    assert hello.chunkwise
    staging = StagingBuffer(STAGING)
    try:
        assert isinstance(raw.call(p.RegisterStaging(staging.size), [staging.fd]), p.Ack)
        keys = (*(key(i) for i in range(CHUNKS)), b"\x7f" * 32)
        frames, final = _frames(raw, 9, p.PrepareLoad(TENANT, keys, chunkwise=True))
        # One frame per chunk (each is 5 MiB), none for the last one loaded: the
        # miss after it ends the batch, and the reply says so as soon.
        assert [(f.first, f.verified, f.layers_done) for f in frames] == [
            (i, i + 1, 0) for i in range(CHUNKS - 1)
        ]
        assert isinstance(final, p.PrepareLoadReply)
        assert final.verified == CHUNKS and final.stop is p.ErrorCode.NOT_FOUND
        for f in frames:
            assert f.chunks == final.chunks[f.first : f.verified]
        for i, slot in enumerate(final.chunks[:CHUNKS]):
            got = bytes(staging.view[slot.offset : slot.offset + sum(slot.layers)])
            assert got == b"".join(chunk(i))
        assert isinstance(raw.call(p.CompleteLoad(final.handle)), p.Ack)
        # Without the key: no frame, whatever the size.
        frames, final = _frames(raw, 10, p.PrepareLoad(TENANT, keys))
        assert frames == [] and isinstance(final, p.PrepareLoadReply) and final.verified == CHUNKS
        assert isinstance(raw.call(p.CompleteLoad(final.handle)), p.Ack)
    finally:
        raw.t.close()
        staging.close()


def test_a_batch_of_small_chunks_gets_no_frame(server: ServerThread, store: Store) -> None:
    small = [key(10 + i) for i in range(8)]
    for i, k in enumerate(small):
        assert store.put(TENANT, NS, k, chunk(i, 4096))
    raw = Raw(server)
    raw.hello(TENANT)
    staging = StagingBuffer(STAGING)
    try:
        assert isinstance(raw.call(p.RegisterStaging(staging.size), [staging.fd]), p.Ack)
        for _ in range(2):  # cold (on the pool), then in the page cache (maybe on the loop)
            frames, final = _frames(raw, 11, p.PrepareLoad(TENANT, tuple(small), chunkwise=True))
            assert frames == []
            assert isinstance(final, p.PrepareLoadReply) and final.verified == len(small)
            assert isinstance(raw.call(p.CompleteLoad(final.handle)), p.Ack)
    finally:
        raw.t.close()
        staging.close()


def test_a_read_that_fails_after_a_frame_keeps_the_chunks_it_reported(
    server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An internal error while reading chunk 2 (after chunks 0 and 1 were reported)
    answers INTERNAL, and still loaded: the two reported chunks."""
    real_load_one = Reads._load_one

    def failing(self: Reads, tenant: str, rec: Any, *a: Any, **kw: Any) -> Any:
        if rec.chunk_key == key(2):
            raise RuntimeError("an unexpected failure of the read")
        return real_load_one(self, tenant, rec, *a, **kw)

    monkeypatch.setattr(Reads, "_load_one", failing)
    monkeypatch.setattr(reads, "CHUNK_FRAME_MIN_BYTES", 1)
    with client_of(server) as c:
        res = c.load([key(i) for i in range(CHUNKS)])
        assert [r.ok for r in res] == [True, True, False, False]
        assert b"".join(bytes(v) for v in res[1].layers or []) == b"".join(chunk(1))
        assert c.connected
