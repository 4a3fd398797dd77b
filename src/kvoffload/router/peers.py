"""The peers' routing rules, over the same index and load views as kvoffload's.

Used by ``scripts/sim_router.py`` to compare policies on one trace, each fed
the same information as the peer it stands for, with the peer's published
default parameters:

- ``random``, ``round-robin``, ``least-loaded`` (fewest requests in flight).
- ``sglang``: SGLang's cache-aware router, sgl-router's current defaults.
  When the load is imbalanced (``max − min > balance_abs_threshold (64)`` and
  ``max > balance_rel_threshold (1.5) · min``, in requests the router has in
  flight) it goes to the least loaded; else to the best prefix match if its
  match rate exceeds ``cache_threshold (0.3)``, else to the worker with the
  smallest tree. SGLang's tree is its own routing history (no events), as here.
- ``llm-d``: the precise prefix-cache scorer (longest consecutive prefix,
  tier-weighted gpu 1.0, cpu 0.8), min-max normalised across the pods as the
  scheduler's ``indexedScoresToNormalizedScoredPods`` does (the best match
  scores 1, the worst 0; all equal: all 1), the queue scorer (min-max of
  waiting requests, fewest 1) and the KV-cache-utilization scorer
  (1 − usage), weights 3 : 2 : 2 (the precise prefix-cache guide's), highest
  sum wins. llm-d does not see storage tiers.
- ``dynamo``: Dynamo's KV router cost ``overlap_score_weight (1.0) ·
  potential_prefill_blocks + potential_active_blocks``, where the prefill
  blocks are the worker's queued prefill tokens (its requests routed and not
  yet past prefill) plus this request's uncached ones, over the block size,
  and the active blocks are the blocks of every request it holds plus this
  one's; overlap credited per matched block gpu 1, host (cpu) 0.75, disk
  (storage) 0.25; temperature 0 (lowest cost wins).
- ``production-stack``: vLLM production-stack's ``kvaware`` routing with
  LMCache: the instance the LMCache controller names for the longest prefix
  (here: the longest match in the instance's own tiers, its GPU and its CPU
  (LMCache's local backend); a store other instances read names no
  instance), if it matches all but ``kv_aware_threshold (2000)`` tokens of the
  prompt; otherwise QPS routing (the instance with the fewest requests routed
  in the last 10 s). No load term on a match.
- ``mooncake``: Mooncake's Conductor: TTFT = queue (prefill time of what the
  instance already has queued) + prefill of the tokens its local (GPU/CPU)
  cache misses, or, when a longer prefix is elsewhere (any store), its
  transfer at one flat bandwidth plus the rest; no decode slowdown, no
  calibration; lowest wins.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .index import TierMatch
from .model import Priors, WorkerLoad

__all__ = ["PEERS", "PeerView", "make_peer"]


@dataclass(frozen=True)
class PeerView:
    """One worker as a peer's router sees it."""

    worker: str
    match: TierMatch  # from events (llm-d, Dynamo, Mooncake) or history (SGLang)
    load: WorkerLoad
    waiting: int  # requests queued, not yet prefilled
    kv_usage: float  # 0..1
    active_blocks: int  # KV blocks of the requests it holds (Dynamo's decode_blocks)
    tree_size: int  # blocks in its routing history (SGLang)
    recent_requests: int = 0  # requests routed to it in the last 10 s (production-stack QPS)


PeerFn = Callable[[Sequence[PeerView], int], str]


def _random(seed: int) -> PeerFn:
    rng = random.Random(seed)

    def choose(views: Sequence[PeerView], n_blocks: int) -> str:
        return rng.choice(views).worker

    return choose


def _round_robin() -> PeerFn:
    i = [0]

    def choose(views: Sequence[PeerView], n_blocks: int) -> str:
        v = views[i[0] % len(views)]
        i[0] += 1
        return v.worker

    return choose


def _least_loaded(views: Sequence[PeerView], n_blocks: int) -> str:
    return min(views, key=lambda v: (v.load.inflight + v.load.decoding, v.waiting)).worker


