"""The direct path's files (docs/spec/layout-v1.md §4.1): the sidecar creates and
allocates the temp file a worker fills, checks it is still its own file of the
leased size, and gives it its name, read-only and durable as the store's
durability says.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from ..errors import StoreIOError
from ..layouts import v1
from ..posix import fsync_dir
from .files import PERMANENT_ERRNOS, Durability, fallocate, make_dirs

#: Directories of a direct tenant: group-shared (setgid, so files inherit the
#: group) and sticky (a group member cannot remove or rename the sidecar's files).
DIRECT_DIR_MODE = 0o3770
#: A leased temp file: the tenant's workers may write it until it is checked.
LEASE_FILE_MODE = 0o660
#: A published direct-path object: nobody writes it again.
PUBLISHED_MODE = 0o440


def share_dirs(top: Path, leaf: Path, gid: int | None) -> None:
    """Give ``top`` and every directory below it down to ``leaf`` the direct-path mode.

    ``gid`` None keeps the group (workers running as the sidecar's uid need
    nothing more). Idempotent; fails with OSError (EPERM) where the sidecar
    may not hand the directory to that group.
    """
    chain = [leaf]
    while chain[-1] != top:
        if top not in chain[-1].parents:
            raise ValueError(f"{leaf} is not below {top}")
        chain.append(chain[-1].parent)
    for d in reversed(chain):
        st = os.stat(d, follow_symlinks=False)
        if gid is not None and st.st_gid != gid:
            os.chown(d, -1, gid, follow_symlinks=False)
        if gid is not None and (st.st_mode & 0o7777) != DIRECT_DIR_MODE:
            os.chmod(d, DIRECT_DIR_MODE, follow_symlinks=False)


def create_lease_file(
    final: Path, size: int, *, durable_dirs: bool, gid: int | None, share_top: Path | None = None
) -> Path:
    """Create and allocate the temp file a worker will fill; returns its path.

    ENOSPC/EDQUOT come out here, as :class:`StoreIOError`, before the worker
    has written a byte; nothing is left behind on any failure.
    """
    parent = final.parent
    tmp = parent / v1.tmp_name()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        try:
            fd = os.open(tmp, flags, LEASE_FILE_MODE)
        except FileNotFoundError:
            make_dirs(parent, durable=durable_dirs)
            fd = os.open(tmp, flags, LEASE_FILE_MODE)
        try:
            if share_top is not None:
                share_dirs(share_top, parent, gid)
            if gid is not None:
                os.fchown(fd, -1, gid)
            os.fchmod(fd, LEASE_FILE_MODE)  # the umask may have cut the group bits
            fallocate(fd, size)
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)  # no fallocate here: a sparse file reads as zeros too
        finally:
            os.close(fd)
    except OSError as exc:
        with contextlib.suppress(OSError):  # a failing cleanup must not hide the error
            tmp.unlink()
        kind = "permanent" if exc.errno in PERMANENT_ERRNOS else "transient"
        raise StoreIOError(f"leasing {final.name} failed ({kind}): {exc}", exc.errno) from exc
    return tmp


def open_lease_file(tmp: Path, size: int) -> int:
    """Open a leased temp file for checking: our own regular file, still ``size`` bytes.

    Raises OSError: ENOENT (gone), ELOOP (replaced by a link), EPERM (no longer
    the sidecar's file), EIO (wrong type or size: the worker truncated or
    extended it).
    """
    fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EIO, f"{tmp.name}: not a regular file")
        if st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, f"{tmp.name}: owned by uid {st.st_uid}, not the sidecar")
        if st.st_nlink != 1:
            raise OSError(errno.EIO, f"{tmp.name}: has {st.st_nlink} links")
        if st.st_size != size:
            raise OSError(errno.EIO, f"{tmp.name}: {st.st_size} bytes, leased {size}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def publish_lease_file(tmp: Path, fd: int, final: Path, durability: Durability) -> bool:
    """Make a checked lease file read-only and durable, and name it. False: ``final`` existed.

    ``fd`` is the descriptor the check read through (closed here).
    """
    try:
        try:
            os.fchmod(fd, PUBLISHED_MODE)
            if durability is Durability.OBJECT:
                os.fsync(fd)
        finally:
            os.close(fd)
        existed = final.exists()
        os.rename(tmp, final)  # equal key => equal content: replacing is harmless
        if durability is Durability.OBJECT:
            fsync_dir(final.parent)
        return not existed
    except OSError as exc:
        with contextlib.suppress(OSError):  # a failing cleanup must not hide the error
            tmp.unlink()
        kind = "permanent" if exc.errno in PERMANENT_ERRNOS else "transient"
        raise StoreIOError(f"publishing {final.name} failed ({kind}): {exc}", exc.errno) from exc


__all__ = [
    "DIRECT_DIR_MODE",
    "LEASE_FILE_MODE",
    "PUBLISHED_MODE",
    "create_lease_file",
    "open_lease_file",
    "publish_lease_file",
    "share_dirs",
]
