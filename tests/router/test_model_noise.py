"""The TTFT model under noisy prefill times: what it learns of the noise, and how it chooses.

A prefill's time is its estimate × a lognormal noise (σ = 0.5 here, as
``scripts/sim_router.py --noise 0.5``). The router learns that spread from the
answers' residuals; a request still running past its estimate keeps a good
part of its time (its mean residual life), a queue of one long prefill is less
certain than one of many short ones, and a worker with a few lucky answers is
not taken for a faster one.
"""

from __future__ import annotations

import math
import random

import pytest

from kvoffload.router.core import Router, Topology, WorkerInfo
from kvoffload.router.fit import attention_left, residual_life
from kvoffload.router.index import SourceState
from kvoffload.router.model import Priors

PRIORS = Priors(prefill_a_s=0.02, prefill_b_s=1e-4, decode_slowdown=0.01)
TRUE_A, TRUE_B = 0.05, 2.5e-5  # the workers' real step overhead and per-token cost


def true_ttft(m: int, budget: int = 8192) -> float:
    return TRUE_A * math.ceil(m / budget) + TRUE_B * m


def workers(n: int) -> Router:
    infos = tuple(WorkerInfo(f"w{i}", f"n{i}") for i in range(n))
    r = Router(Topology(infos), priors=PRIORS, block_tokens=16)
    for w in infos:
        r.set_worker_source(w.name, SourceState.LIVE)
    return r


def teach(r: Router, worker: str, n: int, sigma: float, seed: int, now: float) -> float:
    """``n`` answers of ``worker`` alone, idle between, each noisy with ``sigma``."""
    rng = random.Random(seed)
    others = [w for w in r.loads if w != worker]
    for _ in range(n):
        m = int(math.exp(rng.uniform(math.log(500), math.log(40_000))))
        t = r.dispatch(r.decide([], m, now=now, exclude=others), now)
        took = true_ttft(m) * math.exp(rng.gauss(0.0, sigma) - sigma * sigma / 2)
        r.first_token(t, now + took)
        r.finished(t, now + took)
        now += took + 5.0
    return now


def test_residual_life_is_the_linear_drain_without_noise_and_more_with_it() -> None:
    assert residual_life(0.0, 0.5) == 1.0
    assert residual_life(0.4, 0.0) == pytest.approx(0.6)
    assert residual_life(2.0, 0.0) == 0.0
    # σ = 0.5: a prefill past its estimate has about half its estimate left.
    assert residual_life(1.0, 0.5) == pytest.approx(0.49, abs=0.02)
    assert residual_life(2.0, 0.5) == pytest.approx(0.51, abs=0.03)
    assert 0 < residual_life(50.0, 0.1) < 50.0  # far in the tail: finite, positive


@pytest.mark.parametrize("sigma", [0.0, 0.5])
def test_a_prefill_past_its_estimate_keeps_what_the_learned_noise_says(sigma: float) -> None:
    """A 40k-token prompt is still running at twice its estimate. Learned from noisy
    answers, the router expects a good part of it still ahead (and sends a short
    request elsewhere); learned from exact ones, only the step under way."""
    r = workers(2)
    now = teach(r, "w0", 150, sigma, 3, 0.0)
    big = r.dispatch(r.decide([], 40_000, now=now, exclude=["w1"]), now)
    modelled = big.estimate.prefill_s
    later = now + 2.0 * modelled
    left = r.loads["w0"].queue_s(later)
    if sigma:
        assert r.loads["w0"].fit.sigma > 0.3
        assert left > 0.3 * modelled
    else:
        assert left < 0.15 * modelled


