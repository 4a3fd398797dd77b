"""A connection's write side (connection.py): replies queued in order, written as
the socket takes them, with the descriptors a ``sealed_load`` reply carries
(protocol-v1.md §3.3, §5.33) sent with that frame's first byte."""

from __future__ import annotations

import array
import asyncio
import collections
import socket
from collections.abc import Callable

from ..protocol import close_fds


class Outbox:
    """Bytes not yet taken by the kernel, in order, and who waits for them.

    ``on_pressure`` is called whenever the queue crosses a mark or the socket
    breaks: the connection re-decides whether to read."""

    def __init__(
        self, sock: socket.socket, high: int, low: int, on_pressure: Callable[[], None]
    ) -> None:
        self.sock = sock
        self._fd = sock.fileno()
        self._high, self._low = high, low
        self._on_pressure = on_pressure
        self.loop: asyncio.AbstractEventLoop | None = None
        self.wbuf: collections.deque[memoryview] = collections.deque()
        self.queued = 0  # bytes in wbuf
        self.total = 0  # bytes ever accepted by write
        self.done = 0  # bytes ever written to the socket
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()
        self.failed: OSError | None = None
        #: Descriptors to pass with the frame that starts at a byte count (a
        #: sealed_load reply, §5.33): sent with that frame's first byte, then closed.
        self._fds_at: dict[int, list[int]] = {}
        self._writing = False

    def write(self, data: bytes) -> None:
        """Queue ``data`` behind every earlier frame; written at once when nothing
        waits before it. A broken socket drops it (the reader sees the end)."""
        if self.failed is not None:
            return
        n = len(data)
        self.total += n
        if not self.wbuf:
            try:
                sent = self._send(data) if self._fds_at else self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self._write_failed(exc)
                return
            self.done += sent
            if sent == n:
                return
            self.wbuf.append(memoryview(data)[sent:])
            self.queued += n - sent
            self.set_writing(True)
        else:
            self.wbuf.append(memoryview(data))
            self.queued += n
        if self.queued > self._high:
            self._on_pressure()

    def _on_writable(self) -> None:
        while self.wbuf:
            head = self.wbuf[0]
            try:
                sent = self._send(head) if self._fds_at else self.sock.send(head)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._write_failed(exc)
                return
            self.done += sent
            self.queued -= sent
            if sent < len(head):
                self.wbuf[0] = head[sent:]
                break
            self.wbuf.popleft()
        if not self.wbuf:
            self.set_writing(False)
        while self._waiters and self._waiters[0][0] <= self.done:
            fut = self._waiters.popleft()[1]
            if not fut.done():
                fut.set_result(None)
        if self.queued <= self._low:
            self._on_pressure()

    def _send(self, data: bytes | memoryview) -> int:
        """``send``, or ``sendmsg`` with the descriptors of the frame starting here."""
        fds = self._fds_at.get(self.done)
        if fds is None:
            return self.sock.send(data)
        sent = self.sock.sendmsg(
            [data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        )
        del self._fds_at[self.done]  # in the peer now (they travel with the first byte)
        close_fds(fds)
        return sent

    def write_with_fds(self, data: bytes, fds: list[int]) -> None:
        """:meth:`_write` of a frame whose first byte carries ``fds`` (owned from now on)."""
        if self.failed is not None:
            close_fds(fds)
            return
        self._fds_at[self.total] = fds
        self.write(data)

    def drop_fds(self) -> None:
        for fds in self._fds_at.values():
            close_fds(fds)
        self._fds_at.clear()

    def _write_failed(self, exc: OSError) -> None:
        self.drop_fds()
        self.failed = exc
        self.wbuf.clear()
        self.queued = 0
        self.set_writing(False)
        while self._waiters:
            fut = self._waiters.popleft()[1]
            if not fut.done():
                fut.set_exception(exc)
        self._on_pressure()

    def forget_writer(self) -> None:
        """The connection removed the socket from the loop itself (at teardown)."""
        self._writing = False

    def set_writing(self, on: bool) -> None:
        if on == self._writing or self.loop is None:
            return
        self._writing = on
        if on:
            self.loop.add_writer(self._fd, self._on_writable)
        else:
            self.loop.remove_writer(self._fd)

    async def send(self, data: bytes) -> None:
        """Queue ``data`` in order and return once the kernel has all of it;
        OSError if the socket broke first."""
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        self.write(data)
        await self.flushed(self.total)

    async def flushed(self, mark: int) -> None:
        if self.failed is not None:
            raise self.failed
        if self.done >= mark:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((mark, fut))
        await fut
