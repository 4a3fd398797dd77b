"""Load a stored prefix only when that beats recomputing it.

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
prefill rate at a high one. A hit is loaded when

    tokens / load_rate  <  tokens / prefill_rate       (margin 1 by default)

and recomputed otherwise. Both sides are linear in the tokens of one request
(the tier's per-request latency is inside the measured rate), so the answer
is all or nothing for a request: loading a prefix and recomputing the rest
only pays where the per-token costs differ along the prompt, and the later
tokens of a prompt, whose attention spans more, are the dearer ones to
recompute, so a partial load is never better than the whole one here.

Until both rates are measured, over at least ``min_loads`` loads and
``min_steps`` steps, the guard loads (the first loads are the measurement;
one slow sample never turns reuse off). Once it refuses, no load would ever
measure the tier again, so every ``reprobe_s`` one request loads its first
``probe_tokens`` (one chunk) and recomputes the rest: a bounded cost that
notices a tier that recovered.

Engine-agnostic: the vLLM connector feeds it from its worker metadata and its
scheduler's steps; other engines' adapters can feed it the same way.
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


def _quantile(values: list[float], q: float, *, high: bool) -> float:
    """The ``q`` quantile of ``values``, rounded to the safe side: down to the
    lower neighbour for a rate read low, up for one read high."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    return s[math.ceil(pos) if high else math.floor(pos)]


class RecomputeGuard:
    """Per request: load the stored prefix, or recompute it. Thread-safe."""

    def __init__(
        self,
        *,
        window: int = 64,
        margin: float = 1.0,
        prefill_tokens_per_s: float | None = None,
        probe_tokens: int = 0,
        reprobe_s: float = 30.0,
        min_step_tokens: int = 1,
        min_loads: int = 3,
        min_steps: int = 8,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window < 1 or margin <= 0 or reprobe_s <= 0:
            raise ValueError("window >= 1, margin > 0 and reprobe_s > 0 are required")
        if prefill_tokens_per_s is not None and prefill_tokens_per_s <= 0:
            raise ValueError("prefill_tokens_per_s must be positive")
        self._loads: deque[float] = deque(maxlen=window)
        self._steps: deque[float] = deque(maxlen=window)
        self._margin = margin
        self._fixed_prefill = prefill_tokens_per_s
        self._probe_tokens = probe_tokens
        self._reprobe_s = reprobe_s
        self._min_step_tokens = min_step_tokens
        self._min_loads, self._min_steps = min_loads, min_steps
        self._clock = clock
        self._last_load_sample = clock()
        self._lock = threading.Lock()

    # -- measurements ----------------------------------------------------------------

    def observe_load(self, tokens: int, seconds: float) -> None:
        """A load of ``tokens`` tokens' KV took ``seconds`` (request to last byte)."""
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

    # -- the decision ---------------------------------------------------------------

    def decide(self, offered_tokens: int) -> Decision:
        """How many of ``offered_tokens`` (a stored prefix past the engine's own
        cache) to load: all of them, none, or a probe."""
        if offered_tokens <= 0:
            return Decision(0, "nothing offered")
        load, prefill = self.load_rate(), self.prefill_rate()
        if load is None or prefill is None:
            return Decision(offered_tokens, "rates not measured yet: loading measures the tier")
        load_s, recompute_s = offered_tokens / load, offered_tokens / prefill
        if load_s < recompute_s * self._margin:
            return Decision(
                offered_tokens,
                f"load {load_s * 1e3:.1f} ms < recompute {recompute_s * 1e3:.1f} ms",
            )
        why = (
            f"tier loads {load:.0f} tokens/s, engine prefills {prefill:.0f}: "
            f"load {load_s * 1e3:.1f} ms >= recompute {recompute_s * 1e3:.1f} ms"
        )
        with self._lock:
            due = self._clock() - self._last_load_sample >= self._reprobe_s
            if due and self._probe_tokens > 0:
                self._last_load_sample = self._clock()  # one probe per period
                return Decision(min(self._probe_tokens, offered_tokens), f"probe; {why}")
        return Decision(0, f"recompute; {why}")


__all__ = ["Decision", "RecomputeGuard"]
