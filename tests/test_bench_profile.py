"""benchlib.cpu (scripts/benchlib/cpu.py): the CPU a benchmark row costs each process, and where
py-spy's samples fell. Real processes; no timing assertions (only CPU time that a
child is made to spend, and arithmetic)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def bp() -> ModuleType:
    return importlib.import_module("benchlib.cpu")


def test_process_cpu_seconds_counts_another_process_cpu_not_its_sleep(bp: ModuleType) -> None:
    burn = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\nwhile time.process_time() < 0.3: pass\nsys.stdin.read()"],
        stdin=subprocess.PIPE,
    )  # fmt: skip
    sleeper = subprocess.Popen(["sleep", "5"])
    try:
        deadline = time.monotonic() + 30
        while bp.process_cpu_seconds(burn.pid) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert bp.process_cpu_seconds(burn.pid) >= 0.3
        time.sleep(0.3)
        assert bp.process_cpu_seconds(sleeper.pid) < 0.05
    finally:
        burn.communicate(b"")
        sleeper.kill()
        sleeper.wait()


def test_row_cpu_counts_the_wrapped_calls_and_splits_per_gb(bp: ModuleType) -> None:
    child = subprocess.Popen(["sleep", "5"])
    try:
        meter = bp.RowCpu(child.pid)
        calls: list[int] = []

        def op(i: int) -> None:
            calls.append(i)
            t = time.thread_time()
            while time.thread_time() - t < 0.02:
                pass

        with meter:
            wrapped = meter.wrap(op)
            for i in range(5):
                wrapped(i)
    finally:
        child.kill()
        child.wait()
    assert calls == [0, 1, 2, 3, 4] and meter.calls == 5
    assert meter.client_s >= 0.1 and meter.wall_s >= meter.client_s * 0.9
    split = meter.split(10**8)  # 0.1 GB a call: 0.5 GB in all
    assert split.client_s_per_gb == pytest.approx(meter.client_s / 0.5)
    assert split.sidecar_s_per_gb == pytest.approx(meter.sidecar_s / 0.5)
    assert split.sidecar_s_per_gb < 0.1  # the child slept
    assert bp.RowCpu(1).split(10**8) is None  # no call: nothing to say

    s = bp.CpuSplit(sidecar_s_per_gb=0.3, client_s_per_gb=0.1, wall_s_per_gb=0.25, cores=2)
    assert s.cores_busy == pytest.approx(1.6) and s.cpu_bound_gbps == pytest.approx(5.0)
    assert s.to_json()["cores_busy"] == pytest.approx(1.6)


def test_leaf_frames_counts_where_samples_fell_waits_apart(bp: ModuleType, tmp_path: Path) -> None:
    raw = tmp_path / "spy.txt"
    raw.write_text(
        "main (/v/lib/python3.11/site-packages/kvoffload/a.py:1);open_layer "
        "(/v/lib/python3.11/site-packages/kvoffload/layouts/v1.py:671) 6\n"
        "main (/w/src/kvoffload/client/staged.py:9);copy (/w/scripts/bench_sidecar.py:904) 2\n"
        "run (/usr/lib/python3.11/asyncio/base_events.py:1);EpollSelector.select "
        "(/usr/lib/python3.11/selectors.py:468) 2\n"
        "garbage line without a count\n"
        "\n",
        encoding="utf-8",
    )
    got = bp.leaf_frames(raw)
    assert got.samples == 10 and got.waiting == pytest.approx(0.2)
    assert [(f.frame, round(f.share, 2)) for f in got.top] == [  # shares of the 8 at work
        ("open_layer (kvoffload/layouts/v1.py:671)", 0.75),
        ("copy (bench_sidecar.py:904)", 0.25),
    ]
    got = bp.leaf_frames(raw, only="kvoffload/client/")
    assert got.samples == 2 and got.waiting == 0
    assert [f.frame for f in got.top] == ["copy (bench_sidecar.py:904)"]
    assert bp.leaf_frames(raw, top=1).top[0].share == pytest.approx(0.75)
    assert bp.leaf_frames(tmp_path / "absent.txt") == bp.Leaves(0, 0.0, [])
    assert bp.spied(None, [("sidecar", 1)], tmp_path, "x") == []
    ((name, spy),) = bp.spied("py-spy", [("sidecar", 1)], tmp_path, "x")
    assert name == "sidecar" and spy.out == tmp_path / "x-sidecar.txt" and spy.pid == 1
