"""Smoke tests of scripts/bench_store.py: it runs, reports every row, and leaves nothing behind.

No timing assertions: only that every expected row is there with a positive throughput.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from benchlib.chunks import NAMESPACE, TENANT, Shape
from benchlib.lmcache import run_lmcache_peer
from benchlib.method import drop_cache
from benchlib.stores import settle_ram_tier

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_store.py"
SHAPES = ("large", "small")
DURABILITIES = ("object", "none")
FORMATS = ("sealed", "plain")
ROWS = (
    "put sealed",
    "put plain",
    "get sealed cold",
    "get sealed warm",
    "get plain cold",
    "get plain warm",
)
CPU_CEILINGS = ("memcpy", "aes-gcm encrypt_into", "aes-gcm decrypt_into", "xxh3-128")
IO_CEILINGS = ("raw write {}-obj", "raw read cold {}-obj", "raw read warm {}-obj")
FACTS = ("cores", "filesystem (stat -f -c %T)", "python", "cryptography", "openssl")


def run_quick(script: Path, tmp_path: Path, *extra: str) -> tuple[str, dict[str, Any], Path]:
    """Run ``script --quick --json F --dir D`` in ``tmp_path``; must exit 0.
    Returns (stdout, the JSON document, D)."""
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", *extra, "--json", str(out), "--dir", str(work)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return proc.stdout, doc, work


@pytest.mark.slow
def test_bench_store_quick_writes_every_row(tmp_path: Path) -> None:
    stdout, doc, work = run_quick(SCRIPT, tmp_path)
    assert "kvoffload Store" in stdout

    rows = {r["id"]: r for r in doc["rows"]}
    ceilings = {r["id"]: r for r in doc["ceilings"]}
    expected_rows = {f"{s}/{d}/{r}" for s in SHAPES for d in DURABILITIES for r in ROWS}
    expected_ceilings = {f"{s}/{c}" for s in SHAPES for c in CPU_CEILINGS} | {
        f"{s}/{d}/{c.format(f)}"
        for s in SHAPES
        for d in DURABILITIES
        for c in IO_CEILINGS
        for f in FORMATS
    }
    assert set(rows) == expected_rows
    assert set(ceilings) == expected_ceilings
    for r in [*rows.values(), *ceilings.values()]:
        assert r["ops"] >= 1 and r["seconds"] > 0 and r["gbps"] > 0, r["id"]
    for r in rows.values():
        assert r["ceiling"] in {c["name"] for c in ceilings.values()}, r["id"]
        assert r["ceiling_gbps"] > 0 and r["ratio"] > 0, r["id"]
        assert r["bound_gbps"] > 0 and r["ratio_to_bound"] > 0, r["id"]
    for r in [*rows.values(), *ceilings.values()]:
        if "cold" in r["name"] or "warm" in r["name"]:
            assert r["cached"] is not None, r["id"]
    for fact in FACTS:
        assert doc["machine"][fact], fact
    assert list(work.iterdir()) == [], "the benchmark left files behind"


@pytest.mark.slow
def test_bench_store_cleans_up_when_interrupted(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--dir", str(work)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        # A shell without job control starts background jobs with SIGINT
        # ignored, and the child would inherit that (Python then installs no
        # KeyboardInterrupt handler): give it the disposition of a terminal's.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        # Interrupt once a store is open, so that closing it is part of the clean-up.
        while not any(work.glob(".bench_store-*/*/store")):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the benchmark never opened a store"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert list(work.iterdir()) == [], "the benchmark left files behind"


_SWALLOWED_INTERRUPT = """
import os, signal, sys
from pathlib import Path
from benchlib import method as bm

class TakesTheSignal:
    def __del__(self):  # its KeyboardInterrupt is printed and dropped by Python
        os.kill(os.getpid(), signal.SIGINT)

ran = []
def op(i):
    ran.append(i)
    if i == 1:
        TakesTheSignal()  # collected at once, in this op

