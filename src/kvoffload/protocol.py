"""Wire protocol v1 between a worker and the sidecar: framing, messages, validation.

``docs/spec/protocol-v1.md`` is normative; this module implements it and holds no
I/O, so the client (``kvoffload.client``) and the server
(``kvoffload.sidecar.server``) share every byte-level rule.

Receiving side, in order::

    bytes ──▶ FrameDecoder.feed() ──▶ Frame(msg: dict, fds)
          ──▶ parse_request(msg) / parse_reply(msg) ──▶ typed message

Anything malformed raises :class:`ProtocolError` with an :class:`ErrorCode`;
no ``KeyError``/``TypeError``/``UnicodeDecodeError`` escapes from peer input.
A ``ProtocolError`` with a ``request_id`` concerns one request (the stream is
still in sync); one without is fatal for the connection.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import math
import os
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Self, TypeVar

import msgpack

from kvoffload.errors import ErrorCode, ProtocolError

from .contract import TENANT_RE

PROTOCOL_VERSION = 1
MIN_PROTOCOL_VERSION = 1
MAX_PROTOCOL_VERSION = 1

CLIENT_MAGIC = b"KVOFFCLT"
SERVER_MAGIC = b"KVOFFSRV"
MAGIC_SIZE = 8

MAX_FRAME = 1 << 20
MAX_BATCH = 1024
MAX_LAYERS = 0xFFFF
MAX_TENANTS = 64
MAX_CLIENT_NAME = 128
MAX_REQUEST_ID = 2**32 - 1
MAX_U64 = 2**64 - 1
ALIGNMENT = 4096
KEY_SIZE = 32
SALT_SIZE = 32
MAX_MESSAGE = 4096
#: Most descriptors one frame may declare, and most received but unclaimed.
MAX_FDS = 4
#: Longest object path a lease may name.
MAX_PATH = 4096

_LENGTH = struct.Struct("<I")
LENGTH_SIZE = _LENGTH.size


class Op(StrEnum):
    HELLO = "hello"
    REGISTER_STAGING = "register_staging"
    LOOKUP = "lookup"
    PREPARE_STORE = "prepare_store"
    COMPLETE_STORE = "complete_store"
    ABORT = "abort"
    PREPARE_LOAD = "prepare_load"
    COMPLETE_LOAD = "complete_load"
    TOUCH = "touch"
    STATS = "stats"
    PURGE = "purge"
    FSCK = "fsck"
    BYE = "bye"
    LEASE_STORE = "lease_store"
    LEASE_LOAD = "lease_load"
    #: Server-initiated fatal error frame (id 0).
    ERROR = "error"


class StoreStatus(StrEnum):
    WRITE = "write"
    EXISTS = "exists"
    REJECTED = "rejected"


def _bad(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, message)


# ---------------------------------------------------------------------------
# Field validation. Each helper returns the value with its exact Python type or
# raises ProtocolError(BAD_REQUEST); ``where`` names the field for the message.


def _field(m: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in m:
        raise _bad(f"{where}: missing field {key!r}")
    return m[key]


def _uint(v: Any, where: str, lo: int = 0, hi: int = MAX_U64) -> int:
    # bool is an int subclass, and True must not pass as a size.
    if not isinstance(v, int) or isinstance(v, bool):
        raise _bad(f"{where}: expected an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise _bad(f"{where}: {v} out of range [{lo}, {hi}]")
    return v


def _str(v: Any, where: str, max_len: int) -> str:
    if not isinstance(v, str):
        raise _bad(f"{where}: expected a string, got {type(v).__name__}")
    if len(v) > max_len:
        raise _bad(f"{where}: longer than {max_len} characters")
    return v


def _bin(v: Any, where: str, size: int) -> bytes:
    if not isinstance(v, bytes):
        raise _bad(f"{where}: expected bin, got {type(v).__name__}")
    if len(v) != size:
        raise _bad(f"{where}: expected {size} bytes, got {len(v)}")
    return v


def _bool(v: Any, where: str) -> bool:
    if not isinstance(v, bool):
        raise _bad(f"{where}: expected a bool, got {type(v).__name__}")
    return v


def _float(v: Any, where: str, lo: float = 0.0) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _bad(f"{where}: expected a number, got {type(v).__name__}")
    f = float(v)
    if not math.isfinite(f) or f < lo:
        raise _bad(f"{where}: {v!r} is not a finite number ≥ {lo}")
    return f


def _list(v: Any, where: str, min_len: int, max_len: int) -> list[Any]:
    if not isinstance(v, list):
        raise _bad(f"{where}: expected an array, got {type(v).__name__}")
    if not min_len <= len(v) <= max_len:
        raise _bad(f"{where}: {len(v)} entries, expected {min_len}..{max_len}")
    return v


def _map(v: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise _bad(f"{where}: expected a map with string keys")
    return v


def _tenant(v: Any, where: str) -> str:
    s = _str(v, where, 64)
    if not TENANT_RE.match(s):
        raise _bad(f"{where}: invalid tenant id {s!r}")
    return s


def _keys(v: Any, where: str) -> tuple[bytes, ...]:
    return tuple(
        _bin(k, f"{where}[{i}]", KEY_SIZE) for i, k in enumerate(_list(v, where, 1, MAX_BATCH))
    )


def _layer_sizes(v: Any, where: str, min_len: int) -> tuple[int, ...]:
    return tuple(
        _uint(n, f"{where}[{i}]", 1, MAX_U64)
        for i, n in enumerate(_list(v, where, min_len, MAX_LAYERS))
    )


def _code(v: Any, where: str) -> ErrorCode:
    return ErrorCode.from_wire(_uint(v, where, 0, 0xFFFF))


def _plain(v: Any, where: str, depth: int = 0) -> Any:
    """Check a free-form value (stats, fsck report) holds only plain msgpack types."""
    if depth > 16:
        raise _bad(f"{where}: nested too deep")
    if v is None or isinstance(v, bool | int | float | str | bytes):
        return v
    if isinstance(v, list):
        return [_plain(x, f"{where}[]", depth + 1) for x in v]
    if isinstance(v, dict):
        return {
            _str(k, f"{where} key", MAX_MESSAGE): _plain(x, f"{where}.{k}", depth + 1)
            for k, x in v.items()
        }
    raise _bad(f"{where}: unsupported value of type {type(v).__name__}")


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


def packed_layout(layer_sizes: Sequence[int]) -> tuple[list[int], int]:
    """(offset of each layer inside its region, payload): protocol-v1.md §5 "Packing".

    Layers lie back to back; the region is the payload rounded up to the
    alignment (:func:`region_size`).
    """
    offsets: list[int] = []
    pos = 0
    for n in layer_sizes:
        offsets.append(pos)
        pos += n
    return offsets, pos


def region_size(layer_sizes: Sequence[int], alignment: int = ALIGNMENT) -> int:
    """Staging bytes one chunk occupies."""
    return align_up(sum(layer_sizes), alignment)


def fake_salt(server_secret: bytes, tenant: str) -> bytes:
    """Stable salt shown for a tenant the connection may not use (protocol-v1.md §5.1)."""
    return hmac.new(
        server_secret, b"kvo-fake-salt-v1" + tenant.encode("utf-8"), hashlib.sha256
    ).digest()


# ---------------------------------------------------------------------------
# Requests


@dataclass(frozen=True, slots=True)
class Hello:
    OP: ClassVar[Op] = Op.HELLO
    min_version: int = MIN_PROTOCOL_VERSION
    max_version: int = MAX_PROTOCOL_VERSION
    client: str = ""
    tenants: tuple[str, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {
            "min_version": self.min_version,
            "max_version": self.max_version,
            "client": self.client,
            "tenants": list(self.tenants),
        }

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        lo = _uint(_field(m, "min_version", "hello"), "hello.min_version", 1, 0xFFFF)
        hi = _uint(_field(m, "max_version", "hello"), "hello.max_version", 1, 0xFFFF)
        if lo > hi:
            raise _bad(f"hello: min_version {lo} > max_version {hi}")
        tenants = tuple(
            _tenant(t, f"hello.tenants[{i}]")
            for i, t in enumerate(
                _list(_field(m, "tenants", "hello"), "hello.tenants", 0, MAX_TENANTS)
            )
        )
        if len(set(tenants)) != len(tenants):
            raise _bad("hello.tenants: duplicate tenant")
        client = _str(_field(m, "client", "hello"), "hello.client", MAX_CLIENT_NAME)
        return cls(lo, hi, client, tenants)


@dataclass(frozen=True, slots=True)
class RegisterStaging:
    OP: ClassVar[Op] = Op.REGISTER_STAGING
    size: int

    def to_wire(self) -> dict[str, Any]:
        return {"size": self.size}

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        size = _uint(_field(m, "size", "register_staging"), "register_staging.size", ALIGNMENT)
        if size % ALIGNMENT:
            raise _bad(f"register_staging.size: {size} is not a multiple of {ALIGNMENT}")
        return cls(size)


@dataclass(frozen=True, slots=True)
class Lookup:
    OP: ClassVar[Op] = Op.LOOKUP
    tenant: str
    keys: tuple[bytes, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "keys": list(self.keys)}

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        w = cls.OP.value
        return cls(
            _tenant(_field(m, "tenant", w), f"{w}.tenant"),
            _keys(_field(m, "keys", w), f"{w}.keys"),
        )


@dataclass(frozen=True, slots=True)
class Touch:
    OP: ClassVar[Op] = Op.TOUCH
    tenant: str
    keys: tuple[bytes, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "keys": list(self.keys)}

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        w = cls.OP.value
        return cls(
            _tenant(_field(m, "tenant", w), f"{w}.tenant"),
            _keys(_field(m, "keys", w), f"{w}.keys"),
        )


@dataclass(frozen=True, slots=True)
class PrepareLoad:
    OP: ClassVar[Op] = Op.PREPARE_LOAD
    tenant: str
    keys: tuple[bytes, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "keys": list(self.keys)}

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        w = cls.OP.value
        return cls(
            _tenant(_field(m, "tenant", w), f"{w}.tenant"),
            _keys(_field(m, "keys", w), f"{w}.keys"),
        )


@dataclass(frozen=True, slots=True)
class ChunkSpec:
    key: bytes
    layers: tuple[int, ...]

    @property
    def payload(self) -> int:
        return sum(self.layers)


@dataclass(frozen=True, slots=True)
class PrepareStore:
    OP: ClassVar[Op] = Op.PREPARE_STORE
    tenant: str
    namespace: bytes
    chunks: tuple[ChunkSpec, ...]
    ttl_s: float | None = None

    def to_wire(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "namespace": self.namespace,
            "chunks": [{"key": c.key, "layers": list(c.layers)} for c in self.chunks],
            "ttl_s": self.ttl_s,
        }

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        w = cls.OP.value
        chunks: list[ChunkSpec] = []
        for i, c in enumerate(_list(_field(m, "chunks", w), f"{w}.chunks", 1, MAX_BATCH)):
            cw = f"{w}.chunks[{i}]"
            c = _map(c, cw)
            chunks.append(
                ChunkSpec(
                    _bin(_field(c, "key", cw), f"{cw}.key", KEY_SIZE),
                    _layer_sizes(_field(c, "layers", cw), f"{cw}.layers", 1),
                )
            )
        if len({c.key for c in chunks}) != len(chunks):
            raise _bad(f"{w}.chunks: duplicate key")
        ttl = m.get("ttl_s")
        return cls(
            _tenant(_field(m, "tenant", w), f"{w}.tenant"),
            _bin(_field(m, "namespace", w), f"{w}.namespace", KEY_SIZE),
            tuple(chunks),
            None if ttl is None else _float(ttl, f"{w}.ttl_s"),
        )


@dataclass(frozen=True, slots=True)
class CompleteStore:
    OP: ClassVar[Op] = Op.COMPLETE_STORE
    handle: int

    def to_wire(self) -> dict[str, Any]:
        return {"handle": self.handle}

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        return cls(_uint(_field(m, "handle", cls.OP.value), f"{cls.OP.value}.handle", 1))


@dataclass(frozen=True, slots=True)
class CompleteLoad:
    OP: ClassVar[Op] = Op.COMPLETE_LOAD
    handle: int
    #: Of a ``lease_load`` handle: indices of the chunks whose bytes failed the
    #: reader's checksums (5.15). Optional; absent = none.
    corrupt: tuple[int, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {"handle": self.handle}
        if self.corrupt:
            d["corrupt"] = list(self.corrupt)
        return d

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        w = cls.OP.value
        handle = _uint(_field(m, "handle", w), f"{w}.handle", 1)
        raw = m.get("corrupt")
        if raw is None:
            return cls(handle)
        items = _list(raw, f"{w}.corrupt", 0, MAX_BATCH)
        corrupt = tuple(
            _uint(x, f"{w}.corrupt[{i}]", 0, MAX_BATCH - 1) for i, x in enumerate(items)
        )
        if len(set(corrupt)) != len(corrupt):
            raise _bad(f"{w}.corrupt: duplicate index")
        return cls(handle, corrupt)


@dataclass(frozen=True, slots=True)
class Abort:
    OP: ClassVar[Op] = Op.ABORT
    handle: int

    def to_wire(self) -> dict[str, Any]:
        return {"handle": self.handle}

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        return cls(_uint(_field(m, "handle", cls.OP.value), f"{cls.OP.value}.handle", 1))


@dataclass(frozen=True, slots=True)
class Stats:
    OP: ClassVar[Op] = Op.STATS

    def to_wire(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        return cls()


@dataclass(frozen=True, slots=True)
class Bye:
    OP: ClassVar[Op] = Op.BYE

    def to_wire(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        return cls()


@dataclass(frozen=True, slots=True)
class Purge:
    OP: ClassVar[Op] = Op.PURGE
    tenant: str
    namespace: bytes | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "namespace": self.namespace}

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        ns = m.get("namespace")
        return cls(
            _tenant(_field(m, "tenant", "purge"), "purge.tenant"),
            None if ns is None else _bin(ns, "purge.namespace", KEY_SIZE),
        )


@dataclass(frozen=True, slots=True)
class Fsck:
    OP: ClassVar[Op] = Op.FSCK
    repair: bool = False

    def to_wire(self) -> dict[str, Any]:
        return {"repair": self.repair}

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        return cls(_bool(_field(m, "repair", "fsck"), "fsck.repair"))


@dataclass(frozen=True, slots=True)
class LeaseStore(PrepareStore):
    """``prepare_store``'s fields; the direct path (5.14). Match it before PrepareStore."""

    OP: ClassVar[Op] = Op.LEASE_STORE


