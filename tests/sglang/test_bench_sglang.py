"""Smoke test of scripts/bench_sglang.py: every row is printed, nothing is left behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ..sidecar_proc import clean_env

try:
    from benchlib.sglang import import_sglang

    import_sglang()
except ImportError as exc:  # the main venv: no SGLang
    pytest.skip(f"SGLang is not installed ({exc}); make pytest-sglang", allow_module_level=True)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_sglang.py"


def test_bench_sglang_prints_both_backends_beside_the_ceilings(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--dir", str(tmp_path), "--layers", "2",
         "--page-size", "16", "--batch", "2"],
        env=clean_env({"COLUMNS": "200"}),
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    for kind in ("backup", "prefetch"):
        for backend in ("HiCacheFile", "kvoffload staged", "kvoffload in place"):
            assert any(kind in ln and backend in ln for ln in lines), (kind, backend, r.stdout)
    assert any("memcpy" in ln for ln in lines)
    moved = next(ln for ln in lines if "moved in place" in ln)
    assert " 0 chunks stored" not in moved and " 0 loaded" not in moved, moved
    assert list(tmp_path.iterdir()) == []
