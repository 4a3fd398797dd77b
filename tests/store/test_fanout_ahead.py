"""A tenant's one-level fan-out directories are made before its first write,
with one directory fsync, instead of one mkdir plus one parent fsync per new
leaf inside the writes (issue 12, lever 3). A real Store on real files."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.layouts import v1
from kvoffload.store import Store, StoreConfig
from kvoffload.store import files as fileio
from kvoffload.store.keys.kek import Kek
from tests.helpers.stores import NS, key, layers, make_store, open_store, root_with_fanout


def _count_dir_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    seen: list[Path] = []
    real = fileio.fsync_dir

    def counting(path: Path) -> None:
        seen.append(Path(path))
        real(path)

    monkeypatch.setattr(fileio, "fsync_dir", counting)
    return seen


def test_a_fresh_tenant_gets_all_its_leaves_with_one_fsync(
    tmp_path: Path, kek_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = StoreConfig(root=tmp_path / "store", durability="object")
    s = Store(cfg, Kek.from_file(kek_file), create=True)
    try:
        fsyncs = _count_dir_fsyncs(monkeypatch)
        n = 40
        results = s.put_many("acme", NS, [(key(i), layers(i)) for i in range(n)])
        assert all(results)
        tenant_dir = s.root / "objects" / "acme"
        leaves = sorted(p.name for p in tenant_dir.iterdir())
        assert leaves == [f"{i:02x}" for i in range(256)]
        assert all((tenant_dir / d).stat().st_mode & 0o777 == 0o700 for d in leaves)
        # One fsync of each object's directory after its rename, plus the tenant
        # directory once for its 256 leaves (and the directories above it, made
        # once): not one more per leaf that a write found missing.
        parents = {s.root / v1.object_relpath("acme", key(i)) for i in range(n)}
        object_dirs = [p for p in fsyncs if p != tenant_dir and p in {q.parent for q in parents}]
        assert len(object_dirs) == n
        assert fsyncs.count(tenant_dir) == 1
        assert len(fsyncs) - n <= 3
        for i in range(n):
            assert s.get("acme", key(i)) == layers(i)
    finally:
        s.close()


def test_leaves_already_there_are_kept_and_a_purged_tenant_gets_them_again(
    tmp_path: Path, kek_file: Path
) -> None:
    s = open_store(tmp_path, kek_file)
    try:
        assert s.put("acme", NS, key(1), layers(1))
        leaf = (s.root / v1.object_relpath("acme", key(1))).parent
        assert s.put("acme", NS, key(2), layers(2))
        assert s.get("acme", key(1)) == layers(1)  # nothing of a leaf was replaced
        assert leaf.is_dir()
        s.purge_tenant("acme", wait=True)
        assert not (s.root / "objects" / "acme").exists()
        assert s.put("acme", NS, key(3), layers(3))
        assert len(list((s.root / "objects" / "acme").iterdir())) == 256
        assert s.get("acme", key(3)) == layers(3)
    finally:
        s.close()


def test_a_two_level_store_still_makes_leaves_as_writes_need_them(
    tmp_path: Path, kek_file: Path
) -> None:
    root = tmp_path / "store"
    root_with_fanout(root, [2, 2])  # a root an older build made
    s = make_store(root, kek_file, durability="none", create=False)
    try:
        assert s.layout.fanout == v1.FANOUT_TWO_LEVELS
        assert s.put("acme", NS, key(1), layers(1))
        top = s.root / "objects" / "acme"
        assert len(list(top.iterdir())) == 1  # only the leaf the write needed
        assert s.get("acme", key(1)) == layers(1)
    finally:
        s.close()


def test_a_failure_to_make_leaves_ahead_does_not_fail_the_write(
    tmp_path: Path, kek_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(_d: Path, *, durable: bool) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fileio, "make_fanout", broken)
    s = open_store(tmp_path, kek_file)
    try:
        assert s.put("acme", NS, key(1), layers(1))
        assert s.get("acme", key(1)) == layers(1)
    finally:
        s.close()
