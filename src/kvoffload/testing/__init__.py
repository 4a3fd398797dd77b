"""Start a sidecar as a real process, for tests, the demo and the benchmarks.

The one place that knows how to run ``python -m kvoffload.cli … serve`` as a
child, wait until it answers ``stats`` on its socket, quote its log when it
does not, and stop it (SIGTERM, then SIGKILL):

* :class:`SidecarProcess`: one such process (any CLI arguments, any argv);
* :func:`dev_sidecar`: the embedded development sidecar of a directory
  (``kvoffload --dev serve`` there), optionally reusing one that already
  answers; its socket moves to a short temp dir when the path would not fit
  ``sun_path``.

Standard library only at import time; the client is imported when polling.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ..errors import SidecarStartError

__all__ = [
    "MAX_SOCKET_PATH",
    "READY_TIMEOUT_S",
    "RunningSidecar",
    "SidecarProcess",
    "SidecarStartError",
    "answers",
    "cli_argv",
    "dev_sidecar",
    "die_with_parent",
    "prepare_die_with_parent",
    "sidecar_env",
    "socket_fits",
]

READY_TIMEOUT_S = 60.0
#: A Unix socket path must fit sun_path (108 bytes with its NUL); keep a margin.
MAX_SOCKET_PATH = 100
#: What would configure a child sidecar behind a test's back.
_ENV_DROP = ("KVOFFLOAD_", "LISTEN_", "NOTIFY_SOCKET", "WATCHDOG_")
_PR_SET_PDEATHSIG = 1


def sidecar_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without anything that configures a sidecar, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_ENV_DROP)}
    env.update(extra or {})
    return env


def cli_argv(*args: str) -> list[str]:
    """``python -m kvoffload.cli ARGS`` with this interpreter."""
    return [sys.executable, "-m", "kvoffload.cli", *args]


def socket_fits(path: Path) -> bool:
    return len(os.fsencode(path)) < MAX_SOCKET_PATH


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def prepare_die_with_parent() -> None:
    """Load libc in the parent, before a fork whose child runs :func:`die_with_parent`."""
    if sys.platform.startswith("linux"):
        _libc()


def die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """``preexec_fn``: the child gets SIGTERM when its parent dies, even by SIGKILL.

    libc is loaded by the parent before the fork (see :meth:`SidecarProcess.start`):
    the child, maybe forked from a threaded process, only calls into it."""
    if sys.platform.startswith("linux"):
        _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def answers(socket_path: Path, timeout_s: float = 2.0) -> dict[str, Any] | None:
    """The sidecar's stats if one answers on ``socket_path``, else None."""
    from ..client import fetch_stats
    from ..errors import ProtocolError, TransportError

    if not socket_path.exists():
        return None
    try:
        return fetch_stats(socket_path, timeout_s=timeout_s)
    except (TransportError, ProtocolError, OSError):
        return None


class SidecarProcess:
    """One sidecar process; stdout and stderr go to ``log_path`` (appended) or a temp file."""

    def __init__(
        self,
        workdir: Path,
        socket_path: Path,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        clean_env: bool = True,
        pass_fds: Sequence[int] = (),
        log_path: Path | None = None,
        tie_to_parent: bool = False,
    ) -> None:
        self.workdir = workdir
        self.socket_path = socket_path
        self.argv = list(argv)
        self.env = sidecar_env(env) if clean_env else dict(env or os.environ)
        self.pass_fds = tuple(pass_fds)
        self.log_path = log_path
        self.tie_to_parent = tie_to_parent
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> SidecarProcess:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self._close_log()
        if self.log_path is not None:
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in _close_log
        else:
            self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in _close_log
        if self.tie_to_parent:
            prepare_die_with_parent()
        self.proc = subprocess.Popen(
            self.argv,
            cwd=self.workdir,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            pass_fds=self.pass_fds,
            preexec_fn=die_with_parent if self.tie_to_parent else None,
        )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self, tail: int | None = None) -> str:
        text = ""
        if self.log_path is not None:
            with contextlib.suppress(FileNotFoundError):
                text = self.log_path.read_text(encoding="utf-8", errors="replace")
        elif self._log is not None:
            self._log.flush()
            self._log.seek(0)
            text = self._log.read().decode("utf-8", "replace")
        return text if tail is None else text[-tail:]

    def stats(self, timeout_s: float = 10.0) -> dict[str, Any]:
        from ..client import fetch_stats

        return fetch_stats(self.socket_path, timeout_s=timeout_s)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> dict[str, Any]:
        """Poll the socket until the sidecar answers ``stats``; its stats.

        Raises :class:`SidecarStartError` (quoting the log) if it exits or stays silent."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                raise SidecarStartError(
                    f"the sidecar exited with {self.returncode} during start-up:\n"
                    f"{self.log_text(4000)}"
                )
            stats = answers(self.socket_path)
            if stats is not None:
                return stats
            if time.monotonic() > deadline:
                raise SidecarStartError(
                    f"no answer on {self.socket_path} after {timeout_s:.0f} s:\n"
                    f"{self.log_text(4000)}"
                )
            time.sleep(0.05)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float = 30.0) -> int:
        """The exit status; :class:`subprocess.TimeoutExpired` if it is still running."""
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; reap; close the log (idempotent)."""
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        rc = self.returncode
        self._close_log()
        return rc

    def kill(self) -> None:
        """SIGKILL and reap (idempotent)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


@dataclass
class RunningSidecar:
    """A sidecar serving the embedded development store of ``directory``."""

    directory: Path
    socket_path: Path
    store_root: Path
    started: bool
    pid: int | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    stopped: bool = False
    process: SidecarProcess | None = None


@contextlib.contextmanager
def dev_sidecar(
    directory: Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    reuse: bool = False,
    log_path: Path | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
    process_class: type[SidecarProcess] = SidecarProcess,
) -> Iterator[RunningSidecar]:
    """The sidecar of ``directory``'s embedded store (``./.kvoffload``, default: cwd).

    With ``reuse``, one already answering on its socket is used (and left running).
    Otherwise ``python -m kvoffload.cli --dev serve`` starts there, with ``KVOFFLOAD_*``
    variables removed from its environment (``env`` added), tied to this process's
    life, and is stopped with SIGTERM on exit. :class:`SidecarStartError` if it
    does not come up, quoting its output. ``process_class``: a subclass of
    :class:`SidecarProcess` with the same constructor (tests add helpers)."""
    from ..sidecar.config import Config

    directory = (directory or Path.cwd()).resolve()
    cfg = Config.dev_default(directory)
    sock = cfg.socket_path
    running = RunningSidecar(directory, sock, cfg.store_root, started=False)
    if reuse:
        stats = answers(sock)
        if stats is not None:
            running.stats = stats
            yield running
            return
    extra = dict(env or {})
    with contextlib.ExitStack() as stack:
        if not socket_fits(sock):
            # Too long for sun_path: the same store, its socket in a short temp dir.
            short = Path(tempfile.mkdtemp(prefix="kvo-"))
            stack.callback(shutil.rmtree, short, True)
            sock = running.socket_path = short / "kvoffload.sock"
            extra["KVOFFLOAD_SERVER_SOCKET"] = str(sock)
        proc = process_class(
            directory,
            sock,
            cli_argv("--dev", "serve"),
            env=extra,
            log_path=log_path,
            tie_to_parent=True,
        )
        running.process = proc
        stack.callback(proc.stop)
        proc.start()
        running.started, running.pid = True, proc.pid
        try:
            running.stats = proc.wait_ready(ready_timeout_s)
            yield running
        finally:
            proc.stop()
            running.stopped = True
