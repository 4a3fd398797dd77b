"""The connection's frame loop (sidecar/connection.py) over a real Unix socket.

What the persistent reader, the direct-write fast path with its queue, and
the pool's completion queue must keep: frames however the bytes are split or
glued, descriptors with the frame that declared them, whole replies in order
to a client that reads slowly, and the daemon serving others whatever one
client does. ``FakeStore`` (test_server.py) is the in-memory test double of
the store API; sockets, descriptors, threads and the event loop are real.
"""

from __future__ import annotations

import array
import functools
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvoffload import protocol as p
from kvoffload.protocol import CLIENT_MAGIC, SERVER_MAGIC, ErrorCode
from kvoffload.sidecar import connection
from kvoffload.sidecar.connection import Connection
from kvoffload.staging import PAGE, StagingBuffer
from tests.helpers.server import NS, FakeStore, Raw, ServerThread, key, sock_path, start, wait_until

#: Larger than a Unix socket's send buffer (about 208 KiB by default), below MAX_FRAME.
BLOB = 900_000


class BigStatsStore(FakeStore):
    """FakeStore whose stats make a reply of about ``BLOB`` bytes, and whose
    lookups of present keys are answered on the loop (misses on the pool)."""

    def lookup_cached(self, tenant: str, keys: Sequence[bytes]) -> int | None:
        n = self.lookup(tenant, keys)
        return n if n == len(keys) else None

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "blob": "x" * BLOB}


@pytest.fixture
def big_store() -> BigStatsStore:
    s = BigStatsStore()
    s.data[("acme", key(1))] = [b"a" * 10]
    s.data[("acme", key(2))] = [b"b" * 10]
    return s


@pytest.fixture
def server(big_store: BigStatsStore) -> Iterator[ServerThread]:
    d = Path(tempfile.mkdtemp(prefix="kvo-", dir="/tmp"))  # AF_UNIX: a short path
    st = start(d, big_store)
    yield st
    st.stop()
    shutil.rmtree(d, ignore_errors=True)


class Wire:
    """Raw bytes on a socket: frames out, replies in (a 20 s guard against a hang)."""

    def __init__(self, st: ServerThread) -> None:
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.connect(os.fspath(sock_path(st)))
        self.s.settimeout(20)
        self.dec = p.FrameDecoder(expect_magic=SERVER_MAGIC)
        self.ready: list[p.Frame] = []

    @staticmethod
    def frame(rid: int, req: p.Request) -> bytes:
        return p.encode_frame(p.request_message(rid, req))

    def replies(self, n: int) -> list[tuple[int, Any]]:
        while len(self.ready) < n:
            data = self.s.recv(1 << 20)
            assert data, f"closed after {len(self.ready)} of {n} replies"
            self.ready += self.dec.feed(data)
        out, self.ready = self.ready[:n], self.ready[n:]
        return [p.parse_reply(f.msg) for f in out]

    def closed(self) -> bool:
        """True once the server closed (what it sent before is kept in ``ready``)."""
        while data := self.s.recv(1 << 20):
            self.ready += self.dec.feed(data)
        return True

    def close(self) -> None:
        self.s.close()


def hello(w: Wire) -> None:
    w.s.sendall(CLIENT_MAGIC + w.frame(1, p.Hello(1, 1, "loop-test", ("acme",))))
    [(rid, reply)] = w.replies(1)
    assert rid == 1 and isinstance(reply, p.HelloReply)


def _has_read(conn: Connection, n: int) -> bool:
    """The server's decoder holds the ``n`` bytes sent so far (or the whole frame is done)."""
    return conn.decoder.buffered in (0, n)


def the_connection(st: ServerThread) -> Connection:
    wait_until(lambda: len(st.server.connections) == 1, "one connection")
    return next(iter(st.server.connections))


