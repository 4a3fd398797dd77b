"""Workers for ``scripts/sim_router.py --engine vllm``: vLLM 0.33's real v1 scheduler.

A library of the benchmarks (``benchlib``), not a script of its own.

Each simulated worker owns a real ``vllm.v1.core.sched.scheduler.Scheduler``
with its real KV-cache manager (prefix caching, chunked prefill under a token
budget, several prefills and decodes per step, preemption when the blocks run
out), driven step by step as an engine core drives it with a model runner. The
model runner is a STAND-IN (a test double: no GPU here): it computes nothing,
samples one token where vLLM scheduled a prompt's last chunk, and each step
takes the time of a step-time model of the batch vLLM scheduled::

    step = step_s                                             (launch, sampling, weights)
         + Σ_prefill chunks f_r · (token_s · n + attn_s · n · (2·c + n))
         + Σ_decodes (token_s + decode_ctx_s · context)

for a chunk of ``n`` tokens after ``c`` computed ones, ``f_r`` the request's
prefill noise (lognormal, σ = ``--noise``, mean 1). The router is told none
of these numbers: it starts from its default priors and learns from the first
tokens, ``/metrics`` and the KV events it sees. The events are vLLM's own
(``BlockStored``/``BlockRemoved`` from the block pool, published by the
scheduler through its ``kv_event_publisher``), encoded with msgspec as vLLM's
ZMQ publisher does and decoded by kvoffload's own wire decoder before they
reach the router's index (:func:`kvoffload.router.feed.apply_batch`), after
``event_delay_s``.

Prompts: each 512-token block of a trace's ``hash_ids`` becomes 512 token ids
derived from the id (the same id at the same position gives the same vLLM
block hash, as the trace means). The router hashes them with its own
:class:`~kvoffload.router.hashing.BlockHasher`, as it would a tokenized prompt.

Importing this module imports vLLM (run under the vLLM venv). The engine
(:class:`~benchlib.vllm_engine.VllmWorker`, its step model, the prompts' token
ids) is :mod:`benchlib.vllm_engine`, shared with ``scripts/bench_router_live.py``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from benchlib.vllm_engine import StepModel, VllmWorker, lognormal, tokens_of


@dataclass(frozen=True)
class VllmParams:
    """The vLLM-scheduler cluster (``params`` of ``--json`` with ``--engine vllm``)."""

    block_tokens: int = 512
    gpu_blocks: int = 600  # ≈ 300k tokens of KV per worker
    budget: int = 8192  # max_num_batched_tokens: vLLM 0.33's default on H100/H200
    max_num_seqs: int = 1024  # vLLM 0.33's default on H100/H200
    noise: float = 0.0  # σ of each request's prefill time (lognormal, mean 1)
    event_delay_s: float = 0.05
    metrics_interval_s: float = 1.0
    work_weight: float = 1.0
    risk: float = 2.0  # the router's weight of an estimate's spread (kvoffload.router.core)
    slo_base_s: float = 2.0
    slo_factor: float = 1.5
    step: StepModel = field(default_factory=StepModel)


@dataclass
class Measured:
    ttfts: list[float]
    queues: list[float]
    slo_ok: int
    shed: int
    gpu_hit_tokens: int
    tokens_total: int
    decide_s: float
    decisions: int
    span_s: float
    preemptions: int
    error: dict[str, float] | None


def router_priors(vp: VllmParams) -> Any:
    """What an operator writes in ``[priors]``: vLLM's defaults, none of the step model."""
    from kvoffload.router.model import Priors

    return Priors(
        prefill_budget_tokens=vp.budget,
        kv_capacity_tokens=vp.gpu_blocks * vp.block_tokens,
    )


