"""One worker's estimated TTFT and its terms (:mod:`.model` computes it)."""

from __future__ import annotations

__all__ = ["Estimate"]


class Estimate:
    """One worker's estimated TTFT and its terms (seconds); immutable by convention.

    ``reads`` are the CPU, local-store and shared-store read times; ``cached``
    the tokens credited to GPU, CPU, local store and shared store;
    ``features`` what the fit learns from when its first token comes.
    """

    __slots__ = (
        "attn",
        "cached",
        "features",
        "fit_weight",
        "missing_tokens",
        "prefill_s",
        "queue_s",
        "read_total_s",
        "reads",
        "service_s",
        "spread_s",
        "ttft_s",
        "wait_s",
        "work_s",
    )

    def __init__(
        self,
        queue_s: float,
        prefill_s: float,
        reads: tuple[float, float, float],
        missing_tokens: int,
        cached: tuple[int, int, int, int],
        features: tuple[float, ...] = (),
        attn: float = 0.0,
        wait_s: float = 0.0,
        fit_weight: float = 1.0,
        speed: float = 1.0,
        spread_s: float = 0.0,
    ) -> None:
        # ``spread_s``: the estimate's standard deviation (each queued prefill's and
        # this one's own noise, at the σ the fit's residuals measure).
        self.spread_s = spread_s
        # ``fit_weight``: how much of the answer's time the fit may attribute to the
        # features (1: nothing queued ahead; less the more a queue it cannot see into).
        self.fit_weight = fit_weight
        # ``wait_s``: the wait for free KV beyond the prefill queue (in ``queue_s``).
        self.wait_s = wait_s
        self.queue_s = queue_s
        self.prefill_s = prefill_s
        self.reads = reads
        self.missing_tokens = missing_tokens
        self.cached = cached
        self.features = features
        self.attn = attn
        self.read_total_s = reads[0] + reads[1] + reads[2]
        self.service_s = prefill_s + self.read_total_s
        # The work the request brings, at the deployment's speed (not the worker's:
        # what its cache saves, not a noisy speed factor, is what the choice weighs).
        self.work_s = prefill_s / speed + self.read_total_s
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
            "spread_s": round(self.spread_s, 6),
            "read_s": {k: round(v, 6) for k, v in self.read_s.items()},
            "missing_tokens": self.missing_tokens,
            "cached_tokens": self.cached_tokens,
        }
