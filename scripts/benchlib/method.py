"""The measurement method every benchmark here shares, free of kvoffload imports.

``lmcache_peer.py`` runs in LMCache's own virtualenv, where kvoffload is not
installed; it and the kvoffload benchmarks import this module so that
kvoffload's rows and LMCache's are timed, made cold and cleaned up by the same
code.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType

import numpy as np

Timing = tuple[int, float, float]  # (timed ops, seconds summed over them, median s/op)
PathLike = str | os.PathLike[str]


def interleaved(
    ops: Sequence[Callable[[int], object]], *, n: int, budget_s: float, min_ops: int
) -> list[Timing]:
    """Warm up with ``op(0)`` for each op, then run ``op(i)`` for i in 1..n, each op in turn.

    The order rotates every i, so no op always runs right after another. Stops
    once ``budget_s`` per op is spent and every op has run ``min_ops`` times.
    """
    for op in ops:
        check_interrupt()
        op(0)
    lat: list[list[float]] = [[] for _ in ops]
    spent = 0.0
    for i in range(1, n + 1):
        for j in range(len(ops)):
            check_interrupt()  # a Ctrl-C that a finalizer swallowed stops the run here
            k = (i + j) % len(ops)
            s = time.perf_counter()
            ops[k](i)
            dt = time.perf_counter() - s
            lat[k].append(dt)
            spent += dt
        if spent >= budget_s * len(ops) and i >= min_ops:
            break
    return [(len(x), sum(x), statistics.median(x)) for x in lat]


def write_all(fd: int, data: memoryview) -> None:
    """``os.write`` until all of ``data`` is written."""
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])


def choices(values: list[str] | None, allowed: Sequence[str], default: Sequence[str]) -> list[str]:
    """The values of a repeatable, comma-separated option, in order, without repeats
    (``default`` when none is given); ValueError names one that is not ``allowed``."""
    out: list[str] = []
    for item in values or [",".join(default)]:
        for v in item.split(","):
            v = v.strip()
            if v not in allowed:
                raise ValueError(f"{v!r} is not one of {', '.join(allowed)}")
            if v not in out:
                out.append(v)
    return out


# --------------------------------------------------------------------------- page cache


class Mincore:
    """Page-cache residency of whole files via mmap(2) + mincore(2) (ctypes)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self._mmap = libc.mmap
        self._mmap.restype = ctypes.c_void_p
        self._mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        self._munmap = libc.munmap
        self._munmap.restype = ctypes.c_int
        self._munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self._mincore = libc.mincore
        self._mincore.restype = ctypes.c_int
        self._mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._failed = ctypes.c_void_p(-1).value

    def resident(self, paths: Sequence[PathLike]) -> float | None:
        """Fraction of the files' pages in the page cache, or None if it cannot be told."""
        total = cached = 0
        for p in paths:
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
            try:
                size = os.fstat(fd).st_size
                if size == 0:
                    continue
                pages = (size + self._page - 1) // self._page
                addr = self._mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if addr is None or addr == self._failed:
                    return None
                try:
                    vec = (ctypes.c_ubyte * pages)()
                    if self._mincore(addr, size, vec) != 0:
                        return None
                    cached += int(np.count_nonzero(np.frombuffer(bytes(vec), dtype=np.uint8) & 1))
                    total += pages
                finally:
                    self._munmap(addr, size)
            finally:
                os.close(fd)
        return cached / total if total else None


def drop_cache(paths: Sequence[PathLike]) -> None:
    """Make ``paths`` cold: sync (DONTNEED only drops clean pages), then fadvise each."""
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------- run


def cmd(args: Sequence[str]) -> str:
    """A command's output for the machine facts, or "unknown (why)"."""
    try:
        res = subprocess.run(list(args), capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc.__class__.__name__})"
    return res.stdout.strip() or f"unknown ({res.stderr.strip()[:60]})"


def loadavg() -> str:
    """The 1/5/15-minute load averages, for the machine facts of a run."""
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


#: Signals received inside :func:`scratch_dir`: their KeyboardInterrupt may have
#: been raised inside a finalizer (a ``__del__`` the garbage collector ran), where
#: Python prints it and goes on; :func:`check_interrupt` raises it again.
_received: list[int] = []


def raise_interrupt(signum: int, _frame: FrameType | None) -> None:
    _received.append(signum)
    raise KeyboardInterrupt(f"signal {signum}")


def check_interrupt() -> None:
    """Raise KeyboardInterrupt if a signal asked for one, even one swallowed."""
    if _received:
        raise KeyboardInterrupt(f"signal {_received[-1]}")


@contextlib.contextmanager
def scratch_dir(parent: Path, prefix: str) -> Iterator[Path]:
    """A temp dir removed on exit, Ctrl-C, SIGTERM and SIGHUP (every benchmark's).

    Ctrl-C is taken over only where Python's own handler is in place (a job
    started with SIGINT ignored keeps ignoring it)."""
    sigs = [signal.SIGTERM, signal.SIGHUP]
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        sigs.append(signal.SIGINT)
    _received.clear()
    old = {s: signal.signal(s, raise_interrupt) for s in sigs}
    try:
        d = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        try:
            yield d
        finally:
            shutil.rmtree(d, ignore_errors=True)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
