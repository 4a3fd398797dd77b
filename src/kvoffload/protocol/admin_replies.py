"""Replies of the admin and report verbs of protocol v1 (protocol-v1.md §5.10–5.12,
§5.16–5.18, §5.20): ``purge``, ``stats``, ``fsck``, ``inspect``, ``ls``,
``purge_older``, ``invalidate`` and ``namespaces``. Their results are counts or
free-form report maps; :mod:`.replies` re-exports them with the other replies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Self

import msgspec

from .fields import ReplyMessage, UInt, free_form
from .limits import Op


class PurgeReply(ReplyMessage, frozen=True):
    OP: ClassVar[Op] = Op.PURGE
    removed: UInt
    #: Optional (revision 7, 5.11): ``reached`` (tiers the purge reached) and
    #: ``outside`` (tiers it cannot reach), lists of tier names. Empty: not sent.
    tiers: Mapping[str, tuple[str, ...]] = msgspec.field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"removed": self.removed}
        if self.tiers:
            out["tiers"] = {k: list(v) for k, v in self.tiers.items()}
        return out


class StatsReply(ReplyMessage, frozen=True):
    OP: ClassVar[Op] = Op.STATS
    stats: Mapping[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return {"stats": dict(self.stats)}

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        return cls(free_form(m, "stats", "stats reply"))


class _ReportReply(ReplyMessage, frozen=True):
    """A reply whose one key is the free-form map ``report``."""

    report: Mapping[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return {"report": dict(self.report)}

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        return cls(free_form(m, "report", f"{cls.OP.value} reply"))


class FsckReply(_ReportReply, frozen=True):
    OP: ClassVar[Op] = Op.FSCK


class InspectReply(_ReportReply, frozen=True):
    OP: ClassVar[Op] = Op.INSPECT


class LsReply(_ReportReply, frozen=True):
    """``report``: ``chunks`` (a list of maps) and ``more`` (bool: a next page exists)."""

    OP: ClassVar[Op] = Op.LS


class PurgeOlderReply(ReplyMessage, frozen=True):
    OP: ClassVar[Op] = Op.PURGE_OLDER
    removed: UInt


class DropCacheReply(ReplyMessage, frozen=True):
    """§5.31: the images dropped; ``held_bytes``, the tier's memory still mapped
    (kept as spare buffers)."""

    OP: ClassVar[Op] = Op.DROP_CACHE
    dropped: UInt
    held_bytes: UInt = 0


class InvalidateReply(_ReportReply, frozen=True):
    """§5.20: what was (or, dry, would be) removed, and the unknown contracts left."""

    OP: ClassVar[Op] = Op.INVALIDATE


class NamespacesReply(_ReportReply, frozen=True):
    """§5.20: ``namespaces``, a list of maps."""

    OP: ClassVar[Op] = Op.NAMESPACES


__all__ = [
    "DropCacheReply",
    "FsckReply",
    "InspectReply",
    "InvalidateReply",
    "LsReply",
    "NamespacesReply",
    "PurgeOlderReply",
    "PurgeReply",
    "StatsReply",
]
