"""Where a benchmark row's time goes: the CPU both processes spend on it, and where.

``RowCpu`` measures, for the kvoffload calls of one row, the CPU time of the
calling thread (``time.thread_time`` around each call: the client's own work,
never the raw ceilings interleaved with it) and of the whole sidecar process
(every thread, its process CPU-time clock, over the row: the sidecar idles while
the ceilings run). Per GB of payload, with the wall time beside them, they say
whether a row is bound by the CPU of this machine: ``cores busy`` near the core
count means it is, and then no I/O lever can make it faster.

``Spy`` samples a process with py-spy (``--nonblocking``: the process is never
paused; idle threads are not sampled) for the length of a row, and
``leaf_frames`` reduces the raw stacks to the frames where the samples fell:
a line that calls into native code (AES-GCM, a ``preadv``) stands for that
code's time. py-spy is a tool, not a dependency: ``find_py_spy`` is None where
it is not installed (``pip install py-spy``).
"""

from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

GB = 1e9
_TICK = os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds of every thread of ``pid`` so far, to the nanosecond: the
    process's CPU-time clock (``clock_getcpuclockid(3)``'s id, which Python
    does not wrap: ``(~pid << 3) | CPUCLOCK_SCHED``); ``/proc/PID/stat``'s
    clock ticks where the clock cannot be read."""
    try:
        return time.clock_gettime((~pid << 3) | 2)
    except OSError:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK


def find_py_spy() -> str | None:
    """py-spy beside this interpreter (a venv's bin) or on PATH; None if absent."""
    here = Path(sys.executable).parent / "py-spy"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("py-spy")


@dataclass
class Frame:
    share: float  # of the process's (or the selection's) active samples
    frame: str  # "function (path:line)" as py-spy names it, path shortened


def _short(frame: str) -> str:
    """'fn (/x/site-packages/kvoffload/a/b.py:12)' -> 'fn (kvoffload/a/b.py:12)'."""
    if " (" not in frame:
        return frame
    fn, where = frame.split(" (", 1)
    for mark in ("site-packages/", "/src/", "/scripts/", "/lib/python3."):
        if mark in where:
            where = where.split(mark, 1)[1]
            if mark == "/lib/python3.":
                where = where.split("/", 1)[-1]
            break
    return f"{fn} ({where}"


#: Leaf frames of a thread that waits (py-spy --nonblocking cannot always tell
#: an idle thread): the event loop's poll, an idle pool thread, the client
#: waiting for its reply. Counted apart, as waiting, not as work.
WAITS = (
    "select (selectors.py:",
    "_worker (concurrent/futures/thread.py:",
    "_wait_readable (kvoffload/transport.py:",
    "wait (threading.py:",
    "get (queue.py:",
)


@dataclass
class Leaves:
    """Where a recording's samples fell: ``samples`` in all, the share of them in
    a :data:`WAITS` frame, and the ``top`` leaf frames as shares of the others
    (the process's work)."""

    samples: int
    waiting: float
    top: list[Frame]


def leaf_frames(raw: Path, *, only: str | None = None, top: int = 6) -> Leaves:
    """:class:`Leaves` of a py-spy raw (collapsed) file; ``only``: keep the
    stacks that pass through a frame containing it (the client's calls into
    kvoffload, not the ceilings run between them)."""
    counts: collections.Counter[str] = collections.Counter()
    total = waits = 0
    try:
        lines = raw.read_text(errors="replace").splitlines()
    except OSError:
        return Leaves(0, 0.0, [])
    for line in lines:
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack or not n.isdigit():
            continue
        if only is not None and only not in stack:
            continue
        total += int(n)
        leaf = _short(stack.split(";")[-1])
        if any(w in leaf for w in WAITS):
            waits += int(n)
        else:
            counts[leaf] += int(n)
    work = total - waits
    return Leaves(
        total,
        waits / total if total else 0.0,
        [Frame(c / work, f) for f, c in counts.most_common(top)] if work else [],
    )


@dataclass
class Profile:
    """A py-spy recording of one process during one row, reduced to its leaf frames."""

    process: str  # "sidecar" | "client"
    path: str
    leaves: Leaves

    def to_json(self) -> dict[str, object]:
        return {
            "process": self.process,
            "samples": self.leaves.samples,
            "waiting": self.leaves.waiting,
            "path": self.path,
            "top": [{"share": f.share, "frame": f.frame} for f in self.leaves.top],
        }


class Spy:
    """``py-spy record`` of ``pid`` into ``out`` (raw format) while the block runs."""

    def __init__(self, exe: str, pid: int, out: Path, rate: int = 1000) -> None:
        self.exe, self.pid, self.out, self.rate = exe, pid, out, rate
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Spy:
        log = self.out.with_suffix(".log")
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [self.exe, "record", "--nonblocking", "--rate", str(self.rate), "--format",
                 "raw", "--output", str(self.out), "--pid", str(self.pid)],
                stdout=subprocess.DEVNULL,
                stderr=err,
            )  # fmt: skip
        time.sleep(0.3)  # attached before the row starts
        if self.proc.poll() is not None:  # it could not attach (ptrace refused, say)
            said = log.read_text(errors="replace").strip().splitlines()
            raise RuntimeError(
                f"py-spy could not record pid {self.pid}: "
                f"{said[-1] if said else f'exit {self.proc.returncode}'}"
            )
        return self

    def __exit__(self, *_exc: object) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            reap(proc, 30)


