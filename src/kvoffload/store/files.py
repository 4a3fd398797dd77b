"""POSIX file I/O for objects: atomic immutable writes, whole-object reads.

The write rule of layout v1 (restic's local backend is the model): a temp file
with a random per-writer name in the object's own directory, created with
O_EXCL, written in full and its byte count checked, optionally fsync'd,
renamed into place, and optionally the directory fsync'd. A crash before the
rename leaves only a temp file (collected later); after it, a complete
object. "Already exists" is success.

Writes and reads may use O_DIRECT (``direct=True``) when the buffer address,
the file offset and the length are 4 KiB-aligned, which the store's
page-aligned scratch buffers and layout v1's 4 KiB-padded objects are. A
file system that refuses O_DIRECT (EINVAL at open or at the first I/O) gets
the same bytes through the page cache instead: the flag only ever changes
speed, never the result. Which backend asks for O_DIRECT, and where, is
:mod:`.iobackend`'s business.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import enum
import errno
import fcntl
import mmap
import os
import stat
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..errors import StoreIOError
from ..layouts import v1
from ..posix import O_DIRECT, ScratchBuffers, buffer_address, fsync_dir, pread_all, pwrite_all

__all__ = [
    "DIRECT_ALIGN",
    "O_DIRECT",
    "PERMANENT_ERRNOS",
    "AllocFn",
    "Durability",
    "FillFn",
    "ObjectReader",
    "PartReader",
    "ScratchBuffers",
    "buffer_address",
    "cached_pages",
    "direct_ok",
    "fallocate",
    "fsync_dir",
    "make_dirs",
    "make_fanout",
    "map_opened",
    "populate",
    "read_cached",
    "read_fd",
    "read_file",
    "read_prefix",
    "read_range",
    "read_uncached",
    "sidecar_written",
    "streamed_object",
    "syncfs",
    "unmap",
    "write_atomic",
]

#: ENOSPC, EDQUOT, EACCES, EROFS, EPERM will not go away by retrying.
PERMANENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS, errno.EPERM})
#: O_DIRECT needs buffer address, file offset and length aligned to the logical
#: block size; 4 KiB covers every common device (and is layout v1's alignment).
DIRECT_ALIGN = v1.ALIGN

#: Fills an open temp file with the object (default: :func:`_write_all`).
FillFn = Callable[[int, Path, memoryview], None]
#: Returns a writable buffer of at least the requested size (e.g. ScratchBuffers.get).
AllocFn = Callable[[int], memoryview]


class Durability(enum.StrEnum):
    """How much fsync a write pays for. Never a correctness need: every read verifies."""

    OBJECT = "object"  # fsync file before rename and directory after: survives power loss
    BATCH = "batch"  # syncfs() of the store file system every batch interval (default)
    NONE = "none"  # page cache only: a crash can lose recent objects (they become misses)


_libc: ctypes.CDLL | None = None


def _get_libc() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        lib.fallocate.restype = ctypes.c_int
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.madvise.restype = ctypes.c_int
        _libc = lib
    return _libc


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


#: cachestat(2), Linux 6.5+: one number on every architecture (the generic table).
_NR_CACHESTAT = 451
#: Whether cachestat may work here (cleared at the first ENOSYS, EPERM: seccomp).
_cachestat_ok = os.uname().sysname == "Linux"


def cached_pages(fd: int) -> int | None:
    """How many pages of the open file are in the page cache (cachestat(2): no
    side effect on the cache, unlike a probe read); None where the kernel cannot
    tell (before Linux 6.5, a seccomp filter, another OS)."""
    global _cachestat_ok
    if not _cachestat_ok:
        return None
    rng, out = _CachestatRange(0, 0), _Cachestat()  # len 0: to the end of the file
    if _get_libc().syscall(_NR_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(out), 0) == 0:
        return int(out.nr_cache)
    if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
        _cachestat_ok = False
    return None


def _syncfs(fd: int) -> None:
    if _get_libc().syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def fallocate(fd: int, size: int) -> None:
    """Reserve the blocks up front (contiguous extents, ENOSPC before any byte is written).

    fallocate(2), not posixfallocate(3): glibc emulates the latter where the
    file system lacks it by writing a byte per block, which is slow and fails
    on an O_DIRECT descriptor. Unsupported is fine; ENOSPC/EDQUOT are raised.
    """
    if size <= 0:
        return
    if _get_libc().fallocate(fd, 0, 0, size) != 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(err, os.strerror(err))


def direct_ok(buf: memoryview, offset: int = 0) -> bool:
    """Whether O_DIRECT can move ``buf`` to/from ``offset`` (all three 4 KiB-aligned)."""
    if not O_DIRECT or offset % DIRECT_ALIGN or buf.nbytes % DIRECT_ALIGN or not buf.nbytes:
        return False
    addr = buffer_address(buf)
    return addr is not None and addr % DIRECT_ALIGN == 0


def _drop_direct(fd: int) -> bool:
    """Clear O_DIRECT on an open descriptor (Linux allows it). False if it was not set."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if not flags & O_DIRECT:
        return False
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~O_DIRECT)
    return True


