"""scripts/bench_events.py runs end to end and prints every row (numbers are not asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_events.py"


def test_bench_events_prints_its_rows() -> None:
    pytest.importorskip("zmq")
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--chunk-mib", "2", "--chunks", "2", "--batches", "300"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    for row in ("events off", "events on", "cost on save throughput", "durable buffer"):
        assert row in res.stdout, res.stdout
    assert "received 300/300 (durable)" in res.stdout
