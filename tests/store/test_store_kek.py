"""The store's KEK identity and key-file damage (issue 11, item 3): a KEK is checked
against the id the root records, and a corrupt key file is its tenant's problem only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.errors import StoreError
from kvoffload.layouts import read_layout, v1
from kvoffload.store import Store, StoreConfig
from kvoffload.store.keys.keyring import Kek

NS = bytes(range(32))


def kek(tmp_path: Path, name: str) -> Kek:
    p = tmp_path / name
    if not p.exists():
        p.write_bytes(os.urandom(32))
    return Kek.from_file(p)


def cfg(tmp_path: Path) -> StoreConfig:
    return StoreConfig(root=tmp_path / "store", durability="none")


def fill(tmp_path: Path, k: Kek) -> None:
    with Store(cfg(tmp_path), k, create=True) as s:
        for t in ("aaa", "bbb"):
            for i in range(3):
                s.put(t, NS, bytes([i]) * 32, [t.encode() * 1000])


def flip_key_file(tmp_path: Path, tenant: str) -> None:
    p = tmp_path / "store" / "keys" / f"{tenant}.key"
    raw = bytearray(p.read_bytes())
    doc = json.loads(raw)
    pos = raw.index(doc["salt"]["ct"].encode()) + 3
    raw[pos] = ord("A") if raw[pos] != ord("A") else ord("B")
    p.write_bytes(raw)


def test_root_records_the_kek_id_and_refuses_another_kek(tmp_path: Path) -> None:
    good = kek(tmp_path, "good")
    Store(cfg(tmp_path), good, create=True).close()  # no tenant yet
    assert read_layout(tmp_path / "store").kek_id == good.key_id
    assert (tmp_path / "good").read_bytes().hex() not in (
        tmp_path / "store/layout.json"
    ).read_text()
    other = kek(tmp_path, "other")
    with pytest.raises(StoreError) as info:
        Store(cfg(tmp_path), other)
    msg = str(info.value)
    assert good.key_id in msg and other.key_id in msg and "\n" not in msg


def test_an_old_root_learns_its_kek_id_from_the_key_files(tmp_path: Path) -> None:
    good = kek(tmp_path, "good")
    fill(tmp_path, good)
    lj = tmp_path / "store" / "layout.json"
    doc = json.loads(lj.read_text())
    del doc["kek_id"], doc["checksum"]  # as a root made before either existed
    lj.write_text(json.dumps(doc))
    (tmp_path / "store.index" / "layout.json").unlink()
    with pytest.raises(StoreError, match=good.key_id):
        Store(cfg(tmp_path), kek(tmp_path, "other"))
    assert read_layout(tmp_path / "store").kek_id is None  # nothing recorded by a refusal
    Store(cfg(tmp_path), good).close()
    assert read_layout(tmp_path / "store").kek_id == good.key_id


def test_a_corrupt_key_file_is_that_tenants_problem_only(tmp_path: Path) -> None:
    good = kek(tmp_path, "good")
    fill(tmp_path, good)
    flip_key_file(tmp_path, "aaa")  # the alphabetically first tenant
    with Store(cfg(tmp_path), good) as s:
        assert s.get("bbb", bytes([1]) * 32) == [b"bbb" * 1000]
        assert s.get("aaa", bytes([1]) * 32) is None
        assert "aaa" in s.key_problems() and "bbb" not in s.key_problems()
        rep = s.fsck(verify_data=True)
        assert [x.split(":")[0] for x in rep.unreadable_key_files] == ["aaa"]
        assert not rep.corrupt_files
        s.fsck(repair=True, verify_data=True)
    # aaa's objects are kept (its key file may be restored); nothing else was lost.
    assert (tmp_path / "store" / v1.object_relpath("aaa", bytes([2]) * 32)).exists()
    with Store(cfg(tmp_path), good) as s:
        assert s.get("bbb", bytes([2]) * 32) == [b"bbb" * 1000]


def test_kek_rotation_moves_the_recorded_id(tmp_path: Path) -> None:
    old, new = kek(tmp_path, "old"), kek(tmp_path, "new")
    fill(tmp_path, old)
    with Store(cfg(tmp_path), old) as s:
        assert s.rotate_kek(new) == 2
    info = read_layout(tmp_path / "store")
    assert (info.kek_id, info.kek_id_previous) == (new.key_id, None)
    with pytest.raises(StoreError):
        Store(cfg(tmp_path), old)
    with Store(cfg(tmp_path), new) as s:
        assert s.get("aaa", bytes([0]) * 32) == [b"aaa" * 1000]


def test_cli_serves_inspects_and_fscks_past_a_corrupt_key_file(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvoffload.cli", *args],
            cwd=tmp_path, capture_output=True, text=True, timeout=120,
            env={k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")},
        )  # fmt: skip

    assert run("--dev", "init").returncode == 0
    k = Kek.from_file(tmp_path / ".kvoffload/dev-kek")
    c = StoreConfig(root=tmp_path / ".kvoffload/store", index_dir=tmp_path / ".kvoffload/index")
    with Store(c, k) as s:
        for t in ("aaa", "bbb"):
            s.put(t, NS, bytes([1]) * 32, [os.urandom(5000)])
    p = tmp_path / ".kvoffload/store/keys/aaa.key"
    p.write_bytes(p.read_bytes().replace(b'"ct": "', b'"ct": "x', 1))
    r = run("--dev", "inspect", "--json")
    assert r.returncode == 0, r.stderr
    assert list(json.loads(r.stdout)["tenants_with_unreadable_keys"]) == ["aaa"]
    r = run("--dev", "fsck", "--json")
    assert r.returncode == 5 and "Traceback" not in r.stderr
    assert json.loads(r.stdout)["unreadable_key_files"][0].startswith("aaa:")


@pytest.mark.parametrize("field", ["store_id", "kek_id", "layout_version", "truncated", "garbage"])
def test_a_damaged_layout_json_is_restored_from_the_index_copy(tmp_path: Path, field: str) -> None:
    good = kek(tmp_path, "good")
    fill(tmp_path, good)
    lj = tmp_path / "store" / "layout.json"
    raw = bytearray(lj.read_bytes())
    if field == "truncated":
        raw = raw[: len(raw) // 2]
    elif field == "garbage":
        raw = bytearray(os.urandom(len(raw)))
    else:
        pos = raw.index(f'"{field}": '.encode()) + len(field) + 6
        raw[pos] ^= 0x01  # one bit of the value, still a well-formed JSON value
    lj.write_bytes(raw)
    with Store(cfg(tmp_path), good) as s:
        assert s.get("bbb", bytes([1]) * 32) == [b"bbb" * 1000]
    assert read_layout(tmp_path / "store").kek_id == good.key_id
    assert any(p.name.startswith("layout.json.damaged-") for p in (tmp_path / "store").iterdir())
    # A different KEK is still refused: the copy names the store's own.
    with pytest.raises(StoreError):
        Store(cfg(tmp_path), kek(tmp_path, "other"))
