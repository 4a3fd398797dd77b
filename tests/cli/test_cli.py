"""The kvoffload CLI, run as a real subprocess on a real store."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvoffload.layouts import v1
from kvoffload.store import Store, StoreConfig
from kvoffload.store.keys.keyring import Kek
from tests.helpers.cli import run_cli as run

NS = bytes(range(32))


@pytest.fixture
def dev_store(tmp_path: Path) -> Path:
    r = run(tmp_path, "--dev", "init", "--json")
    assert r.returncode == 0, r.stderr
    # A one-line reminder (the loud banner is serve's alone).
    assert r.stderr.count("development KEK") == 1 and len(r.stderr.splitlines()) == 1, r.stderr
    info = json.loads(r.stdout)
    assert info["layout_version"] == 1
    cfg = StoreConfig(root=tmp_path / ".kvoffload/store", index_dir=tmp_path / ".kvoffload/index")
    s = Store(cfg, Kek.from_file(tmp_path / ".kvoffload/dev-kek"))
    for i in range(3):
        s.put("acme", NS, bytes([i]) * 32, [os.urandom(5000)])
    s.put("beta", NS, bytes([9]) * 32, [os.urandom(5000)], encrypt=False)
    s.close()
    return tmp_path


def test_dev_kek_lives_outside_the_store_root(dev_store: Path) -> None:
    assert (dev_store / ".kvoffload/dev-kek").stat().st_mode & 0o077 == 0
    kek = (dev_store / ".kvoffload/dev-kek").read_bytes()
    for p in (dev_store / ".kvoffload/store").rglob("*"):
        if p.is_file():
            assert kek not in p.read_bytes()


def test_inspect_and_ls(dev_store: Path) -> None:
    r = run(dev_store, "--dev", "inspect", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["chunks"] == 4
    assert info["tenants"]["acme"]["chunks"] == 3
    assert info["tenants"]["beta"]["namespaces"] == {
        NS.hex(): {"chunks": 1, "bytes": info["tenants"]["beta"]["bytes"]}
    }
    r = run(dev_store, "--dev", "ls", "--tenant", "acme", "--json")
    rows = json.loads(r.stdout)
    assert len(rows) == 3 and all(row["sealed"] for row in rows)
    r = run(dev_store, "--dev", "ls", "--older-than", "1d", "--json")
    assert json.loads(r.stdout) == []
    r = run(dev_store, "--dev", "inspect")
    assert r.returncode == 0 and "acme" in r.stdout


def test_purge_asks_unless_yes(dev_store: Path) -> None:
    r = run(dev_store, "--dev", "purge", "--tenant", "acme", input="n\n")
    assert r.returncode == 6
    r = run(dev_store, "--dev", "purge", "--tenant", "acme", "--yes", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["chunks"] == 3
    assert not (dev_store / ".kvoffload/store/keys/acme.key").exists()
    info = json.loads(run(dev_store, "--dev", "inspect", "--json").stdout)
    assert "acme" not in info["tenants"] and info["chunks"] == 1


def test_purge_needs_a_target(dev_store: Path) -> None:
    assert run(dev_store, "--dev", "purge", "--yes").returncode == 2
    assert run(dev_store, "--dev", "purge", "--namespace", NS.hex(), "--yes").returncode == 2


def test_fsck_exit_codes_and_repair(dev_store: Path) -> None:
    assert run(dev_store, "--dev", "fsck").returncode == 0
    obj = dev_store / ".kvoffload/store" / v1.object_relpath("acme", bytes([1]) * 32)
    obj.unlink()
    r = run(dev_store, "--dev", "fsck", "--json")
    assert r.returncode == 5
    assert len(json.loads(r.stdout)["missing_files"]) == 1
    r = run(dev_store, "--dev", "fsck", "--repair", "--verify-data", "--json")
    assert r.returncode == 0, r.stderr
    assert run(dev_store, "--dev", "fsck").returncode == 0


def test_store_in_use_is_exit_4(dev_store: Path) -> None:
    cfg = StoreConfig(root=dev_store / ".kvoffload/store", index_dir=dev_store / ".kvoffload/index")
    s = Store(cfg, Kek.from_file(dev_store / ".kvoffload/dev-kek"))
    try:
        r = run(dev_store, "--dev", "inspect")
        assert r.returncode == 4
        assert "in use" in r.stderr
    finally:
        s.close()


def test_missing_store_is_exit_3(tmp_path: Path, kek_file: Path) -> None:
    r = run(tmp_path, "--root", str(tmp_path / "none"), "--kek-file", str(kek_file), "inspect")
    assert r.returncode == 3
    assert "not a kvoffload store" in r.stderr


def test_no_kek_is_a_clear_error(tmp_path: Path) -> None:
    r = run(tmp_path, "--root", str(tmp_path / "s"), "init")
    assert r.returncode == 1 and "no KEK" in r.stderr


def test_rotate_kek(dev_store: Path, tmp_path: Path) -> None:
    new = tmp_path / "new-kek"
    new.write_bytes(os.urandom(32))
    new.chmod(0o600)
    r = run(dev_store, "--dev", "keys", "rotate-kek", "--new-kek-file", str(new), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["rewrapped_tenants"] == 1  # beta is plaintext: no keys made
    # The old (dev) KEK no longer opens the keys; the new one does.
    r = run(dev_store, "--dev", "fsck", "--verify-data", "--repair")
    assert r.returncode == 1 and "is not this store's KEK" in r.stderr  # refused before any repair
    r = run(
        dev_store,
        "--root", str(dev_store / ".kvoffload/store"),
        "--index-dir", str(dev_store / ".kvoffload/index"),
        "--kek-file", str(new),
        "fsck", "--verify-data", "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["ok"] == 4
