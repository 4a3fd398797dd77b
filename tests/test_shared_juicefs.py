"""The JuiceFS tier: journals and the evictor lease across independent FUSE clients.

Each mount of one JuiceFS volume is a separate client with its own caches,
standing for one node. Writers and takers run as separate processes on their
own mount. Skipped, with the reason, where FUSE or juicefs is absent.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.sidecar.journal import JournalFollower, JournalRecord, JournalWriter, Op
from kvoffload.sidecar.rootlease import EvictorLease

from .sharedfs import juice_volume, juicefs_unavailable

pytestmark = pytest.mark.skipif(
    juicefs_unavailable() is not None, reason=str(juicefs_unavailable())
)

NS = bytes(32)
A = "a" * 32
B = "b" * 32


@pytest.fixture(scope="module")
def mounts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Path]]:
    with juice_volume(tmp_path_factory.mktemp("juicefs"), nodes=3) as mnts:
        yield mnts


def _write(root: str, node: str, n: int, start: int) -> None:
    w = JournalWriter(Path(root), node)
    w.open()
    for i in range(start, start + n):
        w.append([JournalRecord.store("acme", i.to_bytes(32, "big"), NS, 1000 + i)])
    w.close()


def test_a_journal_written_on_one_client_is_followed_on_another(
    mounts: list[Path], tmp_path: Path
) -> None:
    root_a, root_b = mounts[0] / "j1", mounts[1] / "j1"
    root_a.mkdir()
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_write, args=(str(root_a), A, 50, 0))
    p.start()
    p.join(timeout=120)
    assert p.exitcode == 0
    follower = JournalFollower(root_b, own_node_id=B)
    seen: list[bytes] = []
    deadline = time.monotonic() + 30
    while len(seen) < 50 and time.monotonic() < deadline:
        seen += [r.key for _, r in follower.poll() if r.op is Op.STORE]
        time.sleep(0.1)
    assert seen == [i.to_bytes(32, "big") for i in range(50)]
    assert follower.stats.damaged_segments == 0
    # A restart of the writer on another client continues in a new segment.
    p2 = ctx.Process(target=_write, args=(str(mounts[2] / "j1"), A, 5, 50))
    p2.start()
    p2.join(timeout=120)
    deadline = time.monotonic() + 30
    while len(seen) < 55 and time.monotonic() < deadline:
        seen += [r.key for _, r in follower.poll() if r.op is Op.STORE]
        time.sleep(0.1)
    assert seen[50:] == [i.to_bytes(32, "big") for i in range(50, 55)]


def _take(root: str, node: str, start: mp.synchronize.Event, out: mp.Queue) -> None:  # type: ignore[type-arg]
    lease = EvictorLease(Path(root), node, node[:8], ttl_s=60.0)
    start.wait()
    out.put((node, lease.tick()))


def test_clients_racing_for_the_evictor_lease_yield_one_holder(mounts: list[Path]) -> None:
    for m in mounts:
        (m / "lease1").mkdir(exist_ok=True)
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    procs = [
        ctx.Process(target=_take, args=(str(mounts[i % 3] / "lease1"), f"{i:x}" * 32, start, out))
        for i in range(6)
    ]
    for p in procs:
        p.start()
    start.set()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    winners = [n for n, won in results if won]
    assert len(winners) == 1
    cur = EvictorLease(mounts[1] / "lease1", "f" * 32, "x").current()
    assert cur is not None and cur.holder == winners[0]


def test_a_holder_on_one_client_is_replaced_on_another_and_fenced(mounts: list[Path]) -> None:
    class Clock:
        t = 0.0

        def __call__(self) -> float:
            return self.t

    ca, cb = Clock(), Clock()
    la = EvictorLease(mounts[0] / "lease2", A, "ia", ttl_s=6.0, clock=ca)
    lb = EvictorLease(mounts[1] / "lease2", B, "ib", ttl_s=6.0, clock=cb)
    assert la.tick()
    deadline = time.monotonic() + 30
    while lb.current() is None and time.monotonic() < deadline:
        time.sleep(0.1)  # B's client learns of the file
    assert not lb.tick()
    ca.t += 100  # A paused
    cb.t += 7
    assert lb.tick()
    deadline = time.monotonic() + 30
    while la.fence() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert la.fence() is False
    assert la.tick() is False
