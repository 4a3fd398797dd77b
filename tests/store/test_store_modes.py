"""File modes under a lax umask (issue 11, item 8): nothing of the store's metadata
is readable or listable by other uids, whatever the umask of the launcher."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.store import Store, StoreConfig
from kvoffload.store.keys.keyring import Kek

NS = bytes(range(32))


@pytest.fixture
def umask_0022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _others(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode) & 0o007


def test_store_modes_under_umask_0022(tmp_path: Path, kek_file: Path, umask_0022: None) -> None:
    cfg = StoreConfig(root=tmp_path / "store", durability="none")
    with Store(cfg, Kek.from_file(kek_file), create=True) as s:
        s.put("acme", NS, bytes([1]) * 32, [b"x" * 5000])
        s.put("open", NS, bytes([2]) * 32, [b"y" * 5000], encrypt=False)
        s.purge_tenant("open", wait=True)
    root = tmp_path / "store"
    assert stat.S_IMODE((root / "keys").stat().st_mode) == 0o700
    assert _others(root / "keys" / "acme.key") == 0
    assert stat.S_IMODE((root / "objects").stat().st_mode) & 0o044 == 0  # not listable
    for d in (root / "objects").rglob("*"):
        if d.is_dir():
            assert stat.S_IMODE(d.stat().st_mode) & 0o077 == 0, d
        else:
            assert stat.S_IMODE(d.stat().st_mode) & 0o007 == 0, d
    index = cfg.resolved_index_dir()
    assert stat.S_IMODE((index / "audit.jsonl").stat().st_mode) == 0o600
    assert _others(index) == 0


def test_an_old_lax_store_is_tightened_on_open(
    tmp_path: Path, kek_file: Path, umask_0022: None
) -> None:
    cfg = StoreConfig(root=tmp_path / "store", durability="none")
    Store(cfg, Kek.from_file(kek_file), create=True).close()
    for sub in ("keys", "objects", "journal"):
        (tmp_path / "store" / sub).chmod(0o755)
    (cfg.resolved_index_dir() / "audit.jsonl").write_text("")
    (cfg.resolved_index_dir() / "audit.jsonl").chmod(0o644)
    with Store(cfg, Kek.from_file(kek_file)) as s:
        s.put("acme", NS, bytes([1]) * 32, [b"x" * 5000])  # creates the tenant: an audit line
    assert stat.S_IMODE((tmp_path / "store/keys").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "store/objects").stat().st_mode) == 0o711
    assert stat.S_IMODE((cfg.resolved_index_dir() / "audit.jsonl").stat().st_mode) == 0o600
