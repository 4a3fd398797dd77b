"""The recompute guard (kvoffload.integrations.payoff): a hit is loaded only when the
tier's measured load rate beats the engine's measured prefill rate."""

from __future__ import annotations

import pytest

from kvoffload.integrations.payoff import RecomputeGuard


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


def test_a_refusing_guard_probes_the_tier_again_and_notices_it_recovered() -> None:
    clock = Clock()
    g = RecomputeGuard(
        probe_tokens=64, reprobe_s=30.0, window=4, min_loads=1, min_steps=4, clock=clock
    )
    for _ in range(4):
        g.observe_step(2048, 0.1)
    g.observe_load(1024, 1.0)  # slow
    assert g.decide(1024).tokens == 0
    clock.t += 31
    probe = g.decide(1024)
    assert probe.tokens == 64 and "probe" in probe.reason  # one chunk, the rest recomputed
    assert g.decide(1024).tokens == 0  # one probe per period
    for _ in range(4):
        g.observe_load(64, 0.0001)  # the tier recovered: 640k tokens/s
    assert g.decide(1024).tokens == 1024


@pytest.mark.parametrize(
    "kw", [{"window": 0}, {"margin": 0.0}, {"reprobe_s": 0.0}, {"prefill_tokens_per_s": -1.0}]
)
def test_nonsense_settings_are_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RecomputeGuard(**kw)  # type: ignore[arg-type]
