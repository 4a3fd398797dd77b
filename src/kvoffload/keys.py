"""Chained, tenant-salted chunk keys.

A chunk is ``chunk_tokens`` consecutive tokens (a multiple of the engine block
size). Its key commits to the whole prefix that precedes it::

    root     = BLAKE2b-256(key=salt, person="kvo-root-v1", fingerprint)
    key(n)   = BLAKE2b-256(key=salt, person="kvo-chunk-v1",
                           key(n-1) || u32 ntok || ntok × u32 token ||
                           u16 nextra || nextra × (u16 len || bytes))

with ``key(-1) = root`` and all integers little-endian. The salt is the
tenant's secret 32-byte salt (held wrapped in the sidecar's keyring), used as
the BLAKE2b key, so equal prefixes in different tenants never collide and a
party without the salt cannot compute, and so cannot probe for, a tenant's
keys. Extra keys (e.g. multimodal content hashes of inputs inside the chunk,
or a per-request cache salt) enter the chunk they belong to.

A tenant of a trust group (docs/spec/keys-v1.md §12) is handed the *group
salt* instead of its stored salt::

    group_salt = BLAKE2b-256(key=salt, person="kvo-tgrp-v1",
                             u8 len(group) || group)

so the same tenant under two trust groups has disjoint keys, and a tenant
without a group derives exactly as before.

Everything here is deterministic: no Python ``hash()``, no process state.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

import numpy as np

from kvoffload.errors import KeyDerivationError

from .contract import CompatContract

KEY_SIZE = 32
SALT_SIZE = 32
_U32_MAX = 2**32 - 1


def _check_salt(salt: bytes) -> None:
    if len(salt) != SALT_SIZE:
        raise KeyDerivationError(f"tenant salt must be {SALT_SIZE} bytes, got {len(salt)}")


def group_salt(salt: bytes, trust_group: str | None) -> bytes:
    """The salt chunk keys are derived with: the tenant's own, bound to its trust group.

    ``None`` (no group) returns ``salt`` unchanged, so stores written before
    trust groups existed keep their keys. A group label enters BLAKE2b with
    its own personalisation and a length prefix (domain separation): no group
    label, and no other group's label, gives the same output.
    """
    _check_salt(salt)
    if trust_group is None:
        return salt
    label = trust_group.encode("utf-8")
    if not 1 <= len(label) <= 255:
        raise KeyDerivationError("trust group label must be 1-255 bytes")
    return hashlib.blake2b(
        bytes([len(label)]) + label, digest_size=SALT_SIZE, key=salt, person=b"kvo-tgrp-v1"
    ).digest()


def root_key(fingerprint: bytes, salt: bytes) -> bytes:
    _check_salt(salt)
    if len(fingerprint) != 32:
        raise KeyDerivationError("namespace fingerprint must be 32 bytes")
    return hashlib.blake2b(
        fingerprint, digest_size=KEY_SIZE, key=salt, person=b"kvo-root-v1"
    ).digest()


def _tokens_le(tokens: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise KeyDerivationError("tokens must be one-dimensional")
    if arr.size and (arr.dtype.kind not in "iu" or int(arr.min()) < 0 or int(arr.max()) > _U32_MAX):
        raise KeyDerivationError("token ids must be integers in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def next_key(
    parent: bytes, salt: bytes, tokens: Sequence[int] | np.ndarray, extra: Iterable[bytes] = ()
) -> bytes:
    """key(n) from key(n-1), the chunk's tokens and its extra keys."""
    _check_salt(salt)
    if len(parent) != KEY_SIZE:
        raise KeyDerivationError("parent key must be 32 bytes")
    tok = _tokens_le(tokens)
    extras = list(extra)
    if len(extras) > 0xFFFF:
        raise KeyDerivationError("too many extra keys for one chunk")
    h = hashlib.blake2b(digest_size=KEY_SIZE, key=salt, person=b"kvo-chunk-v1")
    h.update(parent)
    h.update(struct.pack("<I", len(tok) // 4))
    h.update(tok)
    h.update(struct.pack("<H", len(extras)))
    for e in extras:
        if len(e) > 0xFFFF:
            raise KeyDerivationError("extra key longer than 65535 bytes")
        h.update(struct.pack("<H", len(e)))
        h.update(e)
    return h.digest()


def chunk_keys(
    contract: CompatContract,
    salt: bytes,
    tokens: Sequence[int] | np.ndarray,
    extra_keys: Sequence[Iterable[bytes]] | None = None,
) -> list[bytes]:
    """Keys of every *full* chunk of ``tokens`` (a trailing partial chunk has none).

    ``extra_keys[i]`` are the extra keys of chunk ``i`` (missing = none).
    """
    n = contract.chunk_tokens
    arr = np.asarray(tokens)
    full = len(arr) // n
    keys: list[bytes] = []
    parent = root_key(contract.fingerprint(), salt)
    for i in range(full):
        extra = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else ()
        parent = next_key(parent, salt, arr[i * n : (i + 1) * n], extra)
        keys.append(parent)
    return keys