try:
    with bm.scratch_dir(Path(sys.argv[1]), ".t-"):
        bm.interleaved([op], n=50, budget_s=60.0, min_ops=50)
except KeyboardInterrupt:
    print("interrupted after", ran)
    sys.exit(130)
print("ran to the end", ran)
"""


def test_an_interrupt_a_finalizer_swallowed_still_stops_the_benchmark(tmp_path: Path) -> None:
    """Ctrl-C landing in a ``__del__`` (the GC runs finalizers at any bytecode) is
    printed and dropped by Python; the benchmark must stop at its next op anyway
    and clean up, not run to its end (bench_store was seen to, in CI)."""
    proc = subprocess.run(
        [sys.executable, "-c", _SWALLOWED_INTERRUPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(SCRIPT.parent)},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert "Exception ignored" in proc.stderr  # the interrupt was swallowed once
    assert proc.returncode == 130, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "interrupted after [0, 1]"
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- bench_io.py

IO_SCRIPT = SCRIPT.parent / "bench_io.py"
PEER_SCRIPT = SCRIPT.parent / "lmcache_peer.py"
LMCACHE_PYTHON = SCRIPT.parent.parent / ".venv-lmcache" / "bin" / "python"
IO_BACKENDS = ("posix-buffered",)  # always runs; posix-direct only where O_DIRECT works
IO_ROWS = ("save sealed", "save plain", "save direct")
IO_LOADS = tuple(f"load {f} {c}" for c in ("cold", "warm") for f in ("sealed", "plain", "direct"))


@pytest.mark.slow
def test_bench_io_quick_writes_every_row(tmp_path: Path) -> None:
    stdout, doc, work = run_quick(IO_SCRIPT, tmp_path, "--no-lmcache")
    assert "kvoffload Store" in stdout
    assert "best sealed path" in stdout

    rows = {r["id"]: r for r in doc["rows"]}
    ran = [b["name"] for b in doc["backends"] if b["available"]]
    assert set(IO_BACKENDS) <= set(ran)
    for b in doc["backends"]:  # a backend that cannot run here says why
        assert b["available"] or b["reason"], b["name"]
    unavailable = {(u["backend"], u["shape"]) for u in doc["unavailable"]}
    for b in doc["backends"]:
        if not b["available"]:
            assert {(b["name"], s) for s in SHAPES} <= unavailable, b["name"]
    for s in SHAPES:
        for backend in ran:
            spec = next(b for b in doc["backends"] if b["name"] == backend)
            # the worker's direct path is benchmarked with the posix backends only
            posix = spec["plan"]["backend"] == "posix"
            for d in DURABILITIES:
                for r in IO_ROWS:
                    want = posix or "direct" not in r
                    assert (f"{s}/{d}/{backend}/{r}" in rows) == want, (s, d, backend, r)
            for r in IO_LOADS:
                if spec["direct_read"] and "warm" in r:
                    continue
                want = posix or "direct" not in r
                assert (f"{s}/{backend}/{r}" in rows) == want, (s, backend, r)
    for r in [*rows.values(), *doc["ceilings"]]:
        assert r["ops"] >= 1 and r["seconds"] > 0 and r["gbps"] > 0, r["id"]
    for r in rows.values():
        assert r["ceiling_gbps"] > 0 and r["ratio"] > 0, r["id"]
        if "cold" in r["name"] or "warm" in r["name"]:
            assert r["cached"] is not None, r["id"]
    ops = {(t["shape"], t["op"], t["durability"]) for t in doc["targets"]}
    assert {(s, "cold load", None) for s in SHAPES} <= ops
    assert {(s, "save", d) for s in SHAPES for d in DURABILITIES} <= ops
    for t in doc["targets"]:
        assert t["ratio"] > 0 and t["target"] == 0.8, t
    assert doc["lmcache"]["status"].startswith("skipped")
    assert doc["machine"]["load average at start (1/5/15 min)"]
    assert list(work.iterdir()) == [], "the benchmark left files behind"


@pytest.mark.slow
@pytest.mark.skipif(
    not LMCACHE_PYTHON.exists(),
    reason=f"{LMCACHE_PYTHON} does not exist (python3 -m venv .venv-lmcache && "
    ".venv-lmcache/bin/pip install torch==2.13.0 lmcache==0.5.6)",
)
def test_lmcache_peer_quick_reports_positive_numbers(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run(
        [str(LMCACHE_PYTHON), str(PEER_SCRIPT), "--quick", "--dir", str(work)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads(proc.stdout)
    names = {(r["shape"], r["variant"], r["name"]) for r in doc["rows"]}
    for s in SHAPES:
        for name in ("put", "put+fsync", "get cold", "get warm"):
            assert (s, "buffered", name) in names
    for r in [*doc["rows"], *doc["ceilings"]]:
        assert r["chunks"] >= 1 and r["seconds"] > 0 and r["gbps"] > 0, r["id"]
    for r in doc["rows"]:
        assert r["ceiling_gbps"] > 0 and r["ratio"] > 0, r["id"]
    assert doc["machine"]["lmcache"]
    assert list(work.iterdir()) == [], "the peer left files behind"


# --------------------------------------------------------------------------- bench_sidecar.py

SIDECAR_SCRIPT = SCRIPT.parent / "bench_sidecar.py"
SIDECAR_ROWS = (
    "save sealed",
    "save plain",
    "save direct",
    "load sealed cold",
    "load sealed warm",
    "load sealed direct cold",
    "load sealed direct warm",
    "load plain cold",
    "load plain warm",
    "load direct cold",
)


TARGET_OPS = ("save", "cold load", "warm load", "direct cold load", "direct warm load")
LMCACHE_SKIP = (
    f"{LMCACHE_PYTHON} does not exist (python3 -m venv .venv-lmcache && "
    ".venv-lmcache/bin/pip install torch==2.13.0 lmcache==0.5.6)"
)


def assert_target_table(stdout: str, doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The final target table is printed last and written to the JSON: one row per sealed
    row (save at each durability, cold and warm load) with both verdicts, and the lookup
    targets per sidecar. Returns the throughput rows by id."""
    assert "issue 12 targets" in stdout
    table = stdout[stdout.index("issue 12 targets") :]
    for col in ("best raw ceiling", "x ceil", "verdict", "LMCache best", "x LMCache"):
        assert col in table, col
    assert "meets" in table or "below" in table
    targets = {t["id"]: t for t in doc["targets"]}
    assert set(targets) == {
        f"{s}/{d}/{op}" for s in SHAPES for d in DURABILITIES for op in TARGET_OPS
    }
    for t in targets.values():
        assert t["ours_gbps"] > 0 and t["ceiling_gbps"] > 0, t["id"]
        assert t["ceiling_target"] == 0.8 and t["lmcache_target"] == 1.2, t["id"]
        assert t["x_ceiling"] == pytest.approx(t["ours_gbps"] / t["ceiling_gbps"]), t["id"]
        assert isinstance(t["meets_ceiling"], bool), t["id"]
        # the ceiling of the very objects: the sealed row's own fastest raw ceiling
        row = next(r for r in doc["rows"] if r["id"] == t["ours"])
        assert row["name"].startswith(("save sealed", "load sealed")), t["id"]
        assert t["ceiling"] == next(
            f"{c['name']} ({c['method']})"
            for c in doc["ceilings"]
            if c["name"] == row["ceiling"] and c["shape"] == row["shape"]
            and c["durability"] == row["durability"]
        ), t["id"]  # fmt: skip
    lookups = {t["id"]: t for t in doc["lookup_targets"]}
    for d in DURABILITIES:
        p99, kps = lookups[f"{d}/lookup 64 keys p99"], lookups[f"{d}/lookup 64 keys keys/s"]
        assert p99["target"] == 150.0 and p99["value"] > 0 and isinstance(p99["met"], bool)
        assert kps["target"] == 200_000.0 and kps["value"] > 0 and isinstance(kps["met"], bool)
        assert p99["met"] == (p99["value"] < 150.0) and kps["met"] == (kps["value"] >= 200_000)
    assert "lookup 64 keys p99" in table and "lookup 64 keys keys/s" in table
    return targets


