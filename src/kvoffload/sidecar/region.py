"""A peer's file handed over for positional I/O only: never mapped (issue 31).

vLLM's primary CPU tier is a ``SharedOffloadRegion``: a file under /dev/shm
that vLLM creates and that cannot be sealed. Mapping it the way §5.2 maps a
staging memfd would let a peer that truncates it crash the shared daemon with
``SIGBUS`` on the next access. :class:`RegionFile` therefore never maps the
descriptor: every access is one ``os.preadv`` / ``os.pwritev`` at an offset
the client chose, bounded by the size registered up front. A truncation under
the server is then a short read (:class:`RegionError` for that chunk), never a
signal, and a write past a truncated end can only grow the peer's own file,
never past the registered size.

What :meth:`RegionFile.from_fd` checks before it keeps a descriptor:

- a regular file (a memfd is one): never a FIFO, socket, device, directory or
  ``O_PATH`` handle (which is also how a symlink would arrive: the server
  never opens a path, so it never follows one);
- owned by the peer's uid (``SO_PEERCRED``), so a client cannot make the
  daemon read or write a file it merely holds a descriptor to;
- open ``O_RDWR`` (loads write into it, stores read from it);
- at least the announced size, which is a positive multiple of 4096 and at
  most the server's limit.

This module is the safe core only; the verb that registers a region and the
``store`` / load variants that address it are not wired yet (see the module's
tests, tests/sidecar/test_region_file.py).
"""

from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Sequence

from kvoffload.errors import RegionError

PAGE = 4096


def _check_fd(fd: int, size: int, peer_uid: int, max_size: int) -> None:
    if size <= 0 or size % PAGE:
        raise RegionError(f"region size {size} is not a positive multiple of {PAGE}")
    if size > max_size:
        raise RegionError(f"region of {size} bytes exceeds {max_size}")
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        st = os.fstat(fd)
    except OSError as exc:
        raise RegionError(f"region descriptor cannot be inspected: {exc.strerror}") from exc
    if flags & getattr(os, "O_PATH", 0):
        raise RegionError("region descriptor is an O_PATH handle, not an open file")
    if not stat.S_ISREG(st.st_mode):
        kind = stat.filemode(st.st_mode)[0]
        raise RegionError(f"region descriptor is not a regular file (type {kind!r})")
    if st.st_uid != peer_uid:
        raise RegionError(f"region file is owned by uid {st.st_uid}, not the peer's {peer_uid}")
    if flags & os.O_ACCMODE != os.O_RDWR:
        raise RegionError("region descriptor is not open O_RDWR")
    if st.st_size < size:
        raise RegionError(f"region file has {st.st_size} bytes, {size} announced")


class RegionFile:
    """A peer's region, addressed by ``pread``/``pwrite`` at bounded offsets."""

    def __init__(self, fd: int, size: int) -> None:
        self._fd = fd
        self.size = size

    @classmethod
    def from_fd(cls, fd: int, size: int, *, peer_uid: int, max_size: int) -> RegionFile:
        """Keep a descriptor received from a peer. Takes ownership of ``fd``
        (closed on refusal too)."""
        try:
            _check_fd(fd, size, peer_uid, max_size)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, size)

    def _bounds(self, offset: int, length: int) -> None:
        if self._fd < 0:
            raise RegionError("region is closed")
        if offset < 0 or length < 0 or offset + length > self.size:
            raise RegionError(f"range {offset}+{length} exceeds the region of {self.size} bytes")

    def read_into(self, offset: int, bufs: Sequence[memoryview]) -> None:
        """Fill ``bufs`` in order from ``offset``; a short read (the peer
        truncated its file) raises :class:`RegionError`."""
        want = sum(b.nbytes for b in bufs)
        self._bounds(offset, want)
        done = 0
        views = [b.cast("B") for b in bufs]
        while done < want:
            try:
                n = os.preadv(self._fd, _tail(views, done), offset + done)
            except OSError as exc:
                raise RegionError(f"region read at {offset + done}: {exc.strerror}") from exc
            if n == 0:
                raise RegionError(
                    f"region read at {offset + done}: {want - done} bytes short "
                    "(the file was truncated)"
                )
            done += n

    def write_from(self, offset: int, bufs: Sequence[memoryview]) -> None:
        """Write ``bufs`` in order at ``offset`` (inside the registered size)."""
        want = sum(b.nbytes for b in bufs)
        self._bounds(offset, want)
        done = 0
        views = [b.cast("B") for b in bufs]
        while done < want:
            try:
                n = os.pwritev(self._fd, _tail(views, done), offset + done)
            except OSError as exc:
                raise RegionError(f"region write at {offset + done}: {exc.strerror}") from exc
            if n == 0:
                raise RegionError(f"region write at {offset + done} made no progress")
            done += n

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _tail(views: Sequence[memoryview], skip: int) -> list[memoryview]:
    """``views`` without their first ``skip`` bytes."""
    out: list[memoryview] = []
    for v in views:
        if skip >= v.nbytes:
            skip -= v.nbytes
            continue
        out.append(v[skip:])
        skip = 0
    return out


__all__ = ["RegionError", "RegionFile"]
