"""Failure mode 5 with a real sidecar (scripts/events_faults.py): random saves, purges,
consumer pauses and restarts, and SIGKILLs of the sidecar end with the consumer's
view equal to the store's truth after every round. The full run is 1000 rounds
(``python scripts/events_faults.py``); the test runs 30."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.paths import REPO

SCRIPT = REPO / "scripts" / "events_faults.py"


def test_a_consumer_never_diverges_from_a_real_sidecar() -> None:
    pytest.importorskip("zmq")
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--rounds", "30", "--seed", "7"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "divergences 0" in res.stdout
    assert "'restart'" in res.stdout and "'snapshot'" in res.stdout
