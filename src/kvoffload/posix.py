"""POSIX file primitives shared by the worker and the sidecar (stdlib only).

* :func:`atomic_create`: a whole small file written under a random temp name
  in its own directory and linked (or renamed) into place, so that a reader
  or a crash sees either no file or the complete one.
* :func:`fsync_dir`: make a directory entry durable.
* :func:`pwrite_all` / :func:`pread_all`: positional I/O that loops on short
  counts and EINTR.
* :class:`ScratchBuffers`, :func:`buffer_address`, :func:`is_aligned`:
  page-aligned per-thread buffers and the alignment test O_DIRECT needs.

The worker package imports this module, so it must stay light: no imports
beyond the standard library, nothing from the sidecar.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path

#: O_DIRECT needs buffer address, file offset and length aligned to the logical
#: block size; 4 KiB covers every common device (and is layout v1's alignment).
ALIGN = 4096
O_DIRECT: int = getattr(os, "O_DIRECT", 0)

#: Some network filesystems refuse fsync on a directory; their metadata
#: operations are synchronous on the server anyway.
NO_DIRSYNC_ERRNOS = frozenset({errno.EINVAL, errno.EOPNOTSUPP})

#: Called with the OSError of a failed pwrite/pread; True: retry the same call
#: (e.g. after clearing O_DIRECT on the descriptor), False: raise it.
RetryFn = Callable[[OSError], bool]

StrPath = str | os.PathLike[str]


def fsync_dir(path: StrPath) -> None:
    """fsync a directory (after creating or renaming an entry in it).

    A file system that does not support it (EINVAL, EOPNOTSUPP) is accepted.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in NO_DIRSYNC_ERRNOS:
            raise
    finally:
        os.close(fd)


def default_tmp_name(final_name: str) -> str:
    """``.<name>.<16 random hex>.tmp``: unique per writer, hidden, recognisable."""
    return f".{final_name}.{os.urandom(8).hex()}.tmp"


def atomic_create(
    path: StrPath,
    data: bytes | bytearray | memoryview,
    *,
    mode: int = 0o600,
    durable: bool = True,
    replace: bool = False,
    tmp_name: str | None = None,
) -> None:
    """Write ``data`` as the file ``path``, all or nothing.

    A temp file in the same directory (``tmp_name``, default
    :func:`default_tmp_name`) is created with ``O_EXCL | O_CLOEXEC`` and
    ``mode`` (filtered by the umask, as open(2) does), written in full, its
    size checked and, when ``durable``, fsync'd. Then:

    * ``replace=False``: ``os.link`` to ``path``, which never replaces. If
      ``path`` exists (another creator won the race) :class:`FileExistsError`
      is raised and the existing file is left as it was.
    * ``replace=True``: ``os.replace`` onto ``path``.

    When ``durable`` the directory is fsync'd after the new name is in place.
    The temp file is removed on every path out of here, including
    ``BaseException`` (KeyboardInterrupt). Before the name is in place a
    failure leaves ``path`` untouched; only a failing directory fsync (raised
    as OSError) comes after the complete file already carries its name.
    """
    final = Path(path)
    tmp = final.with_name(tmp_name if tmp_name is not None else default_tmp_name(final.name))
    view = _byte_view(data)
    # Not inside the try: a temp name that exists already is someone else's.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        try:
            pwrite_all(fd, view, 0)
            if os.fstat(fd).st_size != view.nbytes:
                raise OSError(errno.EIO, f"{tmp.name}: size after write differs")
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, final)
        else:
            os.link(tmp, final)
    finally:
        # After a successful replace the temp name is gone already; after a
        # link it is a second name of the final file, and only the name goes.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    if durable:
        fsync_dir(final.parent)


def _byte_view(data: bytes | bytearray | memoryview) -> memoryview:
    mv = memoryview(data)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def pwrite_all(
    fd: int,
    data: bytes | bytearray | memoryview,
    offset: int = 0,
    *,
    on_error: RetryFn | None = None,
) -> None:
    """Write every byte of ``data`` at ``offset``, looping on short writes and EINTR.

    A write of 0 bytes raises ``OSError(EIO, "short write")``. ``on_error``
    may ask for a failed call to be retried (see :data:`RetryFn`).
    """
    view = _byte_view(data)
    done = 0
    total = view.nbytes
    while done < total:
        try:
            n = os.pwritev(fd, [view[done:]], offset + done)
        except InterruptedError:
            continue
        except OSError as exc:
            if on_error is not None and on_error(exc):
                continue
            raise
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done += n


def pread_all(
    fd: int,
    buf: bytearray | memoryview,
    offset: int = 0,
    *,
    on_error: RetryFn | None = None,
    on_partial: Callable[[int], object] | None = None,
) -> int:
    """Fill ``buf`` from ``offset``, looping on short reads and EINTR; the count read.

    Stops early only at end of file (the count is then below ``len(buf)``;
    callers that need every byte check it). ``on_partial(done)`` is called
    after each read that left the buffer unfilled; ``on_error`` may ask for a
    failed call to be retried (see :data:`RetryFn`).
    """
    view = _byte_view(buf)
    done = 0
    want = view.nbytes
    while done < want:
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except InterruptedError:
            continue
        except OSError as exc:
            if on_error is not None and on_error(exc):
                continue
            raise
        if n == 0:
            break
        done += n
        if done < want and on_partial is not None:
            on_partial(done)
    return done


def buffer_address(buf: memoryview) -> int | None:
    """Address of a writable buffer's first byte; None if read-only or empty."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    except (TypeError, ValueError, BufferError):
        return None


def is_aligned(buf: memoryview, align: int = ALIGN) -> bool:
    """Whether a writable buffer starts on an ``align`` boundary (False if unknown)."""
    addr = buffer_address(buf)
    return addr is not None and addr % align == 0


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class ScratchBuffers:
    """Per-thread page-aligned buffers (anonymous mappings) that grow, and shrink.

    ``prefault``: touch every page when a buffer is mapped, so the hot path
    never faults (a fresh mapping per object costs a page fault per 4 KiB,
    ≈1 GB/s; a reused, touched one runs at memcpy speed). A buffer that is
    outgrown or shrunk is dropped, not closed: a view of it may still be in
    use, and it unmaps when the last one goes.

    Shrinking: a buffer above :attr:`SHRINK_ABOVE` that served
    :attr:`SHRINK_AFTER` requests in a row of at most a quarter of its size is
    replaced by one of the size asked for, so one outsized object does not pin
    its memory in every thread for the life of the process.
    """

    SHRINK_ABOVE = 16 << 20
    SHRINK_AFTER = 8

    def __init__(self, *, prefault: bool = True) -> None:
        self._local = threading.local()
        self._prefault = prefault

    def get(self, size: int) -> memoryview:
        buf: mmap.mmap | None = getattr(self._local, "buf", None)
        if buf is not None and len(buf) > self.SHRINK_ABOVE and size <= len(buf) // 4:
            small = getattr(self._local, "small", 0) + 1
            self._local.small = small
            if small >= self.SHRINK_AFTER:
                buf = None
        else:
            self._local.small = 0
        if buf is None or len(buf) < size:
            self._local.small = 0
            cap = align_up(max(size, 1 << 20), 1 << 20)
            buf = mmap.mmap(-1, cap)
            if self._prefault:
                buf.write(bytes(cap))
            self._local.buf = buf
        return memoryview(buf)[:size]
