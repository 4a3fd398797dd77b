"""Smoke test of scripts/bench_shared.py on the JuiceFS tier: it runs, reports every
row and measure, and B found every chunk A saved. No timing assertions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .sharedfs import juicefs_unavailable

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_shared.py"


@pytest.mark.slow
@pytest.mark.skipif(juicefs_unavailable() is not None, reason=str(juicefs_unavailable()))
def test_bench_shared_quick_reports_every_row(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out), "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = {r["id"]: r for r in doc["rows"]}
    assert rows["raw read, node B's client"]["gbs"] > 0
    load = rows["cross-node load (sealed, verified)"]
    assert load["loaded"] == doc["chunk"]["chunks"] and load["gbs"] > 0
    assert doc["discovery_s"]["found"] == doc["discovery_s"]["of"]
    ex = doc["existence_check_s"]
    assert ex["adopted"] == 16 and ex["absent_found"] == 0
    assert "discovery delay" in proc.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["b.json"]  # nothing left behind
