"""Padded replies leave at their deadline whatever the lookup cost (releasetimer.py).

The first tests check the timer's scheduling logic on a real event loop
(order, never early, cancel, close). The last one checks the mechanism the
floor relies on through a real server: the release instant of a padded
lookup, relative to its floor, must not move with the lookup's compute time.
asyncio's own ``call_at`` fails it (the selector rounds the wait up to whole
milliseconds from the moment the reply was ready, so the release moves with
the compute time); the criterion is a generous bound on a difference of
medians, not a speed.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvoffload import protocol as p
from kvoffload.sidecar.access.policy import Grant, Policy, TenantPolicy
from kvoffload.sidecar.connection import Connection
from kvoffload.sidecar.releasetimer import ReleaseTimer, timerfd_available
from kvoffload.transport import UnixTransport
from tests.helpers.server import ServerThread, sock_path, start

pytestmark = pytest.mark.skipif(not timerfd_available(), reason="needs Linux timerfd")


def _run(coro: Any) -> Any:
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def test_callbacks_run_in_deadline_order_and_never_before_their_deadline() -> None:
    async def main() -> list[tuple[str, float, float]]:
        loop = asyncio.get_running_loop()
        timer = ReleaseTimer(loop)
        assert timer.precise
        ran: list[tuple[str, float, float]] = []
        done = loop.create_future()

        def note(name: str, when: float) -> None:
            ran.append((name, when, loop.time()))
            if len(ran) == 4:
                done.set_result(None)

        now = loop.time()
        plan = {"c": now + 0.004, "a": now + 0.001, "b": now + 0.002, "past": now - 1.0}
        for name, when in plan.items():
            timer.call_at(when, note, name, when)
        dropped = timer.call_at(now + 0.003, note, "cancelled", now + 0.003)
        dropped.cancel()
        assert timer.pending() == 4
        await asyncio.wait_for(done, 10)
        await asyncio.sleep(0.01)  # the cancelled one's deadline has passed too
        timer.close()
        return ran

    ran = _run(main())
    assert [name for name, _, _ in ran] == ["past", "a", "b", "c"]
    assert all(at >= when for _, when, at in ran)


def test_an_earlier_deadline_rearms_and_close_drops_what_is_pending() -> None:
    async def main() -> tuple[list[str], int]:
        loop = asyncio.get_running_loop()
        timer = ReleaseTimer(loop)
        ran: list[str] = []
        timer.call_at(loop.time() + 60.0, ran.append, "late")
        first = loop.create_future()

        def early() -> None:
            ran.append("early")
            first.set_result(None)

        timer.call_at(loop.time() + 0.002, early)
        await asyncio.wait_for(first, 10)  # not held behind the 60 s one
        left = timer.pending()
        timer.close()
        await asyncio.sleep(0.01)
        return ran, left

    ran, left = _run(main())
    assert ran == ["early"] and left == 1


class SlowLookupStore:
    """The real store, whose ``lookup`` first spends a set time computing: it stands
    for a lookup's own cost (a hit walks more of the index than a miss). The
    cost in µs is the first two bytes of the first key."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def lookup(self, tenant: str, keys: Sequence[bytes]) -> int:
        end = time.perf_counter() + int.from_bytes(keys[0][:2], "big") * 1e-6
        while time.perf_counter() < end:  # busy, like real work (a sleep would oversleep)
            pass
        return int(self._store.lookup(tenant, keys))


FLOOR_S = 0.003


@pytest.fixture
def padded_server(store: Any) -> Iterator[ServerThread]:
    import shutil
    import tempfile

    sock_dir = Path(tempfile.mkdtemp(prefix="kvo-rt-", dir="/tmp"))
    policy = Policy(
        tenants={"padded": TenantPolicy(lookup_floor_s=FLOOR_S)},
        grants=[Grant("uid", os.getuid(), frozenset({"padded"}))],
    )
    st = start(sock_dir, SlowLookupStore(store), policy)
    yield st
    st.stop()
    shutil.rmtree(sock_dir, ignore_errors=True)


def test_the_release_of_a_padded_lookup_does_not_move_with_its_compute_time(
    padded_server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Observed on the server's loop: when each reply was ready (held) and when
    # it left, relative to its deadline (arrival + floor).
    ready: dict[int, float] = {}
    seen: list[tuple[float, float]] = []  # (deadline - ready, left - deadline)
    hold, release = Connection._hold, Connection._release

    def spy_hold(self: Connection, work: Any, reply: Any) -> None:
        ready[work.rid] = self._loop.time()  # type: ignore[union-attr]
        hold(self, work, reply)

    def spy_release(self: Connection, rid: int) -> None:
        work = self.held[rid][0]
        assert work.pad is not None
        deadline = work.arrived + work.pad.delay
        seen.append((deadline - ready.pop(rid), self._loop.time() - deadline))  # type: ignore[union-attr]
        release(self, rid)

    monkeypatch.setattr(Connection, "_hold", spy_hold)
    monkeypatch.setattr(Connection, "_release", spy_release)
    t = UnixTransport.connect(sock_path(padded_server), timeout_s=30)
    try:
        t.send(p.request_message(1, p.Hello(1, 1, "release-timer-test", ("padded",))))
        assert isinstance(p.parse_reply(t.recv(timeout_s=30).msg)[1], p.HelloReply)
        # Compute times spread evenly over 0..1.2 ms, in a shuffled order.
        for rid, cost in enumerate([(i * 377) % 1200 for i in range(240)], 2):
            k = cost.to_bytes(2, "big") + bytes(30)
            t0 = time.perf_counter()
            t.send(p.request_message(rid, p.Lookup("padded", (k,))))
            got, reply = p.parse_reply(t.recv(timeout_s=30).msg)
            assert got == rid and isinstance(reply, p.LookupReply)
            assert time.perf_counter() - t0 >= FLOOR_S  # the floor is a lower bound
    finally:
        t.close()
    assert all(late >= 0 for _, late in seen)  # never early
    # Where the time left after the compute falls within a millisecond decides
    # how late a millisecond-rounded timer is (left 2.2 ms: rounded to 3, 0.8
    # ms late; left 2.8 ms: 0.2 ms late). Released at the deadline, both halves
    # are late by the same wake-up: their medians lie within 0.2 ms.
    early = [late for left, late in seen[20:] if 0.1 <= (left * 1e3) % 1 < 0.4]
    later = [late for left, late in seen[20:] if 0.6 <= (left * 1e3) % 1 < 0.9]
    assert len(early) >= 30 and len(later) >= 30, (len(early), len(later))
    gap = statistics.median(early) - statistics.median(later)
    assert abs(gap) < 0.0002, (statistics.median(early), statistics.median(later))
