"""A real sidecar Server on its own event loop in a thread, and a raw frame client.

For tests that need exact frames against the real server and a real Store
(tests/sidecar/test_lookup_load.py). Not a test module: nothing here is
collected.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvoffload import protocol as p
from kvoffload.sidecar.access.policy import Grant, Policy
from kvoffload.sidecar.config import ServerConfig
from kvoffload.sidecar.metrics import Metrics
from kvoffload.sidecar.server import Server
from kvoffload.staging import PAGE, StagingBuffer
from kvoffload.transport import UnixTransport

SECRET = b"\x5b" * 32


def grants(*tenants: str) -> Policy:
    return Policy(grants=[Grant("uid", os.getuid(), frozenset(tenants))])


class ServerThread:
    """A Server on its own event loop in a background thread; ``stop()`` drains it."""

    def __init__(
        self, sock_dir: Path, store: Any, policy: Policy, metrics: Metrics | None = None, **cfg: Any
    ) -> None:
        cfg = {"secret": SECRET, "workers": 4, **cfg}
        self.path = sock_dir / "kvo.sock"
        self.server = Server(store, policy, ServerConfig(socket_path=self.path, **cfg), metrics)
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()
        assert self._ready.wait(20)
        if self._error is not None:
            self.thread.join(20)
            self.loop.close()
            raise self._error

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.start())
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_until_complete(self.server.serve_forever())

    def stop(self) -> None:
        if self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.server.shutdown(), self.loop).result(30)
            self.thread.join(30)
        self.loop.close()


class Raw:
    """A hand-driven protocol client: exact frames, replies matched by id."""

    def __init__(self, path: Path) -> None:
        self.t = UnixTransport.connect(path, timeout_s=20)
        self.next_id = 1

    def send(self, req: p.Request, fds: Sequence[int] = ()) -> int:
        rid = self.next_id
        self.next_id += 1
        self.t.send(p.request_message(rid, req), fds)
        return rid

    def recv(self) -> tuple[int, p.Reply]:
        return p.parse_reply(self.t.recv().msg)

    def call(self, req: p.Request, fds: Sequence[int] = ()) -> p.Reply:
        rid = self.send(req, fds)
        got, reply = self.recv()
        assert got == rid
        return reply

    def hello(self, *tenants: str) -> p.HelloReply:
        reply = self.call(p.Hello(1, 1, "raw-test", tenants))
        assert isinstance(reply, p.HelloReply)
        return reply

    def register(self, size: int = 64 * PAGE) -> StagingBuffer:
        buf = StagingBuffer(size)
        assert self.call(p.RegisterStaging(size), [buf.fd]) == p.Ack(p.Op.REGISTER_STAGING)
        return buf

    def close(self) -> None:
        self.t.close()