@pytest.mark.slow
def test_bench_sidecar_quick_writes_every_row_and_stops_its_sidecars(tmp_path: Path) -> None:
    spy = tmp_path / "spy"
    stdout, doc, work = run_quick(
        SIDECAR_SCRIPT, tmp_path, "--events", "--no-lmcache", "--spy", str(spy)
    )
    assert "kvoffload sidecar" in stdout
    ev = doc["events"]  # the KV-event rows, same run
    assert ev["save_off_bps"] > 0 and ev["save_on_bps"] > 0
    assert ev["publisher_durable_bps"] > 0 and ev["publisher_memory_bps"] > 0
    assert "events' cost on saves" in stdout

    rows = {r["id"]: r for r in doc["rows"]}
    ceilings = {r["id"]: r for r in doc["ceilings"]}
    assert set(rows) == {f"{s}/{d}/{r}" for s in SHAPES for d in DURABILITIES for r in SIDECAR_ROWS}
    for s in SHAPES:
        for c in CPU_CEILINGS:
            assert f"{s}/{c}" in ceilings
        for d in DURABILITIES:
            for f in FORMATS:
                for c in IO_CEILINGS:
                    assert f"{s}/{d}/{c.format(f)}" in ceilings
            for c in IO_CEILINGS[:2]:  # the direct rows: save and cold load
                assert f"{s}/{d}/{c.format('direct')}" in ceilings
    for r in [*rows.values(), *ceilings.values()]:
        assert r["ops"] >= 1 and r["seconds"] > 0 and r["gbps"] > 0, r["id"]
    for r in rows.values():
        assert r["chunks_per_op"] == doc["config"]["batch"], r["id"]
        assert r["ceiling"] in {c["name"] for c in ceilings.values()}, r["id"]
        assert r["ceiling_gbps"] > 0 and r["ratio"] > 0, r["id"]
        assert r["bound_gbps"] > 0 and r["ratio_to_bound"] > 0, r["id"]
        if "cold" in r["name"] or "warm" in r["name"]:
            assert r["cached"] is not None, r["id"]
        assert (r["target"] is not None) == r["name"].startswith(("save sealed", "load sealed"))
        # where the time went: both processes' CPU, and with --spy py-spy of the sealed rows
        cpu = r["cpu"]
        assert cpu["client_cpu_s_per_gb"] > 0 and cpu["sidecar_cpu_s_per_gb"] > 0, r["id"]
        assert cpu["cores_busy"] > 0 and cpu["wall_s_per_gb"] > 0, r["id"]
        sealed = r["name"].startswith(("save sealed", "load sealed"))
        assert [p["process"] for p in r["profiles"]] == (["sidecar", "client"] if sealed else [])
        for p in r["profiles"]:
            assert Path(p["path"]).is_file() and p["path"].startswith(str(spy)), r["id"]
            assert sum(f["share"] for f in p["top"]) <= 1.0 + 1e-9, r["id"]
            assert 0.0 <= p["waiting"] <= 1.0, r["id"]
    samples = [p["samples"] for r in rows.values() for p in r["profiles"]]
    assert sum(samples) > 0, "py-spy recorded nothing"
    assert stdout.index("where the time goes") < stdout.index("issue 12 targets")
    latency = {r["id"]: r for r in doc["latency"]}
    for d in DURABILITIES:
        lk = latency[f"{d}/lookup 64 keys"]
        assert lk["ops"] == doc["config"]["lookups"]
        assert 0 < lk["p50_us"] <= lk["p99_us"] and lk["ceiling_p99_us"] > 0
        assert lk["target_p99_us"] == 150.0 and isinstance(lk["meets_target"], bool)
        assert lk["keys_per_s"] > 0 and isinstance(lk["meets_keys_target"], bool)
    facts = (
        "load average 1/5/15 min (start)",
        "sidecar (object) reports",
        "direct path I/O (client)",
    )
    for fact in (*FACTS, *facts):
        assert doc["machine"][fact], fact
    pids = doc["config"]["sidecar_pids"]
    assert len(pids) == len(DURABILITIES)
    for pid in pids:  # each sidecar was stopped (and reaped), not left running
        assert not Path(f"/proc/{pid}").exists(), f"sidecar {pid} still running"
    assert list(work.iterdir()) == [], "the benchmark left files behind"
    # The target table comes last (after the events rows) and, without LMCache, says so.
    assert stdout.index("issue 12 targets") > stdout.index("events' cost on saves")
    targets = assert_target_table(stdout, doc)
    assert doc["lmcache"]["status"] == "skipped (--no-lmcache)" and doc["lmcache"]["result"] is None
    assert "LMCache peer: skipped (--no-lmcache)" in stdout
    for t in targets.values():
        assert t["lmcache"] is None and t["meets_lmcache"] is None, t["id"]
        assert "LMCache not run" in t["lmcache_note"], t["id"]