@dataclass(frozen=True, slots=True)
class LeaseLoad(PrepareLoad):
    """``prepare_load``'s fields; the direct path (5.15). Match it before PrepareLoad."""

    OP: ClassVar[Op] = Op.LEASE_LOAD


Request = (
    Hello
    | RegisterStaging
    | Lookup
    | PrepareStore
    | CompleteStore
    | Abort
    | PrepareLoad
    | CompleteLoad
    | Touch
    | Stats
    | Purge
    | Fsck
    | Bye
    | LeaseStore
    | LeaseLoad
)

REQUEST_TYPES: dict[Op, type[Request]] = {
    t.OP: t
    for t in (
        Hello,
        RegisterStaging,
        Lookup,
        PrepareStore,
        CompleteStore,
        Abort,
        PrepareLoad,
        CompleteLoad,
        Touch,
        Stats,
        Purge,
        Fsck,
        Bye,
        LeaseStore,
        LeaseLoad,
    )
}

# ---------------------------------------------------------------------------
# Replies (the OK case; an error reply is ErrorReply)


@dataclass(frozen=True, slots=True)
class HelloReply:
    OP: ClassVar[Op] = Op.HELLO
    version: int
    server_id: str
    store_id: str
    salts: Mapping[str, bytes]
    alignment: int = ALIGNMENT
    max_frame: int = MAX_FRAME
    max_batch: int = MAX_BATCH
    max_inflight: int = 64
    max_staging: int = 1 << 40
    handle_ttl_s: float = 60.0
    #: Optional (5.1): tenants of this hello that this connection may use the
    #: direct path for. Absent or false: staging only.
    direct: Mapping[str, bool] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {
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
        }

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        w = "hello reply"
        alignment = _uint(_field(m, "alignment", w), f"{w}.alignment", ALIGNMENT, 1 << 30)
        if alignment & (alignment - 1):
            raise _bad(f"{w}.alignment: {alignment} is not a power of two")
        salts = {
            _tenant(t, f"{w}.salts key"): _bin(s, f"{w}.salts[{t}]", SALT_SIZE)
            for t, s in _map(_field(m, "salts", w), f"{w}.salts").items()
        }
        return cls(
            version=_uint(_field(m, "version", w), f"{w}.version", 1, 0xFFFF),
            server_id=_str(_field(m, "server_id", w), f"{w}.server_id", 256),
            store_id=_str(_field(m, "store_id", w), f"{w}.store_id", 256),
            salts=salts,
            alignment=alignment,
            max_frame=_uint(_field(m, "max_frame", w), f"{w}.max_frame", 1024, MAX_FRAME),
            max_batch=_uint(_field(m, "max_batch", w), f"{w}.max_batch", 1, MAX_BATCH),
            max_inflight=_uint(_field(m, "max_inflight", w), f"{w}.max_inflight", 1),
            max_staging=_uint(_field(m, "max_staging", w), f"{w}.max_staging", ALIGNMENT),
            handle_ttl_s=_float(_field(m, "handle_ttl_s", w), f"{w}.handle_ttl_s"),
            direct={
                _tenant(t, f"{w}.direct key"): _bool(v, f"{w}.direct[{t}]")
                for t, v in _map(m.get("direct", {}), f"{w}.direct").items()
            },
        )


