"""The TTFT model against a worker that schedules as vLLM does: chunked prefill, learned online.

The reference worker here is a few lines of vLLM v1's scheduling rule (each step
fills its token budget with prefill chunks, first come first served, one token
per decoding request), with its own coefficients: the router is never told them
and learns them only from the first tokens it sees.
"""

from __future__ import annotations

import math
import random

import pytest

from kvoffload.router.core import Router, Topology, WorkerInfo
from kvoffload.router.index import SourceState
from kvoffload.router.model import Priors

PRIORS = Priors(
    prefill_a_s=0.02,
    prefill_b_s=1e-4,
    prefill_c_s=0.0,
    decode_slowdown=0.01,
)
#: The worker's real speeds: per step 0.05 s, per token 2.5e-5 s, attention 2e-10 s/token².
TRUE_A, TRUE_B, TRUE_C = 0.05, 2.5e-5, 2e-10


def true_ttft(m: int, budget: int = 8192) -> float:
    """An idle worker's first token for an ``m``-token prompt, chunked by the budget."""
    steps = math.ceil(m / budget)
    return TRUE_A * steps + TRUE_B * m + TRUE_C * m * m


def one_worker() -> Router:
    r = Router(Topology((WorkerInfo("w0", "n0"),)), priors=PRIORS, block_tokens=16)
    r.set_worker_source("w0", SourceState.LIVE)
    return r


def test_several_short_prompts_share_one_step() -> None:
    """Eight 500-token prompts queued: vLLM runs them and a ninth in one 8192-token step."""
    r = one_worker()
    for _ in range(8):
        r.dispatch(r.decide([], 500, now=0.0), 0.0)
    d = r.decide([], 500, now=0.0)
    assert d.chosen is not None
    # Half of the step under way (on average), then one step for all nine.
    one_step = 1.5 * PRIORS.prefill_a_s + PRIORS.prefill_b_s * 9 * 500
    # One prefill at a time would charge a step overhead per request queued (0.63 s).
    assert d.chosen.estimate.ttft_s == pytest.approx(one_step, rel=0.02)


def test_a_long_queue_counts_every_step_of_the_budget() -> None:
    r = one_worker()
    r.dispatch(r.decide([], 20_000, now=0.0), 0.0)  # 3 steps of 8192
    d = r.decide([], 1_000, now=0.0)
    assert d.chosen is not None
    steps = math.ceil(21_000 / 8192) + 0.5
    expected = PRIORS.prefill_a_s * steps + PRIORS.prefill_b_s * 21_000
    assert d.chosen.estimate.ttft_s == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize("sigma", [0.0, 0.5])
def test_estimates_converge_to_the_workers_real_speeds(sigma: float) -> None:
    """From measured TTFTs alone (noisy with σ = 0.5), the estimates meet the worker's."""
    r = one_worker()
    rng = random.Random(7)
    now = 0.0
    for _ in range(400):
        m = int(math.exp(rng.uniform(math.log(200), math.log(60_000))))
        t = r.dispatch(r.decide([], m, now=now), now)
        took = true_ttft(m) * math.exp(rng.gauss(0.0, sigma) - sigma * sigma / 2)
        now += took
        r.first_token(t, now)
        r.finished(t)
        now += 5.0  # idle until the next one
    for m in (300, 4_000, 30_000, 60_000):
        d = r.decide([], m, now=now)
        assert d.chosen is not None
        assert d.chosen.estimate.ttft_s == pytest.approx(true_ttft(m), rel=0.15), m


def test_one_outlier_does_not_derail_the_fit() -> None:
    r = one_worker()
    now = 0.0
    for i in range(200):
        t = r.dispatch(r.decide([], 8_000, now=now), now)
        took = true_ttft(8_000) * (30.0 if i == 150 else 1.0)  # a preempted, recomputed request
        now += took
        r.first_token(t, now)
        r.finished(t)
        now += 5.0
    d = r.decide([], 8_000, now=now)
    assert d.chosen is not None
    assert d.chosen.estimate.ttft_s == pytest.approx(true_ttft(8_000), rel=0.1)


def test_the_queue_drains_between_answers_and_reanchors_on_each() -> None:
    r = one_worker()
    t1 = r.dispatch(r.decide([], 8_000, now=0.0), 0.0)
    t2 = r.dispatch(r.decide([], 8_000, now=0.0), 0.0)
    load = r.loads["w0"]
    q0 = load.queue_s(0.0)
    assert 0 < load.queue_s(0.5) < q0
    # The worker is slower than modelled: t1 answers late. Its last chunk shared a
    # step with t2's first 192 tokens; the rest of t2 is still ahead.
    r.first_token(t1, 5.0)
    assert load.queued(5.0)[0] == pytest.approx(8_000 - 192)
    r.first_token(t2, 6.0)
    assert load.queue_s(6.0) == 0.0


def test_kv_overflow_delays_a_prompt_that_does_not_fit() -> None:
    pri = Priors(prefill_a_s=0.02, prefill_b_s=1e-4, kv_capacity_tokens=100_000)
    r = Router(Topology((WorkerInfo("w0", "n0"),)), priors=pri, block_tokens=16)
    r.set_worker_source("w0", SourceState.LIVE)
    fits = r.decide([], 10_000, now=0.0).chosen
    r.model.refresh(r.loads["w0"], waiting=0, running=20, kv_usage=0.95, now=0.0)
    full = r.decide([], 10_000, now=0.0).chosen
    assert fits is not None and full is not None
    assert full.estimate.ttft_s > fits.estimate.ttft_s + 5_000 * 1e-4 * 0.9