def test_a_queue_of_one_long_prefill_is_less_certain_than_many_short_ones() -> None:
    """About the same mean: one 20k prompt queued on w0, ten 2.2k ones on w1 (a little
    more work). With noisy prefills the one long prompt may run far over: the
    choice takes w1, the estimate both low and certain."""
    r = workers(2)
    now = teach(r, "w0", 120, 0.5, 5, 0.0)
    now = teach(r, "w1", 120, 0.5, 6, now)
    r.dispatch(r.decide([], 20_000, now=now, exclude=["w1"]), now)
    for _ in range(10):
        r.dispatch(r.decide([], 2_200, now=now, exclude=["w0"]), now)
    d = r.decide([], 1_000, now=now)
    est = {c.worker: c.estimate for c in d.candidates}
    assert est["w0"].spread_s > 1.5 * est["w1"].spread_s
    assert est["w0"].ttft_s < est["w1"].ttft_s < 1.25 * est["w0"].ttft_s
    assert d.worker == "w1"


def test_a_worker_with_a_few_lucky_answers_is_not_taken_for_a_faster_one() -> None:
    """Four workers of one kind. w0-w2 answered 80 times each (σ = 0.4); w3's first
    three answers happened to come at 0.6× the truth. Its speed stays with the
    fleet's, and an idle cluster does not send it the next request on that luck."""
    r = workers(4)
    now = 0.0
    for i, w in enumerate(("w0", "w1", "w2")):
        now = teach(r, w, 80, 0.4, 10 + i, now)
    for m in (4_000, 12_000, 30_000):
        t = r.dispatch(r.decide([], m, now=now, exclude=["w0", "w1", "w2"]), now)
        took = 0.6 * true_ttft(m)
        r.first_token(t, now + took)
        r.finished(t, now + took)
        now += took + 5.0
    speeds = {w: r.loads[w].speed for w in r.loads}
    fleet = sum(speeds[w] for w in ("w0", "w1", "w2")) / 3
    assert speeds["w3"] == pytest.approx(fleet, rel=0.03)
    d = r.decide([], 8_000, now=now)
    assert d.worker != "w3"


def test_a_worker_slower_answer_after_answer_gets_its_own_speed() -> None:
    """Shrinkage yields to evidence: w1 is 1.5× slower over 80 noisy answers."""
    r = workers(2)
    now = teach(r, "w0", 150, 0.3, 21, 0.0)
    rng = random.Random(22)
    for _ in range(80):
        m = int(math.exp(rng.uniform(math.log(500), math.log(40_000))))
        t = r.dispatch(r.decide([], m, now=now, exclude=["w0"]), now)
        took = 1.5 * true_ttft(m) * math.exp(rng.gauss(0.0, 0.3) - 0.045)
        r.first_token(t, now + took)
        r.finished(t, now + took)
        now += took + 5.0
    assert r.loads["w1"].speed / r.loads["w0"].speed == pytest.approx(1.5, rel=0.15)


def test_a_long_prompt_half_done_has_more_than_half_its_attention_left() -> None:
    """Chunked prefill runs a prompt's first tokens first; its last chunks attend to
    the most context. Half of a 60k-token prompt drained leaves ¾ of its attention."""
    assert attention_left(60_000, 60_000.0 * 60_000, 30_000) == pytest.approx(0.75 * 60_000**2)
    assert attention_left(60_000, 60_000.0 * 60_000, 60_000) == pytest.approx(60_000.0**2)
    # After 10k cached tokens: the last 1k of 5k new ones attend to 14k before them.
    assert attention_left(5_000, 5_000.0 * (2 * 10_000 + 5_000), 1_000) == 1_000 * (
        2 * 14_000 + 1_000
    )
    r = Router(
        Topology((WorkerInfo("w0", "n0"),)),
        priors=Priors(prefill_a_s=0.02, prefill_b_s=1e-5, prefill_c_s=1e-9),
        block_tokens=16,
    )
    r.set_worker_source("w0", SourceState.LIVE)
    r.dispatch(r.decide([], 60_000, now=0.0), 0.0)
    load = r.loads["w0"]
    # Half its tokens computed, and (residual life) half of them expected left.
    load.drained, load.anchor, load.head_tokens, load.head_since = 30_000.0, 0.0, 30_000.0, 0.0
    tokens, attn = load.queued(0.0)
    assert tokens == pytest.approx(30_000)
    assert attn == pytest.approx(0.75 * 60_000**2)
