"""What a small object's save costs on this file system, by syscall pattern (issue 30, lever 3).

The store writes each object as its own file (layout-v1.md §3): create a
temp name with O_EXCL, fallocate, write, fstat, (fsync), close, rename onto
the final name, (fsync the directory). For small chunks the bytes are the
least of it: inode allocation and the directory operations are the cost.
This script times, op by op interleaved on the same directory tree (one
leaf directory per object, as the store's fan-out gives), the current
pattern and its alternatives, each with the same visibility rule (no partial
object is ever at its final name) and the same durability:

``current``
    the store's pattern above (``files.write_atomic``'s syscalls).
``no fallocate``
    the same without the fallocate (a small write allocates at once anyway).
``O_TMPFILE+link``
    an unnamed inode in the leaf (``O_TMPFILE``), written, (fsync'd), then
    linked at its final name (``linkat`` through ``/proc/self/fd``): no temp
    name to create, rename or clean up after a crash.
``batch dir fsync``
    ``current`` at durability object, with one fsync per distinct parent of
    a batch after every object of it, before the batch counts as saved (the
    store commits a batch's index records only after all its objects):
    what a batch of 4 into the same leaf would save.
``raw write``
    the floor: one pwrite into a file kept open (no inode, no name).

Printed: per pattern and durability, µs per object and objects/s, and the
ratio to ``current``. Usage::

    .venv/bin/python scripts/bench_small_saves.py --dir /mnt/nvme [--size 65536] [--n 400]
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

O_TMPFILE = getattr(os, "O_TMPFILE", 0o20200000)
_AT_FDCWD = -100
_AT_SYMLINK_FOLLOW = 0x400
_libc = ctypes.CDLL(None, use_errno=True)


def _link_fd(fd: int, final: str) -> None:
    """linkat(AT_FDCWD, "/proc/self/fd/N", AT_FDCWD, final, AT_SYMLINK_FOLLOW): the
    unprivileged way to give an O_TMPFILE inode a name (os.link does not follow)."""
    src = f"/proc/self/fd/{fd}".encode()
    if _libc.linkat(_AT_FDCWD, src, _AT_FDCWD, os.fsencode(final), _AT_SYMLINK_FOLLOW):
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), final)


BATCH = 4


def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Patterns:
    def __init__(self, root: Path, data: bytes) -> None:
        self.root = root
        self.data = data
        self.n = 0
        self.leaf_no = 0
        self.raw_fd = os.open(root / "raw", os.O_WRONLY | os.O_CREAT, 0o640)

    def _leaf(self, name: str, same: bool = False) -> tuple[str, str]:
        """A leaf of tree ``name`` (the next one, or with ``same`` the last one
        again) and a fresh object name in it."""
        self.n += 1
        if not same:
            self.leaf_no = (self.leaf_no + 1) % 256
        leaf = self.root / name / f"{self.leaf_no:02x}"
        leaf.mkdir(parents=True, exist_ok=True)
        return str(leaf), str(leaf / f"obj{self.n}")

    def current(
        self, sync: bool, fallocate: bool = True, tree: str = "", same: bool = False
    ) -> str:
        leaf, final = self._leaf(tree or ("cur" if fallocate else "nofa"), same)
        if os.path.exists(final):
            raise FileExistsError(final)
        tmp = f"{leaf}/.tmp{self.n}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o640)
        try:
            if fallocate:
                os.posix_fallocate(fd, 0, len(self.data))
            os.pwrite(fd, self.data, 0)
            if os.fstat(fd).st_size != len(self.data):
                raise OSError(errno.EIO, "short")
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, final)
        return leaf

    def tmpfile(self, sync: bool) -> str:
        leaf, final = self._leaf("tmpf")
        if os.path.exists(final):
            raise FileExistsError(final)
        fd = os.open(leaf, O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o640)
        try:
            os.pwrite(fd, self.data, 0)
            if os.fstat(fd).st_size != len(self.data):
                raise OSError(errno.EIO, "short")
            if sync:
                os.fsync(fd)
            _link_fd(fd, final)
        finally:
            os.close(fd)
        return leaf

    def raw(self, sync: bool) -> None:
        os.pwrite(self.raw_fd, self.data, 0)
        if sync:
            os.fdatasync(self.raw_fd)


def _ops(pat: Patterns, sync: bool) -> dict[str, Callable[[], None]]:
    """The patterns at one durability, each saving one batch of :data:`BATCH` objects."""

    def batch_of(one: Callable[[], str]) -> Callable[[], None]:
        def run() -> None:
            for leaf in [one() for _ in range(BATCH)]:
                if sync:
                    _fsync_dir(leaf)

        return run

    def dirsync_per_batch(same_leaf: bool) -> Callable[[], None]:
        tree = "one" if same_leaf else "four"

        def run() -> None:
            leaves = {pat.current(sync, tree=tree, same=same_leaf and i > 0) for i in range(BATCH)}
            for leaf in leaves:
                if sync:
                    _fsync_dir(leaf)

        return run

    def raw() -> None:
        for _ in range(BATCH):
            pat.raw(sync)

    return {
        "current": batch_of(lambda: pat.current(sync)),
        "no fallocate": batch_of(lambda: pat.current(sync, fallocate=False)),
        "O_TMPFILE+link": batch_of(lambda: pat.tmpfile(sync)),
        "batch dir fsync, 4 leaves": dirsync_per_batch(False),
        "batch dir fsync, 1 leaf": dirsync_per_batch(True),
        "raw write": raw,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path.cwd())
    ap.add_argument("--size", type=int, default=64 << 10, help="object bytes (default 64 KiB)")
    ap.add_argument("--n", type=int, default=400, help="batches of 4 per pattern")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvo-small-", dir=a.dir))
    try:
        pat = Patterns(root, os.urandom(a.size))
        for sync, dur in ((False, "none"), (True, "object")):
            ops = _ops(pat, sync)
            times: dict[str, list[float]] = {k: [] for k in ops}
            for _ in range(a.n):  # interleaved, op by op
                for name, op in ops.items():
                    t = time.perf_counter()
                    op()
                    times[name].append((time.perf_counter() - t) / BATCH)
            base = statistics.median(times["current"])
            print(f"\n{a.size} B objects, durability {dur}, batches of {BATCH} x {a.n}, {a.dir}")
            print(
                f"{'pattern':28s} {'p50 us/obj':>11s} {'mean':>9s} {'obj/s':>9s} {'x current':>10s}"
            )
            for name, ts in times.items():
                p50 = statistics.median(ts)
                print(
                    f"{name:28s} {p50 * 1e6:11.1f} {statistics.fmean(ts) * 1e6:9.1f} "
                    f"{1 / p50:9.0f} {base / p50:9.2f}x"
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