def test_many_pipelined_requests_in_one_write_are_all_answered(server: ServerThread) -> None:
    w = Wire(server)
    hello(w)
    n = 3000
    reqs: dict[int, p.Request] = {}
    for rid in range(2, n + 2):
        # Inline lookups, with a partial one (the pool's path) and a pool verb
        # now and then: fewer than max_inflight on the pool at once.
        reqs[rid] = (
            p.Stats()
            if rid % 500 == 0
            else p.Lookup("acme", (key(1), key(2), key(3)))
            if rid % 100 == 0
            else p.Lookup("acme", (key(1), key(2))[: rid % 2 + 1])
        )
    w.s.sendall(b"".join(w.frame(rid, r) for rid, r in reqs.items()))
    got = dict(w.replies(n))
    assert sorted(got) == sorted(reqs)
    for rid, req in reqs.items():
        if isinstance(req, p.Lookup):
            assert got[rid] == p.LookupReply(min(len(req.keys), 2)), rid
        else:
            assert isinstance(got[rid], p.StatsReply)
    w.close()


def test_frames_split_byte_by_byte_and_an_fd_with_the_first_byte(
    server: ServerThread, big_store: BigStatsStore
) -> None:
    w = Wire(server)
    data = CLIENT_MAGIC + w.frame(1, p.Hello(1, 1, "loop-test", ("acme",)))
    for b in data:
        w.s.sendall(bytes([b]))
    assert isinstance(w.replies(1)[0][1], p.HelloReply)
    buf = StagingBuffer(16 * PAGE)
    reg = p.encode_frame(p.with_fds(p.request_message(2, p.RegisterStaging(16 * PAGE)), 1))
    conn = the_connection(server)
    # The descriptor travels with the frame's first byte; every other byte alone.
    socket.send_fds(w.s, [reg[:1]], [buf.fd])
    for i in range(1, len(reg)):
        w.s.sendall(reg[i : i + 1])
        wait_until(functools.partial(_has_read, conn, i + 1), "byte read")
    assert w.replies(1) == [(2, p.Ack(p.Op.REGISTER_STAGING))]
    # The registered buffer works: a save through it lands in the store.
    buf.view[:5] = b"hello"
    w.s.sendall(w.frame(3, p.StoreBatch("acme", NS, (p.StoreChunk(key(7), (5,), offset=0),))))
    [(rid, reply)] = w.replies(1)
    assert rid == 3 and isinstance(reply, p.StoreReply), reply
    assert big_store.data[("acme", key(7))] == [b"hello"]
    w.close()
    buf.close()


def test_a_reply_larger_than_the_socket_buffer_stays_whole_and_ahead_of_later_replies(
    server: ServerThread,
) -> None:
    w = Wire(server)
    hello(w)
    conn = the_connection(server)
    w.s.sendall(w.frame(2, p.Stats()))
    # The client reads nothing yet: the rest of the reply waits in the server's queue.
    wait_until(lambda: conn.out.queued > 0, "stats reply partly written")
    # Then it reads slowly, a lookup after each small read: each lookup's reply
    # must wait behind the rest of the stats reply, even when the socket has
    # room for it at that moment.
    n = 100
    for i in range(n):
        w.ready += w.dec.feed(w.s.recv(4096))
        w.s.sendall(w.frame(3 + i, p.Lookup("acme", (key(1),))))
    # Another client is served meanwhile.
    other = Raw(server)
    other.hello()
    assert other.call(p.Lookup("acme", (key(1), key(2)))) == p.LookupReply(2)
    other.close()
    got = w.replies(n + 1)
    assert [rid for rid, _ in got] == list(range(2, n + 3))  # in the order queued, whole
    stats = got[0][1]
    assert isinstance(stats, p.StatsReply) and stats.stats["blob"] == "x" * BLOB
    assert all(reply == p.LookupReply(1) for _, reply in got[1:])
    w.close()


