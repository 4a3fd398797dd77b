"""The targets a benchmark prints (never asserts): a kvoffload row against a ceiling
or a peer, and the verdict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchlib.results import Result

TARGET_CEIL = 0.8  # best sealed / raw ceiling, save and cold load
TARGET_PEER = 1.2  # kvoffload sealed / LMCache unencrypted (issue 12)


@dataclass
class Target:
    shape: str
    op: str  # "save" | "cold load" | "warm load"
    durability: str | None
    ours: Result | None  # a row of bench_io.py or of bench_sidecar.py
    theirs_name: str
    theirs_gbps: float | None
    theirs_ratio: float | None  # the other side's x ceil, when it has one
    target: float

    @property
    def ratio(self) -> float | None:
        if self.ours is None or not self.theirs_gbps:
            return None
        return self.ours.gbps / self.theirs_gbps

    @property
    def met(self) -> bool | None:
        r = self.ratio
        return None if r is None else r >= self.target

    def to_json(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "op": self.op,
            "durability": self.durability,
            "ours": self.ours.id if self.ours else None,
            "ours_gbps": self.ours.gbps if self.ours else None,
            "ours_x_ceil": self.ours.ratio if self.ours else None,
            "theirs": self.theirs_name,
            "theirs_gbps": self.theirs_gbps,
            "theirs_x_ceil": self.theirs_ratio,
            "ratio": self.ratio,
            "target": self.target,
            "met": self.met,
        }


def verdict(t: Target) -> str:
    if t.met is None:
        return "-"
    return "[green]meets[/green]" if t.met else "[red]below[/red]"
