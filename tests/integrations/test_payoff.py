"""The recompute guard (kvoffload.integrations.payoff): a hit is loaded only where the
tier's measured load rate beats the engine's measured prefill rate, only the part
that pays, and no request ever waits on a probe of the tier."""

from __future__ import annotations

import pytest

from kvoffload.integrations.payoff import Offer, RecomputeGuard, best_plan, plan_seconds


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_until_both_rates_are_measured_a_hit_is_loaded() -> None:
    g = RecomputeGuard()
    assert g.decide(512).tokens == 512  # the first loads are the measurement
    for _ in range(3):
        g.observe_load(512, 10.0)  # a very slow tier, but no prefill rate yet
    assert g.decide(512).tokens == 512
    for _ in range(7):
        g.observe_step(4096, 0.01)
    assert g.decide(512).tokens == 512  # seven steps are not yet a rate
    g.observe_step(4096, 0.01)
    assert g.decide(512).tokens == 0
    assert g.decide(0).tokens == 0


def test_a_slow_tier_is_recomputed_and_a_fast_one_loaded() -> None:
    g = RecomputeGuard()
    for _ in range(8):
        g.observe_step(2048, 0.1)  # the engine prefills 20k tokens/s
    for _ in range(3):
        g.observe_load(1024, 0.5)  # the tier: 2k tokens/s
    d = g.decide(1024)
    assert d.tokens == 0 and "recompute" in d.reason
    fast = RecomputeGuard()
    for _ in range(8):
        fast.observe_step(2048, 0.1)
        fast.observe_load(1024, 0.01)  # 100k tokens/s
    assert fast.decide(1024).tokens == 1024


def test_rates_are_read_on_the_safe_side() -> None:
    g = RecomputeGuard()
    # The engine: mostly 10k tokens/s, one step four times faster; the tier: mostly
    # 40k tokens/s, one load in four at 5k. Safe readings: the tier is taken at its
    # slow loads, the engine at its fast steps.
    for i in range(8):
        g.observe_step(1000, 0.1 if i % 4 else 0.025)
        g.observe_load(1000, 0.025 if i % 4 else 0.2)
    load, prefill = g.load_rate(), g.prefill_rate()
    assert load is not None and prefill is not None
    assert load < 40_000 and prefill > 10_000


def test_a_configured_prefill_rate_wins_over_measurement() -> None:
    g = RecomputeGuard(prefill_tokens_per_s=1000.0)
    g.observe_step(100_000, 0.1)  # ignored: the operator knows the rate
    for _ in range(3):
        g.observe_load(1000, 0.5)  # 2k tokens/s beats 1k tokens/s
    assert g.prefill_rate() == 1000.0
    assert g.decide(4096).tokens == 4096


def test_steps_too_small_to_be_prefill_are_not_counted() -> None:
    g = RecomputeGuard(min_step_tokens=64)
    for _ in range(8):
        g.observe_step(8, 0.0001)  # decode steps: 80k "tokens/s" that no prefill reaches
    assert g.prefill_rate() is None


def test_a_refusing_guard_never_hands_a_request_a_probe() -> None:
    clock = Clock()
    g = RecomputeGuard(reprobe_s=30.0, window=4, min_loads=1, min_steps=4, clock=clock)
    for _ in range(4):
        g.observe_step(2048, 0.1)
    g.observe_load(1024, 1.0)  # slow
    assert g.decide(1024).tokens == 0
    assert not g.claim_probe()  # the tier was measured just now
    clock.t += 31
    # A probe is due: the request still recomputes all of it (it waits on nothing),
    # and the caller is told, once per period, to read a chunk in the background.
    d = g.decide(1024)
    assert d.tokens == 0 and "recompute" in d.reason
    assert g.claim_probe()
    assert not g.claim_probe()
    assert g.decide(1024).tokens == 0
    for _ in range(4):
        g.observe_load(64, 0.0001)  # the background reads: the tier recovered, 640k tokens/s
    assert g.decide(1024).tokens == 1024
    assert not g.claim_probe()  # a loading guard is measured by its loads


