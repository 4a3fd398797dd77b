"""Crash at every step of every write path (issue 11, the fault suite).

A store client process (``driver.py``: saves staged and direct, purge, KEK
rotation, eviction) and the real ``kvoffload serve`` at first start run under
``strace``, which SIGKILLs them at the n-th ``write``/``pwritev2``/``pwrite64``
(objects, journals, LMDB pages)/``fsync``/``rename``/``link``/``unlink``/
``fallocate``. Each step is found by a calibration run that records every such
syscall; CI samples the steps evenly (``KVOFFLOAD_FAULTS=full``: all). After
each kill: the store opens (no start is blocked), every acknowledged chunk
reads back exactly, nothing reads back wrong, and fsck is clean (after the
operator's retry of an interrupted purge or rotation).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.store import Store
from kvoffload.testing import answers, cli_argv

from . import driver
from .conftest import FULL, Family, family

REPO = Path(__file__).resolve().parents[2]
STRACE = shutil.which("strace")
TRACED = (
    "write,pwritev2,pwritev,pwrite64,fsync,fdatasync,rename,renameat,renameat2,"
    "link,linkat,unlink,unlinkat,fallocate,ftruncate"
)
#: Kill points per operation in CI (evenly spread over the calibrated steps).
BUDGET = {"tenant": 4, "save": 8, "lease": 5, "purge": 5, "rotate": 5, "evict": 4, "first-start": 5}
_LINE = re.compile(r"^(\d+)\s+(\w+)\(")

pytestmark = pytest.mark.skipif(
    STRACE is None, reason="strace is not installed (make test installs it)"
)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")])
    return env


def _strace(out: str, inject: tuple[str, int] | None) -> list[str]:
    assert STRACE is not None
    argv = [STRACE, "-f", "--seccomp-bpf", "-qq", "-o", out, "-e", f"trace={TRACED},execve"]
    if inject is not None:
        argv += ["-e", f"inject={inject[0]}:signal=SIGKILL:when={inject[1]}"]
    return argv


def steps(trace: Path) -> list[tuple[str, int]]:
    """(syscall, n): the n-th call of that syscall by its thread, in trace order;
    calls by child processes that exec'd something else (ldconfig) left out."""
    lines = trace.read_text().splitlines()
    execs = [m.group(1) for ln in lines if (m := _LINE.match(ln)) and m.group(2) == "execve"]
    others = set(execs[1:])
    seen: dict[tuple[str, str], int] = {}
    out = []
    for ln in lines:
        m = _LINE.match(ln)
        if m is None or m.group(2) == "execve" or m.group(1) in others:
            continue
        k = (m.group(1), m.group(2))
        seen[k] = seen.get(k, 0) + 1
        out.append((m.group(2), seen[k]))
    return out


def sample(all_steps: list[tuple[str, int]], budget: int) -> list[tuple[str, int]]:
    uniq = list(dict.fromkeys(all_steps))
    if FULL or len(uniq) <= budget:
        return uniq
    picked = {uniq[round(i * (len(uniq) - 1) / (budget - 1))] for i in range(budget)}
    return [s for s in uniq if s in picked]


def run_driver(
    op: str, d: Path, trace: str, inject: tuple[str, int] | None, durability: str = "object"
) -> tuple[int, set[tuple[str, int]]]:
    argv = [
        *_strace(trace, inject),
        sys.executable,
        "-m",
        "tests.faults.driver",
        op,
        str(d),
        durability,
    ]
    p = subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    acked = set()
    for ln in p.stdout.splitlines():
        parts = ln.split()
        if parts[:1] == ["ACK"]:
            acked.add((parts[1], int(parts[2])))
    if inject is None:
        assert p.returncode == 0, p.stderr[-3000:]
    return p.returncode, acked


def universe(op: str) -> list[tuple[str, int]]:
    if op == "save":
        return (
            [("aaa", i) for i in range(4)]
            + [("ppp", i) for i in range(4)]
            + [("bbb", i) for i in range(4, 8)]
        )
    if op == "lease":
        return [("ppp", i) for i in range(4)]
    if op == "tenant":
        return [("aaa", 0), ("bbb", 0)]
    if op == "evict":
        return [("aaa", i) for i in range(12)]
    return [(t, i) for t in ("aaa", "bbb", "ppp") for i in range(4)]


