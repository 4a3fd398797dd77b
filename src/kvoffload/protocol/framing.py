"""Framing (protocol-v1.md §3): magic, length-prefixed msgpack bodies, descriptors.

The bytes on the wire are made and read by the ``msgpack`` library only, so a
frame is byte for byte what it always was; typed messages are built from and
to the plain maps of :class:`Frame` by :mod:`kvoffload.protocol.codec`.
"""

from __future__ import annotations

import collections
import contextlib
import os
import struct
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import msgpack

from kvoffload.errors import ErrorCode, ProtocolError

from .limits import MAGIC_SIZE, MAX_FDS, MAX_FRAME, MAX_PROTOCOL_VERSION, MIN_PROTOCOL_VERSION

_LENGTH = struct.Struct("<I")
LENGTH_SIZE = _LENGTH.size


def bad(message: str) -> ProtocolError:
    """A BAD_REQUEST ProtocolError (fatal until the codec names a request id)."""
    return ProtocolError(ErrorCode.BAD_REQUEST, message)


def with_fds(msg: Mapping[str, Any], nfds: int) -> Mapping[str, Any]:
    """``msg`` declaring the ``nfds`` descriptors sent with it (protocol-v1.md §3.3)."""
    if not 0 <= nfds <= MAX_FDS:
        raise ValueError(f"a frame carries 0..{MAX_FDS} descriptors, not {nfds}")
    return {**msg, "fds": nfds} if nfds else msg


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


class _Packers(threading.local):
    """One ``msgpack.Packer`` per thread: ``packb`` builds one per call."""

    def __init__(self) -> None:
        self.packer = msgpack.Packer(use_bin_type=True)


_PACKERS = _Packers()


def encode_frame(msg: Mapping[str, Any], max_frame: int = MAX_FRAME) -> bytes:
    """Length prefix + msgpack body. Raises ProtocolError(FRAME_TOO_LARGE) above ``max_frame``."""
    body: bytes = _PACKERS.packer.pack(msg)
    if len(body) > max_frame:
        raise ProtocolError(
            ErrorCode.FRAME_TOO_LARGE, f"frame body of {len(body)} bytes exceeds {max_frame}"
        )
    return _LENGTH.pack(len(body)) + body


