"""Smoke tests of scripts/bench_store.py: it runs, reports every row, and leaves nothing behind.

No timing assertions: only that every expected row is there with a positive throughput.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

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
    "load plain cold",
    "load plain warm",
    "load direct cold",
)


@pytest.mark.slow
def test_bench_sidecar_quick_writes_every_row_and_stops_its_sidecars(tmp_path: Path) -> None:
    stdout, doc, work = run_quick(SIDECAR_SCRIPT, tmp_path, "--events")
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
        assert (r["target"] is not None) == (r["name"] in ("save sealed", "load sealed cold"))
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
    stdout, doc, work = run_quick(TTFT_SCRIPT, tmp_path)
    assert "time to first token" in stdout

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
    assert doc["config"]["torch_threads"] == 2
    assert doc["machine"]["load average 1/5/15 min (start)"]
    assert not Path(f"/proc/{doc['config']['sidecar_pid']}").exists(), "sidecar still running"
    assert list(work.iterdir()) == [], "the benchmark left files behind"
