"""Trace-driven simulation of kvoffload's router against the peers' routing rules.

Runs the router's real decision code (:class:`kvoffload.router.core.Router`:
the same index, TTFT model and choice as ``kvoffload router``) and the peers'
rules (:mod:`kvoffload.router.peers`) on one request trace in the Mooncake
FAST'25 format (one JSON object a line: ``timestamp`` ms, ``input_length``,
``output_length``, ``hash_ids`` of 512-token blocks), over N simulated
workers, and prints per policy: TTFT p50/p90/p99, mean queue wait,
throughput, prefix hit rate per tier (and the trace's infinite-cache bound),
SLO attainment, and the router's decisions per second. Times of the router's
own code are CPU seconds of this process (``time.process_time``), so a busy
machine does not shrink them.

The simulated cluster (every number is in ``params`` of ``--json``):

- workers, two per node; each node has a sidecar store (``STORAGE LOCAL``),
  all nodes share one store root (``STORAGE REMOTE``);
- per worker a GPU prefix cache and a CPU offload tier (capacity in blocks,
  LRU; what the GPU evicts goes to the CPU tier); every prefilled block is
  written through to its node's store and to the shared root (LRU each);
  a prompt hits the GPU up to its first miss, then each read tier from where
  the better ones stop (the CPU tier holds the evicted middle of a prompt);
- a prefill runs one request at a time per worker (FIFO) and takes
  ``(a + b·m + c·m²)·(1 + d·decoding)`` for ``m`` missing tokens, after reading
  the cached ones at each tier's bandwidth; decode runs beside it (continuous
  batching), ``output_length`` steps of ``e + f·decoding`` seconds;
- KV events reach the router ``event_delay_s`` after the fact, store writes
  ``store_delay_s`` after the prefill; every ``metrics_interval_s`` each
  worker's /metrics (waiting, running, KV usage) is scraped;
- the router's priors are deliberately off from the simulated truth
  (``prior_error``): its calibration has to find the real speeds.

Load levels scale the trace's arrival times so that the work left with an
infinite shared cache (prefill what it misses, read the rest from the shared
root) would keep the workers busy a given fraction of the time (light 0.4,
saturation 0.85, overload 1.2). The TTFT SLO of a request is
``slo_base_s + slo_factor × its uncached prefill time on an idle worker``.

Usage::

    python scripts/sim_router.py --trace ../shared/traces/mooncake_synthetic_trace.jsonl
    python scripts/sim_router.py --trace FILE --workers 4 --load overload --json out.json
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import statistics
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from benchlib.trace import Req, infinite_cache_missing, load_trace
from kvoffload.router.core import Router, Ticket, Topology, WorkerInfo
from kvoffload.router.hashing import BlockHasher
from kvoffload.router.index import Location, SourceState, Tier, TierMatch
from kvoffload.router.model import Priors
from kvoffload.router.peers import PEERS, PeerView, make_peer

BLOCK = 512
LOADS = {"light": 0.4, "saturation": 0.85, "overload": 1.2}
POLICIES = (*PEERS, "kvoffload", "kvoffload-shed")


@dataclass(frozen=True)
class Params:
    block_tokens: int = BLOCK
    prefill_a_s: float = 0.02
    prefill_b_s: float = 1.0 / 10_000
    prefill_c_s: float = 2e-10
    decode_slowdown: float = 0.01
    decode_step_s: float = 0.02
    decode_step_per_req_s: float = 0.0004
    bytes_per_token: int = 163_840  # a 70B-class model, GQA, fp16, one TP group
    gpu_blocks: int = 600  # ≈ 300k tokens of KV per worker
    cpu_blocks: int = 2_000
    node_store_blocks: int = 20_000
    shared_store_blocks: int = 200_000
    cpu_bandwidth: float = 25e9
    storage_local_bandwidth: float = 12e9
    storage_remote_bandwidth: float = 6e9
    event_delay_s: float = 0.05
    store_delay_s: float = 0.5
    metrics_interval_s: float = 1.0
    prior_error: float = 1.5  # the router's priors: prefill 1/1.5 as fast, bandwidths 1.5× off
    slo_base_s: float = 2.0
    slo_factor: float = 1.5
    workers_per_node: int = 2
    work_weight: float = 1.0  # the router's weight of added work under load (kvoffload.router.core)

    def truth(self) -> Priors:
        return Priors(
            prefill_a_s=self.prefill_a_s,
            prefill_b_s=self.prefill_b_s,
            prefill_c_s=self.prefill_c_s,
            decode_slowdown=self.decode_slowdown,
            bytes_per_token=self.bytes_per_token,
            cpu_bandwidth=self.cpu_bandwidth,
            storage_local_bandwidth=self.storage_local_bandwidth,
            storage_remote_bandwidth=self.storage_remote_bandwidth,
            cpu_latency_s=0.0,
            storage_local_latency_s=0.001,
            storage_remote_latency_s=0.003,
        )

    def router_priors(self) -> Priors:
        t = self.truth()
        e = self.prior_error
        return replace(
            t,
            prefill_b_s=t.prefill_b_s * e,
            storage_local_bandwidth=t.storage_local_bandwidth / e,
            storage_remote_bandwidth=t.storage_remote_bandwidth * e,
        )

    def slo_s(self, n: int) -> float:
        return self.slo_base_s + self.slo_factor * self.truth().prefill_s(n)


def scaled(reqs: Sequence[Req], params: Params, workers: int, target: float) -> list[Req]:
    missing, _ = infinite_cache_missing(reqs)
    truth = params.truth()
    # The work left with an infinite shared cache: prefill what it misses, read the rest.
    read_s_per_token = params.bytes_per_token / params.storage_remote_bandwidth
    work = sum(
        truth.prefill_s(m) + (r.n - m) * read_s_per_token
        for r, m in zip(reqs, missing, strict=True)
    )
    span = max(r.arrival for r in reqs) or 1.0
    # Busy fraction at the original pace: work / (workers · span); scale the pace to hit target.
    factor = (work / (workers * span)) / target
    return [replace(r, arrival=r.arrival * factor) for r in reqs]


class LRU:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.d: OrderedDict[int, None] = OrderedDict()

    def prefix(self, blocks: Sequence[int]) -> int:
        n = 0
        for h in blocks:
            if h not in self.d:
                break
            n += 1
        return n

    def touch(self, blocks: Sequence[int]) -> tuple[list[int], list[int]]:
        """Insert or refresh; returns (newly stored, evicted)."""
        stored: list[int] = []
        for h in blocks:
            if h in self.d:
                self.d.move_to_end(h)
            else:
                self.d[h] = None
                stored.append(h)
        evicted: list[int] = []
        while len(self.d) > self.capacity:
            old, _ = self.d.popitem(last=False)
            evicted.append(old)
        return stored, evicted


def run_from(blocks: Sequence[int], start: int, tiers: Sequence[LRU]) -> int:
    """How far from ``start`` every block is in one of ``tiers``."""
    k = start
    while k < len(blocks) and any(blocks[k] in t.d for t in tiers):
        k += 1
    return k


@dataclass
class SimWorker:
    name: str
    node: str
    gpu: LRU
    cpu: LRU
    queue: deque[tuple[Req, Ticket, int]] = field(default_factory=deque)
    busy: bool = False
    decoding: int = 0
    tree: set[int] = field(default_factory=set)  # SGLang's approximate tree (routing history)


@dataclass
class Result:
    workers: int
    load: str
    policy: str
    requests: int
    served: int
    shed: int
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    mean_queue_s: float
    throughput_rps: float
    throughput_tok_s: float
    slo_attainment: float
    hit_rate: float
    hit_rate_gpu: float
    hit_rate_cpu: float
    hit_rate_storage_local: float
    hit_rate_storage_remote: float
    infinite_cache_hit_rate: float
    decisions_per_s: float
    estimate_error_abs_p50: float | None = None
    estimate_error_abs_p90: float | None = None
    preemptions: int = 0


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(p * len(s)) - 1))]


def simulate(
    reqs: Sequence[Req],
    params: Params,
    n_workers: int,
    policy: str,
    load: str,
    inf_hit: float,
    seed: int,
) -> Result:
    truth = params.truth()
    bt = params.block_tokens
    nodes = [f"node{i // params.workers_per_node}" for i in range(n_workers)]
    infos = tuple(WorkerInfo(f"w{i}", nodes[i]) for i in range(n_workers))
    roots: dict[str, tuple[bool, tuple[str, ...]]] = {n: (False, (n,)) for n in sorted(set(nodes))}
    roots["shared"] = (True, tuple(sorted(set(nodes))))
    router = Router(
        Topology(infos, roots),
        priors=params.router_priors(),
        block_tokens=bt,
        on_deadline_miss="shed" if policy == "kvoffload-shed" else "fastest",
        work_weight=params.work_weight,
    )
    for info in infos:
        router.set_worker_source(info.name, SourceState.LIVE)
    for root in roots:
        router.set_store_source(root, SourceState.LIVE)
    workers = {
        w.name: SimWorker(w.name, w.node, LRU(params.gpu_blocks), LRU(params.cpu_blocks))
        for w in infos
    }
    stores = {n: LRU(params.node_store_blocks) for n in set(nodes)}
    shared = LRU(params.shared_store_blocks)
    peer = (
        None
        if policy.startswith("kvoffload")
        else make_peer(policy, seed=seed, priors=params.router_priors(), block_tokens=bt)
    )

    seq = itertools.count()
    heap: list[tuple[float, int, str, Any]] = []

    def push(t: float, kind: str, payload: Any) -> None:
        heapq.heappush(heap, (t, next(seq), kind, payload))

    for r in reqs:
        push(r.arrival, "arrive", r)
    push(0.0, "metrics", None)

    ttfts: list[float] = []
    queues: list[float] = []
    slo_ok = 0
    shed = 0
    hit = {"gpu": 0, "cpu": 0, "storage_local": 0, "storage_remote": 0}
    tokens_total = 0
    decide_s = 0.0
    decisions = 0
    last_t = 0.0
    pending_arrivals = len(reqs)

    def event(
        t: float,
        loc: Location,
        stored: Sequence[int],
        removed: list[int],
        delay: float,
        chain: bool = True,
    ) -> None:
        if stored or removed:
            push(t + delay, "index", (loc, stored, removed, chain))

    def start(w: SimWorker, t: float) -> None:
        if w.busy or not w.queue:
            return
        r, ticket, arrived_seq = w.queue.popleft()
        del arrived_seq
        w.busy = True
        blocks = r.blocks
        # The GPU hits up to its first miss; each read tier continues from there
        # with the blocks it (or a read tier before it) holds: the CPU tier holds
        # what the GPU evicted, the prompt's middle, not its first block.
        g = w.gpu.prefix(blocks)
        c = run_from(blocks, g, (w.cpu,))
        s_local = run_from(blocks, c, (w.cpu, stores[w.node]))
        s_remote = run_from(blocks, s_local, (w.cpu, stores[w.node], shared))
        per = {
            "gpu": g,
            "cpu": c - g,
            "storage_local": s_local - c,
            "storage_remote": s_remote - s_local,
        }
        reach = 0
        read_s = 0.0
        for tier, k in per.items():
            tokens = min(k * bt, max(0, r.n - reach))
            reach += tokens
            hit[tier] += tokens
            if tier == "gpu" or tokens == 0:
                continue
            nbytes = tokens * params.bytes_per_token
            if tier == "cpu":
                took = nbytes / params.cpu_bandwidth
            elif tier == "storage_local":
                took = 0.001 + nbytes / params.storage_local_bandwidth
            else:
                took = 0.003 + nbytes / params.storage_remote_bandwidth
            read_s += took
            # The sidecar's read figure (bytes, seconds) reaches the router's calibration.
            router.model.observe_read(Tier(tier), nbytes, took)
        missing = max(1, r.n - reach)
        service = read_s + truth.prefill_s(missing) * (1 + truth.decode_slowdown * w.decoding)
        queues.append(t - r.arrival)
        push(t + service, "prefilled", (w, r, ticket))

    def views(hashes: Sequence[int]) -> list[PeerView]:
        healthy = [i.name for i in infos]
        if policy == "sglang":
            matches = {}
            for name in healthy:
                tree = workers[name].tree
                k = 0
                for h in hashes:
                    if h not in tree:
                        break
                    k += 1
                matches[name] = TierMatch(gpu=k)
        else:
            matches = router.matches(hashes, healthy)
        return [
            PeerView(
                name,
                matches[name],
                router.loads[name],
                len(workers[name].queue),
                len(workers[name].gpu.d) / params.gpu_blocks,
                sum(len(x[0].blocks) for x in workers[name].queue) + workers[name].decoding * 30,
                len(workers[name].tree),
            )
            for name in healthy
        ]

    while heap:
        t, _, kind, payload = heapq.heappop(heap)
        last_t = max(last_t, t)
        if kind == "arrive":
            r = payload
            pending_arrivals -= 1
            tokens_total += r.n
            deadline = params.slo_s(r.n) if policy == "kvoffload-shed" else None
            t0 = time.process_time()
            if peer is None:
                decision = router.decide(r.blocks, r.n, now=t, deadline_s=deadline)
                decide_s += time.process_time() - t0
                decisions += 1
                if decision.worker is None:
                    shed += 1
                    continue
                ticket = router.dispatch(decision, t)
            else:
                vs = views(r.blocks)
                name = peer(vs, len(r.blocks))
                decide_s += time.process_time() - t0
                decisions += 1
                decision = router.decide(r.blocks, r.n, now=t)
                ticket = router.dispatch(decision, t, worker=name)
            w = workers[ticket.worker]
            w.tree.update(r.blocks)
            w.queue.append((r, ticket, 0))
            start(w, t)
        elif kind == "prefilled":
            w, r, ticket = payload
            ttft = t - r.arrival
            ttfts.append(ttft)
            if ttft <= params.slo_s(r.n):
                slo_ok += 1
            router.first_token(ticket, t)
            # A BlockStored carries the request's chain (the engine names every block
            # it caches, with its parent), then the evictions it caused.
            _, evicted = w.gpu.touch(r.blocks)
            event(t, Location("gpu", w.name), r.blocks, evicted, params.event_delay_s)
            if evicted:
                cs, ce = w.cpu.touch(evicted)
                event(t, Location("cpu", w.name), cs, ce, params.event_delay_s, chain=False)
            _, le = stores[w.node].touch(r.blocks)
            event(t, Location("store", w.node), r.blocks, le, params.store_delay_s)
            _, se = shared.touch(r.blocks)
            event(t, Location("store", "shared"), r.blocks, se, params.store_delay_s)
            w.decoding += 1
            step = params.decode_step_s + params.decode_step_per_req_s * w.decoding
            push(t + r.out * step, "decoded", (w, ticket))
            w.busy = False
            start(w, t)
        elif kind == "decoded":
            w, ticket = payload
            w.decoding -= 1
            router.finished(ticket, t)
        elif kind == "index":
            loc, stored, removed, chain = payload
            router.index.apply_stored(loc, stored, chain=chain)
            router.index.apply_removed(loc, removed)
        elif kind == "metrics":
            for w in workers.values():
                router.model.refresh(
                    router.loads[w.name],
                    waiting=len(w.queue),
                    running=w.decoding,
                    kv_usage=len(w.gpu.d) / params.gpu_blocks,
                    now=t,
                )
            if pending_arrivals or any(w.busy or w.queue for w in workers.values()):
                push(t + params.metrics_interval_s, "metrics", None)

    served = len(ttfts)
    first = reqs[0].arrival
    span = max(last_t - first, 1e-9)
    err = router.model.error_summary() if policy.startswith("kvoffload") else None
    return Result(
        workers=n_workers,
        load=load,
        policy=policy,
        requests=len(reqs),
        served=served,
        shed=shed,
        ttft_p50_s=pct(ttfts, 0.5),
        ttft_p90_s=pct(ttfts, 0.9),
        ttft_p99_s=pct(ttfts, 0.99),
        mean_queue_s=statistics.fmean(queues) if queues else math.nan,
        throughput_rps=served / span,
        throughput_tok_s=sum(r.n for r in reqs) / span,
        slo_attainment=slo_ok / len(reqs),
        hit_rate=sum(hit.values()) / tokens_total,
        hit_rate_gpu=hit["gpu"] / tokens_total,
        hit_rate_cpu=hit["cpu"] / tokens_total,
        hit_rate_storage_local=hit["storage_local"] / tokens_total,
        hit_rate_storage_remote=hit["storage_remote"] / tokens_total,
        infinite_cache_hit_rate=inf_hit,
        decisions_per_s=decisions / decide_s if decide_s else math.inf,
        estimate_error_abs_p50=None if err is None else float(err["abs_p50"]),
        estimate_error_abs_p90=None if err is None else float(err["abs_p90"]),
    )


def decision_microbench(
    workers: int = 16, prompt_tokens: int = 32_768, iters: int = 2_000
) -> dict[str, float]:
    """The router's decision code alone at 16-token engine blocks, and hashing a 32k prompt."""
    hasher = BlockHasher(block_size=16)
    rng = random.Random(1)
    tokens = [rng.randrange(32_000) for _ in range(prompt_tokens)]
    t0 = time.process_time()
    hashes = hasher.external_hashes(tokens, cache_salt="tenant-a")
    hash_s = time.process_time() - t0
    infos = tuple(WorkerInfo(f"w{i}", f"node{i // 2}") for i in range(workers))
    nodes = sorted({w.node for w in infos})
    roots: dict[str, tuple[bool, tuple[str, ...]]] = {n: (False, (n,)) for n in nodes}
    roots["shared"] = (True, tuple(nodes))
    router = Router(Topology(infos, roots), block_tokens=16)
    for i, w in enumerate(infos):
        router.set_worker_source(w.name, SourceState.LIVE)
        # Each worker holds a different share of the prompt: 0..100 % of its blocks.
        router.index.apply_stored(Location("gpu", w.name), hashes[: len(hashes) * i // workers])
    for r in roots:
        router.set_store_source(r, SourceState.LIVE)
    router.index.apply_stored(Location("store", "shared"), hashes)
    t0 = time.process_time()
    for i in range(iters):
        router.decide(hashes, prompt_tokens, now=float(i), deadline_s=30.0)
    decide_s = time.process_time() - t0
    return {
        "workers": workers,
        "prompt_tokens": prompt_tokens,
        "blocks": len(hashes),
        "decisions_per_s": iters / decide_s,
        "hash_prompt_ms": hash_s * 1000,
    }


def tokenize_bench(tokenizer_path: str, prompt_tokens: int = 32_768) -> tuple[int, float]:
    """Tokenize a text of about ``prompt_tokens`` tokens: (tokens, CPU milliseconds)."""
    from kvoffload.router.tokenize import Tokenizer

    tok = Tokenizer.load(Path(tokenizer_path))
    sample = " ".join(f"word{i % 977} the quick brown fox" for i in range(1000))
    per_word = len(tok.encode_prompt(sample)) / 1000
    text = " ".join(
        f"word{i % 977} the quick brown fox" for i in range(int(prompt_tokens / per_word))
    )
    t0 = time.process_time()
    n = len(tok.encode_prompt(text))
    return n, (time.process_time() - t0) * 1000


COLUMNS: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("policy", "policy", str),
    ("ttft_p50_s", "p50 s", lambda v: f"{v:.2f}"),
    ("ttft_p90_s", "p90 s", lambda v: f"{v:.2f}"),
    ("ttft_p99_s", "p99 s", lambda v: f"{v:.2f}"),
    ("mean_queue_s", "queue s", lambda v: f"{v:.2f}"),
    ("throughput_rps", "req/s", lambda v: f"{v:.2f}"),
    ("slo_attainment", "SLO", lambda v: f"{v:.1%}"),
    ("hit_rate", "hit", lambda v: f"{v:.1%}"),
    ("hit_rate_gpu", "gpu", lambda v: f"{v:.1%}"),
    ("hit_rate_cpu", "cpu", lambda v: f"{v:.1%}"),
    ("hit_rate_storage_local", "local", lambda v: f"{v:.1%}"),
    ("hit_rate_storage_remote", "remote", lambda v: f"{v:.1%}"),
    ("shed", "shed", str),
    ("decisions_per_s", "dec/s", lambda v: f"{v:,.0f}"),
)


def ttft_floor(reqs: Sequence[Req], params: Params) -> tuple[float, float, float]:
    """TTFT p50/p90/p99 if every reusable block were in the GPU of an idle worker."""
    missing, _ = infinite_cache_missing(reqs)
    truth = params.truth()
    ideal = [truth.prefill_s(m) for m in missing]
    return pct(ideal, 0.5), pct(ideal, 0.9), pct(ideal, 0.99)


def print_table(results: Sequence[Result], floor: tuple[float, float, float]) -> None:
    for (n, load), group in itertools.groupby(results, key=lambda r: (r.workers, r.load)):
        rows = list(group)
        bound = f"infinite-cache bound: {rows[0].infinite_cache_hit_rate:.1%} of input tokens"
        if not math.isnan(floor[0]):
            bound += (
                f"; TTFT floor with it on idle workers: p50 {floor[0]:.2f} s, "
                f"p90 {floor[1]:.2f} s, p99 {floor[2]:.2f} s"
            )
        print(f"\n{n} workers, load {load} ({bound})")
        cells = [[fmt(getattr(r, key)) for key, _, fmt in COLUMNS] for r in rows]
        heads = [h for _, h, _ in COLUMNS]
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
        print("  ".join(h.rjust(wd) for h, wd in zip(heads, widths, strict=True)))
        for c in cells:
            print("  ".join(x.rjust(wd) for x, wd in zip(c, widths, strict=True)))
        for r in rows:
            if r.estimate_error_abs_p50 is not None:
                print(
                    f"  {r.policy}: TTFT estimate |error| p50 {r.estimate_error_abs_p50:.1%}, "
                    f"p90 {r.estimate_error_abs_p90:.1%}"
                )
        best = min((r for r in rows if r.policy != "kvoffload-shed"), key=lambda r: r.ttft_p90_s)
        print(f"  lowest p90 TTFT: {best.policy}")


def vllm_result(
    m: Any, n_workers: int, load: str, policy: str, n_reqs: int, inf_hit: float
) -> Result:
    """One ``--engine vllm`` run as a row (hits: vLLM's own prefix-cache count)."""
    served = len(m.ttfts)
    return Result(
        workers=n_workers,
        load=load,
        policy=policy,
        requests=n_reqs,
        served=served,
        shed=m.shed,
        ttft_p50_s=pct(m.ttfts, 0.5),
        ttft_p90_s=pct(m.ttfts, 0.9),
        ttft_p99_s=pct(m.ttfts, 0.99),
        mean_queue_s=statistics.fmean(m.queues) if m.queues else math.nan,
        throughput_rps=served / m.span_s,
        throughput_tok_s=m.tokens_total / m.span_s,
        slo_attainment=m.slo_ok / n_reqs,
        hit_rate=m.gpu_hit_tokens / max(1, m.tokens_total),
        hit_rate_gpu=m.gpu_hit_tokens / max(1, m.tokens_total),
        hit_rate_cpu=0.0,
        hit_rate_storage_local=0.0,
        hit_rate_storage_remote=0.0,
        infinite_cache_hit_rate=inf_hit,
        decisions_per_s=m.decisions / m.decide_s if m.decide_s else math.inf,
        estimate_error_abs_p50=None if m.error is None else float(m.error["abs_p50"]),
        estimate_error_abs_p90=None if m.error is None else float(m.error["abs_p90"]),
        preemptions=m.preemptions,
    )


def run_vllm(
    args: argparse.Namespace, reqs: list[Req], inf_hit: float
) -> tuple[dict[str, Any], list[Result]]:
    """``--engine vllm``: every (workers, load, policy) on vLLM-scheduler workers."""
    try:
        from benchlib import sim_vllm
        from benchlib.vllm_engine import scaled as scaled_vllm
    except ImportError as exc:
        raise SystemExit(f"sim_router: --engine vllm needs vLLM 0.33 importable ({exc})") from None
    vp = sim_vllm.VllmParams(
        noise=args.noise,
        budget=args.budget or 8192,
        work_weight=1.0 if args.work_weight is None else args.work_weight,
    )
    missing, _ = infinite_cache_missing(reqs)
    policies = [p for p in (args.policy or POLICIES)]
    results: list[Result] = []
    for n in args.workers or ([2] if args.quick else [4, 8]):
        for load in args.load or (["saturation"] if args.quick else list(LOADS)):
            trace = scaled_vllm(reqs, missing, vp.step, vp.budget, n, LOADS[load])
            for policy in policies:
                m = sim_vllm.simulate_vllm(trace, vp, n, policy, args.seed)
                results.append(vllm_result(m, n, load, policy, len(reqs), inf_hit))
                row = results[-1]
                print(
                    f"  {n} workers, {load}, {policy}: p90 {row.ttft_p90_s:.2f} s",
                    file=sys.stderr,
                    flush=True,
                )
    params = {**asdict(vp), "engine": "vllm", "router_priors": asdict(sim_vllm.router_priors(vp))}
    return params, results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, required=True)
    ap.add_argument("--workers", type=int, action="append", help="default: 4 and 8")
    ap.add_argument("--load", choices=sorted(LOADS), action="append", help="default: all three")
    ap.add_argument("--policy", choices=POLICIES, action="append", help="default: all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, help="only the first N requests of the trace")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--tokenizer", help="a local tokenizer directory: time tokenizing 32k tokens")
    ap.add_argument("--no-microbench", action="store_true")
    ap.add_argument("--work-weight", type=float, help="the router's work_weight (default 1.0)")
    ap.add_argument(
        "--engine",
        choices=("simple", "vllm"),
        default="simple",
        help="simple: the formula workers; vllm: vLLM 0.33's real scheduler (needs vLLM)",
    )
    ap.add_argument(
        "--noise", type=float, default=0.0, help="σ of each prefill's time (--engine vllm)"
    )
    ap.add_argument(
        "--budget", type=int, help="max_num_batched_tokens (--engine vllm; default 8192)"
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a bounded run for tests: 300 requests, 2 workers, saturation",
    )
    args = ap.parse_args(argv)
    if not args.trace.is_file():
        print(f"sim_router: no trace file {args.trace}", file=sys.stderr)
        return 2
    if args.noise < 0 or (args.budget is not None and args.budget < 16):
        print("sim_router: --noise must be >= 0 and --budget >= 16", file=sys.stderr)
        return 2
    limit = args.limit if args.limit is not None else (300 if args.quick else None)
    reqs = load_trace(args.trace, limit)
    _, inf_hit = infinite_cache_missing(reqs)
    results: list[Result] = []
    if args.engine == "vllm":
        pdict, results = run_vllm(args, reqs, inf_hit)
        floor = (math.nan, math.nan, math.nan)
    else:
        params = Params() if args.work_weight is None else Params(work_weight=args.work_weight)
        for n in args.workers or ([2] if args.quick else [4, 8]):
            for load in args.load or (["saturation"] if args.quick else list(LOADS)):
                trace = scaled(reqs, params, n, LOADS[load])
                for policy in args.policy or POLICIES:
                    results.append(simulate(trace, params, n, policy, load, inf_hit, args.seed))
        pdict = {**asdict(params), "engine": "simple"}
        floor = ttft_floor(reqs, params)
    print(f"trace {args.trace.name}: {len(reqs)} requests; params: {json.dumps(pdict)}")
    print_table(results, floor)
    micro: dict[str, float] = {}
    if not args.no_microbench:
        micro = decision_microbench()
        print(
            f"\nrouter decision code: {micro['decisions_per_s']:,.0f} decisions/s for "
            f"{micro['workers']:.0f} workers and {micro['prompt_tokens']:.0f}-token prompts "
            f"({micro['blocks']:.0f} blocks of 16); "
            f"hashing that prompt: {micro['hash_prompt_ms']:.1f} ms"
        )
        if args.tokenizer:
            n_tok, ms = tokenize_bench(args.tokenizer)
            micro["tokenize_prompt_ms"] = ms
            micro["tokenize_prompt_tokens"] = n_tok
            print(f"tokenizing a {n_tok}-token prompt ({args.tokenizer}): {ms:.1f} ms")
    if args.json:
        out = {
            "params": {**pdict, "loads": LOADS, "seed": args.seed, "trace": str(args.trace)},
            "ttft_floor_s": {"p50": floor[0], "p90": floor[1], "p99": floor[2]},
            "results": [asdict(r) for r in results],
            "microbench": micro,
        }
        args.json.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
