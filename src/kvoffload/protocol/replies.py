"""Replies of protocol v1 (protocol-v1.md §5), as frozen ``msgspec.Struct`` messages.

These are the OK replies; an error reply is :class:`ErrorReply`. A reply whose
entries depend on a status or flag (``prepare_store``, ``prepare_load`` and
their direct-path twins) is read through private wire structs (a tagged union
on ``status``, a flag then the found entry's fields) and then checked as a
whole: handle 0 exactly when nothing is to be done, found entries a prefix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Self

import msgspec
from msgspec import Meta

from kvoffload.errors import ErrorCode

from .admin_replies import (
    DropCacheReply,
    FsckReply,
    InspectReply,
    InvalidateReply,
    LsReply,
    NamespacesReply,
    PurgeOlderReply,
    PurgeReply,
    StatsReply,
)
from .fields import (
    Aligned,
    Check,
    Message,
    Path,
    ReplyMessage,
    Salt,
    Seconds,
    ShortStr,
    Tenant,
    UInt,
    WireCode,
    code,
    decode,
    op_table,
)
from .framing import bad
from .limits import (
    ALIGNMENT,
    MAX_ALIGNMENT,
    MAX_BATCH,
    MAX_FRAME,
    MAX_LAYERS,
    MAX_MESSAGE,
    Op,
    StoreStatus,
)
from .load_replies import LoadSlot, LookupLoadReply, PrepareLoadReply
from .prefix import Found as _Found
from .prefix import prefix_reply as _prefix_reply
from .region_replies import RegionLoadReply, RegionStoreReply, RegisterRegionReply
from .sealed_replies import SealedLoadReply, SealedSlot

Ident = Annotated[str, Meta(max_length=256)]
Alignment = Annotated[int, Meta(ge=ALIGNMENT, le=MAX_ALIGNMENT)]


class HelloReply(ReplyMessage, frozen=True):
    OP: ClassVar[Op] = Op.HELLO
    WIRE_REQUIRED: ClassVar[tuple[str, ...]] = (
        "alignment",
        "max_frame",
        "max_batch",
        "max_inflight",
        "max_staging",
        "handle_ttl_s",
    )
    version: Annotated[int, Meta(ge=1, le=0xFFFF)]
    server_id: Ident
    store_id: Ident
    salts: Mapping[Tenant, Salt]
    alignment: Alignment = ALIGNMENT
    max_frame: Annotated[int, Meta(ge=1024, le=MAX_FRAME)] = MAX_FRAME
    max_batch: Annotated[int, Meta(ge=1, le=MAX_BATCH)] = MAX_BATCH
    max_inflight: Annotated[int, Meta(ge=1)] = 64
    max_staging: Annotated[int, Meta(ge=ALIGNMENT)] = 1 << 40
    handle_ttl_s: Seconds = 60.0
    #: Optional (5.1): tenants of this hello that this connection may use the
    #: direct path for. Absent or false: staging only.
    direct: Mapping[Tenant, bool] = msgspec.field(default_factory=dict)
    #: Optional (revision 9, §5.26): the server answers ``prepare_load`` with
    #: ``layerwise`` by reporting layers as they are verified.
    layerwise: bool = False
    #: Optional (revision 6, 5.21): the server serves ``store``. Absent: false.
    store: bool = False
    #: Optional (revision 11, §5.29): the server answers a ``complete_load``
    #: without ``corrupt`` before it reads the connection's next request, so a
    #: client may send it and go on without waiting. Absent: false.
    complete_in_order: bool = False
    #: Optional (revision 12, §5.30): the server answers ``prepare_load`` with
    #: ``chunkwise`` by reporting chunks as they are verified. Absent: false.
    chunkwise: bool = False
    #: Optional (revision 15, §5.32): the server serves ``lookup_load`` and the
    #: ``complete`` key of ``prepare_load`` and ``lookup_load``. Absent: false.
    lookup_load: bool = False
    #: Optional (revision 16, §5.33): the server answers ``sealed_load``. Absent: false.
    sealed_load: bool = False
    #: Optional (revision 17, §5.34): the server serves ``register_region``,
    #: ``region_store`` and ``region_load`` for a client of revision 17; the
    #: largest region it registers. Absent (0): none.
    max_region: UInt = 0

    def validate_wire(self, where: str) -> None:
        if self.alignment & (self.alignment - 1):
            raise bad(f"{where}.alignment: {self.alignment} is not a power of two")

    def to_wire(self) -> dict[str, Any]:
        return (
            {
                "direct": dict(self.direct),
                "version": self.version,
                "server_id": self.server_id,
                "store_id": self.store_id,
                "alignment": self.alignment,
                "max_frame": self.max_frame,
                "max_batch": self.max_batch,
                "max_inflight": self.max_inflight,
                "max_staging": self.max_staging,
                "handle_ttl_s": self.handle_ttl_s,
                "salts": dict(self.salts),
                **({"store": True} if self.store else {}),
            }
            | ({"layerwise": True} if self.layerwise else {})
            | ({"complete_in_order": True} if self.complete_in_order else {})
            | ({"chunkwise": True} if self.chunkwise else {})
            | ({"lookup_load": True} if self.lookup_load else {})
            | ({"sealed_load": True} if self.sealed_load else {})
            | ({"max_region": self.max_region} if self.max_region else {})
        )


class Ack(Message, frozen=True):
    """The reply of a verb without result keys; ``op`` says which verb."""

    op: Op

    def to_wire(self) -> dict[str, Any]:
        return {}


class LookupReply(ReplyMessage, frozen=True):
    OP: ClassVar[Op] = Op.LOOKUP
    found: Annotated[int, Meta(ge=0, le=MAX_BATCH)]

    def to_wire(self) -> dict[str, Any]:
        # Message.to_wire's map, without its per-field generic path: a lookup
        # is on the engine scheduler's path.
        return {"found": self.found}


class DeleteReply(ReplyMessage, frozen=True):
    """§5.35: per key, whether the tenant held it on this node and no longer does."""

    OP: ClassVar[Op] = Op.DELETE
    removed: Annotated[tuple[bool, ...], Meta(min_length=1, max_length=MAX_BATCH)]


class CompleteStoreReply(ReplyMessage, frozen=True):
    OP: ClassVar[Op] = Op.COMPLETE_STORE
    stored: Annotated[tuple[bool, ...], Meta(min_length=1, max_length=MAX_BATCH)]


class StoreReply(ReplyMessage, frozen=True):
    """§5.21: per chunk, ``stored`` as ``complete_store`` says it, and ``codes``: 0
    where stored (or present), else why not (NO_SPACE, TOO_LARGE, INTERNAL)."""

    OP: ClassVar[Op] = Op.STORE
    stored: Annotated[tuple[bool, ...], Meta(min_length=1, max_length=MAX_BATCH)]
    codes: Annotated[tuple[WireCode, ...], Meta(max_length=MAX_BATCH)] = ()

    def validate_wire(self, where: str) -> None:
        if self.codes and len(self.codes) != len(self.stored):
            raise bad(f"{where}: codes and stored differ in length")

    def to_wire(self) -> dict[str, Any]:
        return {"stored": list(self.stored), "codes": list(self.codes)}


# -- prepare_store, lease_store: one entry per chunk, by status ---------------


class StoreSlot(Message, frozen=True):
    status: StoreStatus
    offset: int = 0
    code: ErrorCode = ErrorCode.OK

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {"status": self.status.value}
        if self.status is StoreStatus.WRITE:
            d["offset"] = self.offset
        elif self.status is StoreStatus.REJECTED:
            d["code"] = int(self.code)
        return d


class LeaseSlot(Message, frozen=True):
    """One chunk of a ``lease_store`` reply: where and how the worker writes it."""

    status: StoreStatus
    path: str = ""
    size: int = 0
    data_offset: int = 0
    offsets: tuple[int, ...] = ()
    code: ErrorCode = ErrorCode.OK

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {"status": self.status.value}
        if self.status is StoreStatus.WRITE:
            d.update(
                path=self.path,
                size=self.size,
                data_offset=self.data_offset,
                offsets=list(self.offsets),
            )
        elif self.status is StoreStatus.REJECTED:
            d["code"] = int(self.code)
        return d


class _Exists(Message, frozen=True, tag_field="status", tag="exists"):
    pass


class _Rejected(Message, frozen=True, tag_field="status", tag="rejected"):
    code: WireCode


class _StagedWrite(Message, frozen=True, tag_field="status", tag="write"):
    offset: Aligned


class _LeasedWrite(Message, frozen=True, tag_field="status", tag="write"):
    path: Path
    size: Aligned
    data_offset: Aligned
    offsets: Annotated[tuple[Aligned, ...], Meta(min_length=1, max_length=MAX_LAYERS)]


_StagedEntries = Annotated[
    tuple[_StagedWrite | _Exists | _Rejected, ...], Meta(min_length=1, max_length=MAX_BATCH)
]
_LeasedEntries = Annotated[
    tuple[_LeasedWrite | _Exists | _Rejected, ...], Meta(min_length=1, max_length=MAX_BATCH)
]


class _PrepareStoreWire(Message, frozen=True):
    handle: UInt
    chunks: _StagedEntries


class _LeaseStoreWire(Message, frozen=True):
    WIRE_NULLABLE: ClassVar[tuple[str, ...]] = ("durability",)
    handle: UInt
    alignment: Alignment
    chunks: _LeasedEntries
    durability: ShortStr = ""


def _check_handle(handle: int, slots: tuple[StoreSlot | LeaseSlot, ...], where: str) -> None:
    if (handle == 0) == any(s.status is StoreStatus.WRITE for s in slots):
        raise bad(f"{where}: handle {handle} does not match the chunks to write")


class PrepareStoreReply(ReplyMessage, frozen=True):
    OP: ClassVar[Op] = Op.PREPARE_STORE
    handle: int
    chunks: tuple[StoreSlot, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"handle": self.handle, "chunks": [c.to_wire() for c in self.chunks]}

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        w = "prepare_store reply"
        wire = decode(_PrepareStoreWire, m, w)
        slots = tuple(
            StoreSlot(StoreStatus.WRITE, offset=c.offset)
            if isinstance(c, _StagedWrite)
            else StoreSlot(StoreStatus.REJECTED, code=code(c.code))
            if isinstance(c, _Rejected)
            else StoreSlot(StoreStatus.EXISTS)
            for c in wire.chunks
        )
        _check_handle(wire.handle, slots, w)
        return cls(wire.handle, slots)


class LeaseStoreReply(ReplyMessage, frozen=True):
    OP: ClassVar[Op] = Op.LEASE_STORE
    handle: int
    alignment: int
    chunks: tuple[LeaseSlot, ...]
    #: Optional: the server's durability setting ("object", "batch", "none"; ""
    #: if not sent), a hint for how the client writes (5.14).
    durability: str = ""

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "handle": self.handle,
            "alignment": self.alignment,
            "chunks": [c.to_wire() for c in self.chunks],
        }
        if self.durability:
            d["durability"] = self.durability
        return d

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        w = "lease_store reply"
        wire = decode(_LeaseStoreWire, m, w)
        slots = tuple(
            LeaseSlot(
                StoreStatus.WRITE,
                path=c.path,
                size=c.size,
                data_offset=c.data_offset,
                offsets=c.offsets,
            )
            if isinstance(c, _LeasedWrite)
            else LeaseSlot(StoreStatus.REJECTED, code=code(c.code))
            if isinstance(c, _Rejected)
            else LeaseSlot(StoreStatus.EXISTS)
            for c in wire.chunks
        )
        _check_handle(wire.handle, slots, w)
        return cls(wire.handle, wire.alignment, slots, wire.durability)


# -- lease_load: a found prefix of the keys (prepare_load's: load_replies.py) --


class LayerExtent(Message, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Where one layer of a stored object lies, and its XXH3-128 checksum.

    On the wire: ``[offset, length, check]``.
    """

    offset: Aligned
    length: UInt
    check: Check