def check(op: str, d: Path, acked: set[tuple[str, int]]) -> str | None:
    """None if the store after the kill holds up; else what failed."""
    keks = [driver.kek(d, "new"), driver.kek(d)] if op == "rotate" else [driver.kek(d)]
    store = None
    errors = []
    for k in keks:
        try:
            store = Store(driver.config(d), k)
            break
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    if store is None:
        return f"start blocked: {errors}"
    with store as s:
        for t, i in universe(op):
            got = s.get(t, driver.key(t, i))
            if got is not None and got != driver.layers(t, i):
                return f"wrong bytes for {t}/{i}"
            must = (t, i) in acked and op != "evict" and not (op == "purge" and t == "aaa")
            if must and got is None:
                return f"acknowledged chunk {t}/{i} lost"
        if op == "purge":
            s.purge_tenant("aaa", wait=True)  # the operator's retry
            if any(s.get("aaa", driver.key("aaa", i)) is not None for i in range(4)):
                return "purged tenant still served"
        if op == "rotate" and s.keyring.kek_id != driver.kek(d, "new").key_id:
            s.rotate_kek(driver.kek(d, "new"))  # the operator's retry
        rep = s.fsck()
        if not rep.clean:
            return f"fsck not clean: {rep.to_dict()}"
    if op == "rotate":
        with Store(driver.config(d), driver.kek(d, "new")) as s:
            for t, i in universe(op):
                if s.get(t, driver.key(t, i)) != driver.layers(t, i):
                    return f"after rotation {t}/{i} does not read"
    return None


@pytest.fixture
def work(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path


@pytest.mark.parametrize(
    "op", ["tenant", "save", "save-batch", "save-none", "lease", "purge", "rotate", "evict"]
)
def test_crash(op: str, work: Path, fam: Family) -> None:
    # A SIGKILL keeps the page cache: under every durability setting, every
    # acknowledged chunk must survive it (layout-v1.md §4; power loss differs).
    op, _, durability = op.partition("-")
    durability = durability or "object"
    template = work / "template"
    template.mkdir()
    if op in ("purge", "rotate"):
        driver.prefill(template)
    calib = work / "calib"
    shutil.copytree(template, calib)
    run_driver(op, calib, str(work / "trace"), None, durability)
    plan = sample(steps(work / "trace"), BUDGET[op] if durability == "object" else 3)
    assert plan, "the calibration run made no traced syscall"
    prefilled = set(universe(op)) if op in ("purge", "rotate") else set()
    for sysc, n in plan:
        d = work / f"case-{sysc}-{n}"
        shutil.copytree(template, d)
        rc, acked = run_driver(op, d, os.devnull, (sysc, n), durability)
        try:
            failure = check(op, d, acked | prefilled)
        except Exception as exc:  # the check itself must not blow up either
            failure = f"{type(exc).__name__}: {exc}"
        fam.case(
            f"{op}: SIGKILL at {sysc} #{n} (rc {rc}, {len(acked)} acked)",
            failure is None,
            failure or "",
        )
        shutil.rmtree(d, ignore_errors=True)
    fam.check()


def _serve(d: Path, trace: str, inject: tuple[str, int] | None) -> subprocess.Popen[bytes]:
    with open(d / "serve.log", "ab") as log:
        return subprocess.Popen(
            [*_strace(trace, inject), *cli_argv("--dev", "serve")],
            cwd=d, env=_env(), stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip


def _until_ready_or_dead(p: subprocess.Popen[bytes], sock: Path, timeout_s: float = 60) -> bool:
    """True once the sidecar answers (then stopped with SIGTERM); False if it died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if p.poll() is not None:
            return False
        if answers(sock, timeout_s=1.0) is not None:
            # Stop the sidecar itself (strace's child); strace exits with it.
            kids = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
            for kid in kids:
                os.kill(int(kid), signal.SIGTERM)
            p.wait(timeout=60)
            return True
        time.sleep(0.05)
    p.kill()
    p.wait()
    raise AssertionError("the sidecar neither answered nor died")


def test_crash_first_start() -> None:
    fam = family("crash/first-start")
    base = Path(tempfile.mkdtemp(prefix="kvo-crash-", dir="/tmp"))  # AF_UNIX: a short path
    try:
        calib = base / "calib"
        calib.mkdir()
        p = _serve(calib, str(base / "trace"), None)
        assert _until_ready_or_dead(p, calib / ".kvoffload/kvoffload.sock"), "calibration failed"
        plan = sample(steps(base / "trace"), BUDGET["first-start"])
        for sysc, n in plan:
            d = base / f"c{len(os.listdir(base))}"
            d.mkdir()
            killed = _serve(d, os.devnull, (sysc, n))
            _until_ready_or_dead(killed, d / ".kvoffload/kvoffload.sock")
            again = _serve(d, os.devnull, None)
            ok = _until_ready_or_dead(again, d / ".kvoffload/kvoffload.sock")
            detail = "" if ok else (d / "serve.log").read_text()[-800:]
            fam.case(f"first start: SIGKILL at {sysc} #{n}", ok, detail)
            shutil.rmtree(d, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    fam.check()