def simulate_vllm(
    reqs: Sequence[Any],
    vp: VllmParams,
    n_workers: int,
    policy: str,
    seed: int,
    log: list[dict[str, Any]] | None = None,
) -> Measured:
    """One policy over the trace on ``n_workers`` vLLM-scheduler workers.

    ``log``: when given, one row per request (its worker, arrival, size, the
    router's estimate for the worker it went to, TTFT, queue wait) is appended,
    in arrival order, for looking into where a policy loses.
    """
    import heapq
    import itertools
    import time

    from kvoffload.router.core import Router, Topology, WorkerInfo
    from kvoffload.router.feed import Source, apply_batch
    from kvoffload.router.hashing import BlockHasher
    from kvoffload.router.index import SourceState
    from kvoffload.router.peers import PeerView, make_peer

    bt = vp.block_tokens
    infos = tuple(WorkerInfo(f"w{i}", f"node{i}") for i in range(n_workers))
    ours = policy.startswith("kvoffload")
    pri = router_priors(vp)
    router = Router(
        Topology(infos),
        priors=pri,
        block_tokens=bt,
        on_deadline_miss="shed" if policy == "kvoffload-shed" else "fastest",
        work_weight=vp.work_weight,
        risk=vp.risk,
    )
    for info in infos:
        router.set_worker_source(info.name, SourceState.LIVE)
    workers = {
        i.name: VllmWorker(
            i.name,
            block_tokens=bt,
            num_blocks=vp.gpu_blocks,
            budget=vp.budget,
            max_num_seqs=vp.max_num_seqs,
            step=vp.step,
        )
        for i in infos
    }
    peer = None if ours else make_peer(policy, seed=seed, priors=pri, block_tokens=bt)
    hasher = BlockHasher(block_size=bt)
    rng = random.Random(seed + 17)
    seq = itertools.count()
    heap: list[tuple[float, int, str, Any]] = []

    def push(t: float, kind: str, payload: Any) -> None:
        heapq.heappush(heap, (t, next(seq), kind, payload))

    for i, r in enumerate(reqs):
        push(r.arrival, "arrive", (i, r))
    push(0.0, "metrics", None)
    stepping: dict[str, bool] = dict.fromkeys(workers, False)
    tickets: dict[str, tuple[Any, Any, float]] = {}
    routed: dict[str, list[float]] = {n: [] for n in workers}
    tree: dict[str, set[int]] = {n: set() for n in workers}
    m = Measured([], [], 0, 0, 0, 0, 0.0, 0, 0.0, 0, None)
    rows: dict[str, dict[str, Any]] = {}
    last_t = 0.0
    left = len(reqs)

    def kick(name: str, t: float) -> None:
        if stepping[name]:
            return
        res = workers[name].step(t)
        if res is None:
            return
        stepping[name] = True
        push(t + res.duration_s, "stepped", (name, res))

    def views(hashes: Sequence[int], t: float) -> list[PeerView]:
        names = [i.name for i in infos]
        if policy == "sglang":
            matches = {}
            for n in names:
                k = 0
                for h in hashes:
                    if h not in tree[n]:
                        break
                    k += 1
                matches[n] = type(router.matches(hashes, [n])[n])(gpu=k)
        else:
            matches = router.matches(hashes, names)
        out = []
        for n in names:
            w = workers[n]
            recent = routed[n]
            while recent and recent[0] < t - 10.0:
                recent.pop(0)
            out.append(
                PeerView(
                    n,
                    matches[n],
                    router.loads[n],
                    w.waiting(),
                    w.kv_usage(),
                    w.active_blocks(),
                    len(tree[n]),
                    len(recent),
                )
            )
        return out

    while heap:
        t, _, kind, payload = heapq.heappop(heap)
        last_t = max(last_t, t)
        if kind == "arrive":
            i, r = payload
            left -= 1
            tokens = tokens_of(r.blocks, r.n, bt)
            hashes = hasher.external_hashes(tokens)
            m.tokens_total += r.n
            slo = vp.slo_base_s + vp.slo_factor * vp.step.prefill_s(r.n, 0, vp.budget)
            t0 = time.process_time()
            if peer is None:
                d = router.decide(
                    hashes, r.n, now=t, deadline_s=slo if policy == "kvoffload-shed" else None
                )
                m.decide_s += time.process_time() - t0
                if d.worker is None:
                    m.shed += 1
                    continue
                ticket = router.dispatch(d, t)
            else:
                name = peer(views(hashes, t), len(hashes))
                m.decide_s += time.process_time() - t0
                d = router.decide(hashes, r.n, now=t)
                ticket = router.dispatch(d, t, worker=name)
            m.decisions += 1
            rid = f"r{i}"
            if log is not None:
                est = ticket.estimate
                rows[rid] = {
                    "i": i,
                    "worker": ticket.worker,
                    "arrival": t,
                    "n": r.n,
                    "gpu_hit": est.cached[0],
                    "est_ttft": est.ttft_s,
                    "est_queue": est.queue_s,
                    "est_prefill": est.prefill_s,
                    "waiting": [workers[v.name].waiting() for v in infos],
                    "speed": [router.loads[v.name].speed for v in infos],
                    "sigma": router.loads[ticket.worker].fit.sigma,
                    # Every candidate's estimate: (worker, TTFT, queue, spread).
                    "cands": [
                        (c.worker, c.estimate.ttft_s, c.estimate.queue_s, c.estimate.spread_s)
                        for c in d.candidates
                    ],
                }
                log.append(rows[rid])
            tickets[rid] = (ticket, r, slo)
            routed[ticket.worker].append(t)
            tree[ticket.worker].update(hashes)
            workers[ticket.worker].add(rid, tokens, r.out, lognormal(rng, vp.noise))
            kick(ticket.worker, t)
        elif kind == "stepped":
            name, res = payload
            stepping[name] = False
            for batch in res.events:
                push(t + vp.event_delay_s, "events", (name, batch))
            for rid in res.first:
                ticket, r, slo = tickets[rid]
                ttft = t - r.arrival
                m.ttfts.append(ttft)
                m.queues.append(workers[name].started_at.pop(rid, t) - r.arrival)
                if log is not None:
                    rows[rid]["ttft"] = ttft
                    rows[rid]["queue"] = m.queues[-1]
                m.slo_ok += ttft <= slo
                router.first_token(ticket, t)
            for rid in res.done:
                ticket, r, _ = tickets.pop(rid)
                router.finished(ticket, t)
            kick(name, t)
        elif kind == "events":
            name, batch = payload
            apply_batch(router, Source("worker", name), batch)
        elif kind == "metrics":
            for name, w in workers.items():
                router.model.refresh(
                    router.loads[name],
                    waiting=w.waiting(),
                    running=w.running(),
                    kv_usage=w.kv_usage(),
                    now=t,
                )
            if left or any(w.busy for w in workers.values()):
                push(t + vp.metrics_interval_s, "metrics", None)
    m.span_s = max(last_t - reqs[0].arrival, 1e-9)
    m.preemptions = sum(w.preemptions for w in workers.values())
    m.gpu_hit_tokens = sum(_cached_tokens(w) for w in workers.values())
    m.error = router.model.error_summary() if ours else None
    for w in workers.values():
        w.scheduler.shutdown()
    return m


def _cached_tokens(w: VllmWorker) -> int:
    return w.hit_tokens
