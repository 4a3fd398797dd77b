"""Requests of the in-place verbs (protocol-v1.md §5.34, revision 17)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from msgspec import Meta

from .fields import Keys, LayerSizes, Message, Namespace, Seconds, Tenant, UInt, distinct
from .framing import bad
from .limits import ALIGNMENT, MAX_BATCH, Op
from .requests import ChunkSpec, RequestMessage


class RegisterRegion(RequestMessage, frozen=True):
    """§5.34 (revision 17): a region file of the peer, by descriptor (``fds`` = 1)."""

    OP: ClassVar[Op] = Op.REGISTER_REGION
    size: Annotated[int, Meta(ge=ALIGNMENT, multiple_of=ALIGNMENT)]


#: A region id the server gave (``register_region``'s reply).
RegionId = Annotated[int, Meta(ge=1, le=0xFFFF)]


class RegionChunk(ChunkSpec, frozen=True, kw_only=True):
    """A ``region_store`` chunk (§5.34): its packed layers lie in a registered
    region at ``offset`` (any byte offset), ``payload`` bytes long."""

    region: RegionId
    offset: UInt

    def to_wire(self) -> dict[str, Any]:
        d = super().to_wire()
        d["region"] = self.region
        d["offset"] = self.offset
        return d


class RegionStore(RequestMessage, frozen=True):
    """§5.34 (revision 17): ``store`` (§5.21) with each chunk read from a
    registered region file instead of the staging buffer."""

    OP: ClassVar[Op] = Op.REGION_STORE
    WIRE_NULLABLE: ClassVar[tuple[str, ...]] = ("contract",)
    tenant: Tenant
    namespace: Namespace
    chunks: Annotated[tuple[RegionChunk, ...], Meta(min_length=1, max_length=MAX_BATCH)]
    ttl_s: Seconds | None = None
    #: As ``prepare_store``'s (§5.19): the namespace's contract fields.
    contract: Mapping[str, Any] | None = None

    def validate_wire(self, where: str) -> None:
        distinct(tuple(c.key for c in self.chunks), f"{where}.chunks", "key")
        for i, c in enumerate(self.chunks):
            c.validate_wire(f"{where}.chunks[{i}]")

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "tenant": self.tenant,
            "namespace": self.namespace,
            "chunks": [c.to_wire() for c in self.chunks],
        }
        if self.ttl_s is not None:
            d["ttl_s"] = self.ttl_s
        if self.contract is not None:
            d["contract"] = dict(self.contract)
        return d


class RegionDest(Message, frozen=True):
    """Where one chunk of a ``region_load`` goes (§5.34): its layers, packed,
    at ``offset`` of region ``region``; an object of other layer sizes is a miss."""

    region: RegionId
    offset: UInt
    layers: LayerSizes

    def to_wire(self) -> dict[str, Any]:
        return {"region": self.region, "offset": self.offset, "layers": list(self.layers)}

    @property
    def length(self) -> int:
        return sum(self.layers)


class RegionLoad(RequestMessage, frozen=True):
    """§5.34 (revision 17): verify and decrypt the leading chunks of ``keys`` and
    write each into its destination; no handle, nothing to complete."""

    OP: ClassVar[Op] = Op.REGION_LOAD
    tenant: Tenant
    keys: Keys
    dests: Annotated[tuple[RegionDest, ...], Meta(min_length=1, max_length=MAX_BATCH)]

    def validate_wire(self, where: str) -> None:
        if len(self.dests) != len(self.keys):
            raise bad(f"{where}.dests: one per key expected, got {len(self.dests)}")

    def to_wire(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "keys": list(self.keys),
            "dests": [d.to_wire() for d in self.dests],
        }


__all__ = ["RegionChunk", "RegionDest", "RegionId", "RegionLoad", "RegionStore", "RegisterRegion"]