def _buffered_on_einval(fd: int) -> Callable[[OSError], bool]:
    """A retry rule for :func:`~kvoffload.posix.pwrite_all`/``pread_all``: an
    O_DIRECT descriptor the file system turns down (EINVAL) goes on buffered."""

    def retry(exc: OSError) -> bool:
        return exc.errno == errno.EINVAL and _drop_direct(fd)

    return retry


def syncfs(path: Path) -> None:
    """Flush every dirty page of the file system holding ``path``."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _syncfs(fd)
    finally:
        os.close(fd)


def make_dirs(path: Path, *, durable: bool) -> None:
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
            d.mkdir(mode=0o700)  # layout-v1.md §2: not listable by other uids
        except FileExistsError:
            continue
        if durable:
            fsync_dir(d.parent)


def make_fanout(tenant_dir: Path, *, durable: bool) -> None:
    """Create ``tenant_dir`` and its 256 one-level fan-out leaves (``00``..``ff``,
    layout-v1.md §2) that are missing; when durable and any was made, fsync
    ``tenant_dir`` once (and its parents, as :func:`make_dirs` does)."""
    make_dirs(tenant_dir, durable=durable)
    have = set(os.listdir(tenant_dir))
    made = False
    for i in range(256):
        name = f"{i:02x}"
        if name in have:
            continue
        try:
            os.mkdir(tenant_dir / name, 0o700)  # layout-v1.md §2: not listable by other uids
        except FileExistsError:
            continue
        made = True
    if made and durable:
        fsync_dir(tenant_dir)


def _write_all(fd: int, data: memoryview) -> None:
    """pwrite every byte from offset 0. An O_DIRECT descriptor that the file
    system turns down (EINVAL) continues through the page cache."""
    pwrite_all(fd, data, 0, on_error=_buffered_on_einval(fd))


def _open_excl(path: Path, direct: bool) -> tuple[int, bool]:
    """Create ``path`` with O_EXCL (and O_DIRECT if asked and accepted): (fd, direct)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    if direct:
        try:
            return os.open(path, flags | O_DIRECT, 0o640), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            # Refused (tmpfs before Linux 6.6, some FUSE): the file was created
            # all the same, so remove it before the buffered O_EXCL retry.
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    return os.open(path, flags, 0o640), False


def write_atomic(
    final: Path,
    data: memoryview,
    durability: Durability,
    *,
    direct: bool = False,
    fill: FillFn | None = None,
    size: int | None = None,
) -> bool:
    """Write ``data`` as the immutable file ``final``. False if it already existed.

    ``direct``: try O_DIRECT (only used when ``data`` is 4 KiB-aligned in
    address and length). ``fill(fd, tmp_path, data)`` replaces the default
    pwrite loop (kvikio and cuFile write through their own file handles);
    ``size`` is then the file size to expect if it is not ``len(data)`` (the
    bytes of a GPU buffer are not in ``data``).
    """
    if final.exists():
        return False
    size = len(data) if size is None else size
    parent = final.parent
    tmp = parent / v1.tmp_name()
    want_direct = direct and fill is None and direct_ok(data)
    try:
        try:
            fd, _ = _open_excl(tmp, want_direct)
        except FileNotFoundError:
            make_dirs(parent, durable=durability is Durability.OBJECT)
            fd, _ = _open_excl(tmp, want_direct)
        try:
            fallocate(fd, size)
            if fill is None:
                _write_all(fd, data)
            else:
                fill(fd, tmp, data)
            if os.fstat(fd).st_size != size:
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
        with contextlib.suppress(OSError):  # a failing cleanup must not hide the error
            tmp.unlink()
        kind = "permanent" if exc.errno in PERMANENT_ERRNOS else "transient"
        raise StoreIOError(f"writing {final.name} failed ({kind}): {exc}", exc.errno) from exc


