"""How the LMDB index (index.py) encodes its keys, records and usage entries.

``chunks``: ``tenant (utf-8) || 0x00 || chunk key (32)`` → :data:`RECORD`
(schema byte, namespace, key_epoch, size, payload, num_layers, created_ns,
last_access_ns, expires_ns); ``lru`` and ``expiry``: ``u64 BE time || index
key``; ``tenants`` and ``namespaces``: :data:`USAGE` (bytes, count).
"""

from __future__ import annotations

import functools
import struct
from typing import Final

import lmdb

from kvoffload.errors import IndexCorrupt, IndexFailure, IndexVersionError

from .api import ChunkRecord, Usage

INDEX_SCHEMA: Final = 1
"""Version of the record and table encodings below; stored in ``meta``."""

KEY_SIZE: Final = 32
SCHEMA_META: Final = "index_schema"
"""``meta`` entry holding :data:`INDEX_SCHEMA` as ASCII decimal."""

# Tenant names end up in LMDB keys, whose limit is 511 bytes by default; a
# fixed cap leaves room for the 0x00 separator and the 32-byte suffixes.
MAX_TENANT_BYTES: Final = 255

U64_MAX: Final = (1 << 64) - 1

# schema byte, namespace, key_epoch, size, payload, num_layers, created_ns,
# last_access_ns, expires_ns. The leading byte lets a future schema be told
# apart record by record during a migration.
RECORD: Final = struct.Struct(">B32sQQQQQQQ")
USAGE: Final = struct.Struct(">QQ")
U64: Final = struct.Struct(">Q")


def tenant_bytes(tenant: str) -> bytes:
    if not isinstance(tenant, str):
        raise TypeError(f"tenant must be str, not {type(tenant).__name__}")
    try:
        raw = tenant.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"tenant {tenant!r} is not valid unicode") from exc
    # The separator must never occur inside a tenant, or tenant "a"'s prefix
    # scan would also see tenant "a\x00...".
    if 0 in raw:  # as ``b"\x00" in raw``, without an int conversion failing inside
        raise ValueError(f"tenant {tenant!r} contains NUL")
    if len(raw) > MAX_TENANT_BYTES:
        raise ValueError(f"tenant name longer than {MAX_TENANT_BYTES} bytes")
    return raw


@functools.lru_cache(maxsize=1024)
def tenant_prefix(tenant: str) -> bytes:
    """``tenant_bytes(tenant) + b"\x00"``, the leading part of its index keys,
    remembered for the tenants seen last (lookups ask for it on every call; a
    bad name raises as :func:`tenant_bytes` does, and is not remembered)."""
    return tenant_bytes(tenant) + b"\x00"


def check_key(name: str, value: bytes) -> None:
    if not isinstance(value, bytes) or len(value) != KEY_SIZE:
        raise ValueError(f"{name} must be {KEY_SIZE} bytes")


def index_key(tenant: str, chunk_key: bytes) -> bytes:
    check_key("chunk_key", chunk_key)
    return tenant_bytes(tenant) + b"\x00" + chunk_key


def split_key(key: bytes) -> tuple[str, bytes]:
    if len(key) < KEY_SIZE + 1 or key[-KEY_SIZE - 1] != 0:
        raise IndexCorrupt(f"malformed index key {key.hex()}")
    try:
        tenant = key[: -KEY_SIZE - 1].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise IndexCorrupt(f"malformed tenant in index key {key.hex()}") from exc
    return tenant, key[-KEY_SIZE:]


def encode_record(rec: ChunkRecord) -> bytes:
    check_key("namespace", rec.namespace)
    ints = (
        rec.key_epoch,
        rec.size,
        rec.payload,
        rec.num_layers,
        rec.created_ns,
        rec.last_access_ns,
        rec.expires_ns,
    )
    for value in ints:
        if not isinstance(value, int) or not 0 <= value <= U64_MAX:
            raise ValueError(f"record field out of range: {rec!r}")
    return RECORD.pack(INDEX_SCHEMA, rec.namespace, *ints)


def decode_record(key: bytes, value: bytes) -> ChunkRecord:
    tenant, chunk_key = split_key(key)
    if len(value) != RECORD.size or value[0] != INDEX_SCHEMA:
        raise IndexCorrupt(f"undecodable record for {tenant!r}/{chunk_key.hex()}")
    (_, namespace, epoch, size, payload, layers, created, access, expires) = RECORD.unpack(value)
    return ChunkRecord(
        tenant=tenant,
        chunk_key=chunk_key,
        namespace=namespace,
        key_epoch=epoch,
        size=size,
        payload=payload,
        num_layers=layers,
        created_ns=created,
        last_access_ns=access,
        expires_ns=expires,
    )


def decode_usage(value: bytes | None) -> Usage:
    if value is None:
        return Usage(0, 0)
    if len(value) != USAGE.size:
        raise IndexCorrupt("undecodable usage entry")
    nbytes, count = USAGE.unpack(value)
    return Usage(nbytes, count)


def lmdb_failure(exc: lmdb.Error) -> IndexFailure:
    if isinstance(exc, lmdb.CorruptedError | lmdb.InvalidError | lmdb.PageNotFoundError):
        return IndexCorrupt(f"LMDB index is corrupt: {exc}")
    if isinstance(exc, lmdb.VersionMismatchError):
        return IndexVersionError(f"LMDB format version mismatch: {exc}")
    return IndexFailure(f"LMDB index error: {exc}")


__all__ = [
    "INDEX_SCHEMA",
    "KEY_SIZE",
    "MAX_TENANT_BYTES",
    "RECORD",
    "SCHEMA_META",
    "U64",
    "U64_MAX",
    "USAGE",
    "check_key",
    "decode_record",
    "decode_usage",
    "encode_record",
    "index_key",
    "lmdb_failure",
    "split_key",
    "tenant_bytes",
    "tenant_prefix",
]
