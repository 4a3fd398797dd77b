"""A full disk and EIO, on the store root and on the index separately (issue 11,
the fault suite). Full disks are small tmpfs mounts in a private user+mount
namespace (``unshare -rm``; skipped where that is not allowed); EIO is injected
by strace into the object reads (``preadv2``), object writes (``pwritev2``),
their fsyncs and the index's page writes (``pwrite64``).

Held means: every failure is one clear line (StoreError), no temp file is left,
every chunk stored before reads back exactly — also while access times cannot
be recorded — a full disk refuses only new data, and after the fault the
store restarts and fsck is clean.
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

from .conftest import Family

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO)])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _child(argv: list[str], scenario: str, root: Path, index: Path) -> dict[str, Any]:
    cmd = [*argv, sys.executable, "-m", "tests.faults.disk_child", scenario, str(root), str(index)]
    p = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    if p.returncode == 77:
        pytest.skip(f"cannot mount tmpfs in a user namespace here: {p.stderr.strip()[-300:]}")
    assert p.returncode == 0, p.stderr[-3000:]
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


def _on_tmpfs(tmp_path: Path, scenario: str, root_size: str, index_size: str) -> dict[str, Any]:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1)")
    root, index = tmp_path / "root", tmp_path / "index"
    root.mkdir()
    index.mkdir()
    script = (
        f'mount -t tmpfs -o size={root_size} none "{root}" || exit 77; '
        f'mount -t tmpfs -o size={index_size} none "{index}" || exit 77; exec "$@"'
    )
    return _child([unshare, "-rm", "sh", "-c", script, "sh"], scenario, root, index)


def _judge_full(fam: Family, what: str, r: dict[str, Any], *, must_write: bool = True) -> None:
    fam.case(f"{what}: the disk filled", "full_error" in r, "never full")
    fam.case(f"{what}: one clear error", bool(r.get("full_error_clean")), str(r.get("full_error")))
    fam.case(
        f"{what}: chunks stored read back", r.get("stored", 0) > 0 and not r["bad_reads"], str(r)
    )
    fam.case(
        f"{what}: reads while bookkeeping fails",
        not r["bad_reads_again"],
        str(r["bad_reads_again"]),
    )
    fam.case(f"{what}: no temp file left", not r["tmp_left"], str(r["tmp_left"]))
    fam.case(
        f"{what}: a tenant on a full disk",
        r["new_tenant"] in ("created", "clean error"),
        r["new_tenant"],
    )
    fam.case(
        f"{what}: others unaffected", not r["aaa_after_new_tenant"], str(r["aaa_after_new_tenant"])
    )
    # Freeing store space frees no index space (LMDB keeps its file): there a
    # clean refusal is right too.
    wrote = r["put_after_freeing"] is True or (
        not must_write and bool(r.get("put_after_freeing_clean"))
    )
    fam.case(f"{what}: writes after freeing", wrote, str(r["put_after_freeing"]))
    fam.case(f"{what}: restart reads back", not r["bad_after_restart"], str(r["bad_after_restart"]))
    fam.case(f"{what}: fsck clean", r["fsck_clean"], "")


def test_disk_full_store_root(tmp_path: Path, fam: Family) -> None:
    r = _on_tmpfs(tmp_path, "root-full", "2m", "64m")
    assert r.get("full_errno") == 28, r  # ENOSPC, said as such
    _judge_full(fam, "root full", r)
    fam.check()


def test_disk_full_index(tmp_path: Path, fam: Family) -> None:
    r = _on_tmpfs(tmp_path, "index-full", "64m", "160k")
    _judge_full(fam, "index full", r, must_write=False)
    fam.check()


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_disk_eio(tmp_path: Path, fam: Family) -> None:
    root, index = tmp_path / "root", tmp_path / "index"
    root.mkdir()
    index.mkdir()
    _child([], "prefill", root, index)

    def strace(inject: str) -> list[str]:
        return ["strace", "-f", "--seccomp-bpf", "-qq", "-o", os.devnull, "-e", f"inject={inject}"]

    r = _child(strace("preadv2:error=EIO"), "read-eio", root, index)
    fam.case(
        "EIO on object reads: misses, no error", not r.get("read_errors"), str(r.get("read_errors"))
    )
    fam.case("EIO on object reads: nothing wrong", r["wrong"] == 0 and r["served"] == 0, str(r))
    for inject in ("pwritev2:error=EIO", "fsync:error=EIO", "pwrite64:error=EIO"):
        r = _child(strace(inject), "write-eio", root, index)
        fam.case(f"{inject}: the save fails cleanly", r["put"] == "clean error", str(r["put"]))
        fam.case(f"{inject}: no temp file", not r["tmp_left"], str(r["tmp_left"]))
        fam.case(f"{inject}: stored chunks still read", not r["bad_reads"], str(r["bad_reads"]))
    r = _child([], "verify", root, index)
    fam.case("after EIO: everything reads back", not r["bad_reads"], str(r["bad_reads"]))
    fam.case("after EIO: fsck clean", r["fsck_clean"], "")
    fam.check()
