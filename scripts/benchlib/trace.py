"""Mooncake FAST'25 request traces (``../shared/traces/README.md``): loading, the cache bound.

One JSON object a line: ``timestamp`` (ms from the first request),
``input_length``, ``output_length``, ``hash_ids`` (one per 512-token block,
the last one possibly partial; equal ids at the same position are a reusable
prefix). Used by ``scripts/sim_router.py`` and ``scripts/bench_router_live.py``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: Tokens per ``hash_ids`` block in the Mooncake traces.
BLOCK = 512


@dataclass(frozen=True)
class Req:
    arrival: float
    n: int
    out: int
    blocks: tuple[int, ...]


def load_trace(path: Path, limit: int | None) -> list[Req]:
    reqs: list[Req] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                reqs.append(
                    Req(
                        obj["timestamp"] / 1000.0,
                        int(obj["input_length"]),
                        int(obj["output_length"]),
                        tuple(int(h) for h in obj["hash_ids"]),
                    )
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise SystemExit(f"{path}:{lineno}: not a trace record ({exc})") from None
            if limit is not None and len(reqs) >= limit:
                break
    if not reqs:
        raise SystemExit(f"{path}: no requests")
    return reqs


def infinite_cache_missing(reqs: Sequence[Req], block: int = BLOCK) -> tuple[list[int], float]:
    """Per request the tokens an infinite shared cache would miss; the bound's hit rate."""
    seen: set[int] = set()
    missing: list[int] = []
    hit_tokens = 0
    total = 0
    for r in reqs:
        k = 0
        for h in r.blocks:
            if h not in seen:
                break
            k += 1
        cached = min(r.n, k * block)
        hit_tokens += cached
        total += r.n
        missing.append(max(1, r.n - cached))
        seen.update(r.blocks)
    return missing, hit_tokens / total
