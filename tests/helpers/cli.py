"""Running the kvoffload command line and a dev sidecar from tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from kvoffload.testing import SidecarProcess, cli_argv
from tests.sidecar_proc import clean_env


def cli(
    cwd: Path, sock: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    full["KVOFFLOAD_SERVER_SOCKET"] = str(sock)
    full.update(env or {})
    return subprocess.run(
        cli_argv(*args),
        cwd=cwd,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env=full,
        timeout=120,
    )


@contextlib.contextmanager
def sidecar(
    directory: Path, sock: Path, *args: str, env: dict[str, str] | None = None
) -> Iterator[SidecarProcess]:
    extra = {"KVOFFLOAD_SERVER_SOCKET": str(sock), **(env or {})}
    proc = SidecarProcess(
        directory, sock, cli_argv("--dev", *args, "serve"), env=extra, tie_to_parent=True
    )
    proc.start()
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


#: stderr lines a command may print besides its one line: the dev-KEK reminder,
#: purge's confirmation prompt, and the markers some tests print from a prelude.
NOT_THE_ONE_LINE = ("WARNING kvoffload.store.keys.keyring: development KEK", "Purge ", "marker:")


def run_cli(
    cwd: Path,
    *args: str,
    input: str | None = None,
    env: dict[str, str] | None = None,
    prelude: str = "",
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """``kvoffload ARGS`` as a newcomer runs it, in ``cwd``, with no KVOFFLOAD_* variable
    of the test's own environment; ``prelude``: Python run before the CLI is imported."""
    argv = [sys.executable, "-m", "kvoffload.cli"]
    if prelude:
        argv = [sys.executable, "-c", f"{prelude}\nfrom kvoffload.cli import main\nmain()\n"]
    return subprocess.run(
        [*argv, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        input=input,
        stdin=None if input is not None else subprocess.DEVNULL,
        env=clean_env(env),
        timeout=timeout,
    )


def one_line(r: subprocess.CompletedProcess[str], code: int, label: str) -> str:
    """A failure's one stderr line, ``label: ...``, exit ``code`` and no traceback."""
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith(NOT_THE_ONE_LINE)]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"{label}: "), lines[0]
    return lines[0]
