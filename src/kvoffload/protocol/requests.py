"""Requests of protocol v1 (protocol-v1.md §5), as frozen ``msgspec.Struct`` messages.

Each class names its verb in ``OP``; ``to_wire()`` gives its result keys in the
order they have always been sent, and ``from_wire()`` validates a received map
(:func:`kvoffload.protocol.fields.decode`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Self

from msgspec import Meta

from .fields import (
    Handle,
    Key,
    Keys,
    LayerSizes,
    Message,
    Namespace,
    Seconds,
    Tenant,
    UInt,
    decode,
    distinct,
    plain,
)
from .framing import bad
from .limits import (
    ALIGNMENT,
    MAX_BATCH,
    MAX_CLIENT_NAME,
    MAX_PIGGYBACK,
    MAX_PROTOCOL_VERSION,
    MAX_TENANTS,
    MIN_PROTOCOL_VERSION,
    Op,
)

Version = Annotated[int, Meta(ge=1, le=0xFFFF)]


class RequestMessage(Message, frozen=True):
    """Base of the requests: ``OP`` is the verb."""

    OP: ClassVar[Op]

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        return decode(cls, m, cls.OP.value)


class Hello(RequestMessage, frozen=True):
    OP: ClassVar[Op] = Op.HELLO
    WIRE_REQUIRED: ClassVar[tuple[str, ...]] = ("min_version", "max_version", "client", "tenants")
    min_version: Version = MIN_PROTOCOL_VERSION
    max_version: Version = MAX_PROTOCOL_VERSION
    client: Annotated[str, Meta(max_length=MAX_CLIENT_NAME)] = ""
    tenants: Annotated[tuple[Tenant, ...], Meta(max_length=MAX_TENANTS)] = ()
    #: Optional (revision 17, §5.1): the revision of version 1 the client
    #: speaks; absent (0): older than 17. Sent only when non-zero.
    revision: UInt = 0

    def to_wire(self) -> dict[str, Any]:
        d = super().to_wire()
        if not self.revision:
            del d["revision"]
        return d

    def validate_wire(self, where: str) -> None:
        if self.min_version > self.max_version:
            raise bad(f"{where}: min_version {self.min_version} > max_version {self.max_version}")
        distinct(self.tenants, f"{where}.tenants", "tenant")


class RegisterStaging(RequestMessage, frozen=True):
    OP: ClassVar[Op] = Op.REGISTER_STAGING
    size: Annotated[int, Meta(ge=ALIGNMENT, multiple_of=ALIGNMENT)]


class _TenantKeys(RequestMessage, frozen=True):
    tenant: Tenant
    keys: Keys

    def to_wire(self) -> dict[str, Any]:
        # What Message.to_wire gives, without its per-field generic path: a
        # lookup is on the scheduler's path.
        return {"tenant": self.tenant, "keys": list(self.keys)}


class Lookup(_TenantKeys, frozen=True):
    OP: ClassVar[Op] = Op.LOOKUP


class Touch(_TenantKeys, frozen=True):
    OP: ClassVar[Op] = Op.TOUCH


class Delete(_TenantKeys, frozen=True):
    """§5.35 (revision 18): remove chunks of the tenant from the store."""

    OP: ClassVar[Op] = Op.DELETE


#: Revision 15 (§5.32): load handles completed before the request is served.
Completes = Annotated[tuple[Handle, ...], Meta(max_length=MAX_PIGGYBACK)]


class PrepareLoad(_TenantKeys, frozen=True):
    OP: ClassVar[Op] = Op.PREPARE_LOAD
    #: Revision 9 (§5.26): report layers as they are verified (``load_progress``
    #: frames before the reply). Sent only when true, and only to a server whose
    #: ``hello`` announced ``layerwise``; ignored by ``lease_load``.
    layerwise: bool = False
    #: Revision 12 (§5.30): report chunks as they are verified (chunk frames
    #: before the reply). Sent only when true, only to a server whose ``hello``
    #: announced ``chunkwise``, never with ``layerwise``.
    chunkwise: bool = False
    #: Revision 15 (§5.32): earlier load handles this request completes first,
    #: as ``complete_load`` without ``corrupt`` would. Sent only when non-empty,
    #: only to a server whose ``hello`` announced ``lookup_load``.
    complete: Completes = ()

    def validate_wire(self, where: str) -> None:
        distinct(self.complete, f"{where}.complete", "handle")

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {"tenant": self.tenant, "keys": list(self.keys)}
        if self.layerwise:
            d["layerwise"] = True
        if self.chunkwise:
            d["chunkwise"] = True
        if self.complete:
            d["complete"] = list(self.complete)
        return d


class LeaseLoad(PrepareLoad, frozen=True):
    """``prepare_load``'s fields; the direct path (5.15). Match it before PrepareLoad."""

    OP: ClassVar[Op] = Op.LEASE_LOAD

    def validate_wire(self, where: str) -> None:
        if self.complete:
            raise bad(f"{where}.complete: lease_load completes no handle on the way (5.32)")


