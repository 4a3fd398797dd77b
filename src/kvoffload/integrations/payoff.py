"""Load a stored prefix only where that beats recomputing it, and only the part that pays.

A tier that reads slower than the engine prefills makes every hit a loss: the
request waits for bytes it could have computed sooner. :class:`RecomputeGuard`
decides per request, from two rates it measures, never from constants:

- the tier's **load rate**, tokens of KV per second, from the loads the
  workers ran (tokens asked for, wall time from the request to the last
  verified byte, failures included: a failed load cost its time too);
- the engine's **prefill rate**, tokens per second, from the engine's own
  steps (tokens scheduled in a step, time to the next step).

Both are kept over a window of recent samples and read conservatively, so
that an error falls on the safe side (recompute is what the engine would do
without kvoffload): the load rate at a low quantile of its window, the
prefill rate at a high one.

The plans
---------
An :class:`Offer` is one request: ``start`` tokens the engine holds already,
``offered`` stored tokens after them, ``tail`` tokens after those that the
engine computes whatever happens. A plan loads the first ``k`` offered tokens
(whole chunks: ``granule``) and computes the rest; ``k = 0`` is recompute, the
ceiling every other plan is measured against. Its time to first token is

    serial (the load ends before the compute starts):  load(k) + compute(rest)
    overlapped (a layer-wise load: layer i computes while layer i+1 streams,
    over ``stages`` layers, for the first ``overlap`` tokens of compute):
        max(load(k), c) + min(load(k), c) / stages + compute(rest past the overlap)

with ``load(k) = k / load_rate x safety`` and ``compute(n) = n / prefill_rate``.
Serial plans are linear in ``k``, so the best is all or nothing; an overlapped
one is best where the load and the compute it hides take about as long, so a
tier slower than recompute still pays for its first chunks (load a third,
compute two thirds alongside). A plan is taken only when it beats recompute
(times ``margin``), and a partial plan only when it also beats the best whole
plan by ``partial_margin`` (the compute of the later tokens, whose attention
spans more, is dearer than the average rate says: the margin covers it).

Uncertainty falls on the safe side:

- ``safety`` is 1 while the load rate is fresh and ``stale_margin`` once its
  newest sample is older than ``stale_s``: the last estimate is used, made
  dearer, and no request waits to refresh it;
- until both rates are measured (``min_loads`` loads, ``min_steps`` steps)
  every hit is loaded whole: the first loads are the measurement.

Probes never sit on a request's path. Once the guard refuses loads no load
measures the tier again, so :meth:`RecomputeGuard.claim_probe` says, at most
once per ``reprobe_s`` while refusing, that the caller should read one stored
chunk **in the background** (a read that no request waits on) and report it
with :meth:`RecomputeGuard.observe_load`; a tier that recovered is noticed
then, and the request that triggered the probe recomputes as decided.

Engine-agnostic: the vLLM connector feeds it from its worker metadata and its
scheduler's steps and runs probes on a worker thread of their own; other
engines' adapters can feed it the same way, or use :func:`best_plan` alone. The
router's estimate of a worker's time to first token (``router/model.py``) does
not call it: it prices loading every matched chunk, which is never below what
the plan the guard picks costs (recompute, a part, or all), so it errs high.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

#: Quantiles the rates are read at (of the window's samples, rate per sample).
LOAD_QUANTILE = 0.2  # a slow load among five is taken as the tier's speed
PREFILL_QUANTILE = 0.8  # a fast step among five is taken as the engine's speed


@dataclass(frozen=True)
class Decision:
    """What to load of an offered hit, and why (for the debug log)."""

    tokens: int
    reason: str
    #: The plan's estimated time to first token and recompute's, seconds (0: unmeasured).
    plan_s: float = 0.0
    recompute_s: float = 0.0


@dataclass(frozen=True)
class Offer:
    """One request's choice between loading and recomputing (tokens)."""

    offered: int  # stored tokens past what the engine holds: the most a load adds
    tail: int = 0  # tokens after the stored prefix, computed whatever is loaded
    start: int = 0  # tokens the engine holds already (its own prefix cache)
    granule: int = 0  # loads end on multiples of this (from token 0); 0: whole or nothing
    overlap: int = 0  # tokens of compute that run while the load streams; 0: serial
    stages: int = 1  # layers the overlap pipelines over

    def candidates(self) -> list[int]:
        """Every ``k`` a plan may load: 0, the chunk boundaries inside the offer, all."""
        ks = {0, self.offered}
        if self.granule > 0:
            first = -(-self.start // self.granule) * self.granule
            ks.update(
                b - self.start
                for b in range(first, self.start + self.offered, self.granule)
                if b > self.start
            )
        return sorted(k for k in ks if 0 <= k <= self.offered)


def plan_seconds(
    offer: Offer, k: int, load_s_per_token: float, prefill_s_per_token: float
) -> float:
    """Time to first token of loading the first ``k`` offered tokens (see the module doc)."""
    compute = offer.offered - k + offer.tail
    if k <= 0:
        return compute * prefill_s_per_token
    load = k * load_s_per_token
    hidden = min(compute, max(0, offer.overlap)) * prefill_s_per_token
    after = (compute - min(compute, max(0, offer.overlap))) * prefill_s_per_token
    if hidden <= 0:
        return load + after
    return max(load, hidden) + min(load, hidden) / max(1, offer.stages) + after


def best_plan(
    offer: Offer,
    load_s_per_token: float,
    prefill_s_per_token: float,
    *,
    margin: float = 1.0,
    partial_margin: float = 0.15,
) -> tuple[int, float, float]:
    """``(k, plan seconds, recompute seconds)``: the plan to run; ``k = 0`` recomputes.

    A plan with ``k > 0`` must beat recompute times ``margin``; a partial one
    (``0 < k < offered``) must also beat the best of the whole plans by
    ``partial_margin``."""
    recompute = plan_seconds(offer, 0, load_s_per_token, prefill_s_per_token)
    whole = plan_seconds(offer, offer.offered, load_s_per_token, prefill_s_per_token)
    best_k, best_s = (offer.offered, whole) if whole < recompute * margin else (0, recompute)
    bar = min(whole, recompute * margin)  # what a partial plan must beat, with its margin
    for k in offer.candidates():
        if 0 < k < offer.offered:
            s = plan_seconds(offer, k, load_s_per_token, prefill_s_per_token)
            if s * (1 + partial_margin) < bar and s < best_s:
                best_k, best_s = k, s
    return best_k, best_s, recompute


def _quantile(values: list[float], q: float, *, high: bool) -> float:
    """The ``q`` quantile of ``values``, rounded to the safe side: down to the
    lower neighbour for a rate read low, up for one read high."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    return s[math.ceil(pos) if high else math.floor(pos)]


class RecomputeGuard:
    """Per request: load the stored prefix, a leading part of it, or none. Thread-safe."""

    def __init__(
        self,
        *,
        window: int = 64,
        margin: float = 1.0,
        partial_margin: float = 0.15,
        prefill_tokens_per_s: float | None = None,
        reprobe_s: float = 30.0,
        stale_s: float | None = None,
        stale_margin: float = 1.5,
        min_step_tokens: int = 1,
        min_loads: int = 3,
        min_steps: int = 8,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window < 1 or margin <= 0 or reprobe_s <= 0 or partial_margin < 0:
            raise ValueError(
                "window >= 1, margin > 0, partial_margin >= 0 and reprobe_s > 0 are required"
            )
        if stale_margin < 1 or (stale_s is not None and stale_s <= 0):
            raise ValueError("stale_margin >= 1 and stale_s > 0 are required")
        if prefill_tokens_per_s is not None and prefill_tokens_per_s <= 0:
            raise ValueError("prefill_tokens_per_s must be positive")
        self._loads: deque[float] = deque(maxlen=window)
        self._steps: deque[float] = deque(maxlen=window)
        self._margin, self._partial_margin = margin, partial_margin
        self._fixed_prefill = prefill_tokens_per_s
        self._reprobe_s = reprobe_s
        self._stale_s = 2 * reprobe_s if stale_s is None else stale_s
        self._stale_margin = stale_margin
        self._min_step_tokens = min_step_tokens
        self._min_loads, self._min_steps = min_loads, min_steps
        self._clock = clock
        self._last_load_sample = clock()
        self._last_probe = -math.inf
        self._refusing = False
        self._lock = threading.Lock()

    # -- measurements ----------------------------------------------------------------

    def observe_load(self, tokens: int, seconds: float) -> None:
        """A load of ``tokens`` tokens' KV took ``seconds`` (request to last byte);
        a background probe's read is reported the same way."""
        if tokens <= 0 or seconds < 0:
            return
        with self._lock:
            self._loads.append(tokens / max(seconds, 1e-9))
            self._last_load_sample = self._clock()

    def observe_step(self, tokens: int, seconds: float) -> None:
        """An engine step computed ``tokens`` tokens in ``seconds``."""
        if tokens < self._min_step_tokens or seconds <= 0:
            return
        with self._lock:
            self._steps.append(tokens / seconds)

    def load_rate(self) -> float | None:
        """The tier's load rate, tokens/s (conservative), or None before ``min_loads``."""
        with self._lock:
            loads = list(self._loads)
        if len(loads) < self._min_loads:
            return None
        return _quantile(loads, LOAD_QUANTILE, high=False)

    def prefill_rate(self) -> float | None:
        """The engine's prefill rate, tokens/s (configured, else measured), or None."""
        if self._fixed_prefill is not None:
            return self._fixed_prefill
        with self._lock:
            steps = list(self._steps)
        if len(steps) < self._min_steps:
            return None
        return _quantile(steps, PREFILL_QUANTILE, high=True)

    def safety(self) -> float:
        """The factor the load side is made dearer by: ``stale_margin`` once the
        newest load sample is older than ``stale_s``, else 1."""
        with self._lock:
            stale = self._clock() - self._last_load_sample > self._stale_s
        return self._stale_margin if stale else 1.0

    # -- the decision ---------------------------------------------------------------

    def decide(self, offered_tokens: int | Offer) -> Decision:
        """How many of the offered tokens (a stored prefix past the engine's own
        cache) to load: all, a leading part, or none. Never waits for anything."""
        offer = offered_tokens if isinstance(offered_tokens, Offer) else Offer(offered_tokens)
        if offer.offered <= 0:
            return Decision(0, "nothing offered")
        load, prefill = self.load_rate(), self.prefill_rate()
        if load is None or prefill is None:
            return Decision(offer.offered, "rates not measured yet: loading measures the tier")
        safety = self.safety()
        k, plan_s, recompute_s = best_plan(
            offer,
            safety / load,
            1.0 / prefill,
            margin=self._margin,
            partial_margin=self._partial_margin,
        )
        rates = f"tier {load:.0f} tokens/s (x{safety:g} safety), engine {prefill:.0f} tokens/s"
        with self._lock:
            self._refusing = k < offer.offered
        if k == offer.offered:
            what = "load"
        elif k > 0:
            what = f"load {k} of {offer.offered}, compute the rest"
        else:
            what = "recompute"
        return Decision(
            k,
            f"{what}: {plan_s * 1e3:.1f} ms vs recompute {recompute_s * 1e3:.1f} ms; {rates}",
            plan_s,
            recompute_s,
        )

    def claim_probe(self) -> bool:
        """Whether the caller should read one stored chunk now, in the background,
        and report it with :meth:`observe_load`: true at most once per
        ``reprobe_s``, only while the guard refuses loads (a loading guard is
        measured by its loads) and no load sample came in that period."""
        with self._lock:
            now = self._clock()
            if not self._refusing or self._probe_blocked(now):
                return False
            self._last_probe = now
            return True

    def _probe_blocked(self, now: float) -> bool:
        last = max(self._last_load_sample, self._last_probe)
        return now - last < self._reprobe_s


__all__ = ["Decision", "Offer", "RecomputeGuard", "best_plan", "plan_seconds"]
