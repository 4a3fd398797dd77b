"""Retention survives the index (issue 11, item 5): chunks past their TTL are never
served again after a rebuild (fsck --repair, a lost or garbage index)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from kvoffload.store import Store, StoreConfig
from kvoffload.store.keys.keyring import Kek
from kvoffload.store.retention import RECORD_SIZE

NS = bytes(range(32))


def k(i: int) -> bytes:
    return bytes([i]) * 32


@pytest.mark.parametrize("loss", ["repair", "deleted", "garbage"])
@pytest.mark.parametrize("encrypt", [True, False])
def test_a_rebuild_never_revives_expired_chunks(
    tmp_path: Path, kek_file: Path, loss: str, encrypt: bool
) -> None:
    cfg = StoreConfig(root=tmp_path / "store", durability="none")
    kek = Kek.from_file(kek_file)
    with Store(cfg, kek, create=True) as s:
        for i in range(6):
            s.put("acme", NS, k(i), [bytes([i]) * 2000], ttl_s=0.3, encrypt=encrypt)
        for i in range(6, 9):
            s.put("acme", NS, k(i), [bytes([i]) * 2000], ttl_s=3600, encrypt=encrypt)
        s.put("acme", NS, k(9), [b"keep" * 500], encrypt=encrypt)  # no TTL
    time.sleep(0.4)
    index = cfg.resolved_index_dir() / "lmdb"
    if loss == "deleted":
        shutil.rmtree(index)
    elif loss == "garbage":
        (index / "data.mdb").write_bytes(os.urandom((index / "data.mdb").stat().st_size))
    with Store(cfg, kek) as s:
        if loss == "repair":
            s.fsck(repair=True)
        keys = [k(i) for i in range(10)]
        assert [s.get("acme", x) is not None for x in keys] == [False] * 6 + [True] * 4
        assert s.lookup("acme", keys[:6]) == 0
        # Unexpired TTLs are kept as they were.
        assert all(s.index.get("acme", k(i)).expires_ns for i in range(6, 9))
        assert s.index.get("acme", k(9)).expires_ns == 0
        assert s.fsck().clean


def test_a_resave_without_ttl_is_not_bound_by_an_older_ttl(tmp_path: Path, kek_file: Path) -> None:
    cfg = StoreConfig(root=tmp_path / "store", durability="none")
    kek = Kek.from_file(kek_file)
    with Store(cfg, kek, create=True) as s:
        s.put("acme", NS, k(1), [b"a" * 100], ttl_s=0.2)
        time.sleep(0.3)
        assert s.get("acme", k(1)) is None
        s.put("acme", NS, k(1), [b"a" * 100])
    shutil.rmtree(cfg.resolved_index_dir() / "lmdb")
    with Store(cfg, kek) as s:
        assert s.get("acme", k(1)) == [b"a" * 100]


def test_damaged_retention_records_are_skipped_not_fatal(tmp_path: Path, kek_file: Path) -> None:
    cfg = StoreConfig(root=tmp_path / "store", durability="none")
    kek = Kek.from_file(kek_file)
    with Store(cfg, kek, create=True) as s:
        for i in range(3):
            s.put("acme", NS, k(i), [b"a" * 100], ttl_s=0.2)
    (log,) = (cfg.root / "journal" / "retention" / "acme").iterdir()
    raw = bytearray(log.read_bytes())
    assert len(raw) == 3 * RECORD_SIZE
    raw[RECORD_SIZE + 40] ^= 1  # record 1's expiry
    log.write_bytes(bytes(raw) + b"torn")
    time.sleep(0.3)
    shutil.rmtree(cfg.resolved_index_dir() / "lmdb")
    with Store(cfg, kek) as s:
        got = [s.get("acme", k(i)) is not None for i in range(3)]
    assert got == [False, True, False]  # a lost record costs its TTL, nothing else