class LookupLoad(_TenantKeys, frozen=True):
    """Revision 15 (§5.32): ``lookup`` and ``prepare_load`` of the same keys in one
    round trip, completing the load handles in ``complete`` first."""

    OP: ClassVar[Op] = Op.LOOKUP_LOAD
    complete: Completes = ()

    def validate_wire(self, where: str) -> None:
        distinct(self.complete, f"{where}.complete", "handle")

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {"tenant": self.tenant, "keys": list(self.keys)}
        if self.complete:
            d["complete"] = list(self.complete)
        return d


class SealedLoad(_TenantKeys, frozen=True):
    """§5.33 (revision 16): the leading objects handed by descriptor, each with
    the key that opens it alone; completed by ``complete_load``."""

    OP: ClassVar[Op] = Op.SEALED_LOAD


#: An engine block hash as vLLM publishes it: bytes, or a u64 (events-v1 §1).
EngineHash = Annotated[bytes, Meta(min_length=1, max_length=64)] | Annotated[int, Meta(ge=0)]
#: Blocks of one chunk: a chunk holds at most this many engine blocks.
MAX_ENGINE_BLOCKS = 4096


class EngineBlocks(Message, frozen=True):
    """§5.4 ``blocks``: the engine's own hashes of the blocks a chunk holds.

    Kept by the server with the chunk and published on its KV-event feed
    (docs/spec/events-v1.md); never token ids. Optional in protocol 1.
    """

    WIRE_NULLABLE: ClassVar[tuple[str, ...]] = (
        "parent",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kind",
    )
    hashes: Annotated[tuple[EngineHash, ...], Meta(min_length=1, max_length=MAX_ENGINE_BLOCKS)]
    block_size: Annotated[int, Meta(ge=1, le=1 << 20)]
    parent: EngineHash | None = None
    lora_name: Annotated[str, Meta(max_length=256)] | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: Annotated[int, Meta(ge=0, le=0xFFFF)] | None = None
    kind: Annotated[str, Meta(max_length=64)] | None = None

    def validate_wire(self, where: str) -> None:
        if self.extra_keys is not None:
            if len(self.extra_keys) != len(self.hashes):
                raise bad(f"{where}.extra_keys: one entry per hash expected")
            for i, v in enumerate(self.extra_keys):
                if v is not None and not isinstance(v, list | tuple):
                    raise bad(f"{where}.extra_keys[{i}]: an array or nil expected")
                plain(list(v) if v is not None else None, f"{where}.extra_keys[{i}]")

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {"hashes": list(self.hashes), "block_size": self.block_size}
        for name in self.WIRE_NULLABLE:
            v = getattr(self, name)
            if v is not None:
                d[name] = (
                    [list(x) if isinstance(x, tuple) else x for x in v]
                    if (name == "extra_keys")
                    else v
                )
        return d


class ChunkSpec(Message, frozen=True):
    WIRE_NULLABLE: ClassVar[tuple[str, ...]] = ("blocks",)
    key: Key
    layers: LayerSizes
    #: Optional (§5.4): the engine block hashes of the chunk, for KV events.
    blocks: EngineBlocks | None = None

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {"key": self.key, "layers": list(self.layers)}
        if self.blocks is not None:
            d["blocks"] = self.blocks.to_wire()
        return d

    def validate_wire(self, where: str) -> None:
        if self.blocks is not None:
            self.blocks.validate_wire(f"{where}.blocks")

    @property
    def payload(self) -> int:
        return sum(self.layers)


