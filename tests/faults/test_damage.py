"""Byte-level damage of every file kind (issue 11, the fault suite).

A pristine store (two sealed tenants, one plaintext, a TTL'd chunk, an audit
log) is copied per case and one file is damaged: single-bit flips at sampled
offsets (every offset with ``KVOFFLOAD_FAULTS=full``), truncations, swaps.
Then the store is opened as a restarted sidecar would and every chunk read.
Allowed: a miss of the damaged chunk, the damaged tenant's chunks missing (a key
file), a rebuild (the index), a restore (``layout.json``, from the copy in the
index directory). Never: wrong bytes, an exception out of a read, other
tenants' chunks missing. The index is checked in a child process (a crash there
would be an outage too, and must not take the test run down).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvoffload.layouts import v1
from kvoffload.store import Store

from . import driver
from .conftest import FULL, Family

REPO = Path(__file__).resolve().parents[2]
ALL = [(t, i) for t in (*driver.SEALED, driver.PLAIN) for i in range(4)]
Damage = Callable[[Path], None]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pristine")
    driver.prefill(d)
    with Store(driver.config(d), driver.kek(d)) as s:
        s.put(driver.PLAIN, driver.NS, driver.key(driver.PLAIN, 9), [b"ttl" * 99], ttl_s=3600)
    return d


def obj(d: Path, t: str, i: int) -> Path:
    return d / "store" / v1.object_relpath(t, driver.key(t, i))


def offsets(size: int, n: int, seed: str) -> list[int]:
    if FULL:
        return list(range(size))
    r = random.Random(seed)
    head = list(range(0, min(size, 240), 7))  # the header's fields, densely
    rest = sorted(r.sample(range(size), min(size, n)))
    return sorted(set(head[: n // 2] + rest))[:n]


def flip(pos: int) -> Damage:
    def do(p: Path) -> None:
        raw = bytearray(p.read_bytes())
        raw[pos] ^= 1 << (pos % 8)
        p.write_bytes(raw)

    return do


def truncate(n: int) -> Damage:
    def do(p: Path) -> None:
        p.write_bytes(p.read_bytes()[:n])

    return do


def read_all(d: Path) -> dict[str, object]:
    """In process: open, read every chunk, repair; what a restart would serve."""
    return driver.check_json(d)


def read_all_child(d: Path) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO)])
    p = subprocess.run(
        [sys.executable, "-m", "tests.faults.driver", "check", str(d)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if p.returncode != 0:
        return {"opened": False, "error": f"crashed (rc {p.returncode}): {p.stderr[-400:]}"}
    result: dict[str, object] = json.loads(p.stdout.strip().splitlines()[-1])
    return result


def judge(res: dict[str, object], may_miss: set[tuple[str, int]], may_refuse: bool) -> str | None:
    if not res["opened"]:
        err = str(res["error"])
        if may_refuse and "\n" not in err and not err.startswith("crashed"):
            return None
        return f"outage: {err}"
    if res["wrong"]:
        return f"WRONG BYTES: {res['wrong']}"
    lost = {tuple(m.split("/")) for m in res["missing"]}  # type: ignore[attr-defined]
    lost_ok = {(t, str(i)) for t, i in may_miss}
    if not lost <= lost_ok:
        return f"chunks of undamaged files missing: {sorted(lost - lost_ok)}"
    return None


def run_cases(
    fam: Family,
    pristine: Path,
    work: Path,
    target: Callable[[Path], Path],
    damages: list[tuple[str, Damage]],
    may_miss: set[tuple[str, int]],
    *,
    may_refuse: bool = False,
    child: bool = False,
) -> None:
    for what, damage in damages:
        d = work / "case"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(pristine, d)
        damage(target(d))
        try:
            res = read_all_child(d) if child else read_all(d)
            failure = judge(res, may_miss, may_refuse)
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"
        fam.case(what, failure is None, failure or "")
    fam.check()


def _file_damages(p: Path, n: int, seed: str) -> list[tuple[str, Damage]]:
    size = p.stat().st_size
    out = [(f"flip @{o}", flip(o)) for o in offsets(size, n, seed)]
    cuts = sorted({0, 1, 17, size // 3, size // 2, size - 1} - {size})
    out += [(f"truncate to {c}", truncate(c)) for c in cuts if c < size]
    return out


@pytest.mark.parametrize(
    ("t", "i"), [("aaa", 1), ("ppp", 2)], ids=["sealed-object", "plain-object"]
)
def test_damage_object(pristine: Path, tmp_path: Path, fam: Family, t: str, i: int) -> None:
    damages = _file_damages(obj(pristine, t, i), 14, f"{t}{i}")
    run_cases(fam, pristine, tmp_path, lambda d: obj(d, t, i), damages, {(t, i)})


def test_damage_object_swaps(pristine: Path, tmp_path: Path, fam: Family) -> None:
    def swap(a: tuple[str, int], b: tuple[str, int]) -> Damage:
        def do(d: Path) -> None:
            pa, pb = obj(d, *a), obj(d, *b)
            da, db = pa.read_bytes(), pb.read_bytes()
            pa.write_bytes(db)
            pb.write_bytes(da)

        return do

    pairs = [(("aaa", 0), ("aaa", 1)), (("aaa", 0), ("bbb", 0)), (("aaa", 2), ("ppp", 2))]
    for a, b in pairs:
        run_cases(fam, pristine, tmp_path, lambda d: d, [(f"swap {a} {b}", swap(a, b))], {a, b})


def test_damage_key_file(pristine: Path, tmp_path: Path, fam: Family) -> None:
    kf = lambda d: d / "store" / "keys" / "aaa.key"  # noqa: E731
    damages = _file_damages(kf(pristine), 10, "key")

    def swap(d: Path) -> None:
        a, b = d / "aaa.key", d / "bbb.key"
        da, db = a.read_bytes(), b.read_bytes()
        a.write_bytes(db)
        b.write_bytes(da)

    miss = {("aaa", i) for i in range(4)}
    run_cases(fam, pristine, tmp_path, kf, damages, miss)
    both = miss | {("bbb", i) for i in range(4)}
    run_cases(
        fam, pristine, tmp_path, lambda d: d / "store" / "keys", [("swap aaa/bbb", swap)], both
    )


def test_damage_layout_json(pristine: Path, tmp_path: Path, fam: Family) -> None:
    lj = lambda d: d / "store" / "layout.json"  # noqa: E731
    damages = _file_damages(lj(pristine), 8, "layout")
    run_cases(fam, pristine, tmp_path, lj, damages, set())  # restored from the index's copy


def test_damage_retention_journal(pristine: Path, tmp_path: Path, fam: Family) -> None:
    (node,) = (pristine / "store" / "journal" / "retention" / driver.PLAIN).iterdir()
    rel = node.relative_to(pristine)
    damages = _file_damages(node, 8, "journal")
    run_cases(fam, pristine, tmp_path, lambda d: d / rel, damages, set())


def test_damage_audit_log(pristine: Path, tmp_path: Path, fam: Family) -> None:
    al = lambda d: d / "index" / "audit.jsonl"  # noqa: E731
    run_cases(fam, pristine, tmp_path, al, _file_damages(al(pristine), 4, "audit"), set())


def test_damage_index(pristine: Path, tmp_path: Path, fam: Family) -> None:
    mdb = lambda d: d / "index" / "lmdb" / "data.mdb"  # noqa: E731
    damages = _file_damages(mdb(pristine), 8, "index")

    def garbage(p: Path) -> None:
        p.write_bytes(os.urandom(p.stat().st_size))

    damages.append(("random bytes", garbage))
    run_cases(fam, pristine, tmp_path, mdb, damages, set(), child=True)
