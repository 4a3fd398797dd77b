"""Helpers shared by the tests (moved out of test_cli_live.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

from kvoffload.testing import SidecarProcess, cli_argv


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