class PrepareStore(RequestMessage, frozen=True):
    OP: ClassVar[Op] = Op.PREPARE_STORE
    WIRE_NULLABLE: ClassVar[tuple[str, ...]] = ("contract",)
    tenant: Tenant
    namespace: Namespace
    chunks: Annotated[tuple[ChunkSpec, ...], Meta(min_length=1, max_length=MAX_BATCH)]
    ttl_s: Seconds | None = None
    #: Revision 5, optional (§5.19): the namespace's contract fields, which the
    #: server records once they hash to ``namespace``.
    contract: Mapping[str, Any] | None = None

    def validate_wire(self, where: str) -> None:
        distinct(tuple(c.key for c in self.chunks), f"{where}.chunks", "key")
        for i, c in enumerate(self.chunks):
            c.validate_wire(f"{where}.chunks[{i}]")

    def to_wire(self) -> dict[str, Any]:
        d = super().to_wire()
        if self.contract is None:
            del d["contract"]
        else:
            d["contract"] = dict(self.contract)
        return d


class LeaseStore(PrepareStore, frozen=True):
    """``prepare_store``'s fields; the direct path (5.14). Match it before PrepareStore."""

    OP: ClassVar[Op] = Op.LEASE_STORE


class StoreChunk(ChunkSpec, frozen=True, kw_only=True):
    """A ``store`` chunk (§5.21): a ``prepare_store`` chunk plus the region of the
    client's staging buffer that already holds its packed layers."""

    #: Start of the chunk's region: a multiple of the alignment (checked against
    #: the hello's ``alignment`` and the staging size by the server). Required.
    offset: UInt

    def to_wire(self) -> dict[str, Any]:
        d = super().to_wire()
        d["offset"] = self.offset
        return d


class StoreBatch(RequestMessage, frozen=True):
    """§5.21 (revision 6): store chunks the client already put in its staging buffer,
    at regions it chose, in one round trip (``prepare_store`` + ``complete_store``)."""

    OP: ClassVar[Op] = Op.STORE
    tenant: Tenant
    namespace: Namespace
    chunks: Annotated[tuple[StoreChunk, ...], Meta(min_length=1, max_length=MAX_BATCH)]
    ttl_s: Seconds | None = None

    def validate_wire(self, where: str) -> None:
        distinct(tuple(c.key for c in self.chunks), f"{where}.chunks", "key")
        for i, c in enumerate(self.chunks):
            c.validate_wire(f"{where}.chunks[{i}]")


class CompleteStore(RequestMessage, frozen=True):
    OP: ClassVar[Op] = Op.COMPLETE_STORE
    handle: Handle


class CompleteLoad(RequestMessage, frozen=True):
    OP: ClassVar[Op] = Op.COMPLETE_LOAD
    WIRE_NULLABLE: ClassVar[tuple[str, ...]] = ("corrupt",)
    handle: Handle
    #: Of a ``lease_load`` handle: indices of the chunks whose bytes failed the
    #: reader's checksums (5.15). Optional; absent = none.
    corrupt: Annotated[
        tuple[Annotated[int, Meta(ge=0, le=MAX_BATCH - 1)], ...], Meta(max_length=MAX_BATCH)
    ] = ()

    def validate_wire(self, where: str) -> None:
        distinct(self.corrupt, f"{where}.corrupt", "index")

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {"handle": self.handle}
        if self.corrupt:
            d["corrupt"] = list(self.corrupt)
        return d


class Abort(RequestMessage, frozen=True):
    OP: ClassVar[Op] = Op.ABORT
    handle: Handle


class Stats(RequestMessage, frozen=True):
    OP: ClassVar[Op] = Op.STATS


class DropCache(RequestMessage, frozen=True):
    """§5.31 (admin, revision 13): empty the sidecar's RAM tier."""

    OP: ClassVar[Op] = Op.DROP_CACHE


class Bye(RequestMessage, frozen=True):
    OP: ClassVar[Op] = Op.BYE


