"""In-place transfers (protocol-v1.md §5.34, revision 17) with the real server.

A real Server on its own loop and a real Store; the client is
:class:`~kvoffload.client.SidecarClient` or a raw frame client. The region is
a real file of this uid, handed over SCM_RIGHTS. What must hold: the bytes
round-trip through the file with the staging buffer untouched; the server
counts what it moved; a torn or flipped object is a miss and nothing of it
reaches the file; bad descriptors, an older client, unknown regions,
out-of-bounds ranges and malformed frames each get one clear error and the
connection and server go on; a server without revision 17 makes the client
answer None (the caller uses staging).
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload import protocol as p
from kvoffload.client import SidecarClient
from kvoffload.layouts import v1
from kvoffload.protocol import ErrorCode
from kvoffload.sidecar import session as session_mod
from kvoffload.staging import PAGE
from kvoffload.store import Store
from tests.sidecar.inthread import Raw, ServerThread, grants

TENANT = "acme"
NS = b"\x17" * 32
ROW = 4 * PAGE
LAYERS = (PAGE, PAGE, 2 * PAGE)  # one row: three "worker slots"


def key(i: int) -> bytes:
    return bytes([0x40 + i]) * 32


@pytest.fixture
def server(sock_dir: Path, store: Store) -> Iterator[ServerThread]:
    st = ServerThread(sock_dir, store, grants(TENANT))
    yield st
    st.stop()


@pytest.fixture
def region(tmp_path: Path) -> Iterator[tuple[int, bytes]]:
    """A region file of 8 rows of random bytes: (fd, its original bytes)."""
    data = random.Random(31).randbytes(8 * ROW)
    path = tmp_path / "region.mmap"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.write(fd, data)
    yield fd, data
    os.close(fd)


def _rows(fd: int, first: int, n: int) -> bytes:
    return os.pread(fd, n * ROW, first * ROW)


def _client(server: ServerThread) -> SidecarClient:
    return SidecarClient(server.path, TENANT, staging_bytes=16 * PAGE, timeout_s=20)


def _raw(server: ServerThread, revision: int = p.PROTOCOL_REVISION) -> Raw:
    r = Raw(server.path)
    reply = r.call(p.Hello(1, 1, "raw-test", (TENANT,), revision=revision))
    assert isinstance(reply, p.HelloReply)
    return r


def test_store_and_load_back_in_place_bit_exact(
    server: ServerThread, region: tuple[int, bytes]
) -> None:
    fd, data = region
    with _client(server) as c:
        rid = c.register_region(fd, 8 * ROW)
        spans = [(rid, r * ROW, LAYERS) for r in range(3)]
        keys = [key(i) for i in range(3)]
        assert c.save_in_place(NS, list(zip(keys, spans, strict=True))) == [True] * 3
        os.pwrite(fd, b"\0" * (3 * ROW), 4 * ROW)  # the rows to load into: zeroed
        dest = [(rid, (4 + i) * ROW, LAYERS) for i in range(3)]
        assert c.load_in_place(keys, dest) == [True] * 3
        assert _rows(fd, 4, 3) == data[: 3 * ROW]
        # The staging buffer was never written: no byte of it is set.
        assert c.staging is not None and not any(c.staging.view)
        inplace = c.stats()["inplace"]
        assert inplace["stored_chunks"] == 3 and inplace["loaded_chunks"] == 3
        assert inplace["loaded_bytes"] == 3 * ROW
        # And the objects are what a staging load reads back too.
        got = c.load(keys[:1])
        assert b"".join(bytes(x) for x in got[0].layers) == data[:ROW]


def test_a_flipped_or_torn_object_is_a_miss_and_nothing_of_it_is_written(
    server: ServerThread, store: Store, region: tuple[int, bytes]
) -> None:
    fd, data = region
    with _client(server) as c:
        rid = c.register_region(fd, 8 * ROW)
        keys = [key(i) for i in range(3)]
        spans = [(rid, r * ROW, LAYERS) for r in range(3)]
        assert c.save_in_place(NS, list(zip(keys, spans, strict=True))) == [True] * 3
        flip = Path(store.root) / v1.object_relpath(TENANT, keys[1])
        h = v1.decode_header(flip.read_bytes())
        raw = bytearray(flip.read_bytes())
        raw[h.layers[2].offset + 5] ^= 0x01
        flip.write_bytes(bytes(raw))
        sentinel = b"\xa5" * (3 * ROW)
        os.pwrite(fd, sentinel, 4 * ROW)
        dest = [(rid, (4 + i) * ROW, LAYERS) for i in range(3)]
        assert c.load_in_place(keys, dest) == [True, False, False]
        assert _rows(fd, 4, 1) == data[:ROW]
        assert _rows(fd, 5, 2) == sentinel[: 2 * ROW]  # not one byte of the bad chunk
        # Torn: cut short; a miss too, and the client goes on.
        torn = Path(store.root) / v1.object_relpath(TENANT, keys[2])
        with open(torn, "r+b") as f:
            f.truncate(torn.stat().st_size // 2)
        assert c.load_in_place(keys[2:], dest[2:]) == [False]
        assert _rows(fd, 6, 1) == sentinel[:ROW]
        assert c.load_in_place(keys[:1], dest[:1]) == [True]


def test_a_shape_other_than_named_is_a_miss(
    server: ServerThread, region: tuple[int, bytes]
) -> None:
    fd, _data = region
    with _client(server) as c:
        rid = c.register_region(fd, 8 * ROW)
        assert c.save_in_place(NS, [(key(0), (rid, 0, LAYERS))]) == [True]
        os.pwrite(fd, b"\x11" * ROW, 5 * ROW)
        assert c.load_in_place([key(0)], [(rid, 5 * ROW, (2 * PAGE, 2 * PAGE))]) == [False]
        assert _rows(fd, 5, 1) == b"\x11" * ROW


def _bad(reply: p.Reply, code: ErrorCode, words: str) -> None:
    assert isinstance(reply, p.ErrorReply), reply
    assert reply.code is code and words in reply.message, reply


def _alive(r: Raw) -> None:
    assert r.call(p.Lookup(TENANT, (key(9),))) == p.LookupReply(0)


def test_an_older_client_is_refused_the_verb(
    server: ServerThread, region: tuple[int, bytes]
) -> None:
    fd, _ = region
    r = _raw(server, revision=0)
    try:
        _bad(r.call(p.RegisterRegion(8 * ROW), [fd]), ErrorCode.BAD_REQUEST, "revision 17")
        _alive(r)
    finally:
        r.close()


def test_a_client_of_revision_17_keeps_the_verb_under_a_later_server(
    server: ServerThread, region: tuple[int, bytes]
) -> None:
    """The verb came with revision 17: a client that names 17 (not this code's
    later revision) may register a region."""
    fd, _ = region
    r = _raw(server, revision=17)
    try:
        reply = r.call(p.RegisterRegion(8 * ROW), [fd])
        assert isinstance(reply, p.RegisterRegionReply) and reply.region >= 1, reply
    finally:
        r.close()


def _foreign_file(tmp_path: Path) -> int:
    path = tmp_path / "foreign"
    path.write_bytes(b"\0" * ROW)
    os.chown(path, 12345, 12345)
    return os.open(path, os.O_RDWR)


@pytest.mark.parametrize(
    ("make", "size", "words"),
    [
        ("pipe", ROW, "not a regular file"),
        ("socket", ROW, "not a regular file"),
        ("readonly", ROW, "O_RDWR"),
        ("small", 16 * ROW, "announced"),
        ("foreign", ROW, "owned by uid 12345"),
        ("opath", ROW, "O_PATH"),
    ],
)
def test_a_bad_descriptor_is_refused_and_the_connection_goes_on(
    server: ServerThread, tmp_path: Path, make: str, size: int, words: str
) -> None:
    extra: list[Any] = []
    if make == "pipe":
        fd, w = os.pipe()
        extra.append(w)
    elif make == "socket":
        a, b = socket.socketpair()
        extra.append(b)
        fd = os.dup(a.fileno())
        a.close()
    elif make == "foreign":
        if os.geteuid() != 0:
            pytest.skip("a file of another uid needs root to make")
        fd = _foreign_file(tmp_path)
    else:
        path = tmp_path / "f"
        path.write_bytes(b"\0" * ROW)
        flags = {"readonly": os.O_RDONLY, "small": os.O_RDWR, "opath": os.O_PATH}[make]
        fd = os.open(path, flags)
    r = _raw(server)
    try:
        _bad(r.call(p.RegisterRegion(size), [fd]), ErrorCode.BAD_REQUEST, words)
        _alive(r)
    finally:
        os.close(fd)
        for x in extra:
            x.close() if hasattr(x, "close") else os.close(x)
        r.close()


def test_bad_ranges_and_frames_get_one_clear_error(
    server: ServerThread, region: tuple[int, bytes]
) -> None:
    fd, _ = region
    r = _raw(server)
    try:
        _bad(r.call(p.RegisterRegion(8 * ROW)), ErrorCode.BAD_REQUEST, "exactly one fd")
        reg = r.call(p.RegisterRegion(8 * ROW), [fd])
        assert isinstance(reg, p.RegisterRegionReply)
        rid = reg.region
        chunk = p.RegionChunk(key(0), LAYERS, region=rid, offset=7 * ROW + 1)
        _bad(r.call(p.RegionStore(TENANT, NS, (chunk,))), ErrorCode.BAD_REQUEST, "exceeds")
        other = p.RegionChunk(key(0), LAYERS, region=rid + 5, offset=0)
        _bad(r.call(p.RegionStore(TENANT, NS, (other,))), ErrorCode.BAD_REQUEST, "no region")
        far = p.RegionDest(rid, 8 * ROW, (1,))
        _bad(r.call(p.RegionLoad(TENANT, (key(0),), (far,))), ErrorCode.BAD_REQUEST, "exceeds")
        # Nothing was stored by the refused store.
        assert r.call(p.Lookup(TENANT, (key(0),))) == p.LookupReply(0)
        # A frame whose dests do not match its keys, and a store with descriptors.
        rid2 = r.send(p.Lookup(TENANT, (key(0),)))  # keep ids in order
        assert r.recv()[0] == rid2
        msg = p.request_message(
            r.next_id, p.RegionLoad(TENANT, (key(0), key(1)), (p.RegionDest(rid, 0, (1,)),))
        )
        r.next_id += 1
        r.t.send(msg)
        _, reply = r.recv()
        _bad(reply, ErrorCode.BAD_REQUEST, "one per key")
        good = p.RegionChunk(key(0), LAYERS, region=rid, offset=0)
        extra = os.open("/dev/null", os.O_RDONLY)
        try:
            _bad(
                r.call(p.RegionStore(TENANT, NS, (good,)), [extra]), ErrorCode.BAD_REQUEST, "no fds"
            )
        finally:
            os.close(extra)
        for _ in range(p.MAX_REGIONS - 1):
            assert isinstance(r.call(p.RegisterRegion(8 * ROW), [fd]), p.RegisterRegionReply)
        _bad(r.call(p.RegisterRegion(8 * ROW), [fd]), ErrorCode.BAD_REQUEST, "at most")
        stored = r.call(p.RegionStore(TENANT, NS, (good,)))
        assert stored == p.RegionStoreReply((True,), (0,))
    finally:
        r.close()


def test_a_truncated_region_file_is_a_chunk_not_stored(
    server: ServerThread, tmp_path: Path
) -> None:
    path = tmp_path / "shrinks"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 8 * ROW)
        r = _raw(server)
        try:
            reg = r.call(p.RegisterRegion(8 * ROW), [fd])
            assert isinstance(reg, p.RegisterRegionReply)
            os.ftruncate(fd, ROW)  # the peer shrinks its file: a short read, no signal
            chunks = (
                p.RegionChunk(key(0), LAYERS, region=reg.region, offset=0),
                p.RegionChunk(key(1), LAYERS, region=reg.region, offset=4 * ROW),
            )
            reply = r.call(p.RegionStore(TENANT, NS, chunks))
            assert reply == p.RegionStoreReply((True, False), (0, int(ErrorCode.BAD_REQUEST)))
            _alive(r)
        finally:
            r.close()
    finally:
        os.close(fd)


def test_against_a_server_without_revision_17_the_client_answers_none(
    server: ServerThread, region: tuple[int, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(session_mod, "MAX_REGION_BYTES", 0)  # hello announces no max_region
    fd, _ = region
    with _client(server) as c:
        rid = c.register_region(fd, 8 * ROW)
        assert c.save_in_place(NS, [(key(0), (rid, 0, LAYERS))]) is None
        assert c.load_in_place([key(0)], [(rid, 0, LAYERS)]) is None
        assert c.lookup([key(0)]) == 0  # nothing was stored, the connection is fine