class ReadSlot(Message, frozen=True):
    """One key of a ``lease_load`` reply."""

    found: bool
    path: str = ""
    size: int = 0
    layers: tuple[LayerExtent, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        if not self.found:
            return {"found": False}
        return {
            "found": True,
            "path": self.path,
            "size": self.size,
            "layers": [[x.offset, x.length, x.check] for x in self.layers],
        }


class _ReadHit(Message, frozen=True):
    path: Path
    size: Aligned
    layers: Annotated[tuple[LayerExtent, ...], Meta(min_length=1, max_length=MAX_LAYERS)]


class LoadProgress(ReplyMessage, frozen=True):
    """An interim frame of a ``prepare_load`` (same ``id``, code 0).

    Layer-wise (§5.26): the first frame (``layers_done`` 0) carries ``chunks``,
    the regions planned for the leading keys; each later one says that layers
    ``[0, layers_done)`` of the first ``verified`` planned chunks are in their
    regions, verified. Chunk-wise (§5.30): each frame carries the entries of
    chunks ``[first, verified)``, wholly in their regions and verified.
    """

    OP: ClassVar[Op] = Op.LOAD_PROGRESS
    WIRE_REQUIRED: ClassVar[tuple[str, ...]] = ("layers_done", "verified")
    layers_done: Annotated[int, Meta(ge=0, le=MAX_LAYERS)] = 0
    verified: Annotated[int, Meta(ge=0, le=MAX_BATCH)] = 0
    chunks: Annotated[tuple[LoadSlot, ...], Meta(max_length=MAX_BATCH)] = ()
    #: Revision 12 (§5.30): the request index of ``chunks[0]`` (absent: 0).
    first: Annotated[int, Meta(ge=0, le=MAX_BATCH)] = 0

    def validate_wire(self, where: str) -> None:
        if self.chunks and self.layers_done:
            raise bad(f"{where}: chunks are planned only in the first frame")
        if self.first and not self.chunks:
            raise bad(f"{where}: first {self.first} without chunks")
        if self.chunks and self.verified != self.first + len(self.chunks):
            raise bad(
                f"{where}: verified {self.verified} != {self.first} + {len(self.chunks)} chunks"
            )
        for i, c in enumerate(self.chunks):
            if not c.verified or not c.layers or c.offset % ALIGNMENT:
                raise bad(f"{where}.chunks[{i}]: not a planned region")

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {"layers_done": self.layers_done, "verified": self.verified}
        if self.first:
            d["first"] = self.first
        if self.chunks:
            d["chunks"] = [
                {"verified": True, "offset": c.offset, "layers": list(c.layers)}
                for c in self.chunks
            ]
        return d


class LoadPlan(LoadProgress, frozen=True):
    """The plan of a layer-wise load (§5.26: its first frame, exactly once): a
    :class:`LoadProgress` whose ``chunks`` key is on the wire even when no chunk
    is planned (n may be 0). Received, it decodes as a LoadProgress."""

    #: An encoding of its base class, not a message of its own: the reply
    #: table gives the base for its op (tests/protocol/test_protocol_tables.py).
    DECODES_AS_BASE: ClassVar[bool] = True

    def to_wire(self) -> dict[str, Any]:
        d = super().to_wire()
        d.setdefault("chunks", [])
        return d


class LeaseLoadReply(ReplyMessage, frozen=True):
    OP: ClassVar[Op] = Op.LEASE_LOAD
    handle: int
    stop: ErrorCode
    chunks: tuple[ReadSlot, ...]

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
        def hit(c: Any, cw: str) -> ReadSlot | None:
            if not decode(_Found, c, cw).found:
                return None
            h = decode(_ReadHit, c, cw)
            return ReadSlot(True, h.path, h.size, h.layers)

        return cls(*_prefix_reply(m, "lease_load reply", "found", hit, ReadSlot(False)))


class ErrorReply(Message, frozen=True):
    """A reply with a non-zero code; also the server-initiated fatal ``error`` frame."""

    op: str
    code: ErrorCode
    message: str = ""
    #: Only in an UNSUPPORTED_VERSION reply to hello: the server's version range.
    server_versions: tuple[int, int] | None = None

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {"message": self.message[:MAX_MESSAGE]}
        if self.server_versions is not None:
            d["min_version"], d["max_version"] = self.server_versions
        return d


#: The OK replies that carry result keys, each naming its verb in ``OP``:
#: :data:`REPLY_TYPES` is made from it as the request table is from ``Request``.
ResultReply = (
    HelloReply
    | LookupReply
    | PrepareStoreReply
    | CompleteStoreReply
    | PrepareLoadReply
    | StatsReply
    | PurgeReply
    | FsckReply
    | InspectReply
    | LsReply
    | PurgeOlderReply
    | InvalidateReply
    | NamespacesReply
    | LeaseStoreReply
    | LeaseLoadReply
    | LoadProgress
    | StoreReply
    | DropCacheReply
    | LookupLoadReply
    | SealedLoadReply
    | RegisterRegionReply
    | RegionStoreReply
    | RegionLoadReply
    | DeleteReply
)
Reply = ResultReply | Ack | ErrorReply

#: op → reply class of the replies with result keys (an ``Ack`` op is in
#: ``codec.ACK_OPS``), made from :data:`ResultReply`.
REPLY_TYPES: dict[Op, type[ResultReply]] = op_table(ResultReply)

__all__ = [
    "REPLY_TYPES",
    "Ack",
    "CompleteStoreReply",
    "DeleteReply",
    "DropCacheReply",
    "ErrorReply",
    "FsckReply",
    "HelloReply",
    "InspectReply",
    "InvalidateReply",
    "LayerExtent",
    "LeaseLoadReply",
    "LeaseSlot",
    "LeaseStoreReply",
    "LoadPlan",
    "LoadProgress",
    "LoadSlot",
    "LookupLoadReply",
    "LookupReply",
    "LsReply",
    "NamespacesReply",
    "PrepareLoadReply",
    "PrepareStoreReply",
    "PurgeOlderReply",
    "PurgeReply",
    "ReadSlot",
    "RegionLoadReply",
    "RegionStoreReply",
    "RegisterRegionReply",
    "Reply",
    "ReplyMessage",
    "ResultReply",
    "SealedLoadReply",
    "SealedSlot",
    "StatsReply",
    "StoreReply",
    "StoreSlot",
]