@pytest.mark.slow
@pytest.mark.skipif(not LMCACHE_PYTHON.exists(), reason=LMCACHE_SKIP)
def test_bench_sidecar_quick_compares_every_sealed_row_with_lmcache(tmp_path: Path) -> None:
    stdout, doc, work = run_quick(SIDECAR_SCRIPT, tmp_path, "--lmcache-python", str(LMCACHE_PYTHON))
    targets = assert_target_table(stdout, doc)
    assert doc["lmcache"]["status"] == "ran", doc["lmcache"]["status"]
    peer = doc["lmcache"]["result"]
    # the same payloads and batches on both sides
    ours = {s["key"]: s for s in doc["config"]["shapes"]}
    for s in peer["config"]["shapes"]:
        assert (s["layers"], s["layer_bytes"]) == (ours[s["key"]]["layers"],
                                                   ours[s["key"]]["layer_bytes"])  # fmt: skip
        assert s["batch"] == doc["config"]["batch"]
    lm_name = {"save": {"none": "put", "object": "put+fsync"}}
    for t in targets.values():
        # A load row's peer is LMCache's get at the same temperature ("direct cold
        # load" too: LMCache has no direct path, its cold get is the peer).
        want = lm_name.get(t["op"], {}).get(t["durability"]) or f"get {t['op'].split()[-2]}"
        variant, name = t["lmcache"].split(" ", 1)
        assert name == want, t["id"]
        best = max(
            r["gbps"] for r in peer["rows"] if r["shape"] == t["shape"] and r["name"] == want
        )
        assert t["lmcache_gbps"] == best and variant in ("buffered", "odirect"), t["id"]
        assert t["x_lmcache"] == pytest.approx(t["ours_gbps"] / best), t["id"]
        assert isinstance(t["meets_lmcache"], bool), t["id"]
    assert "LMCache peer: ran" in stdout
    assert list(work.iterdir()) == [], "the benchmark left files behind"