def test_a_probe_is_claimed_again_each_period_while_refusing() -> None:
    clock = Clock()
    g = RecomputeGuard(reprobe_s=10.0, min_loads=1, min_steps=1, clock=clock)
    g.observe_step(2048, 0.1)
    g.observe_load(1024, 1.0)
    claims = []
    for _ in range(6):
        clock.t += 4
        assert g.decide(512).tokens == 0
        claims.append(g.claim_probe())
    # 4, 8: within 10 s of the last load sample; 12: due; 16, 20: within 10 s of it; 24: due.
    assert claims == [False, False, True, False, False, True]


def test_a_stale_estimate_is_made_dearer_instead_of_refreshed() -> None:
    clock = Clock()
    g = RecomputeGuard(min_loads=1, min_steps=1, stale_s=60.0, stale_margin=1.5, clock=clock)
    g.observe_step(1000, 0.1)  # 10k tokens/s
    g.observe_load(1200, 0.1)  # 12k tokens/s: loading beats recompute by 1.2x
    assert g.decide(1200).tokens == 1200
    clock.t += 61  # no load sample for a minute: the tier may have slowed
    d = g.decide(1200)
    assert d.tokens == 0 and "x1.5 safety" in d.reason
    g.observe_load(1200, 0.1)
    assert g.decide(1200).tokens == 1200


def _tier_twice_as_slow_as_prefill() -> RecomputeGuard:
    g = RecomputeGuard(min_loads=1, min_steps=1)
    g.observe_step(10_000, 1.0)  # the engine: 10k tokens/s
    g.observe_load(5_000, 1.0)  # the tier: 5k tokens/s
    return g


def test_an_overlapped_load_takes_the_prefix_part_that_pays() -> None:
    g = _tier_twice_as_slow_as_prefill()
    # 24 chunks of 256 on offer, 16 tokens after them; the load streams layer by
    # layer (32 layers) while the step computes the rest.
    offer = Offer(24 * 256, tail=16, granule=256, overlap=8192, stages=32)
    d = g.decide(offer)
    assert 0 < d.tokens < offer.offered and d.tokens % 256 == 0
    # About a third loaded while two thirds compute alongside: faster than both
    # whole plans (recompute 0.616 s, loading it all 1.23 s).
    assert 7 * 256 <= d.tokens <= 9 * 256
    assert d.plan_s < 0.85 * d.recompute_s
    whole = plan_seconds(offer, offer.offered, 1 / 5_000, 1 / 10_000)
    assert d.plan_s < whole


def test_a_serial_load_is_whole_or_nothing() -> None:
    g = _tier_twice_as_slow_as_prefill()
    assert g.decide(Offer(24 * 256, tail=16, granule=256)).tokens == 0
    fast = RecomputeGuard(min_loads=1, min_steps=1)
    fast.observe_step(10_000, 1.0)
    fast.observe_load(40_000, 1.0)
    assert fast.decide(Offer(24 * 256, tail=16, granule=256)).tokens == 24 * 256


def test_a_partial_plan_must_beat_both_whole_plans_by_its_margin() -> None:
    offer = Offer(6 * 256, tail=2, granule=256, overlap=8192, stages=3)
    # Three stages hide little: loading 2 chunks saves 11 %, under the 15 % margin.
    k, plan_s, recompute_s = best_plan(offer, 1 / 5_000, 1 / 10_000)
    assert k == 0 and plan_s == recompute_s
    k, _, _ = best_plan(offer, 1 / 5_000, 1 / 10_000, partial_margin=0.0)
    assert 0 < k < offer.offered


def test_chunk_boundaries_count_from_token_zero() -> None:
    # The engine holds 100 tokens; chunks end at 256, 512, 768: k = 156, 412, 668.
    assert Offer(668, start=100, granule=256).candidates() == [0, 156, 412, 668]
    assert Offer(668, start=100).candidates() == [0, 668]


@pytest.mark.parametrize(
    "kw",
    [
        {"window": 0},
        {"margin": 0.0},
        {"reprobe_s": 0.0},
        {"prefill_tokens_per_s": -1.0},
        {"partial_margin": -0.1},
        {"stale_margin": 0.5},
        {"stale_s": 0.0},
    ],
)
def test_nonsense_settings_are_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RecomputeGuard(**kw)  # type: ignore[arg-type]
