"""The time-to-first-token model: what each worker would take to answer a prompt.

For a worker ``w`` and a prompt of ``n`` tokens of which ``k_t`` are reachable
in tier ``t`` (:class:`~kvoffload.router.index.TierMatch`, disjoint)::

    TTFT(w) = queue(w) + slowdown(w) · s_w · prefill(n − Σ k_t) + Σ_t read_t(k_t)

    prefill(m)  = a + b·m + c·m²                      (priors; s_w calibrated per worker)
    slowdown(w) = 1 + d · decoding requests on w       (decode steps share the GPU)
    read_t(k)   = latency_t + k · bytes_per_token / bandwidth_t   (0 for the GPU tier)
    queue(w)    = what is left of the oldest pending request's service
                  + the service of every other pending request
                  (both × r_w, observed/booked service of the worker's recent requests)
                  + the mean service × requests waiting that the router did not send

The pending requests are the router's own accounting: each request it sends
books its estimated service time (prefill plus reads) and is settled when its
first token comes back, so an underestimate shows up as the oldest request
overstaying and the queue follows what the worker really does. The worker's
``/metrics`` (requests waiting that the router did not send, requests running,
KV usage) refreshes it.

Calibration: ``s_w`` is an exponentially weighted mean of observed/estimated
prefill time, learned from each request that was the oldest pending one when
its first token came (its service is the span since the one before it
answered, or since it was sent); each tier's bandwidth is learned the same way from the
sidecars' read figures (bytes, seconds). Both are clamped to [¼, 4]× the priors
so one outlier cannot derail routing. The estimate-vs-observed error of every
request is kept (:attr:`TTFTModel.errors`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from .index import Tier, TierMatch

__all__ = ["Estimate", "Priors", "TTFTModel", "WorkerLoad"]

_READ_TIERS = (Tier.CPU, Tier.STORAGE_LOCAL, Tier.STORAGE_REMOTE)


@dataclass(frozen=True)
class Priors:
    """Starting values of the model, per deployment (the config's ``[model]``)."""

    prefill_a_s: float = 0.015
    prefill_b_s: float = 1.0 / 12_000  # seconds per prefilled token
    prefill_c_s: float = 0.0  # seconds per token² (attention on long prompts)
    decode_slowdown: float = 0.01  # per decoding request
    bytes_per_token: int = 131_072  # KV bytes per token (all layers of a shard)
    cpu_bandwidth: float = 20e9
    storage_local_bandwidth: float = 5e9
    storage_remote_bandwidth: float = 2e9
    cpu_latency_s: float = 0.0005
    storage_local_latency_s: float = 0.002
    storage_remote_latency_s: float = 0.005
    ewma: float = 0.2  # weight of a new observation

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
        if m <= 0:
            return 0.0
        return self.prefill_a_s + self.prefill_b_s * m + self.prefill_c_s * m * m


@dataclass
class WorkerLoad:
    """What the router knows of one worker's load.

    ``pending`` holds the estimated service time of each request sent and not
    yet answered, in the order sent (the engine serves prefills first come,
    first served); the oldest has been in service since ``head_since``.
    """

    pending: dict[int, float] = field(default_factory=dict)
    pending_s: float = 0.0
    head_since: float = 0.0
    decoding: int = 0  # requests past their first token, not finished
    pending_tokens: int = 0  # prefill tokens sent, first token not yet back
    waiting_external: int = 0  # /metrics waiting beyond what the router sent
    external_s: float = 0.0
    running_reported: int = 0
    kv_usage: float = 0.0
    prefill_scale: float = 1.0
    service_ratio: float = 1.0  # observed / booked service of recent requests

    @property
    def inflight(self) -> int:
        return len(self.pending)

    def queue_s(self, now: float) -> float:
        if not self.pending:
            return self.external_s
        head = next(iter(self.pending.values())) * self.service_ratio
        head_left = max(0.0, head - (now - self.head_since))
        rest = self.pending_s * self.service_ratio - head
        return max(0.0, rest + head_left) + self.external_s


class Estimate:
    """One worker's estimated TTFT and its terms (seconds); immutable by convention.

    ``reads`` are the CPU, local-store and shared-store read times; ``cached``
    the tokens credited to GPU, CPU, local store and shared store.
    """

    __slots__ = (
        "cached",
        "missing_tokens",
        "prefill_s",
        "queue_s",
        "read_total_s",
        "reads",
        "service_s",
        "ttft_s",
    )

    def __init__(
        self,
        queue_s: float,
        prefill_s: float,
        reads: tuple[float, float, float],
        missing_tokens: int,
        cached: tuple[int, int, int, int],
    ) -> None:
        self.queue_s = queue_s
        self.prefill_s = prefill_s
        self.reads = reads
        self.missing_tokens = missing_tokens
        self.cached = cached
        self.read_total_s = reads[0] + reads[1] + reads[2]
        self.service_s = prefill_s + self.read_total_s
        self.ttft_s = queue_s + self.service_s

    @property
    def read_s(self) -> dict[str, float]:
        return dict(zip(("cpu", "storage_local", "storage_remote"), self.reads, strict=True))

    @property
    def cached_tokens(self) -> dict[str, int]:
        return dict(
            zip(("gpu", "cpu", "storage_local", "storage_remote"), self.cached, strict=True)
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "estimated_ttft_s": round(self.ttft_s, 6),
            "queue_s": round(self.queue_s, 6),
            "prefill_s": round(self.prefill_s, 6),
            "read_s": {k: round(v, 6) for k, v in self.read_s.items()},
            "missing_tokens": self.missing_tokens,
            "cached_tokens": self.cached_tokens,
        }


@dataclass
class TTFTModel:
    priors: Priors = field(default_factory=Priors)
    block_tokens: int = 16
    errors: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    _bandwidth_scale: dict[Tier, float] = field(default_factory=dict)
    mean_service_s: float = 0.1
    _costs: tuple[tuple[float, float], ...] | None = None

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
        bt = self.block_tokens
        (lc, pc), (ll, pl), (lr, pr) = self._read_costs()
        gpu, cpu, local, remote = match
        g = min(gpu * bt, n_tokens)
        c = min(cpu * bt, n_tokens - g)
        sl = min(local * bt, n_tokens - g - c)
        sr = min(remote * bt, n_tokens - g - c - sl)
        # The engine always computes the prompt's last token, even on a full hit.
        missing = max(1, n_tokens - g - c - sl - sr)
        pri = self.priors
        prefill = (
            (pri.prefill_a_s + pri.prefill_b_s * missing + pri.prefill_c_s * missing * missing)
            * load.prefill_scale
            * (1.0 + pri.decode_slowdown * load.decoding)
        )
        return Estimate(
            load.queue_s(now),
            prefill,
            (lc + c * pc if c else 0.0, ll + sl * pl if sl else 0.0, lr + sr * pr if sr else 0.0),
            missing,
            (g, c, sl, sr),
        )

    # -- accounting -----------------------------------------------------------------

    def dispatched(self, load: WorkerLoad, ticket_id: int, est: Estimate, now: float) -> float:
        """Book the request's service on the worker; returns its expected first-token time."""
        if not load.pending:
            load.head_since = now
        expected = now + load.queue_s(now) + est.service_s
        load.pending[ticket_id] = est.service_s
        load.pending_s += est.service_s
        load.pending_tokens += est.missing_tokens
        a = self.priors.ewma
        self.mean_service_s = (1 - a) * self.mean_service_s + a * est.service_s
        return expected

    def _unbook(self, load: WorkerLoad, ticket_id: int, est: Estimate, now: float) -> float | None:
        """Settle a booking; the observed service time when it was the oldest pending one."""
        was_head = bool(load.pending) and next(iter(load.pending)) == ticket_id
        service = load.pending.pop(ticket_id, None)
        if service is None:
            return None
        load.pending_s = max(0.0, load.pending_s - service) if load.pending else 0.0
        load.pending_tokens = max(0, load.pending_tokens - est.missing_tokens)
        if not was_head:
            return None
        observed = now - load.head_since
        load.head_since = now
        return observed

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
        """The first token came back: settle the booking and calibrate.

        ``observed=False`` when ``now`` is not the first token's time (a
        non-streamed answer, seen whole): settle, learn nothing.
        """
        service = self._unbook(load, ticket_id, est, now)
        load.decoding += 1
        if not observed:
            return
        took = now - sent_at
        if took > 0:
            self.errors.append((est.ttft_s - took) / took)
        if service is None:
            return
        a = self.priors.ewma
        # The oldest request was served alone since the one before it answered (or
        # since it was sent): that span is its service. Its ratio to the booked
        # estimate scales the rest of the queue (cache contents change while requests
        # wait, which no per-request estimate sees).
        if est.service_s > 0:
            r = math.exp(
                (1 - a) * math.log(load.service_ratio)
                + a * math.log(max(service, 1e-6) / est.service_s)
            )
            load.service_ratio = min(4.0, max(0.25, r))
        # The prefill speed, only from requests that waited less than their own service:
        # their estimated cache hits were still there when they ran.
        if est.queue_s <= est.service_s and est.prefill_s > 0:
            ratio = (service - est.read_total_s) / (est.prefill_s / load.prefill_scale)
            if ratio > 0:
                log_s = (1 - a) * math.log(load.prefill_scale) + a * math.log(ratio)
                load.prefill_scale = min(4.0, max(0.25, math.exp(log_s)))

    def failed(self, load: WorkerLoad, ticket_id: int, est: Estimate, now: float) -> None:
        """The request failed before its first token: unbook it."""
        self._unbook(load, ticket_id, est, now)

    def finished(self, load: WorkerLoad) -> None:
        load.decoding = max(0, load.decoding - 1)

    def refresh(
        self, load: WorkerLoad, *, waiting: int, running: int, kv_usage: float, now: float
    ) -> None:
        """A worker's ``/metrics``: waiting requests the router did not send add to its queue."""
        extra = max(0, waiting - load.inflight)
        load.waiting_external = extra
        load.external_s = extra * self.mean_service_s
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
