"""Byte transports that carry protocol frames (and descriptors) between two peers.

    TransportError            the connection cannot be used (any I/O failure)
    ├── TransportClosed       the peer closed or reset it, or it was closed here
    └── TransportTimeout      no frame within the timeout

:class:`UnixTransport` is the real one (a Unix stream socket, descriptors as
``SCM_RIGHTS``). :class:`MemoryTransport` is an in-memory pair for tests that
runs the same framing code, so a test exercises every encoding and decoding
rule without a socket. Neither is thread-safe: one thread uses one end.

Peer garbage surfaces as :class:`kvoffload.protocol.ProtocolError`, not as a
TransportError: it means a broken peer, not a broken pipe.
"""

from __future__ import annotations

import array
import collections
import math
import os
import queue
import select
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final, Protocol

from kvoffload.errors import TransportClosed, TransportError, TransportTimeout

from .protocol import (
    CLIENT_MAGIC,
    MAX_FDS,
    MAX_FRAME,
    MAX_REPLY_FDS,
    SERVER_MAGIC,
    ErrorCode,
    Frame,
    FrameDecoder,
    ProtocolError,
    close_fds,
    encode_frame,
    with_fds,
)

#: Room for one more than a frame may declare, so that a peer sending too
#: many is told so by the decoder instead of having them truncated silently.
MAX_FDS_PER_RECV = MAX_FDS + 1
RECV_SIZE = 256 * 1024
DEFAULT_TIMEOUT_S = 10.0
# Plain ints: a flag enum's ``|`` and ``&`` cost a call each.
_MSG_NOSIGNAL = int(socket.MSG_NOSIGNAL)
_MSG_SEND_NOW = int(socket.MSG_NOSIGNAL | socket.MSG_DONTWAIT)
_MSG_RECV = int(socket.MSG_CMSG_CLOEXEC)
_MSG_RECV_NOW = int(socket.MSG_CMSG_CLOEXEC | socket.MSG_DONTWAIT)
_MSG_CTRUNC = int(socket.MSG_CTRUNC)
_POLLIN = int(select.POLLIN)


