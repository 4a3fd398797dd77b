"""Helpers shared by the tests (moved out of test_iobackend.py)."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload.store import files as fileio
from kvoffload.store.iobackend import (
    probe_direct,
)
from tests.helpers.paths import REPO


def direct_dirs(tmp_path: Path) -> Iterator[Path]:
    """A directory whose file system takes O_DIRECT: tmp_path, else one under the repo."""
    if probe_direct(tmp_path).supported:
        yield tmp_path
        return
    d = REPO / f".pytest-odirect-{os.getpid()}"
    d.mkdir(exist_ok=True)
    try:
        rep = probe_direct(d)
        if not rep.supported:
            pytest.skip(
                f"no O_DIRECT here: tmp_path: {probe_direct(tmp_path).detail}; repo: {rep.detail}"
            )
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def cached_pages(path: Path) -> int | None:
    fd = os.open(path, os.O_RDONLY)
    try:
        return fileio.cached_pages(fd)
    finally:
        os.close(fd)


class DirectReads:
    """Records every O_DIRECT a descriptor is switched to with fcntl (the real call runs)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = fcntl.fcntl

        def spy(fd: int, cmd: int, arg: int = 0) -> Any:
            if cmd == fcntl.F_SETFL and arg & fileio.O_DIRECT:
                self.count += 1
            return real(fd, cmd, arg)

        monkeypatch.setattr(fcntl, "fcntl", spy)