# --------------------------------------------------------------------------- bench_ttft.py

TTFT_SCRIPT = SCRIPT.parent / "bench_ttft.py"
TTFT_ROWS = (
    "recompute",
    "reuse, cold load",
    "reuse, warm load",
    "reuse layer-wise, cold load",
    "reuse layer-wise, warm load",
)
TTFT_CEILINGS = ("raw read cold", "raw read warm", "memcpy", "suffix prefill alone")


def _has_transformers() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


@pytest.mark.slow
@pytest.mark.skipif(
    not _has_transformers(), reason="transformers is not installed (pip install -e '.[demo]')"
)
def test_bench_ttft_quick_reports_every_row_and_stops_its_sidecar(tmp_path: Path) -> None:
    stdout, doc, work = run_quick(TTFT_SCRIPT, tmp_path, "--rounds", "1")
    assert "time to first token" in stdout
    assert "never slower than recompute" in stdout

    rows = {r["name"]: r for r in doc["rows"]}
    for name in (*TTFT_ROWS, *TTFT_CEILINGS):
        assert name in rows, name
        assert rows[name]["runs"] and all(s > 0 for s in rows[name]["runs"]), name
    for name in ("reuse, cold load", "reuse, warm load", "raw read cold", "raw read warm"):
        assert all(c is not None for c in rows[name]["cached"]), name
    summary = doc["summary"]
    assert summary["target_ratio"] == 0.2
    assert summary["ratio_cold"] > 0 and summary["ratio_warm"] > 0
    assert isinstance(summary["meets_target_cold"], bool)
    exact = doc["exactness"]
    assert exact["within_tolerance"] is True and exact["greedy_match"] is True
    assert exact["logits_max_abs_diff"] <= exact["logits_tolerance"]
    # The same bytes, the same computation: layer-wise reuse changes no bit.
    assert exact["layerwise_vs_whole_max_abs_diff"] == 0
    # Never slower than recompute: with the tier slower than recompute the guard
    # recomputes. The real tier is usually far faster here and loads, but this
    # machine's load can make a 0.5 MiB cold read lose to recompute: whichever
    # the guard chose must be the one its own measured estimates call faster.
    guard = summary["never_slower_than_recompute"]
    # The slow tier is throttled from the recompute time measured first; the no-guard
    # row's own time is not compared with a later recompute (this machine's load
    # swings either by several times): the guard's decisions are checked below.
    assert guard["slow_tier_bytes_per_s"] > 0 and guard["reuse_slow_s"] > 0
    assert guard["decisions"]["slow"] == ["recompute"]
    for tier in ("normal", "slow"):
        (chose,), (est,) = guard["decisions"][tier], guard["estimates"][tier]
        assert est["recompute_s"] > 0 and est["whole_s"] > 0, (tier, est)
        if chose == "load":
            assert est["plan_s"] == pytest.approx(est["whole_s"]), (tier, est)
            assert est["whole_s"] < est["recompute_s"], (tier, est)
        else:
            assert chose == "recompute" and est["whole_s"] >= est["recompute_s"], (tier, est)
    # The layer-wise moderate tier: whatever this machine's timings made the guard
    # choose, it was a plan of whole chunks (8 here).
    assert guard["decisions"]["moderate"][0] in {
        "recompute",
        "load",
        *(f"load {k}/8" for k in range(1, 8)),
    }
    # Probes run in the background and every one of them ended.
    assert all(p["started"] == p["done"] for p in guard["probes"].values())
    # Sealed direct reads: their rows, loaded in full and exact (checked with the others).
    assert "staging vs sealed direct reads" in stdout
    for state in ("cold", "warm"):
        assert rows[f"reuse, {state} load, sealed direct"]["runs"], state
        assert summary["sealed_direct"][f"{state}_sealed_load_s"] > 0
    assert doc["config"]["torch_threads"] == 2
    assert doc["machine"]["load average 1/5/15 min (start)"]
    assert not Path(f"/proc/{doc['config']['sidecar_pid']}").exists(), "sidecar still running"
    assert list(work.iterdir()) == [], "the benchmark left files behind"


