"""The time-to-first-token model: what each worker would take to answer a prompt.

A worker is modelled as vLLM's v1 scheduler runs it: every engine step carries
one token of each decoding request and fills the rest of its token budget
(``max_num_batched_tokens``, ``B``) with prefill chunks, first come first
served, several prompts per step when they fit. A prompt's first token comes
at the end of the step that computes its last prefill token, so for a worker
``w`` with ``Q`` prefill tokens queued ahead (the router's own requests not yet
answered, less what the worker has worked off since, plus what ``/metrics``
says waits there that the router did not send), ``D`` decoding requests, and
a prompt of ``n`` tokens of which ``k_t`` are reachable in tier ``t``
(:class:`~kvoffload.router.index.TierMatch`, disjoint), ``m = n − Σ k_t``::

    steps    = ⌈(Q + m) / (B − D)⌉                     steps until its last chunk runs
    compute  = θ_step · steps                          per-step overhead (launch, sampling)
             + θ_tok  · (Q + m)                        linear compute of every queued token
             + θ_attn · (A_Q + m · (2·(n − m) + m))    attention over each chunk's context
             + θ_dec  · steps · D                      the decode tokens sharing those steps
    TTFT(w)  = s_w · compute                           the worker's own speed factor
             + max(0, wait_kv − queue_s)               free KV: vLLM admits a prompt only
                                                       when all of it fits (``kv_wait``)
             + Σ_t read_t(k_t)                         read_t(k) = latency_t + k·bpt/bandwidth_t

``queue_s`` is the same sum for the queue alone (``m = 0``); ``prefill_s`` is
the rest. The coefficients ``θ`` are one fit for the deployment's workers (one
model on one GPU kind) and learned online, never given (:mod:`.fit`); each
worker has its own speed factor ``s_w``, shrunk toward the fleet's until its
own answers say otherwise (:meth:`TTFTModel._speeds`). Each first token the
router sees is an observation ``(features at dispatch, measured TTFT − reads −
modelled KV wait)``, fed to a recursive least-squares fit in relative terms
(each observation scaled by its prediction, so a 10 s answer weighs as much as
a 0.1 s one), with Huber weights (a residual beyond two running mean absolute
residuals counts proportionally less: noisy prefill times, a preempted request,
cannot drag the fit), each weighted by its own prefill's share of its estimate
to the 4th power (a TTFT that is mostly a queue the router only models teaches
little), and slow forgetting (a worker that changes is followed). The priors
(the config's ``[priors]``) are the fit's starting point and its
regularisation; every coefficient stays within [1/16, 16]× its prior. Read
bandwidths are learned from the sidecars' read figures
(:meth:`TTFTModel.observe_read`), clamped to [¼, 4]×.

The queue: each request the router sends books its prefill tokens on the
worker; between answers the queue drains at the modelled rate (``B − D`` tokens
a step, at the modelled step time), and each first token re-anchors it: what
the answered request did not account for carries over (a worker slower than
modelled keeps its queue). The oldest request's time left is its mean residual
life under the learned noise (:func:`.fit.residual_life`), and its last chunks
carry most of its attention (:func:`.fit.attention_left`). Each estimate has a
spread (:attr:`Estimate.spread_s`) the choice weighs. ``B`` and the worker's KV
capacity are deployment settings (vLLM's ``max_num_batched_tokens`` and the KV
blocks it logs), not coefficients. The estimate-vs-observed error of every
request is kept (:attr:`TTFTModel.errors`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from .estimate import Estimate
from .fit import NF, SIGMA0, Fit, attention_left, residual_life
from .index import Tier, TierMatch

__all__ = ["Estimate", "Priors", "TTFTModel", "WorkerLoad"]

_READ_TIERS = (Tier.CPU, Tier.STORAGE_LOCAL, Tier.STORAGE_REMOTE)
_SPEED_RATE = 0.05  # weight of one answer in a worker's own speed factor
_SPEED_TAU_MIN = 0.02  # least log-spread of speeds between one deployment's workers
_GATE = 4.0  # an answer teaches the fit by (its own prefill's share of its estimate)^_GATE


@dataclass(frozen=True)
class Priors:
    """Starting values of the model, per deployment (the config's ``[model]``)."""

    prefill_a_s: float = 0.015  # seconds per engine step (overhead)
    prefill_b_s: float = 1.0 / 12_000  # seconds per prefilled token
    prefill_c_s: float = 0.0  # seconds per token² (attention on long prompts)
    decode_slowdown: float = 0.0005  # a full step's share per decoding request
    bytes_per_token: int = 131_072  # KV bytes per token (all layers of a shard)
    cpu_bandwidth: float = 20e9
    storage_local_bandwidth: float = 5e9
    storage_remote_bandwidth: float = 2e9
    cpu_latency_s: float = 0.0005
    storage_local_latency_s: float = 0.002
    storage_remote_latency_s: float = 0.005
    ewma: float = 0.2  # weight of a new observation (bandwidths, mean service)
    prefill_budget_tokens: int = 8192  # vLLM's max_num_batched_tokens (H100/H200 default)
    kv_capacity_tokens: int = 0  # the worker's KV cache in tokens; 0: unknown (no term)
    decode_s: float = 10.0  # a request's decode (first token to end): the start of its fit

    def bandwidth(self, tier: Tier) -> float:
        return {
            Tier.CPU: self.cpu_bandwidth,
            Tier.STORAGE_LOCAL: self.storage_local_bandwidth,
            Tier.STORAGE_REMOTE: self.storage_remote_bandwidth,
        }[tier]

    def latency(self, tier: Tier) -> float:
        return {
            Tier.CPU: self.cpu_latency_s,
            Tier.STORAGE_LOCAL: self.storage_local_latency_s,
            Tier.STORAGE_REMOTE: self.storage_remote_latency_s,
        }[tier]

    def prefill_s(self, m: int) -> float:
        """An idle worker's prefill of ``m`` uncached tokens, chunked by the budget."""
        if m <= 0:
            return 0.0
        steps = math.ceil(m / max(1, self.prefill_budget_tokens))
        return self.prefill_a_s * steps + self.prefill_b_s * m + self.prefill_c_s * m * m

    def basis(self) -> tuple[float, ...]:
        """The unit of each feature's coefficient (θ = 1 stands for it)."""
        b = max(self.prefill_b_s, 1e-9)
        step_full = self.prefill_a_s + b * self.prefill_budget_tokens
        # A term with no prior gets a unit of its kind: a step overhead of 256
        # tokens, attention matching the linear term at 100k tokens of context,
        # a decode costing 1 % of a full step.
        return (
            self.prefill_a_s or b * 256,
            b,
            self.prefill_c_s or b / 100_000,
            (self.decode_slowdown or 0.01) * step_full,
        )

    def start(self) -> tuple[float, ...]:
        """The fit's starting θ: the priors over :meth:`basis` (0 where no prior)."""
        return (
            1.0 if self.prefill_a_s else 0.0,
            1.0,
            1.0 if self.prefill_c_s else 0.0,
            1.0 if self.decode_slowdown else 0.0,
        )


@dataclass
class WorkerLoad:
    """What the router knows of one worker's load.

    ``pending`` holds, per request sent and not yet answered (in the order
    sent), its prefill tokens and attention work; ``drained`` is how many of
    the queued tokens the worker is modelled to have computed by ``anchor``.
    """

    pending: dict[int, tuple[int, float]] = field(default_factory=dict)
    pending_tokens: int = 0  # prefill tokens sent, first token not yet back
    pending_attn: float = 0.0
    drained: float = 0.0
    anchor: float = 0.0
    # The oldest unanswered request: since when it has been the head, and its
    # prefill tokens left then (what the residual life of :meth:`_done` runs from).
    head_since: float = 0.0
    head_tokens: float = 0.0
    # Its progress as its KV events show it (the blocks it has stored): tokens done
    # (-1: none seen), when, and what that says of its speed: its time over the
    # modelled (``seen_slow``), believed by ``seen_weight`` (0: not at all, 1: fully).
    seen_tokens: float = -1.0
    seen_at: float = 0.0
    seen_slow: float = 1.0
    seen_weight: float = 0.0
    decoding: int = 0  # requests past their first token, not finished
    waiting_external: int = 0  # /metrics waiting beyond what the router sent
    external_tokens: float = 0.0
    running_reported: int = 0
    kv_usage: float = 0.0
    # KV held: per request sent and not finished, the prompt tokens its blocks hold
    # (vLLM admits a waiting prompt only when its whole prompt fits in the free blocks,
    # and a running request holds its blocks until it finishes).
    held: dict[int, int] = field(default_factory=dict)
    held_tokens: int = 0
    since: dict[int, float] = field(default_factory=dict)  # decoding: first-token time
    decode_s: float = 10.0  # learned: a request's first token to its end
    fit: Fit = field(default_factory=Fit)  # shared by the deployment's workers
    speed: float = 1.0  # learned: this worker's time over the shared fit's, shrunk
    speed_raw: float = 1.0  # its own answers' mean (what the shared fit learns against)
    speed_n: float = 0.0  # the answers behind ``speed_raw`` (weighted, forgetting as it does)
    speed_var: float = 0.0  # the variance of log ``speed`` (how sure the router is of it)
    basis: tuple[float, ...] = (0.0,) * NF
    budget: int = 8192

    @property
    def inflight(self) -> int:
        return len(self.pending)

    @property
    def coefficients(self) -> dict[str, float]:
        """The learned coefficients in seconds (per step, token, attention unit, …)."""
        names = ("step_s", "token_s", "attention_s", "decode_step_s")
        th, sp = self.fit.theta, self.speed
        return {n: t * b * sp for n, t, b in zip(names, th, self.basis, strict=True)}

    @property
    def prefill_scale(self) -> float:
        """The learned per-token prefill cost as a multiple of the prior."""
        return self.fit.theta[1] * self.speed

    def predict(self, z: tuple[float, ...]) -> float:
        return self.speed * self.fit.predict(z)

    def _rate(self) -> float:
        """Prefill tokens a second of the queued mix, modelled (attention included)."""
        q = float(self.pending_tokens)
        if q <= 0:
            return 1.0
        return q / max(self._cost(q, self.pending_attn), 1e-6)

    def _head_left(self, now: float) -> float:
        """The oldest request's prefill tokens expected still to run at ``now``.

        Its time is its estimate × a noise the fit's residuals measure: the
        longer it has run, the more likely it is a slow one, and what is left is
        its mean residual life (:func:`residual_life`), not the linear drain's.
        """
        h0 = self.head_tokens
        if h0 <= 0:
            return 0.0
        m, attn = next(iter(self.pending.values()))
        if self.seen_tokens >= 0:
            # What its events showed done, then the rest at the speed they showed.
            left = max(1.0, m - self.seen_tokens)
            t0 = self._cost(left, attention_left(m, attn, left)) * self.seen_slow
            if t0 <= 0:
                return 0.0
            sig = self.fit.sigma * math.sqrt(max(0.0, 1.0 - self.seen_weight))
            return left * min(1.0, residual_life((now - self.seen_at) / t0, sig))
        t0 = self._cost(h0, attention_left(m, attn, h0))
        if t0 <= 0:
            return 0.0
        return h0 * min(1.0, residual_life((now - self.head_since) / t0, self.fit.sigma))

    def _done(self, now: float, head_left: float | None = None) -> float:
        """Queued tokens computed by ``now``: at the modelled rate, and never past what the
        oldest request is expected still to run (:meth:`_head_left`, or given; at least half
        its last step: until it answers it is still running), the ones behind it waiting."""
        head = next(iter(self.pending.values()))[0]
        done = self.drained + max(0.0, now - self.anchor) * self._rate()
        last = min(head, max(1, self.budget - self.decoding))
        left = self._head_left(now) if head_left is None else head_left
        if self.seen_tokens >= 0:
            return head - max(0.5 * last, left)  # its events say where it is
        return min(done, head - max(0.5 * last, left))

    def head_extra_s(self, now: float, left: float) -> float:
        """The time the oldest request's ``left`` tokens take beyond the modelled
        (negative: less), at the speed its events showed (:meth:`TTFTModel.seen`)."""
        if self.seen_tokens < 0 or left <= 0 or not self.pending:
            return 0.0
        m, attn = next(iter(self.pending.values()))
        left = min(left, float(m))
        return (self.seen_slow - 1.0) * self._cost(left, attention_left(m, attn, left))

    def new_head(self, now: float) -> None:
        """The oldest unanswered request changed: its residual life starts now."""
        self.seen_tokens, self.seen_slow, self.seen_weight = -1.0, 1.0, 0.0
        if self.pending:
            m = next(iter(self.pending.values()))[0]
            self.head_since = now
            self.head_tokens = max(0.0, m - self.drained)
        else:
            self.head_tokens = 0.0

    def queued(self, now: float) -> tuple[float, float]:
        """(prefill tokens, attention work) still ahead of a request sent ``now``.

        What has drained is the oldest request's first tokens (the ones behind it
        wait), so the attention left is its last chunks', each over a longer
        context than its first ones (:func:`attention_left`), and all of the rest's.
        """
        if not self.pending:
            return self.external_tokens, 0.0
        return self._queued(now, self._head_left(now))

    def _queued(self, now: float, head_left: float) -> tuple[float, float]:
        """:meth:`queued`, the queue not empty and the head's :meth:`_head_left` given."""
        ext = self.external_tokens
        # Each unanswered request has at least its last token left.
        left = max(float(len(self.pending)), self.pending_tokens - self._done(now, head_left))
        m, attn = next(iter(self.pending.values()))
        head_left = max(0.0, left - (self.pending_tokens - m))
        rest_attn = max(0.0, self.pending_attn - attn)
        return left + ext, rest_attn + attention_left(m, attn, head_left)

    def spread_sq(self, now: float) -> float:
        """Σ over the queue of each request's modelled time² (the oldest: its expected
        time left), in units of the learned σ²: the variance of the queue's time
        when each prefill's noise is its own (independent)."""
        if not self.pending:
            return 0.0
        return self._spread_sq(self._head_left(now))

    def _spread_sq(self, left: float) -> float:
        """:meth:`spread_sq`, the queue not empty and the head's :meth:`_head_left` given."""
        items = iter(self.pending.values())
        m0, attn0 = next(items)
        cost = self._cost
        total = cost(left, attention_left(m0, attn0, left)) ** 2 if left > 0 else 0.0
        total *= (1.0 - self.seen_weight) * self.seen_slow**2
        for m, attn in items:
            total += cost(float(m), attn) ** 2
        if self.waiting_external:
            each = self.external_tokens / self.waiting_external
            total += self.waiting_external * cost(each, 0.0) ** 2
        return total

    def ahead(self, now: float) -> tuple[float, float, float, float]:
        """:meth:`queued`, :meth:`spread_sq` and :meth:`head_extra_s` at ``now``, the
        head's residual life once."""
        if not self.pending:
            return self.external_tokens, 0.0, 0.0, 0.0
        left = self._head_left(now)
        q, qa = self._queued(now, left)
        return q, qa, self._spread_sq(left), self.head_extra_s(now, left)

    def _cost(self, tokens: float, attn: float) -> float:
        """``predict(features(tokens, attn))``, no tuple: the same arithmetic, the same float."""
        dec = self.decoding
        per = max(1, self.budget - dec)
        steps = float(math.ceil(tokens / per)) if tokens > 0 else 0.0
        if self.pending or dec:
            steps += 0.5
        b = self.basis
        t = self.fit.theta
        # ``Fit.predict``'s sum, term by term from 0 (features' products grouped as there).
        z = 0.0 + t[0] * (steps * b[0]) + t[1] * (tokens * b[1])
        return self.speed * (z + t[2] * (attn * b[2]) + t[3] * (steps * dec * b[3]))

    def features(self, tokens: float, attn: float) -> tuple[float, ...]:
        per = max(1, self.budget - self.decoding)
        steps = float(math.ceil(tokens / per)) if tokens > 0 else 0.0
        if self.pending or self.decoding:
            steps += 0.5  # a step is under way: on average half of it is left
        b = self.basis
        return (steps * b[0], tokens * b[1], attn * b[2], steps * self.decoding * b[3])

    def queue_s(self, now: float) -> float:
        q, a = self.queued(now)
        if q <= 0:
            return 0.0
        return self._cost(q, a)

    def kv_wait(self, need: int, capacity: int, now: float, queue_s: float) -> float:
        """Seconds until a prompt of ``need`` tokens can be admitted (0: it fits now).

        vLLM admits the head of its waiting queue only when the whole prompt fits
        in the free blocks; what frees them is requests finishing. The blocks held
        are the larger of what the router booked (every request sent and not
        finished: the ones still waiting are admitted first) and what ``/metrics``
        reported; decoding requests free theirs when their decode is expected to
        end (the learned mean, at least a quarter of it left); what the ones not
        yet answered hold turns over about once a decode after the queue.
        """
        if capacity <= 0:
            return 0.0
        need = min(need, capacity)
        free = capacity - max(self.held_tokens, int(self.kv_usage * capacity))
        if free >= need:
            return 0.0
        dec = self.decode_s
        frees = sorted(
            (max(dec - (now - self.since[t]), 0.25 * dec), n)
            for t, n in self.held.items()
            if t in self.since
        )
        at = 0.0
        for at, n in frees:
            free += n
            if free >= need:
                return at
        # The rest is held by requests not answered yet: from then on the KV turns
        # over about once a decode (each admitted request frees its blocks a decode
        # after its first token).
        return max(queue_s, at) + (need - free) * dec / capacity


@dataclass
class TTFTModel:
    priors: Priors = field(default_factory=Priors)
    block_tokens: int = 16
    errors: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    _bandwidth_scale: dict[Tier, float] = field(default_factory=dict)
    mean_service_s: float = 0.1
    mean_tokens: float = 2048.0
    _costs: tuple[tuple[float, float], ...] | None = None
    # One fit for the deployment's workers (one model, one GPU kind: one [priors]):
    # each answer teaches it, and each worker's own speed is one learned factor.
    _fit: Fit | None = None
    _loads: list[WorkerLoad] = field(default_factory=list)

    def new_load(self) -> WorkerLoad:
        load = WorkerLoad()
        self._ready(load)
        return load

    def _ready(self, load: WorkerLoad) -> None:
        if not load.basis[0]:
            pri = self.priors
            load.basis = pri.basis()
            load.budget = pri.prefill_budget_tokens
            load.decode_s = pri.decode_s
            if self._fit is None:
                self._fit = Fit(pri.start())
            load.fit = self._fit
            self._loads.append(load)

    def _speeds(self) -> None:
        """Each worker's speed factor: its own evidence shrunk toward the fleet's.

        Empirical Bayes.

        A worker's own log speed ``m`` (the running mean of its answers over the
        shared fit's) has a sampling variance ``v = σ² / n`` (σ the fit's learned
        spread, ``n`` its weighted answers). How much the workers really differ,
        ``τ²``, is how far their ``m`` spread about their precision-weighted mean
        ``μ`` beyond their sampling variance (at least ``_SPEED_TAU_MIN²``). The
        factor is ``exp(μ + (m − μ) · τ² / (τ² + v))``: a worker with a few lucky
        answers stays with the fleet, one that is slower answer after answer gets
        its own speed. A worker never answered stays at 1 (the fit's own). Each
        keeps the variance of its log speed (``τ² v / (τ² + v)``; never answered:
        ``τ²``) for the estimate's spread: an unproven worker is a less certain one.
        """
        sig2 = self._fit.sigma**2 if self._fit is not None else SIGMA0**2
        stats = [
            (math.log(ld.speed_raw), sig2 / ld.speed_n) for ld in self._loads if ld.speed_n > 0
        ]
        if not stats:
            return
        mu = sum(m / v for m, v in stats) / sum(1 / v for _, v in stats)
        spread = sum((m - mu) ** 2 - v for m, v in stats) / len(stats)
        tau2 = max(_SPEED_TAU_MIN**2, spread)
        for ld in self._loads:
            if ld.speed_n > 0:
                m, v = math.log(ld.speed_raw), sig2 / ld.speed_n
                ld.speed = math.exp(mu + (m - mu) * tau2 / (tau2 + v))
                ld.speed_var = tau2 * v / (tau2 + v)
            else:
                ld.speed_var = tau2

    def bandwidth(self, tier: Tier) -> float:
        return self.priors.bandwidth(tier) * self._bandwidth_scale.get(tier, 1.0)

    def _read_costs(self) -> tuple[tuple[float, float], ...]:
        """Per read tier (CPU, local, remote): (latency, seconds per token)."""
        costs = self._costs
        if costs is None:
            bpt = self.priors.bytes_per_token
            costs = self._costs = tuple(
                (self.priors.latency(t), bpt / self.bandwidth(t)) for t in _READ_TIERS
            )
        return costs

    def estimate(self, n_tokens: int, match: TierMatch, load: WorkerLoad, now: float) -> Estimate:
        self._ready(load)
        bt = self.block_tokens
        (lc, pc), (ll, pl), (lr, pr) = self._read_costs()
        gpu, cpu, local, remote = match
        g = min(gpu * bt, n_tokens)
        c = min(cpu * bt, n_tokens - g)
        sl = min(local * bt, n_tokens - g - c)
        sr = min(remote * bt, n_tokens - g - c - sl)
        # The engine always computes the prompt's last token, even on a full hit.
        missing = max(1, n_tokens - g - c - sl - sr)
        cached = n_tokens - missing
        attn = float(missing) * (2.0 * cached + missing)
        q, qa, queue_sq, slow = load.ahead(now)
        queue_s = load._cost(q, qa) if q > 0 else 0.0
        feats = load.features(q + missing, qa + attn)
        total = load.predict(feats)
        wait = load.kv_wait(n_tokens, self.priors.kv_capacity_tokens, now, queue_s)
        # Beyond the features: the wait for KV, and the head's speed its events showed
        # (the fit learns from the answer less both: ``wait_s``).
        extra = max(0.0, wait - queue_s) + max(slow, -queue_s)
        own = max(0.0, total - queue_s)
        share = own / (own + queue_s + extra) if own > 0 else 0.0
        spread = math.sqrt(
            load.fit.sigma**2 * (queue_sq + own * own) + load.speed_var * (queue_s + own) ** 2
        )
        return Estimate(
            queue_s + extra,
            own,
            (lc + c * pc if c else 0.0, ll + sl * pl if sl else 0.0, lr + sr * pr if sr else 0.0),
            missing,
            (g, c, sl, sr),
            feats,
            attn,
            extra,
            share**_GATE,
            load.speed,
            spread,
        )

    # -- accounting -----------------------------------------------------------------

    def _drain_to(self, load: WorkerLoad, now: float) -> None:
        if load.pending:
            load.drained = min(float(load.pending_tokens), load._done(now))
        else:
            load.drained = 0.0
        load.anchor = now

    def dispatched(self, load: WorkerLoad, ticket_id: int, est: Estimate, now: float) -> float:
        """Book the request's prefill on the worker; returns its expected first-token time."""
        self._ready(load)
        self._drain_to(load, now)
        load.pending[ticket_id] = (est.missing_tokens, est.attn)
        if len(load.pending) == 1:
            load.new_head(now)
        n = est.missing_tokens + sum(est.cached)
        load.held[ticket_id] = n
        load.held_tokens += n
        load.pending_tokens += est.missing_tokens
        load.pending_attn += est.attn
        a = self.priors.ewma
        self.mean_service_s = (1 - a) * self.mean_service_s + a * est.service_s
        self.mean_tokens = (1 - a) * self.mean_tokens + a * est.missing_tokens
        return now + est.ttft_s

    def seen(self, load: WorkerLoad, done: float, at: float) -> None:
        """The oldest request's KV events show ``done`` of its prefill tokens computed by
        ``at``: where it is, and its speed (its time so far over the modelled, believed
        by its share of the budget's chunks: one chunk half, four 80 %)."""
        if not load.pending:
            return
        m, attn = next(iter(load.pending.values()))
        done = min(done, m - 1.0)
        if done <= max(0.0, load.seen_tokens):
            return
        start = max(0.0, m - load.head_tokens)  # drained before it became the head
        ran, took = done - start, at - load.head_since
        load.seen_tokens, load.seen_at = done, at
        if ran <= 0 or took <= 0:
            return
        work = attention_left(m, attn, m - start) - attention_left(m, attn, m - done)
        per = max(1, load.budget - load.decoding)
        # Whole steps ran (the +½ step of :meth:`WorkerLoad._cost` is a step under way).
        t, b = load.fit.theta, load.basis
        half = 0.5 * load.speed * (t[0] * b[0] + t[3] * load.decoding * b[3])
        modelled = load._cost(ran, work) - half
        if modelled <= 0:
            return
        w = ran / (ran + per)
        slow = math.exp(w * math.log(min(8.0, max(0.125, took / modelled))))
        load.seen_slow, load.seen_weight = slow, w

    def _unbook(self, load: WorkerLoad, ticket_id: int, now: float) -> bool:
        """Settle a booking: what the worker computed for it leaves the queue."""
        booked = load.pending.get(ticket_id)
        if booked is None:
            return False
        self._drain_to(load, now)
        was_head = next(iter(load.pending)) == ticket_id
        del load.pending[ticket_id]
        m, attn = booked
        load.pending_tokens = max(0, load.pending_tokens - m)
        load.pending_attn = max(0.0, load.pending_attn - attn)
        if not load.pending:
            load.pending_tokens, load.pending_attn, load.drained = 0, 0.0, 0.0
        else:
            # Its tokens were part of what drained; what is left over belongs to the
            # rest. The oldest request answering says more: the worker has just run
            # its last chunk, and the step's budget left over is all the next ones got.
            left = max(0.0, load.drained - m)
            if was_head:
                # Whatever the drain had modelled: the step that ran its last chunk
                # gave the ones behind it what that chunk left of the budget.
                per = max(1, load.budget - load.decoding)
                left = float(per - (m % per or per))
            load.drained = min(left, float(load.pending_tokens))
        if was_head:
            load.new_head(now)
        return True

    def first_token(
        self,
        load: WorkerLoad,
        ticket_id: int,
        est: Estimate,
        sent_at: float,
        now: float,
        *,
        observed: bool = True,
    ) -> None:
        """The first token came back: settle the booking and learn from it.

        ``observed=False`` when ``now`` is not the first token's time (a
        non-streamed answer, seen whole): settle, learn nothing.
        """
        self._ready(load)
        booked = self._unbook(load, ticket_id, now)
        load.decoding += 1
        if ticket_id in load.held:
            load.since[ticket_id] = now
        if not observed:
            return
        took = now - sent_at
        if took > 0:
            self.errors.append((est.ttft_s - took) / took)
        # What the fit learns from is the compute the features describe: the
        # modelled wait for free KV is not the worker's speed and is taken off.
        y = took - est.read_total_s - est.wait_s
        if booked and est.features and y > 0 and est.fit_weight > 0:
            pred = load.fit.predict(est.features)
            if pred > 0:
                w = est.fit_weight
                load.fit.observe_spread(math.log(y / (pred * load.speed_raw)), w)
                # Slowly, and each answer by at most 2× either way: noise averages out;
                # what the choice uses is shrunk toward 1 (_speeds).
                a = _SPEED_RATE * w
                ratio = min(2.0, max(0.5, y / pred))
                sp = math.exp((1 - a) * math.log(load.speed_raw) + a * math.log(ratio))
                load.speed_raw = min(4.0, max(0.25, sp))
                # The EWMA's effective answer count: Σ weights, forgetting at its rate.
                load.speed_n = (1 - a) * load.speed_n + w
                self._speeds()
            load.fit.update(est.features, y / load.speed_raw, est.fit_weight)

    def _release(self, load: WorkerLoad, ticket_id: int) -> float | None:
        """The request's blocks are free again; returns when it started decoding."""
        n = load.held.pop(ticket_id, None)
        if n is not None:
            load.held_tokens = max(0, load.held_tokens - n)
        return load.since.pop(ticket_id, None)

    def failed(self, load: WorkerLoad, ticket_id: int, est: Estimate, now: float) -> None:
        """The request failed before its first token: unbook it."""
        self._unbook(load, ticket_id, now)
        self._release(load, ticket_id)

    def finished(
        self, load: WorkerLoad, ticket_id: int | None = None, now: float | None = None
    ) -> None:
        """The request ended: its blocks are free, and its decode teaches the mean."""
        load.decoding = max(0, load.decoding - 1)
        if ticket_id is None:
            return
        since = self._release(load, ticket_id)
        if since is not None and now is not None and now >= since:
            a = self.priors.ewma
            load.decode_s = (1 - a) * load.decode_s + a * (now - since)

    def refresh(
        self, load: WorkerLoad, *, waiting: int, running: int, kv_usage: float, now: float
    ) -> None:
        """A worker's ``/metrics``: waiting requests the router did not send add to its queue."""
        extra = max(0, waiting - load.inflight)
        load.waiting_external = extra
        load.external_tokens = extra * self.mean_tokens
        load.running_reported = running
        load.kv_usage = kv_usage
        load.decoding = max(load.decoding, running - load.inflight)

    def observe_read(self, tier: Tier, nbytes: int, seconds: float) -> None:
        """A sidecar's read figure: calibrate that tier's bandwidth."""
        if tier is Tier.GPU or nbytes <= 0 or seconds <= 0:
            return
        ratio = (nbytes / seconds) / self.priors.bandwidth(tier)
        a = self.priors.ewma
        cur = self._bandwidth_scale.get(tier, 1.0)
        new = math.exp((1 - a) * math.log(cur) + a * math.log(ratio))
        self._bandwidth_scale[tier] = min(4.0, max(0.25, new))
        self._costs = None

    def error_summary(self) -> dict[str, float]:
        """Relative estimate error (estimate − observed)/observed: mean, p50, p90 of |error|."""
        if not self.errors:
            return {"count": 0, "mean": 0.0, "abs_p50": 0.0, "abs_p90": 0.0}
        abs_sorted = sorted(abs(e) for e in self.errors)
        n = len(abs_sorted)
        return {
            "count": n,
            "mean": sum(self.errors) / n,
            "abs_p50": abs_sorted[n // 2],
            "abs_p90": abs_sorted[min(n - 1, int(n * 0.9))],
        }
