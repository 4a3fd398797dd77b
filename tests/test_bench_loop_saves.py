"""Smoke tests of scripts/bench_loop.py and scripts/bench_small_saves.py (issue 30):
each runs, prints every pattern with a positive figure, and leaves nothing behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _run(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _rows(out: str, names: list[str]) -> dict[str, float]:
    got: dict[str, float] = {}
    for line in out.splitlines():
        for name in names:
            if line.startswith(name + " ") and name not in got:
                got[name] = float(line[len(name) :].split()[0])
    return got


def test_bench_loop_reports_every_loop() -> None:
    out = _run(str(SCRIPTS / "bench_loop.py"), "--n", "20")
    names = ["add_reader", "Protocol", "thread", "echo"]
    rows = _rows(out, names)
    assert set(rows) == set(names) and all(v > 0 for v in rows.values()), out


def test_bench_small_saves_reports_every_pattern_and_cleans_up(tmp_path: Path) -> None:
    out = _run(str(SCRIPTS / "bench_small_saves.py"), "--dir", str(tmp_path), "--n", "3")
    names = ["current", "no fallocate", "O_TMPFILE+link", "batch dir fsync, 4 leaves"]
    assert out.count("durability none") == 1 and out.count("durability object") == 1
    rows = _rows(out, names)
    assert set(rows) == set(names) and all(v > 0 for v in rows.values()), out
    assert list(tmp_path.iterdir()) == []