def test_a_client_that_never_reads_pauses_reading_and_everything_is_answered_once_it_does(
    server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connection, "WRITE_HIGH", 2 * BLOB)
    monkeypatch.setattr(connection, "WRITE_LOW", BLOB // 2)
    w = Wire(server)
    hello(w)
    conn = the_connection(server)
    n = 8
    w.s.sendall(b"".join(w.frame(rid, p.Stats()) for rid in range(2, n + 2)))
    wait_until(lambda: not conn._reading, "reading paused behind unread replies")
    # Bounded: what is queued is at most the replies of the requests read
    # before the pause, not all eight.
    w.s.sendall(w.frame(n + 2, p.Lookup("acme", (key(2),))))
    got = dict(w.replies(n + 1))
    assert sorted(got) == list(range(2, n + 3))
    assert got[n + 2] == p.LookupReply(1)
    assert all(isinstance(got[r], p.StatsReply) for r in range(2, n + 2))
    w.close()


def test_a_client_that_vanishes_mid_reply_leaves_the_daemon_serving_others(
    server: ServerThread,
) -> None:
    for _ in range(3):
        w = Wire(server)
        hello(w)
        the_connection(server)
        w.s.sendall(w.frame(2, p.Stats()) + w.frame(3, p.Stats()))
        wait_until(lambda: the_connection(server).out.queued > 0, "reply partly written")
        w.s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
        w.close()
        wait_until(lambda: not server.server.connections, "connection torn down")
    r = Raw(server)
    r.hello()
    assert r.call(p.Lookup("acme", (key(1),))) == p.LookupReply(1)
    assert isinstance(r.call(p.Stats()), p.StatsReply)
    r.close()


def test_clients_gone_before_the_magic_leave_their_descriptor_numbers_usable(
    server: ServerThread,
) -> None:
    """A socket whose peer left before it was accepted fails its first write;
    its descriptor must leave the loop before it is closed, or the next socket
    given the same number is never read."""
    gate = threading.Event()
    server.loop.call_soon_threadsafe(gate.wait, 20)  # holds the loop: nothing accepted
    for _ in range(10):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(os.fspath(sock_path(server)))
    gate.set()
    wait_until(lambda: not server.server.connections, "the ten accepted and closed")
    for _ in range(5):
        r = Raw(server)
        r.hello()
        assert r.call(p.Lookup("acme", (key(1), key(2)))) == p.LookupReply(2)
        r.close()


def test_too_many_descriptors_in_one_message_are_refused_and_closed(
    server: ServerThread,
) -> None:
    w = Wire(server)
    hello(w)
    before = len(os.listdir("/proc/self/fd"))
    fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(p.MAX_FDS + 3)]
    reg = p.encode_frame(p.with_fds(p.request_message(2, p.RegisterStaging(PAGE)), 1))
    w.s.sendmsg([reg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())])
    for fd in fds:
        os.close(fd)
    assert w.closed()
    [(_rid, reply)] = [p.parse_reply(f.msg) for f in w.ready]
    assert isinstance(reply, p.ErrorReply) and reply.code is ErrorCode.BAD_REQUEST
    wait_until(lambda: not server.server.connections, "connection torn down")
    w.close()
    # Every descriptor the server received was closed (this process is the server).
    wait_until(lambda: len(os.listdir("/proc/self/fd")) <= before - 1, "descriptors closed")


def test_completions_of_many_connections_at_once_each_reach_their_own(
    server: ServerThread,
) -> None:
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            w = Wire(server)
            hello(w)
            for round_ in range(5):
                # Pool verbs (fewer than max_inflight) and inline lookups pipelined,
                # from eight clients at once.
                base = 2 + 100 * round_
                reqs: dict[int, p.Request] = {
                    rid: p.Touch("acme", (key(1),)) if rid % 2 else p.Lookup("acme", (key(1),))
                    for rid in range(base, base + 100)
                }
                w.s.sendall(b"".join(w.frame(r, q) for r, q in reqs.items()))
                got = dict(w.replies(len(reqs)))
                assert sorted(got) == sorted(reqs)
                for rid, req in reqs.items():
                    want = p.Ack(p.Op.TOUCH) if isinstance(req, p.Touch) else p.LookupReply(1)
                    assert got[rid] == want, (rid, got[rid])
            w.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]
