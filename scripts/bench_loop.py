"""The sidecar's connection loop design, measured (issue 30, lever 2).

One request/reply round trip of a 64-key ``lookup`` frame (and its reply)
over a Unix socket, against a server process that decodes the frame and
encodes the reply (msgpack, the same work in each) and differs only in its
loop:

``add_reader``
    what ``sidecar/connection.py`` does: the socket registered with the
    asyncio loop for the connection's life, one ``recvmsg_into`` into a
    preallocated buffer per readable event, frames decoded and answered from
    the callback itself, the reply written straight to the socket.
``Protocol``
    an ``asyncio.Protocol``: ``data_received`` with its own frame buffer,
    ``transport.write``.
``thread``
    a thread per connection: blocking ``recv_into`` and ``sendall``.
``echo``
    the floor: the same bytes echoed by a blocking thread, no decode.

Printed: p50/p99/mean µs per round trip and the ratio to ``add_reader``.
Interleaved: each round sends one request to each server in turn. Usage::

    .venv/bin/python scripts/bench_loop.py [--n 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgpack

KEYS = [bytes([i]) * 32 for i in range(64)]
REQUEST: bytes = msgpack.packb({"op": "lookup", "id": 1, "tenant": "acme", "keys": KEYS})
FRAME = struct.pack("<I", len(REQUEST)) + REQUEST


def _reply(body: bytes) -> bytes:
    msg = msgpack.unpackb(body)
    out = bytes(
        msgpack.packb({"op": msg["op"], "id": msg["id"], "code": 0, "found": len(msg["keys"])})
    )
    return struct.pack("<I", len(out)) + out


def _frames(buf: bytearray) -> list[bytes]:
    """Whole frames taken off the front of ``buf``."""
    out = []
    while len(buf) >= 4:
        (n,) = struct.unpack_from("<I", buf)
        if len(buf) < 4 + n:
            break
        out.append(bytes(buf[4 : 4 + n]))
        del buf[: 4 + n]
    return out


def serve_add_reader(path: str) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        lsock.bind(path)
        lsock.listen()
        conn, _ = await loop.sock_accept(lsock)
        conn.setblocking(False)
        rbuf = bytearray(256 << 10)
        pending = bytearray()
        done = loop.create_future()

        def readable() -> None:
            n, _anc, _fl, _ = conn.recvmsg_into([rbuf], 0)
            if not n:
                loop.remove_reader(conn.fileno())
                done.set_result(None)
                return
            pending.extend(memoryview(rbuf)[:n])
            for body in _frames(pending):
                conn.send(_reply(body))

        loop.add_reader(conn.fileno(), readable)
        await done

    asyncio.run(main())


def serve_protocol(path: str) -> None:
    class P(asyncio.Protocol):
        def __init__(self, done: asyncio.Future[None]) -> None:
            self.buf = bytearray()
            self.done = done

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport)
            self.t = transport

        def data_received(self, data: bytes) -> None:
            self.buf.extend(data)
            for body in _frames(self.buf):
                self.t.write(_reply(body))

        def connection_lost(self, exc: Exception | None) -> None:
            self.done.set_result(None)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        server = await loop.create_unix_server(lambda: P(done), path)
        await done
        server.close()

    asyncio.run(main())


def _threaded(path: str, work: Callable[[bytes], bytes]) -> None:
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(path)
    lsock.listen()
    conn, _ = lsock.accept()

    def run() -> None:
        rbuf = bytearray(256 << 10)
        pending = bytearray()
        while True:
            n = conn.recv_into(rbuf)
            if not n:
                return
            pending.extend(memoryview(rbuf)[:n])
            for body in _frames(pending):
                conn.sendall(work(body))

    t = threading.Thread(target=run)
    t.start()
    t.join()


def serve_thread(path: str) -> None:
    _threaded(path, _reply)


def serve_echo(path: str) -> None:
    reply = _reply(REQUEST)
    _threaded(path, lambda _b: reply)


SERVERS: dict[str, Callable[[str], None]] = {
    "add_reader": serve_add_reader,
    "Protocol": serve_protocol,
    "thread": serve_thread,
    "echo": serve_echo,
}


def _connect(path: str) -> socket.socket:
    for _ in range(500):
        if os.path.exists(path):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(path)
                return s
            except (ConnectionRefusedError, FileNotFoundError):
                s.close()
        time.sleep(0.01)
    raise RuntimeError(f"no server at {path}")


def _round_trip(s: socket.socket, rbuf: bytearray) -> None:
    s.sendall(FRAME)
    got = 0
    need = 4
    while got < need:
        n = s.recv_into(memoryview(rbuf)[got:])
        if not n:
            raise RuntimeError("server closed")
        got += n
        if got >= 4:
            need = 4 + struct.unpack_from("<I", rbuf)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--n", type=int, default=5000, help="round trips per loop")
    a = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="kvo-loop-", dir="/tmp"))
    ctx = mp.get_context("spawn")
    procs, socks = {}, {}
    try:
        for name, fn in SERVERS.items():
            path = str(d / f"{name}.sock")
            procs[name] = ctx.Process(target=fn, args=(path,), daemon=True)
            procs[name].start()
            socks[name] = _connect(path)
        rbuf = bytearray(1 << 16)
        times: dict[str, list[float]] = {k: [] for k in SERVERS}
        for i in range(a.n + 100):
            for name, s in socks.items():
                t = time.perf_counter()
                _round_trip(s, rbuf)
                if i >= 100:  # warm-up dropped
                    times[name].append(time.perf_counter() - t)
        base = statistics.median(times["add_reader"])
        print(f"round trip of a 64-key lookup frame ({len(FRAME)} B), {a.n} each, interleaved")
        print(
            f"{'loop':12s} {'p50 us':>8s} {'p99 us':>8s} {'mean us':>8s} {'x add_reader p50':>17s}"
        )
        for name, ts in times.items():
            ts.sort()
            p50, p99 = statistics.median(ts), ts[int(len(ts) * 0.99)]
            print(
                f"{name:12s} {p50 * 1e6:8.1f} {p99 * 1e6:8.1f} {statistics.fmean(ts) * 1e6:8.1f} "
                f"{base / p50:16.2f}x"
            )
    finally:
        for s in socks.values():
            s.close()
        for p in procs.values():
            p.join(5)
            if p.is_alive():
                p.kill()
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
