"""Run Python code on a file system that refuses O_DIRECT (ramfs), out of everyone's way."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_on_ramfs(tmp_path: Path, child: str, timeout: float = 120) -> dict[str, Any]:
    """Mount a fresh ramfs in a private user+mount namespace (nothing outside sees
    it), run ``child`` there (Python source; ``sys.argv[1]`` is the mount point)
    and return its last stdout line, parsed as JSON. Skips where no namespace or
    mount can be had."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1): cannot mount a file system that refuses O_DIRECT")
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    script = f'mount -t ramfs none "{mnt}" || exit 77; exec "{sys.executable}" -c "$0" "{mnt}"'
    proc = subprocess.run(
        [unshare, "-rm", "sh", "-c", script, child],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    if proc.returncode == 77 or "unshare failed" in proc.stderr:
        pytest.skip(f"cannot mount ramfs in a user namespace here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result
