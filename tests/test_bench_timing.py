"""Smoke test of scripts/bench_timing.py (a real sidecar, a few probes per kind), and its
Mann-Whitney U test against reference values.

No timing assertion but a lower bound: a padded probe's round trip contains the floor.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_timing.py"
KINDS = {
    "forbidden_present",
    "forbidden_absent",
    "empty_absent",
    "own_absent",
    "own_present",
    "padded_present",
    "padded_absent",
    "load_forbidden",
    "load_empty",
}


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_timing", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_mann_whitney_matches_reference_values() -> None:
    mw = _module().mann_whitney
    # No ties: U = 0, mean 50, variance 10*10*21/12 = 175, continuity-corrected
    # z = -49.5 / sqrt(175) = -3.7418, two-sided p = 2 * Phi(-3.7418) = 1.827e-4.
    r = mw(np.arange(1.0, 11.0), np.arange(11.0, 21.0))
    assert r["u"] == 0.0 and r["auc"] == 0.0
    assert r["p"] == pytest.approx(1.827e-4, rel=2e-3)
    # Ties: U = 0 + 0.5 + 0.5 + 1.5 + 4 = 6.5 (b below each a, ties half); tie groups
    # of 3, 2, 2 give variance 25/12 * (11 - 36/90) = 22.083; z = -5.5 / 4.6993 =
    # -1.1704, p = 0.2418.
    r = mw(np.array([1.0, 2, 2, 3, 5]), np.array([2.0, 3, 4, 4, 6]))
    assert r["u"] == 6.5
    assert r["p"] == pytest.approx(0.2418, abs=1e-3)
    same = mw(np.ones(50), np.ones(50))
    assert same["p"] == 1.0 and same["auc"] == 0.5
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=300), rng.normal(size=200)
    assert mw(a, b)["auc"] + mw(b, a)["auc"] == pytest.approx(1.0)
    assert mw(a, b)["p"] == pytest.approx(mw(b, a)["p"])


@pytest.mark.slow
def test_bench_timing_quick_reports_every_kind_and_pair(tmp_path: Path) -> None:
    out = tmp_path / "timing.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--probes",
            "30",
            "--warmup",
            "10",
            "--floor",
            "3ms",
            "--jitter",
            "1ms",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert "Mann-Whitney" in proc.stdout and "load average" in proc.stdout
    assert set(doc["kinds"]) == KINDS
    for kind, s in doc["kinds"].items():
        assert s["n"] == 30, kind
        assert 0 < s["min_us"] <= s["median_us"] <= s["p90_us"], kind
    # The floor is a lower bound on every padded probe's round trip.
    assert doc["kinds"]["padded_present"]["min_us"] >= 3000
    assert doc["kinds"]["padded_absent"]["min_us"] >= 3000
    pairs = {(r["a"], r["b"]) for r in doc["pairs"]}
    assert ("forbidden_present", "empty_absent") in pairs
    assert ("forbidden_present", "forbidden_absent") in pairs
    assert ("own_present", "own_absent") in pairs
    assert ("padded_present", "padded_absent") in pairs
    assert ("load_forbidden", "load_empty") in pairs
    for r in doc["pairs"]:
        assert 0.0 <= r["p"] <= 1.0 and 0.0 <= r["auc"] <= 1.0, r
        assert isinstance(r["distinguishable"], bool)
    facts = doc["facts"]
    assert facts["cores"] >= 1 and len(facts["load average before probes"]) == 3
    assert doc["lookup_padding"]["padded"]["padded"] >= 60
    assert doc["config"]["probes_per_kind"] == 30 and doc["config"]["floor"] == "3ms"
