"""POSIX file I/O for objects: atomic immutable writes, whole-object reads.

The write rule of layout v1 (restic's local backend is the model): a temp file
with a random per-writer name in the object's own directory, created with
O_EXCL, written in full and its byte count checked, optionally fsync'd,
renamed into place, and optionally the directory fsync'd. A crash before the
rename leaves only a temp file (collected later); after it, a complete
object. "Already exists" is success.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import enum
import errno
import mmap
import os
import threading
from pathlib import Path

from ..layouts import v1
from .errors import StoreIOError

#: ENOSPC, EDQUOT, EACCES, EROFS, EPERM will not go away by retrying.
PERMANENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS, errno.EPERM})


class Durability(enum.StrEnum):
    """How much fsync a write pays for. Never a correctness need: every read verifies."""

    OBJECT = "object"  # fsync file before rename and directory after: survives power loss
    BATCH = "batch"  # syncfs() of the store file system every batch interval (default)
    NONE = "none"  # page cache only: a crash can lose recent objects (they become misses)


_libc: ctypes.CDLL | None = None


def _syncfs(fd: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if _libc.syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def syncfs(path: Path) -> None:
    """Flush every dirty page of the file system holding ``path``."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _syncfs(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ScratchBuffers:
    """Per-thread page-aligned buffers that only grow, kept mapped and touched.

    A fresh mapping per object costs a page fault per 4 KiB (≈1 GB/s here);
    a reused one runs at memcpy speed.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, size: int) -> memoryview:
        buf: mmap.mmap | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:
            if buf is not None:
                buf.close()
            cap = v1.align_up(max(size, 1 << 20), 1 << 20)
            buf = mmap.mmap(-1, cap)
            # Touch every page now so the hot path never faults.
            buf.write(bytes(cap))
            self._local.buf = buf
        return memoryview(buf)[:size]


def _make_dirs(path: Path, *, durable: bool) -> None:
    """mkdir -p; when durable, fsync the parent of every directory created.

    Without that, a power loss can drop a new fan-out directory and with it
    an object whose own directory entry was fsync'd.
    """
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue
        if durable:
            fsync_dir(d.parent)


def _write_all(fd: int, data: memoryview) -> None:
    done = 0
    total = len(data)
    while done < total:
        n = os.write(fd, data[done:])
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done += n


def write_atomic(final: Path, data: memoryview, durability: Durability) -> bool:
    """Write ``data`` as the immutable file ``final``. False if it already existed."""
    if final.exists():
        return False
    parent = final.parent
    tmp = parent / v1.tmp_name()
    try:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o640)
        except FileNotFoundError:
            _make_dirs(parent, durable=durability is Durability.OBJECT)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o640)
        try:
            if len(data):
                try:
                    os.posix_fallocate(fd, 0, len(data))
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                        raise
            _write_all(fd, data)
            if os.fstat(fd).st_size != len(data):
                raise OSError(errno.EIO, f"{tmp}: size after write differs")
            if durability is Durability.OBJECT:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, final)
        if durability is Durability.OBJECT:
            fsync_dir(parent)
        return True
    except OSError as exc:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        kind = "permanent" if exc.errno in PERMANENT_ERRNOS else "transient"
        raise StoreIOError(f"writing {final.name} failed ({kind}): {exc}", exc.errno) from exc


def read_file(path: Path, scratch: ScratchBuffers, max_size: int) -> memoryview:
    """Read a whole object into a scratch buffer. Raises OSError (incl. ENOENT, ESTALE)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size > max_size:
            raise OSError(errno.EFBIG, f"{path.name}: {size} bytes exceeds the object limit")
        buf = scratch.get(size)
        done = 0
        while done < size:
            n = os.readv(fd, [buf[done:]])
            if n == 0:
                break  # shrank under us: the short buffer fails verification
            done += n
        return buf[:done]
    finally:
        os.close(fd)


def read_prefix(path: Path, n: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)
