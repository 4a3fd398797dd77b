"""The peers' routing rules, over the same index and load views as kvoffload's.

Used by ``scripts/sim_router.py`` to compare policies on one trace, each fed
the same information as the peer it stands for, with the peer's published
default parameters:

- ``random``, ``round-robin``, ``least-loaded`` (fewest requests in flight).
- ``sglang``: SGLang's cache-aware router. When the load is imbalanced
  (``max − min > balance_abs_threshold (32)`` and ``max > balance_rel_threshold
  (1.0001) · min``, in requests) it goes to the least loaded; else to the best
  prefix match if its match rate exceeds ``cache_threshold (0.5)``, else to the
  worker with the smallest tree. SGLang's tree is its own routing history
  (no events), as here.
- ``llm-d``: the precise prefix-cache scorer (longest consecutive prefix,
  tier-weighted gpu 1.0, cpu 0.8, normalized by prompt blocks), the queue
  scorer and the KV-cache-utilization scorer, weights 3 : 2 : 2 (the precise
  prefix-cache guide's), highest sum wins. llm-d does not see storage tiers.
- ``dynamo``: Dynamo's KV router cost
  ``overlap_score_weight (1.0) · max(0, prefill_blocks − credit) + decode_blocks``
  with tier credits gpu 1, host (cpu) 0.75, disk (storage) 0.25 per matched
  block, temperature 0 (lowest cost wins).
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
    if hi - lo > 32 and hi > 1.0001 * lo:
        return min(views, key=lambda v: v.load.inflight + v.load.decoding).worker
    best = max(views, key=lambda v: v.match.longest)
    if n_blocks and best.match.longest / n_blocks > 0.5:
        return best.worker
    return min(views, key=lambda v: v.tree_size).worker


def _llmd(views: Sequence[PeerView], n_blocks: int) -> str:
    def prefix(v: PeerView) -> float:
        return (v.match.gpu * 1.0 + v.match.cpu * 0.8) / n_blocks if n_blocks else 0.0

    qs = [v.waiting for v in views]
    qmax, qmin = max(qs), min(qs)

    def queue(v: PeerView) -> float:
        return 1.0 if qmax == qmin else (qmax - v.waiting) / (qmax - qmin)

    return max(views, key=lambda v: 3 * prefix(v) + 2 * queue(v) + 2 * (1.0 - v.kv_usage)).worker


def _dynamo(views: Sequence[PeerView], n_blocks: int) -> str:
    def cost(v: PeerView) -> float:
        m = v.match
        credit = 1.0 * m.gpu + 0.75 * m.cpu + 0.25 * (m.storage_local + m.storage_remote)
        return 1.0 * max(0.0, n_blocks - credit) + v.active_blocks

    return min(views, key=cost).worker


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


PEERS = ("random", "round-robin", "least-loaded", "sglang", "llm-d", "dynamo", "mooncake")


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
        return _dynamo
    if name == "mooncake":
        return _mooncake(priors or Priors(), block_tokens)
    raise ValueError(f"unknown policy {name!r} (one of {', '.join(PEERS)})")