def _sglang(views: Sequence[PeerView], n_blocks: int) -> str:
    loads = [v.load.inflight + v.load.decoding for v in views]
    hi, lo = max(loads), min(loads)
    if hi - lo > 64 and hi > 1.5 * lo:
        return min(views, key=lambda v: v.load.inflight + v.load.decoding).worker
    best = max(views, key=lambda v: v.match.longest)
    if n_blocks and best.match.longest / n_blocks > 0.3:
        return best.worker
    return min(views, key=lambda v: v.tree_size).worker


def _minmax(values: Sequence[float], *, higher_is_better: bool = True) -> list[float]:
    """llm-d's normalisation across pods: best 1, worst 0, all equal all 1."""
    lo, hi = min(values), max(values)
    if hi == lo:
        return [1.0] * len(values)
    if higher_is_better:
        return [(v - lo) / (hi - lo) for v in values]
    return [(hi - v) / (hi - lo) for v in values]


def _llmd(views: Sequence[PeerView], n_blocks: int) -> str:
    prefix = _minmax([v.match.gpu * 1.0 + v.match.cpu * 0.8 for v in views])
    queue = _minmax([float(v.waiting) for v in views], higher_is_better=False)
    total = [
        3 * p + 2 * q + 2 * (1.0 - v.kv_usage) for p, q, v in zip(prefix, queue, views, strict=True)
    ]
    return views[max(range(len(views)), key=total.__getitem__)].worker


def _dynamo(block_tokens: int) -> PeerFn:
    def choose(views: Sequence[PeerView], n_blocks: int) -> str:
        def cost(v: PeerView) -> float:
            m = v.match
            credit = 1.0 * m.gpu + 0.75 * m.cpu + 0.25 * (m.storage_local + m.storage_remote)
            queued = v.load.pending_tokens / block_tokens
            prefill = queued + max(0.0, n_blocks - credit)
            return 1.0 * prefill + v.active_blocks + n_blocks

        return min(views, key=cost).worker

    return choose


def _production_stack(block_tokens: int, threshold_tokens: int = 2000) -> PeerFn:
    def choose(views: Sequence[PeerView], n_blocks: int) -> str:
        def own(v: PeerView) -> int:
            m = v.match
            return m.gpu + m.cpu

        # Ties go to the fewer QPS.
        best = max(views, key=lambda v: (own(v), -v.recent_requests))
        matched = own(best) * block_tokens
        if own(best) and matched >= max(n_blocks * block_tokens - threshold_tokens, 0):
            return best.worker
        return min(views, key=lambda v: v.recent_requests).worker

    return choose


def _mooncake(priors: Priors, block_tokens: int) -> PeerFn:
    def choose(views: Sequence[PeerView], n_blocks: int) -> str:
        n = n_blocks * block_tokens
        elsewhere = max(v.match.longest for v in views) * block_tokens
        bw = priors.storage_remote_bandwidth

        def ttft(v: PeerView) -> float:
            queue = priors.prefill_s(v.load.pending_tokens)
            local = (v.match.gpu + v.match.cpu) * block_tokens
            best = priors.prefill_s(n - local)
            if elsewhere > local:
                moved = elsewhere - local
                best = min(
                    best, moved * priors.bytes_per_token / bw + priors.prefill_s(n - elsewhere)
                )
            return queue + best

        return min(views, key=ttft).worker

    return choose


PEERS = (
    "random",
    "round-robin",
    "least-loaded",
    "sglang",
    "llm-d",
    "dynamo",
    "production-stack",
    "mooncake",
)


def make_peer(
    name: str, *, seed: int = 0, priors: Priors | None = None, block_tokens: int = 16
) -> PeerFn:
    """A fresh instance of one peer's rule (stateful ones keep their own state)."""
    if name == "random":
        return _random(seed)
    if name == "round-robin":
        return _round_robin()
    if name == "least-loaded":
        return _least_loaded
    if name == "sglang":
        return _sglang
    if name == "llm-d":
        return _llmd
    if name == "dynamo":
        return _dynamo(block_tokens)
    if name == "production-stack":
        return _production_stack(block_tokens)
    if name == "mooncake":
        return _mooncake(priors or Priors(), block_tokens)
    raise ValueError(f"unknown policy {name!r} (one of {', '.join(PEERS)})")
