"""The evictor lease of a shared root (shared-root-v1.md §4), on real files.

Time is an injected monotonic clock (each node has its own, as real nodes
do); the files, link(2) races and processes are real.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

from kvoffload.store.shared.lease import EvictorLease, LeaseState


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


A = "a" * 32
B = "b" * 32


def lease(root: Path, node: str, clock: Clock, ttl: float = 10.0) -> EvictorLease:
    return EvictorLease(root, node, node[:8], ttl_s=ttl, clock=clock)


def test_one_holder_at_a_time_and_renewal_keeps_it(tmp_path: Path) -> None:
    ca, cb = Clock(), Clock()
    la, lb = lease(tmp_path, A, ca), lease(tmp_path, B, cb)
    assert la.tick() is True
    assert lb.tick() is False
    for _ in range(10):  # A ticks every 3 s; B never sees it stale for 10 s
        ca.t += 3
        cb.t += 3
        assert la.tick() is True
        assert lb.tick() is False
        assert la.fence() is True
        assert lb.fence() is False
    cur = la.current()
    # A renewal is due ttl/3 (3.3 s) after the last one: every second tick.
    assert cur is not None and cur.holder == A and cur.epoch == 1 and cur.renewal == 5


def test_the_holder_rewrites_its_lease_file_every_third_of_the_ttl_not_every_tick(
    tmp_path: Path,
) -> None:
    """A holder's loop ticks at every journal poll (0.5 s by default, often less);
    each renewal is an fsync and a rename on the shared filesystem (on JuiceFS a
    file left in its trash). Over 60 s of ticks every 0.25 s under a 9 s lease,
    the file is rewritten every 3 s: 20 times, not 240."""
    ca, cb = Clock(), Clock()
    la, lb = lease(tmp_path, A, ca, ttl=9.0), lease(tmp_path, B, cb, ttl=9.0)
    assert la.tick() is True
    assert lb.tick() is False
    renewals_seen = set()
    for _ in range(240):
        ca.t += 0.25
        cb.t += 0.25
        assert la.tick() is True
        assert lb.tick() is False  # the observer never sees it stale
        assert la.fence() is True
        cur = lb.current()
        assert cur is not None
        renewals_seen.add(cur.renewal)
    cur = lb.current()
    assert cur is not None and cur.holder == A and cur.epoch == 1
    assert cur.renewal == 20 and la.renewals == 20
    assert renewals_seen == set(range(21))


def test_a_silent_holder_is_replaced_after_the_ttl_as_seen_by_the_taker(tmp_path: Path) -> None:
    ca, cb = Clock(), Clock()
    cb.t = 5.0  # clocks of two nodes have nothing in common
    la, lb = lease(tmp_path, A, ca), lease(tmp_path, B, cb)
    assert la.tick()
    assert not lb.tick()
    cb.t += 9.9
    assert not lb.tick()
    cb.t += 0.2
    assert lb.tick()
    cur = lb.current()
    assert cur is not None and (cur.epoch, cur.holder) == (2, B)


def test_a_paused_holder_cannot_act_after_resuming(tmp_path: Path) -> None:
    ca, cb = Clock(), Clock()
    la, lb = lease(tmp_path, A, ca), lease(tmp_path, B, cb)
    assert la.tick()
    assert la.fence()
    lb.tick()
    # A is frozen (SIGSTOP): its clock runs on, it does not renew.
    ca.t += 30
    cb.t += 30
    assert lb.tick()  # B takes epoch 2
    assert la.fence() is False  # A, resumed, must not remove anything
    assert la.tick() is False  # and does not get the role back
    assert la.held is None


def test_the_margin_stops_a_late_holder_before_its_deadline(tmp_path: Path) -> None:
    ca = Clock()
    la = lease(tmp_path, A, ca, ttl=9.0)
    assert la.tick()
    ca.t += 5.9
    assert la.fence() is True
    ca.t += 0.2  # within margin (3 s) of the deadline, never renewed
    assert la.fence() is False


def test_a_higher_epoch_fences_the_old_holder_at_once(tmp_path: Path) -> None:
    ca = Clock()
    la = lease(tmp_path, A, ca)
    assert la.tick()
    st = LeaseState(2, B, "x", 0, 10.0, False)
    (tmp_path / "journal" / "evictor" / "epoch-00000000000000000002.json").write_bytes(st.to_json())
    assert la.fence() is False
    assert la.tick() is False


def test_release_lets_another_node_take_over_at_once(tmp_path: Path) -> None:
    ca, cb = Clock(), Clock()
    la, lb = lease(tmp_path, A, ca), lease(tmp_path, B, cb)
    assert la.tick()
    assert not lb.tick()
    la.release()
    assert la.fence() is False
    assert lb.tick()


def test_a_damaged_lease_file_does_not_block_the_role(tmp_path: Path) -> None:
    d = tmp_path / "journal" / "evictor"
    d.mkdir(parents=True)
    (d / "epoch-00000000000000000004.json").write_bytes(b"{garbage")
    lb = lease(tmp_path, B, Clock())
    assert lb.tick()
    cur = lb.current()
    assert cur is not None and (cur.epoch, cur.holder) == (5, B)
    assert any("not JSON" in e for e in lb.errors)


def test_an_unknown_lease_version_is_not_acted_on_as_valid(tmp_path: Path) -> None:
    d = tmp_path / "journal" / "evictor"
    d.mkdir(parents=True)
    (d / "epoch-00000000000000000001.json").write_text('{"lease_version": 9, "epoch": 1}')
    lb = lease(tmp_path, B, Clock())
    lb.tick()
    assert any("lease_version 9 is not supported" in e for e in lb.errors)


def test_old_epoch_files_are_cleaned_by_a_new_holder(tmp_path: Path) -> None:
    clocks = [Clock() for _ in range(4)]
    nodes = [f"{i}" * 32 for i in range(4)]
    for i in range(4):
        lz = lease(tmp_path, nodes[i], clocks[i])
        lz.tick()
        lz.release()
    names = sorted(p.name for p in (tmp_path / "journal" / "evictor").iterdir())
    assert names == ["epoch-00000000000000000003.json", "epoch-00000000000000000004.json"]


def _race(root: str, node: str, start: mp.synchronize.Event, out: mp.Queue) -> None:  # type: ignore[type-arg]
    lz = EvictorLease(Path(root), node, node[:8], ttl_s=60.0)
    start.wait()
    out.put((node, lz.tick()))


def test_racing_processes_yield_exactly_one_holder(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    procs = [
        ctx.Process(target=_race, args=(str(tmp_path), f"{i:x}" * 32, start, out)) for i in range(6)
    ]
    for p in procs:
        p.start()
    start.set()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    winners = [n for n, won in results if won]
    assert len(winners) == 1
    cur = EvictorLease(tmp_path, "f" * 32, "x").current()
    assert cur is not None and cur.holder == winners[0] and cur.epoch == 1
