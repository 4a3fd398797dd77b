"""The TTFT model against the waits vLLM adds that are not prefill compute.

vLLM 0.33 admits the head of its waiting queue only when the whole prompt fits
in the free KV blocks, and a running request holds its blocks until it
finishes; a TTFT measured behind such a wait (or behind a queue the router
cannot see into) says little about the worker's speed. The reference worker
here has its own coefficients; the router learns them only from what it sees.
"""

from __future__ import annotations

import math
import random

import pytest

from kvoffload.router.core import Router, Topology, WorkerInfo
from kvoffload.router.index import SourceState
from kvoffload.router.model import Priors

TRUE_A, TRUE_B = 0.05, 2.5e-5  # the worker's real step overhead and per-token cost


def true_ttft(m: int, budget: int = 8192) -> float:
    return TRUE_A * math.ceil(m / budget) + TRUE_B * m


def workers(n: int, **pri: int) -> Router:
    priors = Priors(prefill_a_s=0.02, prefill_b_s=1e-4, decode_slowdown=0.01, **pri)
    infos = tuple(WorkerInfo(f"w{i}", f"n{i}") for i in range(n))
    r = Router(Topology(infos), priors=priors, block_tokens=16)
    for w in infos:
        r.set_worker_source(w.name, SourceState.LIVE)
    return r


def test_ttfts_holding_waits_the_router_cannot_see_do_not_drag_the_fit() -> None:
    """Half the answers come behind a queue and a hidden wait 5× that queue long
    (held for KV, or behind another gateway's requests): the speed the router
    learns is still the worker's own."""
    r = workers(1)
    rng = random.Random(3)
    now = 0.0
    for i in range(300):
        m = int(math.exp(rng.uniform(math.log(500), math.log(30_000))))
        if i % 2:
            # A long prompt queued first, then this one behind it; the measured
            # TTFT also holds a wait the features say nothing of.
            head = r.dispatch(r.decide([], 20_000, now=now), now)
            t = r.dispatch(r.decide([], m, now=now), now)
            ahead = true_ttft(20_000)
            r.first_token(head, now + ahead)
            took = ahead + true_ttft(m) + 5.0 * ahead
            r.first_token(t, now + took)
            r.finished(head, now + took)
        else:
            t = r.dispatch(r.decide([], m, now=now), now)
            took = true_ttft(m)
            r.first_token(t, now + took)
        r.finished(t, now + took)
        now += took + 5.0
    for m in (2_000, 20_000):
        d = r.decide([], m, now=now)
        assert d.chosen is not None
        assert d.chosen.estimate.ttft_s == pytest.approx(true_ttft(m), rel=0.2), m


def test_a_worker_whose_kv_is_full_waits_for_its_decodes() -> None:
    """w0's KV is held by requests still decoding (their decodes take ~4 s, learned
    from the ones that finished): a prompt that does not fit waits for them."""
    r = workers(2, kv_capacity_tokens=100_000)
    now = 0.0
    for _ in range(20):  # learn how long a decode takes on w0: 4 s
        t = r.dispatch(r.decide([], 1_000, now=now, exclude=["w1"]), now)
        r.first_token(t, now + 0.1)
        r.finished(t, now + 4.1)
        now += 5.0
    for _ in range(3):  # three 30k-token requests now decoding on w0: 90k of 100k held
        t = r.dispatch(r.decide([], 30_000, now=now, exclude=["w1"]), now)
        r.first_token(t, now + 1.0)
        now += 1.0
    d = r.decide([], 20_000, now=now)
    full = next(c for c in d.candidates if c.worker == "w0")
    # The oldest decode started 2 s ago: about 2 s of it left, then there is room.
    assert full.estimate.queue_s == pytest.approx(2.0, rel=0.25)
    assert d.worker == "w1"
    # A prompt that fits in the 10k left does not wait.
    small = next(c for c in r.decide([], 5_000, now=now).candidates if c.worker == "w0")
    assert small.estimate.queue_s < 0.1


def test_finishing_frees_the_blocks() -> None:
    r = workers(1, kv_capacity_tokens=100_000)
    held = [r.dispatch(r.decide([], 45_000, now=0.0), 0.0) for _ in range(2)]
    for t in held:
        r.first_token(t, 1.0)
    assert r.decide([], 20_000, now=1.0).candidates[0].estimate.queue_s > 1.0
    r.finished(held[0], 2.0)
    assert r.decide([], 20_000, now=2.0).candidates[0].estimate.queue_s < 0.1


def test_an_unanswered_head_keeps_the_queue_open() -> None:
    """The worker is slower than modelled: long past the modelled end of the prompt
    it is running, it has not answered, so a prompt sent now still waits for it."""
    r = workers(1)
    r.dispatch(r.decide([], 40_000, now=0.0), 0.0)
    late = 40_000 * 1e-4 * 3  # three times the modelled prefill
    d = r.decide([], 100, now=late)
    assert d.chosen is not None
    # At least half a step of its tokens (4,096 × 1e-4 s) is still ahead.
    assert d.chosen.estimate.queue_s >= 0.4


def test_what_one_worker_teaches_the_others_know_and_each_keeps_its_speed() -> None:
    """One deployment, one fit: a worker never answered yet is estimated at what the
    others taught, and a worker 1.5× slower than the rest is learned as such."""
    r = workers(3)
    rng = random.Random(5)
    now = 0.0

    def serve(worker: str, slow: float, n: int) -> None:
        nonlocal now
        others = [w for w in ("w0", "w1", "w2") if w != worker]
        for _ in range(n):
            m = int(math.exp(rng.uniform(math.log(500), math.log(30_000))))
            t = r.dispatch(r.decide([], m, now=now, exclude=others), now)
            took = true_ttft(m) * slow
            r.first_token(t, now + took)
            r.finished(t, now + took)
            now += took + 5.0

    serve("w0", 1.0, 200)
    serve("w1", 1.5, 80)
    for m in (2_000, 20_000):
        est = {c.worker: c.estimate.ttft_s for c in r.decide([], m, now=now).candidates}
        assert est["w2"] == pytest.approx(true_ttft(m), rel=0.15), m
        assert est["w0"] == pytest.approx(true_ttft(m), rel=0.15), m
        assert est["w1"] == pytest.approx(1.5 * true_ttft(m), rel=0.2), m


def test_under_load_a_slightly_slower_worker_still_gets_the_shorter_queues_work() -> None:
    """Under load the choice weighs the work a request brings (up to 64× its
    service); a worker learned 25 % slower must not lose a request to a deeper
    queue elsewhere that answers later: only what a cache saves is work saved."""
    r = workers(2)
    rng = random.Random(9)
    now = 0.0
    for i in range(300):
        w, slow = ("w0", 1.25) if i % 2 else ("w1", 1.0)
        m = int(math.exp(rng.uniform(math.log(500), math.log(30_000))))
        t = r.dispatch(r.decide([], m, now=now, exclude=["w1" if w == "w0" else "w0"]), now)
        took = true_ttft(m) * slow
        r.first_token(t, now + took)
        r.finished(t, now + took)
        now += took + 5.0
    for w, k in (("w0", 50), ("w1", 65)):  # both busy, w1 deeper
        other = "w1" if w == "w0" else "w0"
        for _ in range(k):
            r.dispatch(r.decide([], 10_000, now=now, exclude=[other]), now)
    d = r.decide([], 10_000, now=now)
    est = {c.worker: c.estimate.ttft_s for c in d.candidates}
    assert est["w0"] < est["w1"]
    assert d.worker == "w0"