def _open_read(path: Path, direct: bool) -> int:
    flags = os.O_RDONLY | os.O_CLOEXEC
    if direct:
        try:
            return os.open(path, flags | O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags)


def _pread_into(fd: int, buf: memoryview, offset: int, want: int) -> int:
    """preadv up to ``want`` bytes into ``buf`` from ``offset``; stops early at EOF."""

    def on_partial(done: int) -> None:
        if done % DIRECT_ALIGN:
            _drop_direct(fd)  # an unaligned short read: go on buffered

    # Stops early at EOF (shrank under us): the short buffer fails verification.
    return pread_all(
        fd, buf[:want], offset, on_error=_buffered_on_einval(fd), on_partial=on_partial
    )


def _object_size(fd: int, path: str | Path, max_size: int) -> int:
    """The size of an open object file; EFBIG (a miss) over ``max_size``."""
    size = os.fstat(fd).st_size
    if size > max_size:
        name = os.path.basename(path)
        raise OSError(errno.EFBIG, f"{name}: {size} bytes exceeds the object limit")
    return size


def read_file(
    path: Path,
    scratch: ScratchBuffers | AllocFn,
    max_size: int,
    *,
    direct: bool = False,
) -> memoryview:
    """Read a whole object into a buffer from ``scratch``. Raises OSError (incl. ENOENT, ESTALE).

    ``direct``: try O_DIRECT; the buffer asked for is then the size rounded up
    to 4 KiB (layout v1 objects already are), read in aligned requests.
    """
    alloc = scratch.get if isinstance(scratch, ScratchBuffers) else scratch
    fd = _open_read(path, direct)
    try:
        size = _object_size(fd, path, max_size)
        want = v1.align_up(size, DIRECT_ALIGN) if direct else size
        buf = alloc(want)
        if direct and not direct_ok(buf[:want]):
            _drop_direct(fd)
            want = size
        done = _pread_into(fd, buf, 0, want)
        return buf[: min(done, size)]
    finally:
        os.close(fd)


