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


@pytest.mark.slow
def test_bench_store_quick_writes_every_row(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out), "--dir", str(work)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "kvoffload Store" in proc.stdout

    doc = json.loads(out.read_text(encoding="utf-8"))
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
