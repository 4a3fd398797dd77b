"""The ``sealed_load`` reply (protocol-v1.md §5.33, revision 16)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Self

from msgspec import Meta

from kvoffload.errors import ErrorCode

from .fields import Aligned, Message, ReplyMessage, decode
from .framing import bad
from .limits import Op
from .prefix import Found, prefix_reply


class SealedSlot(Message, frozen=True):
    """One key of a ``sealed_load`` reply (§5.33)."""

    found: bool
    size: int = 0
    #: The object's own key (keys-v1.md §14); empty for a plaintext object.
    key: bytes = b""
    namespace: bytes = b""

    def to_wire(self) -> dict[str, Any]:
        if not self.found:
            return {"found": False}
        return {"found": True, "size": self.size, "key": self.key, "namespace": self.namespace}


class _SealedHit(Message, frozen=True):
    size: Aligned
    key: Annotated[bytes, Meta(max_length=32)]
    namespace: Annotated[bytes, Meta(min_length=32, max_length=32)]


class SealedLoadReply(ReplyMessage, frozen=True):
    """§5.33: the found prefix; found chunk ``i`` is the ``i``-th descriptor of the frame.

    ``fds`` is not on the wire: the sender's descriptors to pass (the connection
    closes them once sent), or, received, the ones that came with the frame."""

    OP: ClassVar[Op] = Op.SEALED_LOAD
    handle: int
    stop: ErrorCode
    chunks: tuple[SealedSlot, ...]
    fds: tuple[int, ...] = ()

    @property
    def found(self) -> int:
        return sum(1 for c in self.chunks if c.found)

    def to_wire(self) -> dict[str, Any]:
        return {
            "handle": self.handle,
            "stop": int(self.stop),
            "chunks": [c.to_wire() for c in self.chunks],
        }

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        def hit(c: Any, cw: str) -> SealedSlot | None:
            if not decode(Found, c, cw).found:
                return None
            h = decode(_SealedHit, c, cw)
            if len(h.key) not in (0, 32):
                raise bad(f"{cw}.key: {len(h.key)} bytes, expected 0 or 32")
            return SealedSlot(True, h.size, h.key, h.namespace)

        return cls(*prefix_reply(m, "sealed_load reply", "found", hit, SealedSlot(False)))


__all__ = ["SealedLoadReply", "SealedSlot"]
