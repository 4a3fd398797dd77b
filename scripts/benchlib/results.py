"""A benchmark row, and how a kvoffload row is held against its ceiling."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from benchlib.chunks import GB


@dataclass
class Result:
    kind: str  # "ceiling" | "kvoffload"
    name: str
    shape: str
    durability: str | None
    ops: int
    payload_bytes: int  # per op
    file_bytes: int  # per op (0 when no file is involved)
    seconds: float  # wall time of the timed loop
    p50_ms: float
    cached: float | None = None  # page-cache residency of the timed files before the loop
    ceiling: str | None = None
    ceiling_gbps: float | None = None
    ratio: float | None = None
    bound_gbps: float | None = None
    bound_of: list[str] = field(default_factory=list)
    ratio_to_bound: float | None = None

    @property
    def id(self) -> str:
        return "/".join(x for x in (self.shape, self.durability, self.name) if x)

    @property
    def gbps(self) -> float:
        return self.ops * self.payload_bytes / self.seconds / GB if self.seconds > 0 else 0.0

    @property
    def file_gbps(self) -> float | None:
        if not self.file_bytes or self.seconds <= 0:
            return None
        return self.ops * self.file_bytes / self.seconds / GB

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["id"] = self.id
        d["gbps"] = self.gbps
        d["file_gbps"] = self.file_gbps
        return d


def compare(row: Result, ceiling: Result, stages: Sequence[Result]) -> None:
    """Hold ``row`` against its raw ``ceiling`` and against the serial bound: the
    ceiling and the CPU ``stages`` the row must run, one after the other."""
    row.ceiling = ceiling.name
    row.ceiling_gbps = ceiling.gbps
    row.ratio = row.gbps / ceiling.gbps if ceiling.gbps else None
    parts = [ceiling, *stages]
    if all(p.gbps > 0 for p in parts):
        row.bound_gbps = 1.0 / sum(1.0 / p.gbps for p in parts)
        row.bound_of = [p.name for p in parts]
        row.ratio_to_bound = row.gbps / row.bound_gbps