class PartReader:
    """One large read split into parts that are read at once, on threads of its
    own, so that a single object comes off the device with as many requests in
    flight as a batch of objects would: its bytes are all there sooner, and the
    caller verifies and hands it out while the device reads the next one (the
    parts of later reads queue behind it, in order).

    Never a pool that the caller itself runs on: a read waits for its parts."""

    #: A part is at least this large (a smaller read is one request).
    MIN_PART = 4 << 20

    def __init__(self, streams: int) -> None:
        self.streams = streams
        self._pool = ThreadPoolExecutor(max_workers=streams, thread_name_prefix="kvoffload-read")

    def read(self, fd: int, buf: memoryview, want: int) -> int:
        """:func:`_pread_into` of ``want`` bytes from offset 0, in parts; the
        count read, contiguous from the start (short at end of file). Returns,
        or raises the first part's error, only once every part has finished
        with ``buf``."""
        n = min(self.streams, want // self.MIN_PART)
        if n < 2:
            return _pread_into(fd, buf, 0, want)
        step = v1.align_up(-(-want // n), DIRECT_ALIGN)
        parts: list[tuple[int, Future[int]]] = []
        for off in range(0, want, step):
            size = min(step, want - off)
            parts.append((off, self._pool.submit(_pread_into, fd, buf[off:], off, size)))
        done, failure = 0, None
        for off, fut in parts:
            try:
                got = fut.result()
            except BaseException as exc:  # every part is waited for before this raises
                failure = failure or exc
                continue
            if done == off:  # the bytes after a short part (end of file) do not count
                done += got
        if failure is not None:
            raise failure
        return done

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def read_uncached(
    path: str | Path,
    alloc: AllocFn,
    max_size: int,
    min_size: int,
    *,
    parts: PartReader | None = None,
) -> memoryview | None:
    """The whole object read with O_DIRECT into a buffer from ``alloc``, where it
    is at least ``min_size`` bytes and less than half of it is in the page cache;
    None otherwise (and where the kernel cannot tell, or the buffer or the file
    system cannot take O_DIRECT): the caller reads it through the page cache.
    Raises OSError as :func:`read_file` does (ENOENT, EFBIG; EIO from a read).
    ``parts``: read it in parts at once (:class:`PartReader`).

    A cold large object then comes off the device in a few large requests, at
    the device's speed and without evicting hot objects to make room for it;
    one that is cached is still served from memory. Objects this large are
    written with O_DIRECT too (:data:`~.iobackend.DIRECT_WRITE_MIN`), so the
    page cache holds them only where something else put them there."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = _object_size(fd, path, max_size)
        if size < min_size or not O_DIRECT:
            return None
        cached = cached_pages(fd)
        if cached is None or cached * mmap.PAGESIZE * 2 >= size:
            return None
        want = v1.align_up(size, DIRECT_ALIGN)
        buf = alloc(want)
        if not direct_ok(buf[:want]):
            return None
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | O_DIRECT)
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # this file system turns O_DIRECT down
                return None
            raise
        done = _pread_into(fd, buf, 0, want) if parts is None else parts.read(fd, buf, want)
        return buf[: min(done, size)]
    finally:
        os.close(fd)


#: madvise(2), Linux 5.14+: fault a mapping in now, failing with an error (EIO,
#: EFAULT) where a page cannot be read, instead of a SIGBUS at first touch.
MADV_POPULATE_READ = 22
#: Whether this kernel takes MADV_POPULATE_READ (cleared at the first EINVAL).
_populate_ok = True
#: Smaller objects are read, not mapped: mmap, populate and munmap cost more
#: than the copy they save (64 KiB objects loaded 15-35 % slower mapped here).
MAP_MIN_BYTES = 1 << 20


def sidecar_written(st: os.stat_result) -> bool:
    """Whether a file is one :func:`write_atomic` made: a regular file of this uid,
    one link, writable by its owner only. No descriptor that could truncate it
    outlives its rename; a direct-path object (written through a worker's
    descriptor, published read-only) or anything else is not one."""
    return (
        stat.S_ISREG(st.st_mode)
        and st.st_uid == os.geteuid()
        and st.st_nlink == 1
        and st.st_mode & 0o222 == 0o200
    )


def map_opened(fd: int, st: os.stat_result) -> mmap.mmap | None:
    """A read-only mapping of the whole file open at ``fd`` (``st`` its fstat),
    not yet populated; None where it may not be mapped safely: not
    :func:`sidecar_written` (another descriptor could shrink it under the
    mapping, and a read would then fault with SIGBUS), under
    :data:`MAP_MIN_BYTES`, or a kernel without MADV_POPULATE_READ.

    Touch a range only after :func:`populate` of it returned: a page that
    cannot be read is then an OSError (EIO, EFAULT), never a SIGBUS.
    """
    if not (_populate_ok and st.st_size >= MAP_MIN_BYTES and sidecar_written(st)):
        return None
    return mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)


def populate(m: mmap.mmap, start: int = 0, length: int = 0) -> bool:
    """Fault ``[start, start + length)`` of a :func:`map_opened` mapping in
    (``length`` 0: to the end), reading it from the device where it is cold.
    False where this kernel refuses MADV_POPULATE_READ (then read instead);
    OSError (EIO…) where a page cannot be read."""
    global _populate_ok
    lo = start - start % mmap.PAGESIZE
    end = min(len(m), start + length) if length else len(m)
    if end <= lo:
        return True
    # madvise(2) through ctypes, which releases the GIL for the call, not
    # ``mmap.madvise``, which holds it: populating a cold object is its whole
    # device read, and every other I/O stream's decrypt waited on it (a 32 MiB
    # object: ~25 ms). The array exports the mapping, so no other thread can
    # close (munmap) it while the call runs: close is refused, never unsafe.
    arr = np.frombuffer(m, dtype=np.uint8)
    try:
        addr = int(arr.__array_interface__["data"][0])
        if _get_libc().madvise(addr + lo, end - lo, MADV_POPULATE_READ) != 0:
            err = ctypes.get_errno()
            if err != errno.EINVAL:
                raise OSError(err, os.strerror(err))
            _populate_ok = False
            return False
    finally:
        del arr
    return True


def unmap(m: mmap.mmap) -> None:
    """Close a mapping; a view that outlives it (a traceback's frame) keeps it
    until it goes: closing under it is refused, never unsafe."""
    with contextlib.suppress(BufferError):
        m.close()


#: Objects this large are read layer by layer (:func:`streamed_object`) where
#: reads go through the page cache; smaller ones are read whole.
STREAM_MIN_BYTES = 1 << 20


class ObjectReader(NamedTuple):
    """An open object read piece by piece (:func:`~kvoffload.layouts.v1.open_read_into`)."""

    read_at: v1.ReadAt
    size: int


@contextlib.contextmanager
def streamed_object(path: Path, max_size: int) -> Iterator[ObjectReader | None]:
    """The object at ``path``, open, for reading one layer slot at a time through
    the page cache; None where it is under :data:`STREAM_MIN_BYTES` (the
    caller reads it whole). Raises OSError as :func:`read_file` does (ENOENT,
    EFBIG; EIO from a read).

    Each slot is copied into a buffer small enough to stay in the CPU cache
    and verified and decrypted from there: one copy the kernel makes and one
    pass over the destination. Measured against verifying from a populated
    mapping of the whole object (:func:`map_opened`, :func:`populate`) on 32 MiB objects:
    populating and unmapping cost a page-table walk per 4 KiB, which the copy
    of a cache-sized slot does not, and a cold object's later layers come off
    the device (kernel readahead) while its earlier ones are decrypted.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = _object_size(fd, path, max_size)
        if size < STREAM_MIN_BYTES:
            yield None
            return

        def read_at(buf: memoryview, offset: int) -> int:
            return pread_all(fd, buf, offset)

        yield ObjectReader(read_at, size)
    finally:
        os.close(fd)


#: preadv2 flag: fail with EAGAIN instead of waiting for the device (Linux 4.14+).
RWF_NOWAIT: int = getattr(os, "RWF_NOWAIT", 0)


def read_cached(
    path: str | Path, alloc: AllocFn, max_size: int, *, prefetch: bool = False
) -> memoryview | None:
    """The whole file, read only if every byte of it is in the page cache
    (``preadv2(RWF_NOWAIT)``: no wait on the device); None where part of it is
    not, or where the kernel or file system cannot tell (the caller then reads
    it the ordinary way, on a thread that may wait). Raises OSError as
    :func:`read_file` does (ENOENT, EFBIG).

    ``prefetch``: where it is not all cached, start reading it into the page
    cache (``POSIX_FADV_WILLNEED`` submits the reads and returns), so that the
    ordinary read that follows finds it there or on its way."""
    if not RWF_NOWAIT:
        return None
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = _object_size(fd, path, max_size)
        buf = alloc(size)[:size]
        try:
            got = os.preadv(fd, [buf], 0, RWF_NOWAIT)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOTSUP):
                if prefetch:
                    _will_need(fd, size)
                return None
            raise
        if got != size and prefetch:
            _will_need(fd, size)
        return buf if got == size else None
    finally:
        os.close(fd)


def _will_need(fd: int, size: int) -> None:
    with contextlib.suppress(OSError, AttributeError):  # a hint: no harm where refused
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)


def read_range(path: Path, offset: int, out: memoryview, *, direct: bool = False) -> int:
    """Read ``len(out)`` bytes at ``offset`` into ``out`` (one layer of an object).

    Returns the byte count (short at end of file). O_DIRECT only when
    ``offset``, ``len(out)`` and the address of ``out`` are 4 KiB-aligned.
    """
    use_direct = direct and direct_ok(out, offset)
    fd = _open_read(path, use_direct)
    try:
        return _pread_into(fd, out, offset, len(out))
    finally:
        os.close(fd)


def read_prefix(path: Path, n: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def read_fd(fd: int, buf: memoryview, size: int) -> int:
    """Read ``size`` bytes from offset 0 of ``fd`` into ``buf``; the count read."""
    return _pread_into(fd, buf, 0, size)