# --------------------------------------------------------------------------- target mapping


def _load_script(name: str) -> Any:
    """scripts/<name>.py as a module: scripts/ is on sys.path (pyproject's pytest
    ``pythonpath``), as it is for a script that Python runs."""
    return importlib.import_module(name)


def _sidecar_rows(bsc: Any) -> tuple[list[Any], list[Any]]:
    """Synthetic results of one shape ('large', 32 x 1 MiB, batches of 4) at durabilities
    object and none: each sealed row at 1 GB/s against a ceiling at 2 GB/s (4 streams),
    and a lookup at p99 100 us answering 64 keys in a mean of 400 us."""
    results: list[Any] = []
    payload = 4 * 32 * (1 << 20)
    for dur in DURABILITIES:
        for name in (
            "save sealed",
            "load sealed cold",
            "load sealed warm",
            "load sealed direct cold",
            "load sealed direct warm",
        ):
            ceil = f"raw {'write' if name.startswith('save') else 'read'} sealed-obj x4"
            results.append(
                bsc.Row("ceiling", ceil, "large", dur, 10, payload, payload, 10 * payload / 2e9,
                        1.0, method="O_DIRECT, 4 streams")
            )  # fmt: skip
            row = bsc.Row("kvoffload", name, "large", dur, 10, payload, payload,
                          10 * payload / 1e9, 1.0)  # fmt: skip
            row.ceiling, row.ceiling_gbps, row.ratio = ceil, 2.0, 0.5
            results.append(row)
    lat = [bsc.Latency.of("kvoffload", "lookup 64 keys", d, [4e-4] * 99 + [1e-4], 64)
           for d in DURABILITIES]  # fmt: skip
    for lt in lat:
        lt.ceiling, lt.ceiling_p50_us, lt.ceiling_p99_us = "unix socket round trip", 20.0, 30.0
    return results, lat


