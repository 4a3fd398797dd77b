"""Power loss (issue 11, the fault suite): a store rooted on :mod:`powerfs`, a
FUSE file system that keeps only what was fsync'd, loses power at sampled
mutating requests of a run of saves; the store is then opened on what
survived. Durability ``object``: every acknowledged chunk survives. ``batch``
and ``none``: anything may be lost (a plain FUSE mount never hears of the
syncfs behind ``batch``), but nothing is ever served wrong and the start is
never blocked. Skipped where FUSE cannot be mounted in a user namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import FULL, Family

REPO = Path(__file__).resolve().parents[2]
CUTS = {
    "object": [3, 20, 45, 90, 10**6],
    "batch": [30, 90, 10**6],
    "none": [30, 90, 10**6],
}


def _run(tmp: Path, durability: str, cut: int) -> dict[str, Any]:
    unshare = shutil.which("unshare")
    if unshare is None or not os.path.exists("/dev/fuse"):
        pytest.skip("no unshare(1) or /dev/fuse")
    for sub in ("mnt", "idx", "out"):
        shutil.rmtree(tmp / sub, ignore_errors=True)
    (tmp / "mnt").mkdir()
    (tmp / "idx").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO)])
    argv = [unshare, "-rm", sys.executable, "-m", "tests.faults.powerloss_child"]
    argv += [str(tmp / "mnt"), str(tmp / "out"), str(tmp / "idx"), durability, str(cut)]
    p = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    if p.returncode == 77 or "unshare failed" in p.stderr:
        pytest.skip(f"cannot mount FUSE in a user namespace here: {p.stderr.strip()[-300:]}")
    assert p.returncode == 0, p.stderr[-3000:]
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("durability", ["object", "batch", "none"])
def test_powerloss(durability: str, tmp_path: Path, fam: Family) -> None:
    cuts = [*range(1, 200, 3), 10**6] if FULL else CUTS[durability]
    for cut in cuts:
        r = _run(tmp_path, durability, cut)
        what = f"{durability}: power lost at mutation {cut} ({len(r['acked'])} acked)"
        if not r.get("opened"):
            fam.case(what, False, f"start blocked: {r.get('error')}")
            continue
        bad = []
        if r["wrong"]:
            bad.append(f"WRONG BYTES {r['wrong']}")
        if durability == "object" and r["lost"]:
            bad.append(f"acknowledged chunks lost {r['lost']}")
        if not r["fsck_clean"]:
            bad.append("fsck not clean after repair")
        fam.case(what, not bad, "; ".join(bad))
    fam.check()