@dataclass(frozen=True, slots=True)
class Ack:
    """The reply of a verb without result keys; ``op`` says which verb."""

    op: Op

    def to_wire(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True, slots=True)
class LookupReply:
    OP: ClassVar[Op] = Op.LOOKUP
    found: int

    def to_wire(self) -> dict[str, Any]:
        return {"found": self.found}

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        return cls(_uint(_field(m, "found", "lookup reply"), "lookup reply.found", 0, MAX_BATCH))


@dataclass(frozen=True, slots=True)
class StoreSlot:
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


@dataclass(frozen=True, slots=True)
class PrepareStoreReply:
    OP: ClassVar[Op] = Op.PREPARE_STORE
    handle: int
    chunks: tuple[StoreSlot, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"handle": self.handle, "chunks": [c.to_wire() for c in self.chunks]}

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        w = "prepare_store reply"
        slots: list[StoreSlot] = []
        for i, c in enumerate(_list(_field(m, "chunks", w), f"{w}.chunks", 1, MAX_BATCH)):
            cw = f"{w}.chunks[{i}]"
            c = _map(c, cw)
            raw = _str(_field(c, "status", cw), f"{cw}.status", 16)
            try:
                status = StoreStatus(raw)
            except ValueError:
                raise _bad(f"{cw}.status: unknown status {raw!r}") from None
            if status is StoreStatus.WRITE:
                off = _uint(_field(c, "offset", cw), f"{cw}.offset")
                if off % ALIGNMENT:
                    raise _bad(f"{cw}.offset: {off} is not aligned")
                slots.append(StoreSlot(status, offset=off))
            elif status is StoreStatus.REJECTED:
                slots.append(StoreSlot(status, code=_code(_field(c, "code", cw), f"{cw}.code")))
            else:
                slots.append(StoreSlot(status))
        handle = _uint(_field(m, "handle", w), f"{w}.handle")
        if (handle == 0) == any(s.status is StoreStatus.WRITE for s in slots):
            raise _bad(f"{w}: handle {handle} does not match the chunks to write")
        return cls(handle, tuple(slots))