def _peer(layer_bytes: int = 1 << 20, batch: int = 4) -> dict[str, Any]:
    rows = [
        # (variant, name, GB/s): the best variant differs from row to row
        ("buffered", "put", 2.0), ("odirect", "put", 1.0),
        ("buffered", "put+fsync", 0.5), ("odirect", "put+fsync", 0.8),
        ("buffered", "get cold", 0.6), ("odirect", "get cold", 0.9),
        ("buffered", "get warm", 3.0),
    ]  # fmt: skip
    return {
        "config": {
            "shapes": [{"key": "large", "layers": 32, "layer_bytes": layer_bytes, "batch": batch}]
        },
        "rows": [
            {"shape": "large", "variant": v, "name": n, "gbps": g, "ratio": 0.9} for v, n, g in rows
        ],
    }


def test_sidecar_targets_meet_lmcache_best_variant_at_equal_durability() -> None:
    bsc = _load_script("bench_sidecar")
    results, lat = _sidecar_rows(bsc)
    shape = Shape("large", 32, 1 << 20, "Llama", 32)
    rows, lookups = bsc.final_targets(results, lat, _peer(), [shape], list(DURABILITIES), 4)
    got = {r.id: r for r in rows}
    assert set(got) == {f"large/{d}/{op}" for d in DURABILITIES for op in TARGET_OPS}
    # LMCache's put (page cache) meets our durability none, put+fsync our object; the
    # fastest of its variants each time; its gets meet our loads at every durability.
    want = {
        "large/none/save": ("buffered put", 2.0),
        "large/object/save": ("odirect put+fsync", 0.8),
        "large/none/cold load": ("odirect get cold", 0.9),
        "large/object/cold load": ("odirect get cold", 0.9),
        "large/none/warm load": ("buffered get warm", 3.0),
        "large/object/warm load": ("buffered get warm", 3.0),
    }
    for rid, (name, gbps) in want.items():
        lm = got[rid].vs_lmcache
        assert lm is not None and (lm.theirs_name, lm.theirs_gbps) == (name, gbps), rid
        assert lm.ratio == pytest.approx(1.0 / gbps) and lm.met == (1.0 / gbps >= 1.2), rid
        c = got[rid].vs_ceiling
        assert c.theirs_gbps == 2.0 and c.ratio == pytest.approx(0.5) and c.met is False, rid
        assert c.theirs_name.endswith("(O_DIRECT, 4 streams)"), rid
    assert got["large/object/save"].vs_lmcache.met is True  # 1.0 / 0.8 = 1.25x
    assert got["large/none/save"].vs_lmcache.met is False  # 0.5x
    by_id = {lk.id: lk for lk in lookups}
    assert by_id["none/lookup 64 keys p99"].value == pytest.approx(400.0)
    assert by_id["none/lookup 64 keys p99"].met is False  # p99 400 us >= 150 us
    kps = by_id["object/lookup 64 keys keys/s"]
    assert kps.value == pytest.approx(64 / (99 * 400 + 100) * 100 * 1e6) and kps.met is False


