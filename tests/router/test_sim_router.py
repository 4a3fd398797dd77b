"""Smoke tests of scripts/sim_router.py: every policy runs on a small trace, the JSON is readable,
and bad input is one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvoffload.router.peers import PEERS

from .procs import ROOT, env
from .sim_trace import make_trace

SCRIPT = ROOT / "scripts" / "sim_router.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_policy_runs_and_the_json_has_every_row(tmp_path: Path) -> None:
    trace = make_trace(tmp_path / "trace.jsonl")
    out = tmp_path / "out.json"
    r = run("--trace", str(trace), "--workers", "2", "--load", "saturation", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "lowest p90 TTFT" in r.stdout and "decisions/s" in r.stdout
    data = json.loads(out.read_text())
    assert data["params"]["loads"]["saturation"] == 0.85
    rows = data["results"]
    assert {row["policy"] for row in rows} == {*PEERS, "kvoffload", "kvoffload-shed"}
    for row in rows:
        assert row["workers"] == 2 and row["load"] == "saturation"
        assert row["served"] + row["shed"] == row["requests"] == 120
        assert (
            0 <= row["slo_attainment"] <= 1
            and 0 <= row["hit_rate"] <= row["infinite_cache_hit_rate"] + 1e-9
        )
        assert row["ttft_p50_s"] <= row["ttft_p90_s"] <= row["ttft_p99_s"]
    ours = next(row for row in rows if row["policy"] == "kvoffload")
    assert ours["estimate_error_abs_p50"] is not None and ours["shed"] == 0
    assert data["microbench"]["decisions_per_s"] > 0
    assert data["ttft_floor_s"]["p90"] > 0


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    r = run("--trace", str(tmp_path / "missing.jsonl"), "--no-microbench")
    assert r.returncode == 2 and "no trace file" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10}\n', encoding="utf-8")
    r = run("--trace", str(bad), "--no-microbench")
    assert r.returncode != 0 and "bad.jsonl:1: not a trace record" in r.stderr
    assert "Traceback" not in r.stderr
