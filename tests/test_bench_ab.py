"""scripts/ab_sidecar.py: the A/B wrapper's verdict and its refusals (no benchmark runs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ab_sidecar as ab
from tests.helpers.paths import REPO, SCRIPTS


def test_a_row_is_worse_only_beyond_both_trees_spread() -> None:
    gbps = ab.Samples("GB/s", True, {"a": [1.0, 1.2, 1.1], "b": [1.05, 0.95, 1.0]})
    assert ab.verdict(gbps, "a", "b")[1] == "within noise"  # b's best is above a's worst
    gbps.values["b"] = [0.8, 0.85, 0.9]
    ratio, v = ab.verdict(gbps, "a", "b")
    assert v == "worse" and ratio is not None and abs(ratio - 0.85 / 1.1) < 1e-9
    lat = ab.Samples("µs", False, {"a": [100.0, 120.0], "b": [80.0, 90.0]})
    assert ab.verdict(lat, "a", "b")[1] == "better"  # lower latency in every round
    assert ab.verdict(ab.Samples("µs", False, {"a": [1.0]}), "a", "b") == (None, "missing")


def test_collect_reads_the_target_and_latency_rows() -> None:
    doc = {
        "targets": [{"id": "large/object/save", "ours_gbps": 1.5}],
        "latency": [{"kind": "kvoffload", "id": "object/lookup-64", "p50_us": 90, "p99_us": 140}],
    }
    got: dict[str, ab.Samples] = {}
    ab.collect(doc, "after", got)
    assert got["large/object/save GB/s"].values == {"after": [1.5]}
    assert got["kvoffload object/lookup-64 p99"].values == {"after": [140]}


def test_the_sidecar_cpu_per_lookup_is_read_from_the_json_or_the_printed_line() -> None:
    got: dict[str, ab.Samples] = {}
    ab.collect({"lookup_cpu_us": {"object": 31.5}}, "after", got)
    line = "  none/sidecar CPU per 1-key lookup    72.4 us (goal <= 25)"
    ab.collect({"lookup_cpu_us": dict(ab.cpu_lines(line))}, "before", got)
    assert got["object/sidecar CPU per 1-key lookup µs"].values == {"after": [31.5]}
    assert got["none/sidecar CPU per 1-key lookup µs"].values == {"before": [72.4]}
    assert not got["none/sidecar CPU per 1-key lookup µs"].higher_is_better


def test_bad_trees_get_one_line(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(SCRIPTS / "ab_sidecar.py"), *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    for args, says in (
        (("--tree", f"a={REPO}"), "exactly two"),
        (("--tree", f"a={REPO}", "--tree", f"b={tmp_path}"), "not a kvoffload checkout"),
        (("--tree", str(REPO), "--tree", f"b={REPO}"), "NAME=PATH"),
    ):
        proc = run(*args)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
        assert says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
