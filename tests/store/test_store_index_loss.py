"""Index loss (issue 11, items 4, 10): a garbage, deleted or other-schema index is
moved aside and rebuilt from the files at open (and so in ``fsck --repair``);
nothing stored is forgotten and the nonce count restarts on a fresh epoch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.errors import StoreIOError
from kvoffload.store import Store, StoreConfig
from kvoffload.store.keys.keyring import Kek

NS = bytes(range(32))


def k(i: int) -> bytes:
    return bytes([i]) * 32


def fill(cfg: StoreConfig, kek: Kek, n: int = 5) -> None:
    with Store(cfg, kek, create=True) as s:
        for i in range(n):
            s.put("acme", NS, k(i), [bytes([i]) * 3000])


@pytest.mark.parametrize("damage", ["garbage", "zeros", "deleted", "truncated", "pages-cut"])
def test_a_lost_index_is_rebuilt_from_the_files(
    tmp_path: Path, kek_file: Path, damage: str
) -> None:
    cfg = StoreConfig(root=tmp_path / "store", durability="none")
    kek = Kek.from_file(kek_file)
    fill(cfg, kek)
    mdb = cfg.resolved_index_dir() / "lmdb" / "data.mdb"
    size = mdb.stat().st_size
    if damage == "garbage":
        mdb.write_bytes(os.urandom(size))
    elif damage == "zeros":
        mdb.write_bytes(bytes(size))
    elif damage == "truncated":
        mdb.write_bytes(mdb.read_bytes()[:100])
    elif damage == "pages-cut":  # LMDB would map past the end: SIGBUS in the reader
        raw = mdb.read_bytes()
        mdb.write_bytes(raw[: len(raw) // 2 // 4096 * 4096 or 8192])
    else:
        for p in mdb.parent.iterdir():
            p.unlink()
        mdb.parent.rmdir()
    with Store(cfg, kek) as s:
        assert s.lookup("acme", [k(i) for i in range(5)]) == 5
        assert s.get("acme", k(3)) == [bytes([3]) * 3000]
        assert s.fsck().clean
        epoch = s.keyring.ensure_tenant("acme").current_epoch
        s.put("acme", NS, k(9), [b"new" * 100])  # the nonce count is unknown: a fresh epoch
        assert s.keyring.ensure_tenant("acme").current_epoch == epoch + 1
        assert s.get("acme", k(0)) == [bytes([0]) * 3000]  # the old epoch still opens
    if damage != "deleted":
        assert any(p.name.startswith("lmdb.corrupt-") for p in cfg.resolved_index_dir().iterdir())


def test_without_rebuild_a_garbage_index_is_one_clear_error(tmp_path: Path, kek_file: Path) -> None:
    cfg = StoreConfig(root=tmp_path / "store", durability="none")
    fill(cfg, Kek.from_file(kek_file))
    mdb = cfg.resolved_index_dir() / "lmdb" / "data.mdb"
    mdb.write_bytes(os.urandom(mdb.stat().st_size))
    cfg.rebuild_corrupt_index = False
    with pytest.raises(StoreIOError, match="corrupt"):
        Store(cfg, Kek.from_file(kek_file))


def test_cli_fsck_repair_rebuilds_a_garbage_index(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvoffload.cli", *args],
            cwd=tmp_path, capture_output=True, text=True, timeout=120,
            env={k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")},
        )  # fmt: skip

    assert run("--dev", "init").returncode == 0
    cfg = StoreConfig(root=tmp_path / ".kvoffload/store", index_dir=tmp_path / ".kvoffload/index")
    with Store(cfg, Kek.from_file(tmp_path / ".kvoffload/dev-kek")) as s:
        for i in range(3):
            s.put("acme", NS, k(i), [os.urandom(5000)])
    mdb = tmp_path / ".kvoffload/index/lmdb/data.mdb"
    mdb.write_bytes(os.urandom(mdb.stat().st_size))
    r = run("--dev", "fsck", "--repair")
    assert r.returncode == 0, r.stderr
    r = run("--dev", "fsck")
    assert r.returncode == 0, r.stdout + r.stderr
    r = run("--dev", "inspect", "--json")
    assert '"chunks": 3' in r.stdout


def test_an_unindexed_object_after_a_crash_is_normal_and_reconciled(
    tmp_path: Path, kek_file: Path
) -> None:
    cfg = StoreConfig(root=tmp_path / "store", durability="none")
    kek = Kek.from_file(kek_file)
    fill(cfg, kek)
    with Store(cfg, kek) as s:
        # The state a crash between an object's rename and its index insert leaves.
        s.index.remove("acme", k(1))
        s.index.remove("acme", k(2))
        used = s.used_bytes
        rep = s.fsck()
        assert rep.clean, rep.to_dict()  # normal after a crash: fsck exits 0
        assert len(rep.unindexed_files) == 2
        assert s.index.get("acme", k(1)) is not None  # and indexed it
        s.index.remove("acme", k(3))
        done = s.maintain()
        assert done["adopted"] == 1 and s.index.get("acme", k(3)) is not None
        assert s.lookup_cached("acme", [k(i) for i in range(5)]) == 5
        assert s.used_bytes >= used
