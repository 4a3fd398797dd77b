"""Key files: the format-1 JSON document, its wrapped secrets, encoding and decoding.

Part of the keyring (``kvoffload.store.keys.keyring`` re-exports everything
here); ``docs/spec/keys-v1.md`` is the normative description. ::

    TenantKeys      one tenant's unwrapped salt and AES-256 data keys (DEKs), by epoch
    encode_record   a tenant's keys and metadata -> the bytes of its key file
    decode_record   the bytes of a key file -> the tenant's keys and metadata,
                    every field checked, the secrets unwrapped and authenticated
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvoffload.errors import KeyringError

from .kek import NONCE_SIZE, Kek

__all__ = [
    "DEK_SIZE",
    "FORMAT_VERSION",
    "MAX_EPOCH",
    "SALT_SIZE",
    "TAG_SIZE",
    "TenantKeys",
    "decode_record",
    "encode_record",
]

FORMAT_VERSION = 1
DEK_SIZE = 32
SALT_SIZE = 32
TAG_SIZE = 16
#: Object headers store the key epoch as a u32, and 0 means "not sealed".
MAX_EPOCH = 2**32 - 1

_WRAP_PREFIX = b"kvo-wrap-v1"
_TOP_FIELDS = frozenset(
    {"format", "tenant", "kek_id", "created", "current_epoch", "salt", "epochs"}
)
_SALT_FIELDS = frozenset({"nonce", "ct"})
_EPOCH_FIELDS = frozenset({"nonce", "ct", "created"})


def _salt_aad(tenant: str) -> bytes:
    return b"|".join((_WRAP_PREFIX, b"salt", tenant.encode("ascii")))


def _dek_aad(tenant: str, epoch: int) -> bytes:
    return b"|".join((_WRAP_PREFIX, b"dek", tenant.encode("ascii"), str(epoch).encode("ascii")))


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, eq=False)
class TenantKeys:
    """One tenant's unwrapped secrets.

    Hold one only for the operation at hand and ask the keyring again for the
    next: the keyring's cache bound is what makes a purge reach this process.
    ``repr`` never shows a secret.
    """

    tenant: str
    #: 32 secret bytes, the BLAKE2b key of the tenant's chunk keys; fixed for life.
    salt: bytes = field(repr=False)
    #: The epoch new objects are sealed under.
    current_epoch: int
    #: AES-256 data keys by epoch; old epochs stay so that old objects open.
    deks: dict[int, bytes] = field(repr=False)
    _aeads: dict[int, AESGCM] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.salt) != SALT_SIZE:
            raise ValueError(f"tenant salt must be {SALT_SIZE} bytes")
        if any(len(k) != DEK_SIZE for k in self.deks.values()):
            raise ValueError(f"data keys must be {DEK_SIZE} bytes")
        if self.current_epoch not in self.deks:
            raise ValueError(f"no data key for the current epoch {self.current_epoch}")

    def aead(self, epoch: int) -> AESGCM | None:
        """The AES-256-GCM of ``epoch``, or None when the tenant has no such epoch."""
        aead = self._aeads.get(epoch)
        if aead is None:
            dek = self.deks.get(epoch)
            if dek is None:
                return None
            # setdefault: two threads racing here end up sharing one object.
            aead = self._aeads.setdefault(epoch, AESGCM(dek))
        return aead


@dataclass(frozen=True)
class _Record:
    """A decoded key file: the secrets plus the metadata a rewrite must keep."""

    keys: TenantKeys
    kek_id: str
    created: str
    epoch_created: dict[int, str]


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate field {k!r}")
        out[k] = v
    return out


class _UnknownKek(KeyringError):
    """A key file wrapped by a KEK this keyring does not hold (rotated elsewhere)."""


def _document(tenant: str, data: bytes, bad: Callable[[str], KeyringError]) -> dict[str, Any]:
    """The key file's JSON object, of this format, with its fields, for ``tenant``."""
    try:
        doc = json.loads(data, object_pairs_hook=_no_duplicate_keys)
    except (ValueError, RecursionError) as exc:
        raise bad(f"not a valid JSON key file ({exc})") from exc
    if not isinstance(doc, dict):
        raise bad("not a JSON object")
    fmt = doc.get("format")
    if type(fmt) is not int or fmt != FORMAT_VERSION:
        raise bad(
            f"unknown format {fmt!r}; this kvoffload reads format {FORMAT_VERSION} "
            "(upgrade kvoffload)"
        )
    if doc.keys() != _TOP_FIELDS:
        raise bad(f"fields {sorted(doc.keys() ^ _TOP_FIELDS)} are missing or unknown in format 1")
    if doc["tenant"] != tenant:
        raise bad(f"names tenant {doc['tenant']!r}, expected {tenant!r}")
    return doc


