"""The replies of the loads answered into staging: ``prepare_load`` (5.7) and
``lookup_load`` (revision 15, 5.32), and the prefix check that ``lease_load``'s
reply (replies.py) shares (prefix.py): the found chunks are a prefix of the keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Self

from msgspec import Meta

from kvoffload.errors import ErrorCode

from .fields import (
    Aligned,
    LayerSizes,
    Message,
    ReplyMessage,
    decode,
)
from .framing import bad
from .limits import MAX_BATCH, MAX_PIGGYBACK, Op
from .prefix import prefix_reply as _prefix_reply


class LoadSlot(Message, frozen=True):
    verified: bool
    offset: int = 0
    layers: tuple[int, ...] = ()


class _Verified(Message, frozen=True):
    verified: bool


class _LoadHit(Message, frozen=True):
    offset: Aligned
    layers: LayerSizes


#: §5.32: the handles of a request's ``complete`` that were no live load handle.
CompleteFailed = Annotated[tuple[Annotated[int, Meta(ge=1)], ...], Meta(max_length=MAX_PIGGYBACK)]


class _Piggyback(Message, frozen=True):
    complete_failed: CompleteFailed = ()


class _LookupFound(Message, frozen=True):
    WIRE_REQUIRED: ClassVar[tuple[str, ...]] = ("found",)
    found: Annotated[int, Meta(ge=0, le=MAX_BATCH)] = 0


def _load_hit(c: Any, cw: str) -> LoadSlot | None:
    if not decode(_Verified, c, cw).verified:
        return None
    h = decode(_LoadHit, c, cw)
    return LoadSlot(True, h.offset, h.layers)


class PrepareLoadReply(ReplyMessage, frozen=True):
    OP: ClassVar[Op] = Op.PREPARE_LOAD
    handle: int
    stop: ErrorCode
    chunks: tuple[LoadSlot, ...]
    #: Revision 15 (§5.32): handles of the request's ``complete`` that were no
    #: live load handle of the connection (absent: none).
    complete_failed: CompleteFailed = ()

    @property
    def verified(self) -> int:
        """Length of the verified prefix."""
        return sum(1 for c in self.chunks if c.verified)

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "handle": self.handle,
            "stop": int(self.stop),
            "chunks": [c.to_wire() for c in self.chunks],
        }
        if self.complete_failed:
            d["complete_failed"] = list(self.complete_failed)
        return d

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        w = "prepare_load reply"
        failed = decode(_Piggyback, m, w).complete_failed
        return cls(*_prefix_reply(m, w, "verified", _load_hit, LoadSlot(False)), failed)


class LookupLoadReply(PrepareLoadReply, frozen=True):
    """Revision 15 (§5.32): what ``lookup`` (``found``) and ``prepare_load`` (the
    rest) of the same keys answer."""

    OP: ClassVar[Op] = Op.LOOKUP_LOAD
    found: Annotated[int, Meta(ge=0, le=MAX_BATCH)] = 0

    def to_wire(self) -> dict[str, Any]:
        return {"found": self.found, **super().to_wire()}

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        w = "lookup_load reply"
        found = decode(_LookupFound, m, w).found
        failed = decode(_Piggyback, m, w).complete_failed
        handle, stop, chunks = _prefix_reply(m, w, "verified", _load_hit, LoadSlot(False))
        if found > len(chunks):
            raise bad(f"{w}: found {found} > {len(chunks)} keys")
        return cls(handle, stop, chunks, failed, found)


__all__ = ["CompleteFailed", "LoadSlot", "LookupLoadReply", "PrepareLoadReply"]
