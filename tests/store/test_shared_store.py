"""Several Stores ("nodes") on one store root, each with its own index: the fast
tier of the shared root (one local directory; the JuiceFS tier adds client caches).

Real files, real LMDB indexes, real AES-GCM; the background follower threads
are slowed down (journal_poll_s) and the tests call follow_journals() /
evictor_tick() themselves, so each step is deterministic.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.errors import StoreFull
from kvoffload.store import Store, StoreConfig
from kvoffload.store.keys.keyring import Kek
from tests.helpers.shared import NS, Nodes, key, layers
from tests.sharedfs import doctor_sharing


@pytest.fixture
def nodes(tmp_path: Path, kek_file: Path) -> Iterator[Nodes]:
    n = Nodes(tmp_path, kek_file)
    yield n
    n.close()


def test_a_chunk_saved_on_one_node_is_a_hit_on_another_from_its_own_index(nodes: Nodes) -> None:
    a, b = nodes.node("a"), nodes.node("b")
    assert a.tenant_salt("acme") == b.tenant_salt("acme")  # one keyring in the root
    for i in range(5):
        assert a.put("acme", NS, key(i), layers(i))
    assert b.lookup("acme", [key(i) for i in range(5)]) == 0  # no probing, not followed yet
    assert b.follow_journals() == 5
    assert b.lookup("acme", [key(i) for i in range(5)]) == 5
    assert b.get("acme", key(3)) == layers(3)
    assert b.used_bytes == a.used_bytes
    info = b.shared_info()
    assert info is not None and info["followed"] == 5


def test_removals_and_namespace_purges_reach_the_other_index(nodes: Nodes) -> None:
    a, b = nodes.node("a"), nodes.node("b")
    other_ns = bytes(32)
    for i in range(4):
        a.put("acme", NS, key(i), layers(i))
    a.put("acme", other_ns, key(9), layers(9))
    b.follow_journals()
    assert a.delete("acme", key(0))
    a.purge_namespace("acme", other_ns)
    b.follow_journals()
    assert b.lookup("acme", [key(0)]) == 0
    assert b.lookup("acme", [key(9)]) == 0
    assert b.lookup("acme", [key(1), key(2), key(3)]) == 3
    assert b.used_bytes == a.used_bytes


def test_a_tenant_purge_stops_decryption_on_the_other_node_at_once(nodes: Nodes) -> None:
    a, b = nodes.node("a"), nodes.node("b", key_cache_ttl_s=3600.0)
    a.put("acme", NS, key(1), layers(1))
    a.put("beta", NS, key(1), layers(2))
    b.follow_journals()
    assert b.get("acme", key(1)) == layers(1)  # b now caches acme's keys for an hour
    a.purge_tenant("acme", wait=True)
    b.follow_journals()
    assert b.get("acme", key(1)) is None
    assert b.lookup("acme", [key(1)]) == 0
    assert b.get("beta", key(1)) == layers(2)  # other tenants unaffected


def test_a_follower_restart_resumes_from_its_saved_position(nodes: Nodes) -> None:
    a, b = nodes.node("a"), nodes.node("b")
    a.put("acme", NS, key(1), layers(1))
    assert b.follow_journals() == 1
    b.close()
    nodes.open.remove(b)
    a.put("acme", NS, key(2), layers(2))
    b2 = nodes.node("b")
    b2.follow_journals()
    # The open caught up, with only the new record: the position was kept.
    assert b2.shared_info()["followed"] == 1  # type: ignore[index]
    assert b2.lookup("acme", [key(1), key(2)]) == 2


def test_only_the_lease_holder_evicts_and_the_root_stays_under_capacity(nodes: Nodes) -> None:
    size = len(b"".join(layers(0)))
    cap = 12 * (size + 8192)
    a = nodes.node("a", capacity_bytes=cap, evictor_lease_s=3600.0)  # holder from its open
    b = nodes.node("b", capacity_bytes=cap, evictor_lease_s=3600.0)
    assert a.shared_info()["evictor_here"] is True  # type: ignore[index]
    assert b.evictor_tick() is False
    root_objects = nodes.tmp / "root" / "objects"

    def on_disk() -> int:
        return sum(p.stat().st_size for p in root_objects.rglob("*.kvo"))

    # The holder granted b nothing yet (b was not registered): b's save is refused.
    with pytest.raises(StoreFull):
        b.put("acme", NS, key(0), layers(0))
    i, stored, refused = 0, 0, 0
    for _round in range(12):
        a.follow_journals()
        a.evictor_tick()  # evicts, then grants from the room under the high watermark
        b.follow_journals()
        b.evictor_tick()  # b learns its grant
        for _ in range(4):  # b writes more than one round's grant, a does too
            for s in (b, a):
                try:
                    s.put("acme", NS, key(i), layers(i))
                    stored += 1
                except StoreFull:
                    refused += 1
                i += 1
                assert on_disk() <= cap  # never, whoever writes
    assert stored > 12 and refused > 0
    assert a.counters.evictions > 0
    assert b.counters.evictions == 0
    b.follow_journals()
    # The holder's removals reached b's index: what b's index holds is on disk.
    for j in range(i):
        if b.lookup("acme", [key(j)]):
            assert b.get("acme", key(j)) is not None


def test_a_node_with_no_holder_in_sight_writes_nothing_past_its_grant(nodes: Nodes) -> None:
    size = len(b"".join(layers(0)))
    cap = 12 * (size + 8192)
    a = nodes.node("a", capacity_bytes=cap, evictor_lease_s=3600.0)
    b = nodes.node("b", capacity_bytes=cap, evictor_lease_s=3600.0)
    a.evictor_tick()
    b.evictor_tick()
    grant = b.shared_info()["grant"]["bytes"]  # type: ignore[index]
    assert grant > 0
    written = 0
    for j in range(20):  # a never runs again: b's grant is all it may use
        try:
            b.put("acme", NS, key(100 + j), layers(j))
            written += size + 8192
        except StoreFull:
            break
    info = b.shared_info()
    assert info is not None and info["grant"]["written"] <= grant


def test_a_root_that_is_not_shared_writes_no_journal(tmp_path: Path, kek_file: Path) -> None:
    cfg = StoreConfig(root=tmp_path / "root", durability="none")  # type: ignore[arg-type]
    with Store(cfg, Kek.from_file(kek_file), create=True) as s:
        s.put("acme", NS, key(1), layers(1))
        assert s.shared_info() is None
    assert list((tmp_path / "root" / "journal").iterdir()) == []


def test_the_config_turns_a_shared_root_on_and_refuses_a_bad_value(tmp_path: Path) -> None:
    from kvoffload.errors import ConfigError
    from kvoffload.sidecar.config import load_config

    f = tmp_path / "c.toml"
    f.write_text('[store]\nshared = true\njournal_poll = "250ms"\nevictor_lease = "20s"\n')
    sc = load_config(f, env={}).store_config()
    assert (sc.shared, sc.journal_poll_s, sc.evictor_lease_s) == (True, 0.25, 20.0)
    assert load_config(None, env={"KVOFFLOAD_STORE_SHARED": "off"}).shared is False
    with pytest.raises(ConfigError, match=r"\[store\] shared: not a boolean: 'maybe'"):
        load_config(None, env={"KVOFFLOAD_STORE_SHARED": "maybe"})


def test_a_lone_shared_node_with_a_capacity_keeps_saving_by_evicting(nodes: Nodes) -> None:
    size = len(b"".join(layers(0)))
    cap = 12 * (size + 8192)
    a = nodes.node("a", capacity_bytes=cap, evictor_lease_s=3600.0)
    for j in range(40):  # no tick in between: the holder evicts and refills in the save
        assert a.put("acme", NS, key(j), layers(j))
        assert a.used_bytes <= cap
    assert a.counters.evictions >= 28
    assert a.lookup("acme", [key(39)]) == 1


def test_inspect_shows_the_shared_root(tmp_path: Path, kek_file: Path) -> None:
    import json
    import os
    import subprocess

    from kvoffload.testing import cli_argv, sidecar_env

    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[store]\nroot = "{tmp_path}/root"\nindex_dir = "{tmp_path}/idx"\nshared = true\n'
        f'[server]\nsocket = "{tmp_path}/s.sock"\n[security]\nkek_file = "{kek_file}"\n'
    )
    other = other_node_journal(tmp_path / "root")
    r = subprocess.run(
        cli_argv("--config", str(cfg), "inspect", "--json"),
        capture_output=True,
        text=True,
        env=sidecar_env(),
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    shared = json.loads(r.stdout)["shared"]
    assert shared["evictor_here"] is True
    assert list(shared["nodes_followed"]) == [other]
    r = subprocess.run(
        cli_argv("--config", str(cfg), "inspect"),
        capture_output=True,
        text=True,
        env={**sidecar_env(), "COLUMNS": "200"},
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert f"following {other[:8]}@" in r.stdout
    assert os.path.isdir(tmp_path / "root" / "journal" / "nodes")


def other_node_journal(root: Path) -> str:
    """Another node's journal in ``root`` (as if a second sidecar had opened it)."""
    from kvoffload.layouts import create_root
    from kvoffload.store.shared.journal import JournalRecord, JournalWriter

    create_root(root)
    node = "c" * 32
    w = JournalWriter(root, node, durable=False)
    w.open()
    w.append([JournalRecord.purge_tenant("nobody")])
    w.close()
    return node


