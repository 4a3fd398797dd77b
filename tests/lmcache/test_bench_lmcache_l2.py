"""scripts/bench_lmcache_l2.py --quick runs both adapters and their ceilings in one run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_lmcache_l2.py"


def test_quick_run_prints_both_adapters_beside_their_ceilings(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--dir", str(tmp_path), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    for op in ("put", "get warm"):
        got = {x["adapter"]: x for x in rows if x["name"] == op}
        assert {"kvoffload", "lmcache-fs"} <= set(got) and len(got) == 3
        assert all(x["gbps"] > 0 and x["batches"] >= 2 for x in got.values())
        assert all(got[a]["ceiling_gbps"] for a in ("kvoffload", "lmcache-fs"))
    assert "x ceil" in r.stdout and "kvoffload / lmcache fs" in r.stdout
    assert not list(tmp_path.glob(".bench_lmcache_l2-*"))  # its scratch dir is gone