def _epochs(
    tenant: str, epochs_doc: dict[str, Any], kek: Kek, bad: Callable[[str], KeyringError]
) -> tuple[dict[int, bytes], dict[int, str]]:
    """The data keys of every epoch, unwrapped and authenticated, and when each was made."""
    deks: dict[int, bytes] = {}
    epoch_created: dict[int, str] = {}
    for name, entry_doc in epochs_doc.items():
        if not (name.isascii() and name.isdigit() and str(int(name)) == name):
            raise bad(f"epoch name {name!r} is not a canonical decimal integer")
        epoch = int(name)
        if not 1 <= epoch <= MAX_EPOCH:
            raise bad(f"epoch {epoch} is outside 1..{MAX_EPOCH}")
        entry = _fields(entry_doc, _EPOCH_FIELDS, bad, f"epoch {epoch}")
        epoch_created[epoch] = _timestamp(entry["created"], bad, f"epoch {epoch} created")
        try:
            deks[epoch] = kek._unwrap(
                _b64(entry["nonce"], NONCE_SIZE, bad, f"epoch {epoch} nonce"),
                _b64(entry["ct"], DEK_SIZE + TAG_SIZE, bad, f"epoch {epoch} ct"),
                _dek_aad(tenant, epoch),
            )
        except InvalidTag as exc:
            raise bad(
                f"data key of epoch {epoch} fails authentication (corrupt, tampered, "
                "or moved from another tenant or epoch)"
            ) from exc
    return deks, epoch_created


def decode_record(
    tenant: str, path: Path, data: bytes, keks: Mapping[str, Kek], current_kek_id: str
) -> _Record:
    """Decode ``tenant``'s key file ``data``, read from ``path``, unwrapping with ``keks`` by id."""

    def bad(why: str) -> KeyringError:
        return KeyringError(f"key file {path}: {why}")

    doc = _document(tenant, data, bad)
    kek_id = doc["kek_id"]
    if not isinstance(kek_id, str):
        raise bad("kek_id is not a string")
    kek = keks.get(kek_id)
    if kek is None:
        others = [k for k in keks if k != current_kek_id]
        also = f" (previous KEKs: {', '.join(others)})" if others else ""
        raise _UnknownKek(
            f"key file {path} wrapped by KEK {kek_id}, loaded KEK is {current_kek_id}{also}"
        )
    created = _timestamp(doc["created"], bad, "created")
    current = doc["current_epoch"]
    if type(current) is not int or not 1 <= current <= MAX_EPOCH:
        raise bad(f"current_epoch {current!r} is not an integer in 1..{MAX_EPOCH}")
    salt_doc = _fields(doc["salt"], _SALT_FIELDS, bad, "salt")
    epochs_doc = doc["epochs"]
    if not isinstance(epochs_doc, dict) or not epochs_doc:
        raise bad("epochs is not a non-empty object")
    try:
        salt = kek._unwrap(
            _b64(salt_doc["nonce"], NONCE_SIZE, bad, "salt nonce"),
            _b64(salt_doc["ct"], SALT_SIZE + TAG_SIZE, bad, "salt ct"),
            _salt_aad(tenant),
        )
    except InvalidTag as exc:
        raise bad(
            "salt fails authentication (corrupt, tampered, or from another tenant's file)"
        ) from exc
    deks, epoch_created = _epochs(tenant, epochs_doc, kek, bad)
    if current != max(deks):
        raise bad(f"current_epoch {current} is not the newest epoch {max(deks)}")
    return _Record(
        keys=TenantKeys(tenant, salt, current, deks),
        kek_id=kek_id,
        created=created,
        epoch_created=epoch_created,
    )


def encode_record(rec: _Record, kek: Kek) -> bytes:
    """The key file of ``rec``, its secrets wrapped by ``kek``."""
    t = rec.keys.tenant
    epochs = {
        str(e): {**kek._wrap(rec.keys.deks[e], _dek_aad(t, e)), "created": rec.epoch_created[e]}
        for e in sorted(rec.keys.deks)
    }
    doc = {
        "format": FORMAT_VERSION,
        "tenant": t,
        "kek_id": kek.key_id,
        "created": rec.created,
        "current_epoch": rec.keys.current_epoch,
        "salt": kek._wrap(rec.keys.salt, _salt_aad(t)),
        "epochs": epochs,
    }
    return (json.dumps(doc, indent=2) + "\n").encode("ascii")


def _fields(
    value: Any, names: frozenset[str], bad: Callable[[str], KeyringError], what: str
) -> dict[str, Any]:
    if not isinstance(value, dict) or value.keys() != names:
        raise bad(f"{what} must be an object with exactly the fields {sorted(names)}")
    return value


def _b64(value: Any, size: int, bad: Callable[[str], KeyringError], what: str) -> bytes:
    if not isinstance(value, str):
        raise bad(f"{what} is not a string")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad(f"{what} is not valid base64") from exc
    # Canonical form only, so no two files (or bit flips) encode the same bytes.
    if len(raw) != size or base64.b64encode(raw).decode("ascii") != value:
        raise bad(f"{what} is not the canonical base64 of {size} bytes")
    return raw


def _timestamp(value: Any, bad: Callable[[str], KeyringError], what: str) -> str:
    if not isinstance(value, str):
        raise bad(f"{what} is not a string")
    try:
        datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ")
    except ValueError as exc:
        raise bad(f"{what} {value!r} is not a UTC timestamp YYYY-MM-DDTHH:MM:SSZ") from exc
    return value
