"""A node of a shared root that restarts, crashes mid-write, opens the root
without ``shared`` or holds the lease (issue 28, items 1-4), on the fast tier:
several Stores on one local directory, real files, LMDB indexes, journals and
lease files; the crashes are real SIGKILLs of real processes. The JuiceFS tier
with real sidecars is tests/store/test_shared_juicefs_restart.py.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload.errors import StoreError, StoreFull
from kvoffload.layouts import v1
from kvoffload.store import Store, StoreConfig
from kvoffload.store.keys.keyring import Kek
from kvoffload.store.shared.journal import JournalFollower, Op
from tests.helpers.shared import NS, Nodes, key, layers

SIZE = v1.object_size([len(x) for x in layers(0)], True)  # every chunk here: 3 x 3000 B


@pytest.fixture
def nodes(tmp_path: Path, kek_file: Path) -> Iterator[Nodes]:
    n = Nodes(tmp_path, kek_file)
    yield n
    n.close()


def _grant(s: Store) -> dict[str, int]:
    info = s.shared_info()
    assert info is not None
    grant: dict[str, int] = info["grant"]
    return grant


def test_a_restarted_node_keeps_what_it_wrote_under_the_epoch(nodes: Nodes) -> None:
    """Grants are cumulative within an epoch: a node that forgot its written bytes
    at a restart would be granted them all again (the root outgrew its capacity)."""
    cap = 24 * SIZE
    a = nodes.node("a", capacity_bytes=cap, evictor_lease_s=3600.0)  # holder
    b = nodes.node("b", capacity_bytes=cap, evictor_lease_s=3600.0)
    a.follow_journals()
    a.evictor_tick()  # b's first grant
    b.evictor_tick()
    stored = 0
    for i in range(40):
        try:
            b.put("acme", NS, key(i), layers(i))
            stored += 1
        except StoreFull:
            break
    before = _grant(b)
    assert stored > 0 and before["written"] == stored * SIZE
    b.close()
    b = nodes.node("b", capacity_bytes=cap, evictor_lease_s=3600.0)
    after = _grant(b)
    assert (after["epoch"], after["bytes"]) == (before["epoch"], before["bytes"])
    assert after["written"] == before["written"]
    # What b may still write is what the grant left, not the grant again.
    more = 0
    for i in range(100, 140):
        try:
            b.put("acme", NS, key(i), layers(i))
            more += 1
        except StoreFull:
            break
    assert (stored + more) * SIZE <= before["bytes"]


def test_a_restarted_node_that_takes_the_lease_evicts_nothing_it_need_not(
    nodes: Nodes,
) -> None:
    """A node restarted mid-epoch that then takes the role counts the old holder's
    grants minus what it saw used of them; had it forgotten what it saw, every
    grant of the epoch would count as unused: it evicted the whole root and
    granted nothing for three lease times."""
    cap = 24 * SIZE
    b = nodes.node("b", capacity_bytes=cap, evictor_lease_s=3600.0)  # holder
    a = nodes.node("a", capacity_bytes=cap, evictor_lease_s=3600.0)
    i = 0
    for _round in range(12):  # several capacities through both: grants keep growing
        for s in (b, a):
            s.follow_journals()
            s.evictor_tick()
        for s in (a, b):
            for _ in range(4):
                with contextlib.suppress(StoreFull):
                    s.put("acme", NS, key(i), layers(i))
                i += 1
    b.follow_journals()
    b.evictor_tick()
    a.follow_journals()
    lease = a._state.shared.lease  # type: ignore[union-attr]
    cur = lease.current()
    assert cur is not None and cur.holder == b._state.shared.node_id  # type: ignore[union-attr]
    assert sum(cur.grants.values()) > 2 * cap  # cumulative: far above the capacity
    a.close()
    a = nodes.node("a", capacity_bytes=cap, evictor_lease_s=3600.0)  # restarted
    used = a.used_bytes
    assert 0 < used <= cap
    b.close()  # releases the role: a takes epoch 2 at its next tick
    assert a.evictor_tick() is True
    assert _grant(a)["epoch"] == cur.epoch + 1
    assert a.counters.evictions == 0
    assert a.used_bytes == used
    assert _grant(a)["bytes"] > 0
    assert a.put("acme", NS, key(10_000), layers(1))


def _crash_child(root: str, index: str, kek: str, where: str) -> None:
    """Store 3 chunks, then SIGKILL this process in the middle of a batch of 4:
    ``index``, after their objects took their names and before the index
    transaction; ``rename``, before the first object takes its name (a temp file
    left). A fault injection at one call; everything else is the real path."""
    cfg = StoreConfig(
        root=Path(root),
        index_dir=Path(index),
        durability="none",  # type: ignore[arg-type]
        shared=True,
        journal_poll_s=3600,
        capacity_bytes=64 * SIZE,
        evictor_lease_s=3600.0,
        io_streams=1,
    )
    s = Store(cfg, Kek.from_file(Path(kek)), create=True)
    s.put_many("acme", NS, [(key(i), layers(i)) for i in range(3)])

    def die(*_a: Any, **_k: Any) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "lease":  # a direct-path write: the worker was filling the file
        lease = s.lease_store("acme", NS, key(10), [len(x) for x in layers(10)])
        assert lease is not None and lease.tmp.exists()
        die()
    if where == "index":
        s.index.put_each = die  # type: ignore[method-assign]
    else:
        real = os.rename

        def rename(src: Any, dst: Any, *a: Any, **k: Any) -> None:
            if str(dst).endswith(v1.OBJECT_SUFFIX):
                die()
            real(src, dst, *a, **k)

        os.rename = rename  # type: ignore[assignment]
    s.put_many("acme", NS, [(key(10 + i), layers(10 + i)) for i in range(4)])
    sys.exit(3)  # not reached


def _crash(nodes: Nodes, kek_file: Path, where: str) -> None:
    ctx = mp.get_context("spawn")
    p = ctx.Process(
        target=_crash_child,
        args=(str(nodes.tmp / "root"), str(nodes.tmp / "index-a"), str(kek_file), where),
    )
    p.start()
    p.join(timeout=120)
    assert p.exitcode == -signal.SIGKILL


def test_a_write_in_flight_at_a_crash_is_counted_indexed_and_journaled_at_restart(
    nodes: Nodes, kek_file: Path
) -> None:
    _crash(nodes, kek_file, "index")
    crashed = [key(10 + i) for i in range(4)]
    on_disk = [nodes.tmp / "root" / v1.object_relpath("acme", k) for k in crashed]
    assert all(p.exists() for p in on_disk)  # named, never indexed nor journaled
    a = nodes.node("a", capacity_bytes=64 * SIZE, evictor_lease_s=3600.0)
    # Counted against the grant they were written under: 3 + 4 chunks.
    assert _grant(a)["written"] == 7 * SIZE
    assert a.lookup("acme", crashed) == 4
    info = a.shared_info()
    assert info is not None and info["crashed_writes_settled"] == 4
    # Journaled for the others, under the grant epoch they used.
    stores = [
        r
        for _n, r in JournalFollower(nodes.tmp / "root").poll()
        if r.op is Op.STORE and r.key in crashed
    ]
    assert sorted(r.key for r in stores) == sorted(crashed)
    assert {r.grant_epoch for r in stores} == {_grant(a)["epoch"]}
    b = nodes.node("b")
    assert b.lookup("acme", crashed) == 4  # from a's journal, no probe
    # A second restart counts nothing twice.
    a.close()
    a = nodes.node("a", capacity_bytes=64 * SIZE, evictor_lease_s=3600.0)
    assert _grant(a)["written"] == 7 * SIZE


@pytest.mark.parametrize("where", ["rename", "lease"])
def test_a_temp_file_left_by_a_crash_is_removed_without_walking_the_tree(
    nodes: Nodes, kek_file: Path, where: str
) -> None:
    _crash(nodes, kek_file, where)
    objects = nodes.tmp / "root" / "objects"
    left = [p for p in objects.rglob(f"{v1.TMP_PREFIX}*")]
    assert len(left) == 1
    assert left[0].parent == (nodes.tmp / "root" / v1.object_relpath("acme", key(10))).parent
    # An old temp file and an object no journal names, elsewhere in the tree: a
    # walk would find both; a shared root's sweep never walks.
    other = objects / "acme" / "ff"
    other.mkdir(parents=True, exist_ok=True)
    stray = other / f"{v1.TMP_PREFIX}0123456789abcdef-1"
    stray.write_bytes(b"x")
    os.utime(stray, (1, 1))
    a = nodes.node("a", capacity_bytes=64 * SIZE, evictor_lease_s=3600.0, tmp_max_age_s=0.0)
    # The crashed write never took its name, but its temp file holds its bytes
    # until it is swept: counted against the grant all the same.
    assert _grant(a)["written"] == 4 * SIZE
    listed = _listings_during(a.maintain, objects)
    assert listed == {left[0].parent}
    assert not left[0].exists()
    assert stray.exists()
    assert a.maintain()["tmp_removed"] == 0  # swept once, then forgotten


def _listings_during(fn: Any, under: Path) -> set[Path]:
    """The directories under ``under`` that ``fn()`` lists (os.listdir / os.scandir,
    os.walk included), seen by a Python audit hook (hooks cannot be removed: it
    records only while armed)."""
    seen: set[Path] = set()
    armed = [True]

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if armed[0] and event in ("os.listdir", "os.scandir") and args:
            p = Path(os.fsdecode(args[0])) if isinstance(args[0], (str, bytes)) else None
            if p is not None and p.is_relative_to(under):
                seen.add(p)

    sys.addaudithook(hook)
    try:
        fn()
    finally:
        armed[0] = False
    return seen


def test_the_sweep_of_a_shared_root_lists_no_object_directory(nodes: Nodes) -> None:
    a = nodes.node("a")
    for i in range(20):
        a.put("acme", NS, key(i), layers(i))
    b = nodes.node("b")
    assert _listings_during(b.maintain, nodes.tmp / "root" / "objects") == set()
    assert _listings_during(a.maintain, nodes.tmp / "root" / "objects") == set()


def test_a_root_that_other_nodes_journal_into_refuses_a_node_that_is_not_shared(
    nodes: Nodes, kek_file: Path
) -> None:
    a = nodes.node("a")
    for i in range(5):
        a.put("acme", NS, key(i), layers(i))
    files = sorted(p for p in (nodes.tmp / "root").rglob("*") if p.is_file())
    cfg = StoreConfig(
        root=nodes.tmp / "root",
        index_dir=nodes.tmp / "index-plain",
        durability="none",  # type: ignore[arg-type]
        capacity_bytes=SIZE,
    )
    node_id = a._state.shared.node_id  # type: ignore[union-attr]
    with pytest.raises(
        StoreError, match=rf"is shared: 1 other node\(s\).*{node_id}.*shared = true"
    ):
        Store(cfg, Kek.from_file(kek_file))
    assert sorted(p for p in (nodes.tmp / "root").rglob("*") if p.is_file()) == files
    assert not (nodes.tmp / "index-plain" / "lmdb").exists()
    # The node that journals there may stop sharing the root (nobody else uses it).
    a.close()
    own = StoreConfig(
        root=nodes.tmp / "root",
        index_dir=nodes.tmp / "index-a",
        durability="none",  # type: ignore[arg-type]
    )
    with Store(own, Kek.from_file(kek_file)) as s:
        assert s.lookup("acme", [key(i) for i in range(5)]) == 5


def test_a_holder_store_ticking_at_every_poll_rewrites_its_lease_only_when_due(
    nodes: Nodes,
) -> None:
    """The journal loop ticks the lease at every poll (0.5 s by default); the lease
    file is rewritten every ttl/3 (and when a grant is raised), not at every tick."""
    from kvoffload.store.shared.lease import EvictorLease

    a = nodes.node("a", capacity_bytes=24 * SIZE, evictor_lease_s=3600.0)
    nodes.node("b", capacity_bytes=24 * SIZE, evictor_lease_s=3600.0)
    observer = EvictorLease(nodes.tmp / "root", "0" * 32, "observer")
    a.follow_journals()
    a.evictor_tick()  # grants b: one publication
    first = observer.current()
    assert first is not None
    for _ in range(50):  # 25 s of polls at the default interval, nothing written
        a.follow_journals()
        assert a.evictor_tick() is True
    cur = observer.current()
    assert cur is not None and cur.renewal == first.renewal
    assert a.shared_info()["lease_renewals"] == first.renewal  # type: ignore[index]


def test_the_index_directory_is_judged_by_the_mount_that_holds_it(tmp_path: Path) -> None:
    """``serve`` refuses an index on a network or cluster filesystem and warns of an
    unknown FUSE one (the JuiceFS tier runs serve on a real mount). Here the mount
    table is a file written for the test, so every kind can be named."""
    from kvoffload.store.fstypes import index_dir_kind

    for sub in ("jfs", "nfs", "sshfs"):
        (tmp_path / sub).mkdir()
    table = tmp_path / "mounts"
    table.write_text(
        "/dev/root / ext4 rw 0 0\n"
        f"JuiceFS:vol {tmp_path}/jfs fuse.juicefs rw 0 0\n"
        f"srv:/export {tmp_path}/nfs nfs4 rw 0 0\n"
        f"me@host: {tmp_path}/sshfs fuse.sshfs rw 0 0\n"
    )
    # The default index_dir, <root>.index, of a root below the mount point.
    assert index_dir_kind(tmp_path / "jfs" / "store.index", table).network is True
    assert index_dir_kind(tmp_path / "nfs" / "a" / "b", table).family == "NFS"
    assert index_dir_kind(tmp_path / "sshfs" / "idx", table).network is None
    assert index_dir_kind(tmp_path / "local" / "idx", table).network is False


def test_the_juicefs_settings_are_read_from_the_mounts_config_file(tmp_path: Path) -> None:
    """``doctor`` reads a JuiceFS mount's virtual ``.config`` (the JuiceFS tier reads
    a real one); here a directory stands for the mount point."""
    import json

    from kvoffload.store.fstypes import juicefs_settings

    cfg = {"Format": {"Name": "vol", "TrashDays": 0}, "AttrTimeout": 500_000_000}
    (tmp_path / ".config").write_text(json.dumps(cfg))
    assert juicefs_settings(tmp_path) == {"volume": "vol", "trash_days": 0, "attr_cache_s": 0.5}
    (tmp_path / ".config").write_text("{}")
    assert "does not say the trash days" in juicefs_settings(tmp_path)["error"]
    assert "cannot read" in juicefs_settings(tmp_path / "absent")["error"]
