"""Helpers shared by the tests (moved out of test_server.py)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvoffload import protocol as p
from kvoffload.sidecar.access.policy import Grant, Policy
from kvoffload.sidecar.config import ServerConfig
from kvoffload.sidecar.server import Server
from kvoffload.staging import PAGE, StagingBuffer
from kvoffload.testing.fakestore import FakeStore as BaseFakeStore
from kvoffload.transport import UnixTransport

NS = b"\x22" * 32


SECRET = b"\x5a" * 32


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def wait_until(cond: Callable[[], bool], what: str) -> None:
    """Synchronise with the server's threads (not a timing assertion)."""
    deadline = time.monotonic() + 20
    while not cond():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


class FakeStore(BaseFakeStore):
    """The store port's in-memory double, with a lookup a test can hold (``slow_key``)."""

    def __init__(self, capacity: int | None = None) -> None:
        super().__init__(capacity)
        self.slow_key: bytes | None = None
        self.release_slow = threading.Event()

    def lookup(self, tenant: str, keys: Sequence[bytes]) -> int:
        if self.slow_key in keys:
            assert self.release_slow.wait(20)
        return super().lookup(tenant, keys)


def grants(*tenants: str, admin: bool = False) -> Policy:
    return Policy(grants=[Grant("uid", os.getuid(), frozenset(tenants), admin=admin)])


class ServerThread:
    """A Server on its own event loop in a background thread."""

    def __init__(self, store: Any, policy: Policy, config: ServerConfig) -> None:
        self.server = Server(store, policy, config)
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()
        assert self._ready.wait(20)
        if self._error is not None:
            self.thread.join(20)
            self.loop.close()  # a loop left open is a ResourceWarning, an error here
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


def start(sock_dir: Path, store: Any, policy: Policy | None = None, **cfg: Any) -> ServerThread:
    cfg = {"secret": SECRET, "workers": 4, **cfg}
    config = ServerConfig(socket_path=sock_dir / "kvo.sock", **cfg)
    return ServerThread(store, policy or grants("acme"), config)


def sock_path(st: ServerThread) -> Path:
    path = st.server.config.socket_path
    assert path is not None
    return path


class Raw:
    """A hand-driven protocol client for tests that need exact frames."""

    def __init__(self, st: ServerThread) -> None:
        self.t = UnixTransport.connect(sock_path(st), timeout_s=20)
        self.next_id = 1

    def call(self, req: p.Request, fds: Sequence[int] = ()) -> p.Reply:
        rid = self.next_id
        self.next_id += 1
        self.t.send(p.request_message(rid, req), fds)
        got, reply = p.parse_reply(self.t.recv().msg)
        assert got == rid
        return reply

    def hello(self, *tenants: str) -> p.HelloReply:
        reply = self.call(p.Hello(1, 1, "raw-test", tenants or ("acme",)))
        assert isinstance(reply, p.HelloReply)
        return reply

    def register(self, size: int = 16 * PAGE) -> StagingBuffer:
        buf = StagingBuffer(size)
        assert self.call(p.RegisterStaging(size), [buf.fd]) == p.Ack(p.Op.REGISTER_STAGING)
        return buf

    def close(self) -> None:
        self.t.close()