class Purge(RequestMessage, frozen=True):
    OP: ClassVar[Op] = Op.PURGE
    tenant: Tenant
    namespace: Namespace | None = None
    #: Revision 7, optional: reply with the tiers reached (sent only when true).
    tiers: bool = False

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {"tenant": self.tenant, "namespace": self.namespace}
        if self.tiers:
            d["tiers"] = True
        return d


class Fsck(RequestMessage, frozen=True):
    OP: ClassVar[Op] = Op.FSCK
    WIRE_REQUIRED: ClassVar[tuple[str, ...]] = ("repair",)
    repair: bool = False
    #: Revision 3, optional: also decrypt/checksum every layer (sent only when true).
    verify_data: bool = False

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {"repair": self.repair}
        if self.verify_data:
            d["verify_data"] = True
        return d


class Inspect(RequestMessage, frozen=True):
    """§5.16 (admin): the store's summary, per tenant and namespace."""

    OP: ClassVar[Op] = Op.INSPECT


class Ls(RequestMessage, frozen=True):
    """§5.17 (admin): index records, filtered, one page at a time."""

    OP: ClassVar[Op] = Op.LS
    tenant: Tenant | None = None
    namespace: Namespace | None = None
    older_than_s: Seconds | None = None
    newer_than_s: Seconds | None = None
    #: Rows of this page (0 = as many as fit: the server's page size).
    limit: UInt = 0
    #: Matching rows to skip (the rows of earlier pages).
    skip: UInt = 0


class PurgeOlder(RequestMessage, frozen=True):
    """§5.18 (admin): remove chunks created more than ``older_than_s`` ago."""

    OP: ClassVar[Op] = Op.PURGE_OLDER
    WIRE_REQUIRED: ClassVar[tuple[str, ...]] = ("older_than_s",)
    older_than_s: Seconds
    tenant: Tenant | None = None


#: §5.20: a selector value (a model revision, tokenizer hash, template version).
Selector = Annotated[str, Meta(min_length=1, max_length=1024)]


class Invalidate(RequestMessage, frozen=True):
    """§5.20 (admin, revision 5): purge the namespaces built under a contract field."""

    OP: ClassVar[Op] = Op.INVALIDATE
    WIRE_NULLABLE: ClassVar[tuple[str, ...]] = (
        "model_revision",
        "tokenizer_hash",
        "chat_template_version",
        "model",
        "tenant",
    )
    model_revision: Selector | None = None
    tokenizer_hash: Selector | None = None
    chat_template_version: Selector | None = None
    model: Selector | None = None
    tenant: Tenant | None = None
    dry_run: bool = False

    def validate_wire(self, where: str) -> None:
        if not (self.model_revision or self.tokenizer_hash or self.chat_template_version):
            raise bad(f"{where}: needs model_revision, tokenizer_hash or chat_template_version")

    def selector(self) -> dict[str, str]:
        names = ("model_revision", "tokenizer_hash", "chat_template_version", "model")
        return {n: v for n in names if (v := getattr(self, n)) is not None}

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = self.selector()
        if self.tenant is not None:
            d["tenant"] = self.tenant
        if self.dry_run:
            d["dry_run"] = True
        return d


class Namespaces(RequestMessage, frozen=True):
    """§5.20 (admin, revision 5): the namespaces with their contracts, sizes and ages."""

    OP: ClassVar[Op] = Op.NAMESPACES
    WIRE_NULLABLE: ClassVar[tuple[str, ...]] = ("tenant",)
    tenant: Tenant | None = None
    #: Rows to skip: those of earlier pages (as ``ls``, §5.17).
    skip: UInt = 0

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {} if self.tenant is None else {"tenant": self.tenant}
        if self.skip:
            d["skip"] = self.skip
        return d


__all__ = [
    "Abort",
    "Bye",
    "ChunkSpec",
    "CompleteLoad",
    "CompleteStore",
    "Delete",
    "DropCache",
    "Fsck",
    "Hello",
    "Inspect",
    "Invalidate",
    "LeaseLoad",
    "LeaseStore",
    "Lookup",
    "LookupLoad",
    "Ls",
    "Namespaces",
    "PrepareLoad",
    "PrepareStore",
    "Purge",
    "PurgeOlder",
    "RegisterStaging",
    "RequestMessage",
    "SealedLoad",
    "Stats",
    "StoreBatch",
    "StoreChunk",
    "Touch",
]
