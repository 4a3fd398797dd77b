"""``scripts/sim_router.py --engine vllm``: vLLM 0.33's real scheduler serves, the router learns.

Runs under the vLLM venv (skipped where vLLM does not import). Bounded: a
60-request trace, two workers, three policies.
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

SCRIPT = ROOT / "scripts" / "sim_router.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_vllm_workers_serve_every_request_and_the_json_keeps_its_shape(tmp_path: Path) -> None:
    trace = make_trace(tmp_path / "trace.jsonl", n=60)
    out = tmp_path / "out.json"
    r = run(
        "--trace", str(trace), "--engine", "vllm", "--quick", "--noise", "0.5",
        "--policy", "kvoffload", "--policy", "dynamo", "--policy", "round-robin",
        "--no-microbench", "--json", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    params = data["params"]
    assert params["engine"] == "vllm" and params["noise"] == 0.5 and params["budget"] == 8192
    # The router is not handed the step model: its priors are the defaults.
    assert params["router_priors"]["prefill_b_s"] != params["step"]["token_s"]
    rows = data["results"]
    assert [row["policy"] for row in rows] == ["kvoffload", "dynamo", "round-robin"]
    for row in rows:
        assert row["workers"] == 2 and row["load"] == "saturation"
        assert row["served"] == row["requests"] == 60
        assert 0 < row["ttft_p50_s"] <= row["ttft_p90_s"] <= row["ttft_p99_s"]
        assert 0 <= row["hit_rate_gpu"] <= 1
    ours = rows[0]
    assert ours["estimate_error_abs_p50"] is not None
    # vLLM's own prefix cache served the multi-turn trace's repeated prefixes.
    assert ours["hit_rate_gpu"] > 0


def test_bad_noise_is_one_line(tmp_path: Path) -> None:
    trace = make_trace(tmp_path / "trace.jsonl", n=5)
    r = run("--trace", str(trace), "--engine", "vllm", "--noise", "-1", "--no-microbench")
    assert r.returncode == 2 and "--noise" in r.stderr and "Traceback" not in r.stderr
