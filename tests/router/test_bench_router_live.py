"""``scripts/bench_router_live.py --quick``: every router's row, every request a full stream.

Runs under the vLLM venv (skipped where vLLM does not import); the sglang-router
rows need ``sglang_router`` (``.venv-sglang-router``, requirements/sglang-router.txt).
No timing assertions: the rows are there and every stream ended with ``[DONE]``
after ``max_tokens`` tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from .procs import ROOT, env
from .sim_trace import make_trace

SCRIPT = ROOT / "scripts" / "bench_router_live.py"
SGLANG = ROOT / ".venv-sglang-router" / "bin" / "python"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.slow
def test_quick_run_has_every_row_and_full_streams(tmp_path: Path) -> None:
    if not SGLANG.exists():
        pytest.skip("sglang-router not installed in .venv-sglang-router")
    trace = make_trace(tmp_path / "trace.jsonl", n=24)
    out = tmp_path / "live.json"
    r = run("--quick", "--trace", str(trace), "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = {row["router"]: row for row in doc["rows"]}
    assert set(rows) == {"kvoffload", "sglang", "round-robin"}
    assert rows["round-robin"]["detail"] == "sglang-router round_robin"
    for row in rows.values():
        assert row["requests"] == row["complete"] == 24 and row["errors"] == 0, row
        assert sum(row["per_engine"].values()) == 24
        assert 0 < row["ttft_p50_s"] <= row["ttft_p90_s"] <= row["ttft_p99_s"]
    assert doc["ceilings"]["idle_ttft_s"] > 0
    # Round-robin over two engines alternates: both served half.
    assert sorted(rows["round-robin"]["per_engine"].values()) == [12, 12]
    for name in ("kvoffload", "sglang", "round-robin", "ceiling"):
        assert name in r.stdout


def test_bad_option_is_one_line(tmp_path: Path) -> None:
    r = run("--quick", "--load", "0", "--trace", str(make_trace(tmp_path / "t.jsonl", n=5)))
    assert r.returncode == 2 and "--load" in r.stderr and "Traceback" not in r.stderr
