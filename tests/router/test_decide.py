"""The TTFT model and the decision: terms, accounting, calibration, deadlines, modes, tenants."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest

from kvoffload.router.core import Mode, Router, Topology, WorkerInfo
from kvoffload.router.hashing import BlockHasher
from kvoffload.router.index import Location, SourceState, TierMatch
from kvoffload.router.model import Priors, TTFTModel, WorkerLoad

PRIORS = Priors(
    prefill_a_s=0.0,
    prefill_b_s=1e-4,
    prefill_c_s=0.0,
    decode_slowdown=0.1,
    bytes_per_token=1000,
    cpu_bandwidth=1e9,
    storage_local_bandwidth=1e8,
    storage_remote_bandwidth=1e7,
    cpu_latency_s=0.0,
    storage_local_latency_s=0.0,
    storage_remote_latency_s=0.0,
)


def router(n: int = 2, **kw: object) -> Router:
    infos = tuple(WorkerInfo(f"w{i}", f"node{i}") for i in range(n))
    roots: dict[str, tuple[bool, tuple[str, ...]]] = {
        f"node{i}": (False, (f"node{i}",)) for i in range(n)
    }
    roots["shared"] = (True, tuple(f"node{i}" for i in range(n)))
    r = Router(Topology(infos, roots), priors=PRIORS, block_tokens=16, **kw)  # type: ignore[arg-type]
    for w in infos:
        r.set_worker_source(w.name, SourceState.LIVE)
    for root in roots:
        r.set_store_source(root, SourceState.LIVE)
    return r


def test_estimate_terms_follow_the_formula() -> None:
    m = TTFTModel(PRIORS, block_tokens=16)
    load = WorkerLoad(decoding=5)
    est = m.estimate(160, TierMatch(gpu=2, cpu=1, storage_local=1, storage_remote=1), load, now=0)
    assert est.cached_tokens == {"gpu": 32, "cpu": 16, "storage_local": 16, "storage_remote": 16}
    assert est.missing_tokens == 80
    # One step of the budget, after half of the one under way (the worker decodes):
    # 80 tokens, and 5 decodes each 10 % of a full step in each of those 1.5 steps.
    assert est.prefill_s == pytest.approx(80 * 1e-4 + 1.5 * 5 * 0.1 * 8192 * 1e-4)
    assert est.read_s["cpu"] == pytest.approx(16 * 1000 / 1e9)
    assert est.read_s["storage_remote"] == pytest.approx(16 * 1000 / 1e7)
    assert est.ttft_s == pytest.approx(est.prefill_s + sum(est.read_s.values()))


def test_a_full_hit_still_computes_the_last_token() -> None:
    m = TTFTModel(PRIORS, block_tokens=16)
    est = m.estimate(32, TierMatch(gpu=2), WorkerLoad(), now=0)
    assert est.missing_tokens == 1


def test_queue_is_the_booked_service_and_follows_the_first_tokens() -> None:
    r = router(1)
    d1 = r.decide([], 10_000, now=0.0)
    t1 = r.dispatch(d1, 0.0)
    d2 = r.decide([], 10_000, now=0.0)
    assert d2.chosen is not None
    assert d2.chosen.estimate.queue_s == pytest.approx(1.0)  # 10k tokens × 1e-4 s
    t2 = r.dispatch(d2, 0.0)
    # Half its modelled time in, the head has a little more than half left: a
    # prefill's time is noisy, and one still running is more likely a slow one.
    assert r.loads["w0"].queue_s(0.5) == pytest.approx(1.5, rel=0.01)
    r.first_token(t1, 1.0)
    # t1's last chunk (1,808 tokens) shared its step with t2's first 6,383 (t1 now
    # decodes: 8,191 a step); until t2 answers, at least half a step of it is left
    # (4,095.5 tokens), in the step under way and its half-step: 1.5 steps of one decode.
    left = 8_191 / 2
    assert r.loads["w0"].queue_s(1.0) == pytest.approx(
        left * 1e-4 + 1.5 * 0.1 * 8192 * 1e-4, rel=1e-3
    )
    r.first_token(t2, 2.0)
    assert r.loads["w0"].queue_s(2.0) == 0.0


def test_calibration_learns_a_slower_worker() -> None:
    r = router(1)
    for i in range(40):
        now = float(i * 10)
        t = r.dispatch(r.decide([], 10_000, now=now), now)
        r.first_token(t, now + 2.0)  # the worker is twice as slow as the prior
        r.finished(t)
    assert r.loads["w0"].prefill_scale == pytest.approx(2.0, rel=0.05)
    d = r.decide([], 10_000, now=1000.0)
    assert d.chosen is not None and d.chosen.estimate.ttft_s == pytest.approx(2.0, rel=0.05)
    assert r.model.error_summary()["abs_p50"] < 0.05  # the latest estimates are right


def test_read_figures_calibrate_a_tier_bandwidth() -> None:
    m = TTFTModel(PRIORS)
    from kvoffload.router.index import Tier

    for _ in range(60):
        m.observe_read(Tier.STORAGE_REMOTE, 2_000_000, 0.1)  # 2e7 B/s: twice the prior
    assert m.bandwidth(Tier.STORAGE_REMOTE) == pytest.approx(2e7, rel=0.02)


def test_idle_worker_reading_the_shared_store_beats_a_busy_one_holding_everything() -> None:
    r = router(2)
    prompt = list(range(10_000, 10_000 + 200))  # 200 blocks = 3,200 tokens
    r.index.apply_stored(Location("gpu", "w0"), prompt)
    r.index.apply_stored(Location("store", "shared"), prompt)
    # w0 is busy: 5 s of booked prefill ahead.
    for _ in range(5):
        r.dispatch(r.decide([], 10_000, now=0.0, exclude=["w1"]), 0.0)
    d = r.decide(prompt, 3_200, now=0.0)
    assert d.worker == "w1"
    by = {c.worker: c for c in d.candidates}
    assert by["w0"].match.gpu == 200 and by["w1"].match.storage_remote == 200
    assert by["w1"].estimate.read_s["storage_remote"] > 0
    # Without the queue, the worker holding the prefix wins.
    r2 = router(2)
    r2.index.apply_stored(Location("gpu", "w0"), prompt)
    r2.index.apply_stored(Location("store", "shared"), prompt)
    assert r2.decide(prompt, 3_200, now=0.0).worker == "w0"


def test_no_worker_meets_the_deadline_sheds_with_retry_after() -> None:
    r = router(2)
    d = r.decide([], 50_000, now=0.0, deadline_s=1.0)  # 5 s of prefill anywhere
    assert d.worker is None and d.shed
    assert d.retry_after_s == 4.0
    f = router(2, on_deadline_miss="fastest").decide([], 50_000, now=0.0, deadline_s=1.0)
    assert f.worker is not None and f.retry_after_s == 4.0
    assert r.decide([], 5_000, now=0.0, deadline_s=1.0).worker is not None


def test_unhealthy_workers_are_never_chosen_and_none_left_is_no_decision() -> None:
    r = router(2)
    r.healthy["w0"] = False
    assert {r.decide([], 100, now=0.0).worker for _ in range(3)} == {"w1"}
    r.healthy["w1"] = False
    d = r.decide([], 100, now=0.0)
    assert d.worker is None and not d.shed and d.candidates == ()


def test_modes_follow_the_sources() -> None:
    r = router(2)
    assert r.decide([1], 16, now=0.0).mode is Mode.EXACT
    r.set_worker_source("w1", SourceState.STALE)
    assert r.decide([1], 16, now=0.0).mode is Mode.DEGRADED
    blank = Router(Topology((WorkerInfo("a", "n"), WorkerInfo("b", "n"))), priors=PRIORS)
    d = blank.decide([1], 16, now=0.0)
    assert d.mode is Mode.FALLBACK
    blank.dispatch(d, 0.0)
    # Routing history now exists: DEGRADED, and the history credits the worker it went to.
    d2 = blank.decide([1], 16, now=0.0)
    assert d2.mode is Mode.DEGRADED


def test_degraded_mode_routes_a_shared_prefix_to_where_the_history_sent_it() -> None:
    r = router(2)
    r.set_worker_source("w0", SourceState.STALE)
    r.set_worker_source("w1", SourceState.STALE)
    prompt = list(range(500, 600))
    first = r.decide(prompt, 1_600, now=0.0)
    t = r.dispatch(first, 0.0)
    r.first_token(t, 0.2)
    r.finished(t)
    second = r.decide(prompt, 1_600, now=1.0)
    assert second.mode is Mode.DEGRADED
    assert second.worker == first.worker
    assert second.chosen is not None and second.chosen.match.gpu == 100


def test_another_tenants_identical_prompt_is_routed_cold() -> None:
    hasher = BlockHasher(block_size=16)
    tokens = list(range(3_200))
    r = router(2)
    victim = hasher.external_hashes(tokens, cache_salt="salt-of-tenant-a")
    r.index.apply_stored(Location("gpu", "w0"), victim)
    own = r.decide(victim, len(tokens), now=0.0)
    assert own.chosen is not None and own.chosen.match.gpu == 200
    attacker = hasher.external_hashes(tokens, cache_salt="salt-of-tenant-b")
    d = r.decide(attacker, len(tokens), now=0.0)
    assert all(c.match.longest == 0 for c in d.candidates)
    unsalted = hasher.external_hashes(tokens)
    assert all(c.match.longest == 0 for c in r.decide(unsalted, len(tokens), now=0.0).candidates)


def test_failure_before_the_first_token_unbooks_the_request() -> None:
    r = router(1)
    t = r.dispatch(r.decide([1, 2], 10_000, now=0.0), 0.0)
    assert r.loads["w0"].inflight == 1
    r.failed(t, 0.1)
    assert r.loads["w0"].inflight == 0 and r.loads["w0"].queue_s(0.1) == 0.0
    assert r.index.prefix_lengths([1, 2]).get(Location("gpu", "w0"), 0) == 0


def test_an_answer_seen_whole_settles_without_calibrating() -> None:
    r = router(1)
    t = r.dispatch(r.decide([], 10_000, now=0.0), 0.0)
    r.first_token(t, 30.0, observed=False)  # 30 s: the whole answer, decode included
    assert r.loads["w0"].inflight == 0
    assert r.loads["w0"].prefill_scale == 1.0 and r.loads["w0"].fit.count == 0
    assert r.model.error_summary()["count"] == 0


def _residual_life(x: float, sigma: float) -> float:
    """E[f − x | f > x] for f lognormal with mean 1 and log-σ ``sigma``, from the normal CDF."""
    phi = NormalDist().cdf
    mu = -sigma * sigma / 2
    tail = 1 - phi((math.log(x) - mu) / sigma)  # P(f > x)
    above = 1 - phi((math.log(x) - mu - sigma * sigma) / sigma)  # E[f; f > x]
    return above / tail - x


def test_a_fixed_sequence_decides_and_estimates_as_the_model_says() -> None:
    """Three decisions worked out by hand from the model's documented terms.

    With PRIORS (no step overhead, no attention term, θ at its start) a worker's
    time for ``t`` tokens is ``t·1e-4 + steps·D·0.08192`` (``D`` decoding, a full
    step's 10 % each), ``steps = ⌈t / (8192 − D)⌉ + ½`` while it is busy; the
    learned σ is its prior 0.25 and no worker has a speed variance yet.
    """
    r = router(2)
    sigma, tok = 0.25, 1e-4

    # 1. An idle cluster: both equal; the first worker wins the tie.
    a = r.decide(list(range(1, 65)), 1024, now=0.0)
    assert a.worker == "w0"
    for c in a.candidates:
        assert c.estimate.ttft_s == pytest.approx(0.1024, rel=1e-9)
        assert c.estimate.spread_s == pytest.approx(sigma * 0.1024, rel=1e-9)
    ta = r.dispatch(a, 0.0)

    # 2. At 0.03 s a prompt sharing A's first 48 blocks (A in flight on w0).
    now = 0.03
    b = r.decide([*range(1, 49), *range(1001, 1017)], 1024, now=now)
    head_left = 1024 * min(1.0, _residual_life(now / 0.1024, sigma))
    done = min(now * 1024 / 0.1024, 1024 - max(0.5 * 1024, head_left))
    queue_s = (1024 - done) * tok
    own = 256 * tok  # 768 tokens in w0's GPU (in flight)
    expect = {
        "w0": (queue_s + own, sigma * math.hypot(head_left * tok, own), own),
        "w1": (0.1024, sigma * 0.1024, 0.1024),
    }
    mean_service = 0.8 * 0.1 + 0.2 * 0.1024  # the EWMA after A
    weight = 1.0 * 0.5 * (queue_s / 2) / mean_service  # one of two busy
    for c in b.candidates:
        ttft, spread, work = expect[c.worker]
        assert c.match.gpu == (48 if c.worker == "w0" else 0)
        assert c.estimate.ttft_s == pytest.approx(ttft, rel=1e-9)
        assert c.estimate.spread_s == pytest.approx(spread, rel=1e-9)
        assert c.estimate.work_s == pytest.approx(work, rel=1e-9)
    keys = {w: t + 2.0 * s + weight * k for w, (t, s, k) in expect.items()}
    assert b.worker == min(keys, key=keys.__getitem__) == "w0"
    r.dispatch(b, now)

    # 3. A answers at 0.1 s (seen whole: nothing learned) and decodes. Its last
    # chunk's step left 8192 − 1024 tokens of budget to B, all of B's 256; until B
    # answers, half its last step is left: 128 tokens, one step under way.
    r.first_token(ta, 0.1, observed=False)
    c3 = r.decide(list(range(2001, 2065)), 1024, now=0.1)
    step = 0.1 * 8192 * tok  # one decoding request's share of a step
    queue_s = 128 * tok + 1.5 * step
    own = 1024 * tok + (math.ceil((128 + 1024) / 8191) + 0.5) * step - 1.5 * step
    w0 = next(c for c in c3.candidates if c.worker == "w0")
    assert w0.estimate.queue_s == pytest.approx(queue_s, rel=1e-9)
    assert w0.estimate.prefill_s == pytest.approx(own, rel=1e-9)
    assert w0.estimate.spread_s == pytest.approx(sigma * own, rel=1e-9)  # no head left
    assert c3.worker == "w1"
