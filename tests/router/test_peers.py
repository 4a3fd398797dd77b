"""The peers' rules as the simulator runs them: each one's published defaults, checked on cases."""

from __future__ import annotations

import pytest

from kvoffload.router.index import TierMatch
from kvoffload.router.model import Priors, WorkerLoad
from kvoffload.router.peers import PeerView, make_peer

NONE = TierMatch()


def view(
    name: str,
    match: TierMatch = NONE,
    *,
    inflight: int = 0,
    waiting: int = 0,
    kv: float = 0.0,
    active: int = 0,
    tree: int = 0,
) -> PeerView:
    load = WorkerLoad()
    for i in range(inflight):
        load.pending[i] = (0, 0.0)
    return PeerView(name, match, load, waiting, kv, active, tree)


def test_sglang_goes_least_loaded_only_past_its_imbalance_threshold() -> None:
    rule = make_peer("sglang")
    cached = view("a", TierMatch(gpu=8), inflight=70)
    idle = view("b", inflight=0)
    assert rule([cached, idle], 10) == "b"  # 70 − 0 > 64: least loaded
    cached = view("a", TierMatch(gpu=8), inflight=60)
    assert rule([cached, idle], 10) == "a"  # balanced enough: match rate 0.8 > 0.3
    low = view("a", TierMatch(gpu=3), tree=100)
    small = view("b", tree=5)
    assert rule([low, small], 10) == "b"  # match rate 0.3 ≤ 0.3: the smallest tree
    assert rule([view("a", TierMatch(gpu=4), tree=100), small], 10) == "a"


def test_llmd_weighs_prefix_queue_and_kv_usage_3_2_2() -> None:
    rule = make_peer("llm-d")
    # Full GPU prefix (3·1.0) but the longest queue (2·0) and a full cache (2·0) → 3.0;
    # no prefix, empty queue, empty cache → 4.0.
    holder = view("a", TierMatch(gpu=10), waiting=10, kv=1.0)
    other = view("b", waiting=0, kv=0.0)
    assert rule([holder, other], 10) == "b"
    # CPU blocks count 0.8: 3·0.8 + 2·1 + 2·0.5 = 5.4 beats 0 + 2·1 + 2·1 = 4.
    cpu = view("a", TierMatch(cpu=10), kv=0.5)
    assert rule([cpu, view("b")], 10) == "a"


def test_llmd_normalises_prefix_scores_across_pods() -> None:
    """Min-max across pods: 9 of 10 blocks against 8 of 10 is 1 against 0, not 0.9 against 0.8."""
    rule = make_peer("llm-d")
    better = view("a", TierMatch(gpu=9), waiting=5)  # 3·1 + 2·0 + 2 = 5
    queued_less = view("b", TierMatch(gpu=8), waiting=0)  # 3·0 + 2·1 + 2 = 4
    assert rule([better, queued_less], 10) == "a"


def test_dynamo_counts_the_workers_queued_prefill() -> None:
    rule = make_peer("dynamo", block_tokens=16)
    holder = view("a", TierMatch(gpu=10))
    holder.load.pending_tokens = 16 * 20  # 20 blocks of prefill queued there
    other = view("b")  # 10 blocks to prefill, nothing queued
    assert rule([holder, other], 10) == "b"
    holder.load.pending_tokens = 16 * 5
    assert rule([holder, other], 10) == "a"


def test_production_stack_routes_to_the_match_or_by_qps() -> None:
    rule = make_peer("production-stack", block_tokens=512)
    holder = view("a", TierMatch(gpu=4, cpu=6))  # 5,120 of the prompt's tokens
    fresh = PeerView("b", NONE, WorkerLoad(), 0, 0.0, 0, 0, recent_requests=0)
    busy = PeerView("a", holder.match, holder.load, 50, 0.9, 999, 0, recent_requests=40)
    assert rule([busy, fresh], 12) == "a"  # all but 1,024 ≤ 2,000 tokens: no load term
    assert rule([busy, fresh], 20) == "b"  # 10 blocks short: the fewest recent requests
    shared = PeerView("a", TierMatch(storage_remote=12), WorkerLoad(), 0, 0.0, 0, 0, 40)
    assert rule([shared, fresh], 12) == "b"  # a shared store names no instance


def test_dynamo_credits_tiers_1_075_025() -> None:
    rule = make_peer("dynamo")
    storage = view("a", TierMatch(storage_remote=8))  # cost 10 − 2 = 8
    cpu = view("b", TierMatch(cpu=4))  # 10 − 3 = 7
    assert rule([storage, cpu], 10) == "b"
    busy_gpu = view("c", TierMatch(gpu=10), active=9)  # 0 + 9
    assert rule([storage, cpu, busy_gpu], 10) == "b"


def test_mooncake_weighs_transfer_against_its_queue() -> None:
    pri = Priors(
        prefill_a_s=0.0, prefill_b_s=1e-4, bytes_per_token=1000, storage_remote_bandwidth=1e9
    )
    rule = make_peer("mooncake", priors=pri, block_tokens=16)
    holder = view("a", TierMatch(gpu=100))
    holder.load.pending_tokens = 100_000  # 10 s of queued prefill
    idle = view("b")
    assert rule([holder, idle], 100) == "b"  # it can pull the prefix instead
    holder.load.pending_tokens = 0
    assert rule([holder, idle], 100) == "a"


def test_round_robin_cycles_and_unknown_names_are_refused() -> None:
    rule = make_peer("round-robin")
    vs = [view("a"), view("b"), view("c")]
    assert [rule(vs, 1) for _ in range(4)] == ["a", "b", "c", "a"]
    with pytest.raises(ValueError, match="unknown policy"):
        make_peer("ouija")