def reap(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Wait for ``proc`` to end, killing it after ``timeout_s``."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class CpuSplit:
    """CPU seconds per GB of payload of one row's kvoffload calls."""

    sidecar_s_per_gb: float
    client_s_per_gb: float
    wall_s_per_gb: float
    cores: int

    @property
    def cores_busy(self) -> float:
        """Cores the two processes kept busy on average while the calls ran."""
        if self.wall_s_per_gb <= 0:
            return 0.0
        return (self.sidecar_s_per_gb + self.client_s_per_gb) / self.wall_s_per_gb

    @property
    def cpu_bound_gbps(self) -> float:
        """The GB/s this CPU work allows were it spread perfectly over every core."""
        used = self.sidecar_s_per_gb + self.client_s_per_gb
        return self.cores / used if used > 0 else float("inf")

    def to_json(self) -> dict[str, float]:
        return {
            "sidecar_cpu_s_per_gb": self.sidecar_s_per_gb,
            "client_cpu_s_per_gb": self.client_s_per_gb,
            "wall_s_per_gb": self.wall_s_per_gb,
            "cores_busy": self.cores_busy,
            "cpu_bound_gbps": self.cpu_bound_gbps,
        }


class RowCpu:
    """The CPU time of one row's kvoffload calls (see the module docstring)."""

    def __init__(self, sidecar_pid: int) -> None:
        self.pid = sidecar_pid
        self.calls = 0
        self.client_s = 0.0
        self.wall_s = 0.0
        self.sidecar_s = 0.0
        self._start = 0.0

    def wrap(self, op: Callable[[int], object]) -> Callable[[int], None]:
        def counted(i: int) -> None:
            c, w = time.thread_time(), time.perf_counter()
            try:
                op(i)
            finally:
                self.client_s += time.thread_time() - c
                self.wall_s += time.perf_counter() - w
                self.calls += 1

        return counted

    def __enter__(self) -> RowCpu:
        self._start = process_cpu_seconds(self.pid)
        return self

    def __exit__(self, *_exc: object) -> None:
        self.sidecar_s = process_cpu_seconds(self.pid) - self._start

    def split(self, payload_per_call: int) -> CpuSplit | None:
        """Per GB over every call of the row (its untimed warm-up call included,
        since the sidecar's CPU cannot be told apart per call)."""
        gb = self.calls * payload_per_call / GB
        if gb <= 0:
            return None
        return CpuSplit(
            self.sidecar_s / gb, self.client_s / gb, self.wall_s / gb, os.cpu_count() or 1
        )


def spied(
    exe: str | None, pids: Sequence[tuple[str, int]], out_dir: Path | None, stem: str
) -> list[tuple[str, Spy]]:
    """One (process name, :class:`Spy`) per (name, pid), recording into
    ``out_dir/stem-NAME.txt``; none where py-spy or the directory is not given."""
    if exe is None or out_dir is None:
        return []
    return [(name, Spy(exe, pid, out_dir / f"{stem}-{name}.txt")) for name, pid in pids]