class Transport(Protocol):
    """A framed, descriptor-capable, bidirectional message channel."""

    def send(self, msg: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
        """Send one frame; ``fds`` are duplicated into the peer (still owned by the caller)."""
        ...

    def recv(self, timeout_s: float | None = None) -> Frame:
        """The next frame; its ``fds`` are owned by the caller. ``None`` = the default timeout."""
        ...

    def close(self) -> None: ...

    @property
    def closed(self) -> bool: ...


class UnixTransport:
    """A connected ``AF_UNIX``/``SOCK_STREAM`` socket speaking the framed protocol.

    The constructor sends this side's magic at once (protocol-v1.md §3.1) and
    expects the peer's before the first frame.

    The socket stays in blocking mode, and the timeout is applied here: a
    socket with a Python timeout polls before every send as well as every
    receive, and toggles its mode on every change of timeout. A frame goes
    out in one non-blocking ``send``; only one that does not fit the socket's
    buffer at once (or that carries descriptors) waits, under the timeout as a
    deadline for the whole frame. A receive polls (a deadline that signals do
    not extend) and then reads without blocking.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        send_magic: bytes,
        expect_magic: bytes,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        max_frame: int = MAX_FRAME,
    ) -> None:
        self._sock = sock
        self._timeout_s = timeout_s
        self._max_frame = max_frame
        # A server's frames may carry a sealed_load reply's descriptors (§5.33).
        max_fds = MAX_REPLY_FDS if expect_magic == SERVER_MAGIC else MAX_FDS
        self._decoder = FrameDecoder(
            expect_magic=expect_magic, max_frame=max_frame, max_fds=max_fds
        )
        self._ancillary = socket.CMSG_LEN((max_fds + 1) * array.array("i").itemsize)
        self._ready: collections.deque[Frame] = collections.deque()
        self._closed = False
        self._rbuf = bytearray(RECV_SIZE)
        sock.settimeout(None)
        self._poll = select.poll()
        self._poll.register(sock.fileno(), _POLLIN)
        self._send_bytes(send_magic, ())

    @classmethod
    def connect(
        cls, path: str | os.PathLike[str], *, timeout_s: float | None = DEFAULT_TIMEOUT_S
    ) -> UnixTransport:
        """Client side: connect to the sidecar's socket."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(os.fspath(path))
        except TimeoutError as exc:
            sock.close()
            raise TransportTimeout(f"connecting to {os.fspath(path)!r} timed out") from exc
        except OSError as exc:
            sock.close()
            raise TransportError(f"cannot connect to {os.fspath(path)!r}: {exc}") from exc
        return cls(sock, send_magic=CLIENT_MAGIC, expect_magic=SERVER_MAGIC, timeout_s=timeout_s)

    @classmethod
    def accept(cls, sock: socket.socket, *, timeout_s: float | None = None) -> UnixTransport:
        """Server side of an accepted (blocking) connection."""
        return cls(sock, send_magic=SERVER_MAGIC, expect_magic=CLIENT_MAGIC, timeout_s=timeout_s)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def socket(self) -> socket.socket:
        return self._sock

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed("transport is closed")

    def _send_bytes(self, data: bytes, fds: Sequence[int]) -> None:
        # MSG_NOSIGNAL: a host process that restored the default SIGPIPE action
        # (some engines do) must get EPIPE from a dead sidecar, not die of it.
        try:
            sent = 0
            if not fds:
                try:
                    sent = self._sock.send(data, _MSG_SEND_NOW)
                except BlockingIOError:
                    sent = 0
                if sent == len(data):
                    return
            # The waiting path (a Python timeout: a deadline for the rest of
            # the frame): descriptors, or a frame the buffer did not take at once.
            self._sock.settimeout(self._timeout_s)
            try:
                if fds:
                    sent = socket.send_fds(self._sock, [data], list(fds), _MSG_NOSIGNAL)
                if sent < len(data):
                    self._sock.sendall(memoryview(data)[sent:], _MSG_NOSIGNAL)
            finally:
                self._sock.settimeout(None)
        except TimeoutError as exc:
            # Part of a frame may be out: the stream can no longer be trusted.
            self.close()
            raise TransportTimeout("send timed out") from exc
        except OSError as exc:
            self.close()
            raise TransportClosed(f"send failed: {exc}") from exc

    def send(self, msg: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
        self._check_open()
        self._send_bytes(encode_frame(with_fds(msg, len(fds)), self._max_frame), fds)

    def recv(self, timeout_s: float | None = None) -> Frame:
        self._check_open()
        timeout = self._timeout_s if timeout_s is None else timeout_s
        while not self._ready:
            self._receive_some(timeout)
        return self._ready.popleft()

    def _wait_readable(self, timeout_s: float) -> None:
        """Until the socket is readable; TransportTimeout after ``timeout_s``.
        ``poll`` resumes after a signal with the time left, as a socket timeout did."""
        ms = max(0, math.ceil(timeout_s * 1000))
        try:
            ready = self._poll.poll(ms)
        except OSError as exc:
            self.close()
            raise TransportClosed(f"receive failed: {exc}") from exc
        if not ready:
            # The decoder keeps any partial frame, so the stream stays usable.
            raise TransportTimeout("no reply within the timeout")

    def _receive_some(self, timeout_s: float | None) -> None:
        deadline = None
        while True:
            if timeout_s is not None:
                if deadline is None:
                    deadline = time.monotonic() + timeout_s
                self._wait_readable(deadline - time.monotonic())
            try:
                n, ancdata, flags, _ = self._sock.recvmsg_into(
                    [self._rbuf], self._ancillary, _MSG_RECV if timeout_s is None else _MSG_RECV_NOW
                )
                break
            except BlockingIOError:
                continue  # readable, then not: wait again for the time left
            except OSError as exc:
                self.close()
                raise TransportClosed(f"receive failed: {exc}") from exc
        fds: list[int] = []
        for level, kind, cdata in ancdata:  # empty unless the peer sent descriptors
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(cdata[: len(cdata) - len(cdata) % got.itemsize])
                fds.extend(got)
        if flags & _MSG_CTRUNC:
            close_fds(fds)
            self.close()
            raise ProtocolError(ErrorCode.BAD_REQUEST, "peer sent too many descriptors")
        if not n:
            close_fds(fds)
            self.close()
            raise TransportClosed("connection closed by peer")
        try:
            self._ready.extend(self._decoder.feed(memoryview(self._rbuf)[:n], fds))
        except ProtocolError:
            self.close()
            raise

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._decoder.close()
        while self._ready:
            close_fds(self._ready.popleft().fds)
        self._sock.close()


class _Eof:
    pass


_EOF: Final = _Eof()


class MemoryTransport:
    """In-memory test transport: one end of a queue-backed pair built by :meth:`pair`.

    Frames are really encoded and decoded. Descriptors are passed as ints and
    duplicated on send, as ``SCM_RIGHTS`` would, so the receiver owns what it
    gets and may close it.
    """

    def __init__(
        self,
        send_magic: bytes,
        expect_magic: bytes,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
    ) -> None:
        self._inbox: queue.Queue[tuple[bytes, list[int]] | _Eof] = queue.Queue()
        self._peer: MemoryTransport | None = None
        max_fds = MAX_REPLY_FDS if expect_magic == SERVER_MAGIC else MAX_FDS
        self._decoder = FrameDecoder(expect_magic=expect_magic, max_fds=max_fds)
        self._ready: collections.deque[Frame] = collections.deque()
        self._send_magic = send_magic
        self._timeout_s = timeout_s
        self._closed = False
        self._eof = False

    @classmethod
    def pair(
        cls, *, timeout_s: float | None = DEFAULT_TIMEOUT_S
    ) -> tuple[MemoryTransport, MemoryTransport]:
        """(client end, server end), each having sent its magic."""
        client = cls(CLIENT_MAGIC, SERVER_MAGIC, timeout_s)
        server = cls(SERVER_MAGIC, CLIENT_MAGIC, timeout_s)
        client._peer, server._peer = server, client
        client.send_bytes(CLIENT_MAGIC)
        server.send_bytes(SERVER_MAGIC)
        return client, server

    @property
    def closed(self) -> bool:
        return self._closed

    def send_bytes(self, data: bytes, fds: Sequence[int] = ()) -> None:
        """Deliver raw bytes to the peer (tests use it to inject garbage)."""
        if self._closed:
            raise TransportClosed("transport is closed")
        peer = self._peer
        if peer is None or peer._closed:
            raise TransportClosed("peer closed the connection")
        peer._inbox.put((bytes(data), [os.dup(fd) for fd in fds]))

    def send(self, msg: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
        self.send_bytes(encode_frame(with_fds(msg, len(fds))), fds)

    def recv(self, timeout_s: float | None = None) -> Frame:
        timeout = self._timeout_s if timeout_s is None else timeout_s
        while not self._ready:
            if self._closed:
                raise TransportClosed("transport is closed")
            if self._eof:
                raise TransportClosed("connection closed by peer")
            try:
                item = self._inbox.get(timeout=timeout)
            except queue.Empty:
                raise TransportTimeout("no reply within the timeout") from None
            if isinstance(item, _Eof):
                self._eof = True
                continue
            data, fds = item
            try:
                self._ready.extend(self._decoder.feed(data, fds))
            except ProtocolError:
                self.close()
                raise
        return self._ready.popleft()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._decoder.close()
        while self._ready:
            close_fds(self._ready.popleft().fds)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if not isinstance(item, _Eof):
                close_fds(item[1])
        if self._peer is not None:
            self._peer._inbox.put(_EOF)
        # Wakes a thread of this end blocked in recv(), as shutdown() would.
        self._inbox.put(_EOF)


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "MemoryTransport",
    "Transport",
    "TransportClosed",
    "TransportError",
    "TransportTimeout",
    "UnixTransport",
]
