"""The replies of the in-place verbs (protocol-v1.md §5.34, revision 17)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from msgspec import Meta

from kvoffload.errors import ErrorCode

from .fields import ReplyMessage, WireCode, code
from .framing import bad
from .limits import MAX_BATCH, Op


class RegisterRegionReply(ReplyMessage, frozen=True):
    """§5.34: the id that names the registered region in later requests."""

    OP: ClassVar[Op] = Op.REGISTER_REGION
    region: Annotated[int, Meta(ge=1, le=0xFFFF)]


class RegionStoreReply(ReplyMessage, frozen=True):
    """§5.34: what ``store`` (§5.21) answers, per chunk."""

    OP: ClassVar[Op] = Op.REGION_STORE
    stored: Annotated[tuple[bool, ...], Meta(min_length=1, max_length=MAX_BATCH)]
    codes: Annotated[tuple[WireCode, ...], Meta(min_length=1, max_length=MAX_BATCH)]

    def validate_wire(self, where: str) -> None:
        if len(self.codes) != len(self.stored):
            raise bad(f"{where}: codes and stored differ in length")

    def to_wire(self) -> dict[str, Any]:
        return {"stored": list(self.stored), "codes": list(self.codes)}


class RegionLoadReply(ReplyMessage, frozen=True):
    """§5.34: the leading ``loaded`` chunks are verified and in their destinations;
    ``stop`` says why the prefix ended (``OK``: every key)."""

    OP: ClassVar[Op] = Op.REGION_LOAD
    loaded: Annotated[int, Meta(ge=0, le=MAX_BATCH)]
    #: An error code (§4); one this side does not know reads as ``INTERNAL``.
    stop: WireCode

    @property
    def why(self) -> ErrorCode:
        return code(self.stop)

    def to_wire(self) -> dict[str, Any]:
        return {"loaded": self.loaded, "stop": int(self.stop)}


__all__ = ["RegionLoadReply", "RegionStoreReply", "RegisterRegionReply"]