@dataclass(frozen=True, slots=True)
class CompleteStoreReply:
    OP: ClassVar[Op] = Op.COMPLETE_STORE
    stored: tuple[bool, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"stored": list(self.stored)}

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        w = "complete_store reply"
        raw = _list(_field(m, "stored", w), f"{w}.stored", 1, MAX_BATCH)
        return cls(tuple(_bool(b, f"{w}.stored[{i}]") for i, b in enumerate(raw)))


@dataclass(frozen=True, slots=True)
class LoadSlot:
    verified: bool
    offset: int = 0
    layers: tuple[int, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {"verified": self.verified, "offset": self.offset, "layers": list(self.layers)}


@dataclass(frozen=True, slots=True)
class PrepareLoadReply:
    OP: ClassVar[Op] = Op.PREPARE_LOAD
    handle: int
    stop: ErrorCode
    chunks: tuple[LoadSlot, ...]

    @property
    def verified(self) -> int:
        """Length of the verified prefix."""
        return sum(1 for c in self.chunks if c.verified)

    def to_wire(self) -> dict[str, Any]:
        return {
            "handle": self.handle,
            "stop": int(self.stop),
            "chunks": [c.to_wire() for c in self.chunks],
        }

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        def hit(c: Mapping[str, Any], cw: str) -> LoadSlot:
            off = _uint(_field(c, "offset", cw), f"{cw}.offset")
            if off % ALIGNMENT:
                raise _bad(f"{cw}.offset: {off} is not aligned")
            return LoadSlot(True, off, _layer_sizes(_field(c, "layers", cw), cw, 1))

        return cls(*_prefix_reply(m, "prepare_load reply", "verified", hit, LoadSlot(False)))


_S = TypeVar("_S")


def _prefix_reply(
    m: Mapping[str, Any],
    w: str,
    flag: str,
    hit: Callable[[Mapping[str, Any], str], _S],
    miss: _S,
) -> tuple[int, ErrorCode, tuple[_S, ...]]:
    """(handle, stop, slots) of a load-type reply: the chunks whose ``flag`` is
    true form a prefix, ``stop`` is OK exactly when there is no miss, and the
    handle is 0 exactly when nothing was found."""
    slots: list[_S] = []
    seen_miss = False
    for i, c in enumerate(_list(_field(m, "chunks", w), f"{w}.chunks", 1, MAX_BATCH)):
        cw = f"{w}.chunks[{i}]"
        c = _map(c, cw)
        if not _bool(_field(c, flag, cw), f"{cw}.{flag}"):
            seen_miss = True
            slots.append(miss)
            continue
        if seen_miss:
            raise _bad(f"{cw}: {flag} chunk after a miss")
        slots.append(hit(c, cw))
    stop = _code(_field(m, "stop", w), f"{w}.stop")
    if (stop is ErrorCode.OK) != (not seen_miss):
        raise _bad(f"{w}: stop {stop.name} does not match the chunks")
    handle = _uint(_field(m, "handle", w), f"{w}.handle")
    if (handle == 0) == (slots[0] is not miss):  # the found chunks are a prefix
        raise _bad(f"{w}: handle {handle} does not match the {flag} chunks")
    return handle, stop, tuple(slots)


@dataclass(frozen=True, slots=True)
class LeaseSlot:
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


def _path_str(v: Any, where: str) -> str:
    path = _str(v, where, MAX_PATH)
    if not path.startswith("/") or "\0" in path:
        raise _bad(f"{where}: not an absolute path")
    return path


def _aligned(v: Any, where: str) -> int:
    n = _uint(v, where)
    if n % ALIGNMENT:
        raise _bad(f"{where}: {n} is not a multiple of {ALIGNMENT}")
    return n


@dataclass(frozen=True, slots=True)
class LeaseStoreReply:
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
        slots: list[LeaseSlot] = []
        for i, c in enumerate(_list(_field(m, "chunks", w), f"{w}.chunks", 1, MAX_BATCH)):
            cw = f"{w}.chunks[{i}]"
            c = _map(c, cw)
            raw = _str(_field(c, "status", cw), f"{cw}.status", 16)
            try:
                status = StoreStatus(raw)
            except ValueError:
                raise _bad(f"{cw}.status: unknown status {raw!r}") from None
            if status is StoreStatus.WRITE:
                offsets = tuple(
                    _aligned(o, f"{cw}.offsets[{j}]")
                    for j, o in enumerate(
                        _list(_field(c, "offsets", cw), f"{cw}.offsets", 1, MAX_LAYERS)
                    )
                )
                slots.append(
                    LeaseSlot(
                        status,
                        path=_path_str(_field(c, "path", cw), f"{cw}.path"),
                        size=_aligned(_field(c, "size", cw), f"{cw}.size"),
                        data_offset=_aligned(_field(c, "data_offset", cw), f"{cw}.data_offset"),
                        offsets=offsets,
                    )
                )
            elif status is StoreStatus.REJECTED:
                slots.append(LeaseSlot(status, code=_code(_field(c, "code", cw), f"{cw}.code")))
            else:
                slots.append(LeaseSlot(status))
        handle = _uint(_field(m, "handle", w), f"{w}.handle")
        if (handle == 0) == any(s.status is StoreStatus.WRITE for s in slots):
            raise _bad(f"{w}: handle {handle} does not match the chunks to write")
        alignment = _uint(_field(m, "alignment", w), f"{w}.alignment", ALIGNMENT, 1 << 30)
        raw_d = m.get("durability")
        durability = "" if raw_d is None else _str(raw_d, f"{w}.durability", 16)
        return cls(handle, alignment, tuple(slots), durability)


@dataclass(frozen=True, slots=True)
class LayerExtent:
    """Where one layer of a stored object lies, and its XXH3-128 checksum."""

    offset: int
    length: int
    check: bytes


@dataclass(frozen=True, slots=True)
class ReadSlot:
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


@dataclass(frozen=True, slots=True)
class LeaseLoadReply:
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
        def hit(c: Mapping[str, Any], cw: str) -> ReadSlot:
            layers = []
            for j, x in enumerate(_list(_field(c, "layers", cw), f"{cw}.layers", 1, MAX_LAYERS)):
                lw = f"{cw}.layers[{j}]"
                x = _list(x, lw, 3, 3)
                layers.append(
                    LayerExtent(
                        _aligned(x[0], f"{lw}[0]"),
                        _uint(x[1], f"{lw}[1]"),
                        _bin(x[2], f"{lw}[2]", 16),
                    )
                )
            return ReadSlot(
                True,
                _path_str(_field(c, "path", cw), f"{cw}.path"),
                _aligned(_field(c, "size", cw), f"{cw}.size"),
                tuple(layers),
            )

        return cls(*_prefix_reply(m, "lease_load reply", "found", hit, ReadSlot(False)))


@dataclass(frozen=True, slots=True)
class StatsReply:
    OP: ClassVar[Op] = Op.STATS
    stats: Mapping[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return {"stats": dict(self.stats)}

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        raw = _map(_field(m, "stats", "stats reply"), "stats reply.stats")
        return cls(_plain(dict(raw), "stats reply.stats"))


@dataclass(frozen=True, slots=True)
class PurgeReply:
    OP: ClassVar[Op] = Op.PURGE
    removed: int

    def to_wire(self) -> dict[str, Any]:
        return {"removed": self.removed}

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        return cls(_uint(_field(m, "removed", "purge reply"), "purge reply.removed"))


@dataclass(frozen=True, slots=True)
class FsckReply:
    OP: ClassVar[Op] = Op.FSCK
    report: Mapping[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return {"report": dict(self.report)}

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        raw = _map(_field(m, "report", "fsck reply"), "fsck reply.report")
        return cls(_plain(dict(raw), "fsck reply.report"))


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """A reply with a non-zero code; also the server-initiated fatal ``error`` frame."""

    op: str
    code: ErrorCode
    message: str = ""
    #: Only in an UNSUPPORTED_VERSION reply to hello: the server's version range.
    server_versions: tuple[int, int] | None = field(default=None)

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {"message": self.message[:MAX_MESSAGE]}
        if self.server_versions is not None:
            d["min_version"], d["max_version"] = self.server_versions
        return d


Reply = (
    HelloReply
    | Ack
    | LookupReply
    | PrepareStoreReply
    | CompleteStoreReply
    | PrepareLoadReply
    | StatsReply
    | PurgeReply
    | FsckReply
    | LeaseStoreReply
    | LeaseLoadReply
    | ErrorReply
)

_REPLY_TYPES: dict[
    Op,
    type[HelloReply]
    | type[LookupReply]
    | type[PrepareStoreReply]
    | type[CompleteStoreReply]
    | type[PrepareLoadReply]
    | type[StatsReply]
    | type[PurgeReply]
    | type[FsckReply]
    | type[LeaseStoreReply]
    | type[LeaseLoadReply],
] = {
    Op.HELLO: HelloReply,
    Op.LOOKUP: LookupReply,
    Op.PREPARE_STORE: PrepareStoreReply,
    Op.COMPLETE_STORE: CompleteStoreReply,
    Op.PREPARE_LOAD: PrepareLoadReply,
    Op.STATS: StatsReply,
    Op.PURGE: PurgeReply,
    Op.FSCK: FsckReply,
    Op.LEASE_STORE: LeaseStoreReply,
    Op.LEASE_LOAD: LeaseLoadReply,
}
ACK_OPS = frozenset({Op.REGISTER_STAGING, Op.ABORT, Op.COMPLETE_LOAD, Op.TOUCH, Op.BYE})

# ---------------------------------------------------------------------------
# Envelopes and parsing


def request_message(request_id: int, req: Request) -> dict[str, Any]:
    if not 1 <= request_id <= MAX_REQUEST_ID:
        raise ValueError(f"request id {request_id} out of range")
    return {"op": req.OP.value, "id": request_id, **req.to_wire()}


def reply_message(request_id: int, reply: Reply) -> dict[str, Any]:
    if isinstance(reply, ErrorReply):
        if reply.code is ErrorCode.OK:
            raise ValueError("an ErrorReply needs a non-zero code")
        op, code = reply.op, int(reply.code)
    elif isinstance(reply, Ack):
        op, code = reply.op.value, 0
    else:
        op, code = reply.OP.value, 0
    return {"op": op, "id": request_id, "code": code, **reply.to_wire()}


def error_message(code: ErrorCode, message: str) -> dict[str, Any]:
    """The server-initiated fatal error frame (id 0)."""
    return reply_message(0, ErrorReply(Op.ERROR.value, code, message))


def _envelope_id(msg: Mapping[str, Any], lo: int) -> int:
    rid = msg.get("id")
    if not isinstance(rid, int) or isinstance(rid, bool) or not lo <= rid <= MAX_REQUEST_ID:
        raise _bad(f"missing or invalid request id {rid!r}")
    return rid


def parse_request(msg: Mapping[str, Any]) -> tuple[int, Request]:
    """Validate one received request. Raises ProtocolError (see its ``fatal``)."""
    rid = _envelope_id(msg, 1)
    op = msg.get("op")
    if not isinstance(op, str):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "missing or invalid op", request_id=rid)
    try:
        cls = REQUEST_TYPES[Op(op)]
    except (ValueError, KeyError):
        raise ProtocolError(
            ErrorCode.UNSUPPORTED, f"unknown op {op[:64]!r}", request_id=rid, op=op[:64]
        ) from None
    try:
        return rid, cls.from_wire(msg)
    except ProtocolError as exc:
        raise ProtocolError(exc.code, exc.message, request_id=rid, op=op) from None


def parse_reply(msg: Mapping[str, Any]) -> tuple[int, Reply]:
    """Validate one received reply or server-initiated error (id 0).

    A malformed reply is fatal: the client cannot trust the server's state.
    """
    rid = _envelope_id(msg, 0)
    op_raw = msg.get("op")
    if not isinstance(op_raw, str):
        raise _bad("reply: missing or invalid op")
    code = _code(_field(msg, "code", "reply"), "reply.code")
    if code is not ErrorCode.OK or rid == 0:
        if code is ErrorCode.OK:
            raise _bad("error frame with code OK")
        message = msg.get("message", "")
        versions: tuple[int, int] | None = None
        if code is ErrorCode.UNSUPPORTED_VERSION and "min_version" in msg:
            versions = (
                _uint(msg["min_version"], "reply.min_version", 0, 0xFFFF),
                _uint(msg.get("max_version"), "reply.max_version", 0, 0xFFFF),
            )
        return rid, ErrorReply(
            op_raw[:64],
            code,
            message[:MAX_MESSAGE] if isinstance(message, str) else "",
            versions,
        )
    try:
        op = Op(op_raw)
    except ValueError:
        raise _bad(f"reply: unknown op {op_raw[:64]!r}") from None
    if op in ACK_OPS:
        return rid, Ack(op)
    cls = _REPLY_TYPES.get(op)
    if cls is None:
        raise _bad(f"reply: op {op.value!r} has no reply")
    return rid, cls.from_wire(msg)


# ---------------------------------------------------------------------------
# Framing


def with_fds(msg: Mapping[str, Any], nfds: int) -> Mapping[str, Any]:
    """``msg`` declaring the ``nfds`` descriptors sent with it (protocol-v1.md §3.3)."""
    if not 0 <= nfds <= MAX_FDS:
        raise ValueError(f"a frame carries 0..{MAX_FDS} descriptors, not {nfds}")
    return {**msg, "fds": nfds} if nfds else msg


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def encode_frame(msg: Mapping[str, Any], max_frame: int = MAX_FRAME) -> bytes:
    """Length prefix + msgpack body. Raises ProtocolError(FRAME_TOO_LARGE) above ``max_frame``."""
    body: bytes = msgpack.packb(msg, use_bin_type=True)
    if len(body) > max_frame:
        raise ProtocolError(
            ErrorCode.FRAME_TOO_LARGE, f"frame body of {len(body)} bytes exceeds {max_frame}"
        )
    return _LENGTH.pack(len(body)) + body


def decode_body(body: bytes) -> dict[str, Any]:
    """One frame body → a map with string keys. Fatal ProtocolError otherwise."""
    try:
        msg = msgpack.unpackb(
            body, raw=False, strict_map_key=True, use_list=True, ext_hook=_reject_ext
        )
    except Exception as exc:  # msgpack raises a zoo: ValueError, FormatError, StackError…
        raise _bad(f"undecodable frame body: {type(exc).__name__}") from None
    if not isinstance(msg, dict) or not all(isinstance(k, str) for k in msg):
        raise _bad("frame body is not a map with string keys")
    return msg


@dataclass(slots=True)
class Frame:
    """One decoded frame and the descriptors that arrived with it (now owned by the caller)."""

    msg: dict[str, Any]
    fds: list[int] = field(default_factory=list)


def close_fds(fds: Iterable[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class FrameDecoder:
    """Incremental decoder: feed received bytes (and descriptors), get whole frames.

    A frame that carries descriptors says how many in its ``fds`` key, and
    takes that many from the FIFO of descriptors received so far
    (protocol-v1.md §3.3). Counting, rather than matching descriptors to byte
    positions, is what stays right however the kernel glues stream segments
    into one ``recvmsg``: Linux returns the bytes of earlier frames together
    with a later frame's descriptors. Descriptors arrive with the frame's
    first byte, so they are always here by the time the frame is complete.

    After a ProtocolError the decoder is poisoned: the stream is out of sync.
    """

    def __init__(self, expect_magic: bytes | None = None, max_frame: int = MAX_FRAME) -> None:
        self._buf = bytearray()
        self._magic = expect_magic
        self._max_frame = max_frame
        self._fds: collections.deque[int] = collections.deque()
        self._error: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        return len(self._buf)

    @property
    def pending_fds(self) -> int:
        """Descriptors received and not yet claimed by a frame."""
        return len(self._fds)

    def _fail(self, err: ProtocolError) -> ProtocolError:
        self._error = err
        self.close()
        return err

    def feed(self, data: bytes | bytearray | memoryview, fds: Sequence[int] = ()) -> list[Frame]:
        """Whole frames completed by ``data``; the decoder owns ``fds`` from now on."""
        if self._error is not None:
            close_fds(fds)
            raise self._error
        self._fds.extend(fds)
        self._buf += data
        frames: list[Frame] = []
        try:
            if self._magic is not None:
                n = min(len(self._buf), MAGIC_SIZE)
                if self._buf[:n] != self._magic[:n]:
                    raise ProtocolError(
                        ErrorCode.BAD_MAGIC,
                        f"peer sent {bytes(self._buf[:n])!r}, expected magic {self._magic!r}",
                    )
                if n < MAGIC_SIZE:
                    return frames
                del self._buf[:MAGIC_SIZE]
                self._magic = None
            while len(self._buf) >= LENGTH_SIZE:
                (length,) = _LENGTH.unpack_from(self._buf)
                if length == 0:
                    raise _bad("zero-length frame")
                if length > self._max_frame:
                    raise ProtocolError(
                        ErrorCode.FRAME_TOO_LARGE,
                        f"frame of {length} bytes exceeds the limit of {self._max_frame}",
                    )
                if len(self._buf) < LENGTH_SIZE + length:
                    break
                msg = decode_body(bytes(self._buf[LENGTH_SIZE : LENGTH_SIZE + length]))
                del self._buf[: LENGTH_SIZE + length]
                frames.append(Frame(msg, self._claim_fds(msg)))
            if len(self._fds) > MAX_FDS:
                raise _bad(f"{len(self._fds)} descriptors sent that no frame declared")
        except ProtocolError as exc:
            self._fail(exc)
            if frames:
                # The frames before the bad bytes are good: hand them out, and
                # raise on the next feed (or raise_if_failed) instead of
                # dropping them, which would depend on how reads were split.
                return frames
            raise exc from None
        return frames

    def raise_if_failed(self) -> None:
        """Raise the error a previous ``feed`` deferred behind good frames, if any."""
        if self._error is not None:
            raise self._error

    def _claim_fds(self, msg: Mapping[str, Any]) -> list[int]:
        n = _uint(msg.get("fds", 0), "fds", 0, MAX_FDS)
        if n > len(self._fds):
            raise _bad(f"frame declares {n} descriptors, {len(self._fds)} arrived")
        return [self._fds.popleft() for _ in range(n)]

    def close(self) -> None:
        """Close descriptors not yet handed out with a frame."""
        close_fds(self._fds)
        self._fds.clear()


# ---------------------------------------------------------------------------
# Handshake


def negotiate_version(
    client_min: int,
    client_max: int,
    server_min: int = MIN_PROTOCOL_VERSION,
    server_max: int = MAX_PROTOCOL_VERSION,
) -> int:
    """The version both sides speak (the highest), or ProtocolError(UNSUPPORTED_VERSION)."""
    version = min(client_max, server_max)
    if version < max(client_min, server_min):
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"no common protocol version: client speaks {client_min}..{client_max}, "
            f"server speaks {server_min}..{server_max}; upgrade the older side",
        )
    return version


def check_magic(data: bytes, expected: bytes) -> None:
    if data != expected:
        raise ProtocolError(
            ErrorCode.BAD_MAGIC, f"peer sent {data[:MAGIC_SIZE]!r}, expected magic {expected!r}"
        )


__all__ = [
    "ACK_OPS",
    "ALIGNMENT",
    "CLIENT_MAGIC",
    "KEY_SIZE",
    "MAX_BATCH",
    "MAX_FDS",
    "MAX_FRAME",
    "MAX_PROTOCOL_VERSION",
    "MIN_PROTOCOL_VERSION",
    "PROTOCOL_VERSION",
    "REQUEST_TYPES",
    "SALT_SIZE",
    "SERVER_MAGIC",
    "Abort",
    "Ack",
    "ChunkSpec",
    "CompleteLoad",
    "CompleteStore",
    "CompleteStoreReply",
    "ErrorCode",
    "ErrorReply",
    "Frame",
    "FrameDecoder",
    "Fsck",
    "FsckReply",
    "Hello",
    "HelloReply",
    "LayerExtent",
    "LeaseLoad",
    "LeaseLoadReply",
    "LeaseSlot",
    "LeaseStore",
    "LeaseStoreReply",
    "LoadSlot",
    "Lookup",
    "LookupReply",
    "Op",
    "PrepareLoad",
    "PrepareLoadReply",
    "PrepareStore",
    "PrepareStoreReply",
    "ProtocolError",
    "Purge",
    "PurgeReply",
    "ReadSlot",
    "RegisterStaging",
    "Reply",
    "Request",
    "Stats",
    "StatsReply",
    "StoreSlot",
    "StoreStatus",
    "Touch",
    "align_up",
    "check_magic",
    "close_fds",
    "decode_body",
    "encode_frame",
    "error_message",
    "fake_salt",
    "negotiate_version",
    "packed_layout",
    "parse_reply",
    "parse_request",
    "region_size",
    "reply_message",
    "request_message",
    "with_fds",
]