def test_sidecar_targets_never_compare_other_shapes_batches_or_durabilities() -> None:
    bsc = _load_script("bench_sidecar")
    results, lat = _sidecar_rows(bsc)
    shape = Shape("large", 32, 1 << 20, "Llama", 32)
    cases = {
        "another chunk": (_peer(layer_bytes=64 << 10), "32 x 65536 B, ours 32 x 1048576 B"),
        "another batch": (_peer(batch=32), "batches are 32 chunks, ours 4"),
        "no peer": (None, "LMCache not run"),
    }
    for case, (peer, note) in cases.items():
        rows, _ = bsc.final_targets(results, lat, peer, [shape], list(DURABILITIES), 4)
        for r in rows:
            assert r.vs_lmcache is None and note in r.note, (case, r.id)
            assert r.to_json()["meets_lmcache"] is None and r.vs_ceiling.ratio == 0.5, case
    # LMCache has no 'batch' durability: a save at batch is compared with its ceiling only.
    for r in results:
        if r.durability == "none":
            r.durability = "batch"
    rows, _ = bsc.final_targets(results, lat, _peer(), [shape], ["batch"], 4)
    save = next(r for r in rows if r.op == "save")
    assert save.vs_lmcache is None and "no durability 'batch'" in save.note
    assert all(r.vs_lmcache is not None for r in rows if r.op != "save")


def test_missing_lmcache_venv_is_one_status_line_naming_the_install(tmp_path: Path) -> None:
    from rich.console import Console

    status, doc = run_lmcache_peer(
        tmp_path / "no-venv" / "bin" / "python", tmp_path, Console(stderr=True), quick=True,
        row_budget_s=0.1, large_mib_per_row=1, small_ops=1, large_batch=1, small_batch=1,
        durabilities=["object"],
    )  # fmt: skip
    assert doc is None and "\n" not in status
    assert status.startswith("not run:") and "pip install torch==2.13.0 lmcache==0.5.6" in status
    assert list(tmp_path.iterdir()) == [], "nothing was written"


def test_in_process_benchmarks_measure_a_mapped_ram_tier_and_cold_rows_empty_it(
    tmp_path: Path,
) -> None:
    """bench_store/bench_io: settle_ram_tier waits until a store's RAM tier has mapped
    its memory (as bench_sidecar waits for a sidecar's), and a cold row's
    Store.drop_cache leaves the next load to read the file (a cold row served from
    the tier measured memory, not the device)."""
    from kvoffload.store import Store, StoreConfig
    from kvoffload.store.keys.keyring import Kek
    from tests.helpers.direct_reads import direct_dirs

    kek = tmp_path / "kek"
    kek.write_bytes(os.urandom(32))
    kek.chmod(0o600)
    for d in direct_dirs(tmp_path):
        cfg = StoreConfig(root=d / "store", durability="none", ram_cache=128 << 20)
        store = Store(cfg, Kek.from_file(kek), create=True)
        try:
            layers = [memoryview(os.urandom(1 << 20)) for _ in range(16)]
            settle_ram_tier(store, layers)
            tier = store.stats()["ram_tier"]
            assert not tier["filling"] and tier["held_bytes"] >= 64 << 20, tier
            key = bytes(range(32))
            assert store.put(TENANT, NAMESPACE, key, layers)
            hits = store.stats()["ram_tier"]["hits"]
            assert store.get(TENANT, key) == [bytes(v) for v in layers]
            assert store.stats()["ram_tier"]["hits"] == hits + 1  # the image of the save
            store.drop_cache()
            drop_cache([store._path(TENANT, key)])
            assert store.get(TENANT, key) == [bytes(v) for v in layers]
            assert store.stats()["ram_tier"]["hits"] == hits + 1  # read from its file
        finally:
            store.close()