def test_filesystem_types_are_classified_for_sharing() -> None:
    from kvoffload.store.fstypes import classify

    assert classify("nfs").network is True and "lookupcache" in classify("nfs").advice
    assert classify("fuseblk", "fuse.juicefs").family == "JuiceFS"
    assert classify("fuseblk", "fuse.sshfs").network is None
    assert classify("ext2/ext3").network is False
    assert classify(None).family == "unknown"


def test_doctor_says_a_shared_flag_on_a_local_root_reaches_only_this_node(
    tmp_path: Path, kek_file: Path
) -> None:
    sh = doctor_sharing(
        tmp_path, kek_file, tmp_path / "root", index_dir=tmp_path / "idx", shared=True
    )
    assert sh["looks_shared"] is False
    assert any("local filesystem" in str(w) for w in sh["warnings"])  # type: ignore[attr-defined]
    sh = doctor_sharing(tmp_path, kek_file, tmp_path / "root", index_dir=tmp_path / "idx")
    assert sh["warnings"] == []


def test_with_its_follower_stopped_a_node_still_finds_another_nodes_chunk_by_name(
    nodes: Nodes,
) -> None:
    a = nodes.node("a")
    b = nodes.node("b", probe_files_on_miss=True)  # follows only every hour
    for i in range(3):
        a.put("acme", NS, key(i), layers(i))
    assert b.shared_info()["followed"] == 0  # type: ignore[index]
    assert b.lookup("acme", [key(0), key(1), key(2), key(3)]) == 3  # existence checks
    assert b.get("acme", key(2)) == layers(2)


