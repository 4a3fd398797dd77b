"""What a consumer of KV events knows of each source (docs/spec/events-v1.md §8).

A :class:`SourceSpec` names one publisher (its PUB endpoint, replay ROUTER and
topic); a :class:`SourceStatus` is what :class:`~.consumer.EventConsumer`
reports of it: its :class:`Health`, the last seq applied, counters, and the
recoveries (:class:`Recovery`) it needed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum


class Health(StrEnum):
    LIVE = "live"
    REPLAYING = "replaying"
    STALE = "stale"


class Recovery(StrEnum):
    """How a source's view was brought back in line."""

    REPLAY = "replay"
    SNAPSHOT = "snapshot"
    RESTART = "restart"


@dataclass(frozen=True)
class CurveClient:
    """ZMQ CURVE keys (Z85) to reach a publisher on TCP (events-v1 §7)."""

    server_public_key: bytes
    public_key: bytes
    secret_key: bytes


@dataclass(frozen=True)
class SourceSpec:
    """One publisher: its PUB endpoint, replay ROUTER and topic prefix.

    ``snapshots``: the source answers ``snapshot/1`` on its replay socket (a
    kvoffload sidecar; a vLLM engine does not). ``topic``: a tenant's channel too (§7.1).
    """

    name: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    snapshots: bool = False
    curve: CurveClient | None = None


@dataclass
class SourceStatus:
    """Health and counters of one source; a copy when read through the consumer."""

    name: str
    health: Health = Health.STALE
    last_seq: int | None = None
    incarnation: int | None = None
    batches: int = 0
    events: int = 0
    duplicates: int = 0
    gaps: int = 0
    malformed: int = 0
    unknown_events: int = 0
    failed_requests: int = 0
    recoveries: Counter[str] = field(default_factory=Counter)
    last_error: str | None = None


#: Applied batches remembered per source to tell a duplicate from a restart.


def copy_status(s: SourceStatus) -> SourceStatus:
    return SourceStatus(
        name=s.name,
        health=s.health,
        last_seq=s.last_seq,
        incarnation=s.incarnation,
        batches=s.batches,
        events=s.events,
        duplicates=s.duplicates,
        gaps=s.gaps,
        malformed=s.malformed,
        unknown_events=s.unknown_events,
        failed_requests=s.failed_requests,
        recoveries=Counter(s.recoveries),
        last_error=s.last_error,
    )


__all__ = ["CurveClient", "Health", "Recovery", "SourceSpec", "SourceStatus", "copy_status"]