def decode_body(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    """One frame body → a map with string keys. Fatal ProtocolError otherwise."""
    try:
        msg = msgpack.unpackb(
            body, raw=False, strict_map_key=True, use_list=True, ext_hook=_reject_ext
        )
    except Exception as exc:  # msgpack raises a zoo: ValueError, FormatError, StackError…
        raise bad(f"undecodable frame body: {type(exc).__name__}") from None
    if type(msg) is not dict or not all(map(isinstance, msg, repeat(str))):
        raise bad("frame body is not a map with string keys")
    return msg


@dataclass(slots=True)
class Frame:
    """One decoded frame and the descriptors that arrived with it (now owned by the caller)."""

    msg: dict[str, Any]
    fds: list[int] = field(default_factory=list)


def close_fds(fds: Iterable[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class FrameDecoder:
    """Incremental decoder: feed received bytes (and descriptors), get whole frames.

    A frame that carries descriptors says how many in its ``fds`` key, and
    takes that many from the FIFO of descriptors received so far
    (protocol-v1.md §3.3). Counting, rather than matching descriptors to byte
    positions, is what stays right however the kernel glues stream segments
    into one ``recvmsg``: Linux returns the bytes of earlier frames together
    with a later frame's descriptors. Descriptors arrive with the frame's
    first byte, so they are always here by the time the frame is complete.

    After a ProtocolError the decoder is poisoned: the stream is out of sync.
    """

    def __init__(
        self, expect_magic: bytes | None = None, max_frame: int = MAX_FRAME, max_fds: int = MAX_FDS
    ) -> None:
        self._buf = bytearray()
        self._magic = expect_magic
        self._max_frame = max_frame
        #: Descriptors a frame may declare: MAX_FDS from a client, MAX_REPLY_FDS
        #: from a server (a ``sealed_load`` reply, §5.33).
        self._max_fds = max_fds
        self._fds: collections.deque[int] = collections.deque()
        self._error: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        return len(self._buf)

    @property
    def idle(self) -> bool:
        """In sync between frames: the magic read, nothing buffered, no descriptor
        waiting for its frame, no error. The next bytes begin a frame, so a
        caller may read whole frames of them itself (connection.py's lookups)."""
        return self._magic is None and not self._buf and not self._fds and self._error is None

    @property
    def pending_fds(self) -> int:
        """Descriptors received and not yet claimed by a frame."""
        return len(self._fds)

    def _fail(self, err: ProtocolError) -> ProtocolError:
        self._error = err
        self.close()
        return err

    def feed(self, data: bytes | bytearray | memoryview, fds: Sequence[int] = ()) -> list[Frame]:
        """Whole frames completed by ``data``; the decoder owns ``fds`` from now on."""
        if self._error is not None:
            close_fds(fds)
            raise self._error
        if fds:
            self._fds.extend(fds)
        frames: list[Frame] = []
        try:
            if self._buf or self._magic is not None:
                self._buf += data
                self._frames(self._buf, frames)
            else:
                # Nothing buffered (the usual case: a request arrives whole in
                # one read): frames are decoded from ``data`` itself, and only
                # an incomplete tail is copied.
                with memoryview(data) as view:
                    self._buf += view[self._frames(view, frames) :]
            if len(self._fds) > self._max_fds:
                raise bad(f"{len(self._fds)} descriptors sent that no frame declared")
        except ProtocolError as exc:
            self._fail(exc)
            if frames:
                # The frames before the bad bytes are good: hand them out, and
                # raise on the next feed (or raise_if_failed) instead of
                # dropping them, which would depend on how reads were split.
                return frames
            raise exc from None
        return frames

    def _frames(self, buf: bytearray | memoryview, frames: list[Frame]) -> int:
        """Append the whole frames at the start of ``buf`` to ``frames``; how many
        bytes they took. From the buffer (a bytearray), they are also removed."""
        pos = 0
        if self._magic is not None:
            n = min(len(buf), MAGIC_SIZE)
            if bytes(buf[:n]) != self._magic[:n]:
                raise ProtocolError(
                    ErrorCode.BAD_MAGIC,
                    f"peer sent {bytes(buf[:n])!r}, expected magic {self._magic!r}",
                )
            if n < MAGIC_SIZE:
                return 0
            pos = MAGIC_SIZE
            self._magic = None
        end = len(buf)
        try:
            while end - pos >= LENGTH_SIZE:
                (length,) = _LENGTH.unpack_from(buf, pos)
                if length == 0:
                    raise bad("zero-length frame")
                if length > self._max_frame:
                    raise ProtocolError(
                        ErrorCode.FRAME_TOO_LARGE,
                        f"frame of {length} bytes exceeds the limit of {self._max_frame}",
                    )
                start = pos + LENGTH_SIZE
                if end - start < length:
                    break
                # Released before the buffer is trimmed, even when decoding fails.
                with memoryview(buf)[start : start + length] as body:
                    msg = decode_body(body)
                pos = start + length
                frames.append(Frame(msg, self._claim_fds(msg)))
        finally:
            if pos and type(buf) is bytearray:
                del buf[:pos]
        return pos

    def raise_if_failed(self) -> None:
        """Raise the error a previous ``feed`` deferred behind good frames, if any."""
        if self._error is not None:
            raise self._error

    def _claim_fds(self, msg: Mapping[str, Any]) -> list[int]:
        n = msg.get("fds", 0)
        if n == 0 and type(n) is int:
            return []
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= self._max_fds:
            raise bad(f"fds: {n!r} is not an integer in [0, {self._max_fds}]")
        if n > len(self._fds):
            raise bad(f"frame declares {n} descriptors, {len(self._fds)} arrived")
        return [self._fds.popleft() for _ in range(n)]

    def close(self) -> None:
        """Close descriptors not yet handed out with a frame."""
        close_fds(self._fds)
        self._fds.clear()


def negotiate_version(
    client_min: int,
    client_max: int,
    server_min: int = MIN_PROTOCOL_VERSION,
    server_max: int = MAX_PROTOCOL_VERSION,
) -> int:
    """The version both sides speak (the highest), or ProtocolError(UNSUPPORTED_VERSION)."""
    version = min(client_max, server_max)
    if version < max(client_min, server_min):
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"no common protocol version: client speaks {client_min}..{client_max}, "
            f"server speaks {server_min}..{server_max}; upgrade the older side",
        )
    return version


def check_magic(data: bytes, expected: bytes) -> None:
    if data != expected:
        raise ProtocolError(
            ErrorCode.BAD_MAGIC, f"peer sent {data[:MAGIC_SIZE]!r}, expected magic {expected!r}"
        )