def test_a_new_node_catches_up_from_the_journals_without_walking_the_tree(
    nodes: Nodes, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    caplog.set_level(logging.INFO)
    a = nodes.node("a")
    for i in range(6):
        a.put("acme", NS, key(i), layers(i))
    a.delete("acme", key(5))
    b = nodes.node("b")  # a fresh index on a root full of objects
    assert b.lookup("acme", [key(i) for i in range(5)]) == 5  # from a's journal
    assert b.lookup("acme", [key(5)]) == 0
    info = b.shared_info()
    assert info is not None and info["followed"] == 7
    assert not [r for r in caplog.records if "rebuil" in r.getMessage()]


def test_after_a_takeover_the_old_epochs_grants_still_count_against_the_capacity(
    nodes: Nodes,
) -> None:
    import time

    size = len(b"".join(layers(0)))
    cap = 12 * (size + 8192)
    a = nodes.node("a", capacity_bytes=cap, evictor_lease_s=3.0)
    b = nodes.node("b", capacity_bytes=cap, evictor_lease_s=3.0)
    nodes.node("c", capacity_bytes=cap, evictor_lease_s=3.0)
    assert a.evictor_tick() is True  # grants a, b and c in epoch 1
    b.evictor_tick()
    old_b = b.shared_info()["grant"]  # type: ignore[index]
    assert old_b["epoch"] == 1 and old_b["bytes"] > 0
    # a goes silent; b sees epoch 1 unchanged for the ttl and takes epoch 2.
    b.evictor_tick()
    time.sleep(3.1)
    assert b.evictor_tick() is True
    new = b.shared_info()
    assert new is not None and new["grant"]["epoch"] == 2
    lease = b._state.shared.lease  # type: ignore[union-attr]
    assert lease.previous is not None and lease.previous.epoch == 1
    # Everything any node may still write, under either epoch, fits the capacity:
    # b's own grant of epoch 1 is not among it (b writes under the epoch it holds
    # now, and had no write in flight).
    me = b._state.shared.node_id  # type: ignore[union-attr]
    old = sum(g for n, g in lease.previous.grants.items() if n != me)
    assert b.used_bytes + sum(lease.grants.values()) + old <= cap


def test_a_compacted_journal_restates_what_is_still_present(nodes: Nodes) -> None:
    a = nodes.node("a", journal_segment_bytes=600)  # a few records per segment
    c = nodes.node("c")
    for i in range(12):
        a.put("acme", NS, key(i), layers(i))
    c.follow_journals()
    for i in range(4):
        a.delete("acme", key(i))
    a.put("beta", NS, key(50), layers(50))
    a.purge_tenant("beta", wait=True)
    segs = a._state.shared.writer.segment_count()  # type: ignore[union-attr]
    assert segs > 3
    assert a.compact_journal(max_segments=2) == 8  # chunks 4..11 are still present
    assert a._state.shared.writer.segment_count() < segs  # type: ignore[union-attr]
    # A node that starts now learns exactly what is present from the checkpoint.
    b = nodes.node("b")
    assert b.lookup("acme", [key(i) for i in range(4, 12)]) == 8
    assert b.lookup("acme", [key(0)]) == 0
    # A node that had followed before converges too, and sees what comes after.
    a.put("acme", NS, key(99), layers(99))
    c.follow_journals()
    assert c.lookup("acme", [key(99)]) == 1
    assert c.lookup("acme", [key(i) for i in range(4, 12)]) == 8
    assert a.compact_journal(max_segments=100) is None  # below the bound: nothing


def test_each_node_of_a_shared_root_seals_within_its_share_of_a_deks_nonces(
    nodes: Nodes,
) -> None:
    # 64 shares of 64 x 9 segments: each node may seal 9 segments (3 chunks of 3
    # layers) under one DEK epoch, whatever the other nodes sealed.
    a = nodes.node("a", max_segments_per_epoch=64 * 9)
    b = nodes.node("b", max_segments_per_epoch=64 * 9)
    for i in range(3):
        a.put("acme", NS, key(i), layers(i))
        b.put("acme", NS, key(100 + i), layers(i))
    assert a.keyring.get("acme").current_epoch == 1  # type: ignore[union-attr]
    assert b.keyring.get("acme").current_epoch == 1  # type: ignore[union-attr]
    a.put("acme", NS, key(3), layers(3))  # a's share of epoch 1 is spent: a new epoch
    assert a.keyring.get("acme").current_epoch == 2  # type: ignore[union-attr]
    for i in range(4, 12):
        a.put("acme", NS, key(i), layers(i))
    assert a.keyring.get("acme").current_epoch > 2  # type: ignore[union-attr]
    # b still caches epoch 1's keys: objects under a's newer epochs make it re-read
    # the key file rather than count them as damaged.
    b.follow_journals()
    for i in range(12):
        assert b.get("acme", key(i)) == layers(i)
    assert b.counters.corrupt == 0


def test_the_event_feed_of_a_shared_root_is_remote_unless_told() -> None:
    from kvoffload.sidecar.config import load_config

    assert load_config(None, env={}).events.locality == "LOCAL"
    assert load_config(None, env={"KVOFFLOAD_STORE_SHARED": "1"}).events.locality == "REMOTE"
    told = {"KVOFFLOAD_STORE_SHARED": "1", "KVOFFLOAD_EVENTS_LOCALITY": "local"}
    assert load_config(None, env=told).events.locality == "LOCAL"


def test_a_kek_rotated_on_one_node_is_picked_up_by_nodes_given_the_new_kek(
    tmp_path: Path,
) -> None:
    import os
    import shutil
    import time

    from kvoffload.errors import StoreError

    old = os.urandom(32)
    new = os.urandom(32)
    kek_files = {}
    for n in ("a", "b", "c"):
        f = tmp_path / f"kek-{n}"
        f.write_bytes(old)
        f.chmod(0o600)
        kek_files[n] = f

    def node(n: str) -> Store:
        cfg = StoreConfig(
            root=tmp_path / "root",
            index_dir=tmp_path / f"index-{n}",
            durability="none",  # type: ignore[arg-type]
            shared=True,
            journal_poll_s=3600,
            key_cache_ttl_s=0.0,  # every read goes to the key file
        )
        return Store(cfg, Kek.from_file(kek_files[n]), create=True)

    a, b, c = node("a"), node("b"), node("c")
    try:
        a.put("acme", NS, key(1), layers(1))
        b.follow_journals()
        c.follow_journals()
        # The roll-out: the new KEK goes to a's and b's credential files; a rotates.
        new_file = tmp_path / "kek-new"
        new_file.write_bytes(new)
        new_file.chmod(0o600)
        shutil.copy(new_file, kek_files["b"])
        a.rotate_kek(Kek.from_file(new_file))
        time.sleep(0.01)
        # b reads key files wrapped by the new KEK: it re-reads its KEK file.
        assert b.get("acme", key(1)) == layers(1)
        b.put("acme", NS, key(2), layers(2))  # and wraps with it from now on
        a.follow_journals()
        assert a.get("acme", key(2)) == layers(2)
        # c kept only the old KEK: a miss, never an exception, never bytes.
        assert c.get("acme", key(1)) is None
        c.close()
        # ...and once the rotation is complete it is refused at open, both ids named.
        with pytest.raises(StoreError) as exc:
            node("c")
        assert Kek.from_file(kek_files["c"]).key_id in str(exc.value)
        assert Kek.from_file(new_file).key_id in str(exc.value)
    finally:
        for s in (a, b):
            s.close()


def test_an_eviction_is_journaled_under_the_epoch_its_fence_allowed(nodes: Nodes) -> None:
    """The lease may lapse between the fence and the removal's journal record (a
    holder stalled under load): the record still names the epoch the fence
    allowed the removal under, never 0 (shared-root-v1.md §4)."""
    from kvoffload.store.shared.journal import JournalFollower, Reason

    size = len(b"".join(layers(0)))
    cap = 12 * (size + 8192)
    a = nodes.node("a", capacity_bytes=cap, evictor_lease_s=3600.0)
    lease = a._state.shared.lease  # type: ignore[union-attr]
    held = lease.held
    assert held is not None and held.epoch >= 1
    j = 0
    while a.counters.evictions == 0:  # fill to the capacity, until a save evicts
        assert a.put("acme", NS, key(j), layers(j))
        j += 1
    real_remove = a.index.remove

    def remove_as_the_lease_lapses(tenant: str, k: bytes) -> object:
        lease._held = None  # lapsed after the fence, before the record is written
        return real_remove(tenant, k)

    a.index.remove = remove_as_the_lease_lapses  # type: ignore[method-assign]
    with contextlib.suppress(StoreFull):
        for _ in range(4):
            a.put("acme", NS, key(j), layers(j))
            j += 1
    evicted = [
        r for _n, r in JournalFollower(nodes.tmp / "root").poll() if r.reason is Reason.EVICTED
    ]
    assert evicted
    assert [r.grant_epoch for r in evicted] == [held.epoch] * len(evicted)


def test_a_holder_writes_only_under_a_grant_already_on_its_lease_file(nodes: Nodes) -> None:
    """A grant the holder raises for itself between ticks is published before it is
    used: a node that takes over after the holder pauses reads, from the file,
    every byte the old holder may still write (shared-root-v1.md §4.1)."""
    from kvoffload.store.shared.lease import EvictorLease

    size = len(b"".join(layers(0)))
    cap = 12 * (size + 8192)
    a = nodes.node("a", capacity_bytes=cap, evictor_lease_s=3600.0)
    node_id = a._state.shared.node_id  # type: ignore[union-attr]
    observer = EvictorLease(nodes.tmp / "root", "0" * 32, "observer")
    refills = 0
    last_grant = 0
    for j in range(40):  # several times the capacity: grants run out and are raised
        with contextlib.suppress(StoreFull):
            a.put("acme", NS, key(j), layers(j))
        on_file = observer.current()
        assert on_file is not None
        grant = a.shared_info()["grant"]  # type: ignore[index]
        assert grant["written"] <= on_file.grants.get(node_id, 0), (j, grant, on_file.grants)
        refills += grant["bytes"] > last_grant
        last_grant = grant["bytes"]
    assert refills > 2  # raised between ticks, not only at a tick


@pytest.mark.parametrize("who", ["holder", "other"])
def test_a_node_resumed_from_a_pause_writes_nothing_until_it_reads_the_lease_again(
    nodes: Nodes, who: str
) -> None:
    """A pause (SIGSTOP, a VM freeze) longer than the lease lets the others take the
    role and stop counting the old grants; the paused node's writer must not go on
    under what it knew before the pause."""
    size = len(b"".join(layers(0)))
    cap = 12 * (size + 8192)
    a = nodes.node("a", capacity_bytes=cap, evictor_lease_s=60.0)
    b = nodes.node("b", capacity_bytes=cap, evictor_lease_s=60.0)
    a.evictor_tick()  # a holds the role and grants b
    b.evictor_tick()
    s = a if who == "holder" else b
    assert s.put("acme", NS, key(0), layers(0))
    lease = s._state.shared.lease  # type: ignore[union-attr]
    real = lease._clock
    lease._clock = lambda: real() + 61.0  # the pause: the monotonic clock ran on
    with pytest.raises(StoreFull):
        s.put("acme", NS, key(1), layers(1))
    s.evictor_tick()  # its loop runs again: it reads the lease (and may take it)
    s.evictor_tick()
    assert s.put("acme", NS, key(2), layers(2))
