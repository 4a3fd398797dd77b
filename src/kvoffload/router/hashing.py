"""The engine's block hashes of a prompt, computed exactly as vLLM 0.33 does.

vLLM's prefix cache names each full block of ``block_size`` tokens by a chained
hash (``vllm/v1/core/kv_cache_utils.py``)::

    hash(n) = H((hash(n-1), tuple(tokens of block n), extra_keys(n)))
    hash(-1) = NONE_HASH = H(seed)        seed: $PYTHONHASHSEED, else "vllm-none-hash"

where ``H`` is ``--prefix-caching-hash-algo`` (``sha256``: SHA-256 of the
pickle, protocol 5, the default; ``sha256_cbor``: SHA-256 of canonical CBOR;
``xxhash``/``xxhash_cbor``: XXH3-128 of the same), and ``extra_keys(n)`` is a
tuple of tagged keys or ``None``: ``("lora", name, path)`` on every block of a
LoRA request, then ``("cache_salt", salt)`` on the first block only.
Multimodal and prompt-embeds inputs also enter the extra keys; the router does
not compute those, so a request carrying them is routed as cold (never
credited with KV it might not match).

KV events publish a hash as its low 64 bits (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``,
on by default): :func:`external_hash` is that conversion, and the router's index
is keyed by it. A 64-bit collision can only mislead a routing estimate, never
reuse KV: the engine matches on the full hash.

The canonical CBOR encoder here covers the types these tuples hold (bytes,
str, int, None, bool, tuples/lists) and nothing else; anything else is a
:class:`TypeError`. Standard library plus ``xxhash`` (a base dependency).
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ALGORITHMS",
    "DEFAULT_SEED",
    "BlockHasher",
    "cbor_canonical",
    "external_hash",
    "hash_function",
]

DEFAULT_SEED = "vllm-none-hash"
ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
_MASK64 = (1 << 64) - 1


def _head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([(major << 5) | n])
    if n < 0x100:
        return bytes([(major << 5) | 24, n])
    if n < 0x10000:
        return bytes([(major << 5) | 25]) + struct.pack(">H", n)
    if n < 0x100000000:
        return bytes([(major << 5) | 26]) + struct.pack(">I", n)
    if n <= _MASK64:
        return bytes([(major << 5) | 27]) + struct.pack(">Q", n)
    raise TypeError("integers beyond 64 bits are not encoded")


def _cbor(obj: Any, out: list[bytes]) -> None:
    if obj is None:
        out.append(b"\xf6")
    elif obj is True:
        out.append(b"\xf5")
    elif obj is False:
        out.append(b"\xf4")
    elif isinstance(obj, int):
        out.append(_head(0, obj) if obj >= 0 else _head(1, -1 - obj))
    elif isinstance(obj, bytes):
        out.append(_head(2, len(obj)))
        out.append(obj)
    elif isinstance(obj, str):
        raw = obj.encode("utf-8")
        out.append(_head(3, len(raw)))
        out.append(raw)
    elif isinstance(obj, tuple | list):
        out.append(_head(4, len(obj)))
        for item in obj:
            _cbor(item, out)
    else:
        raise TypeError(f"cannot CBOR-encode {type(obj).__name__}")


def cbor_canonical(obj: Any) -> bytes:
    """``cbor2.dumps(obj, canonical=True)`` for the types a block-hash tuple holds."""
    out: list[bytes] = []
    _cbor(obj, out)
    return b"".join(out)


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _xxh128(data: bytes) -> bytes:
    import xxhash

    digest: bytes = xxhash.xxh3_128_digest(data)
    return digest


@functools.cache
def hash_function(name: str) -> Callable[[Any], bytes]:
    """vLLM's ``get_hash_fn_by_name``: the serializer and digest of one algorithm."""
    if name == "sha256":
        sha256, dumps, proto = hashlib.sha256, pickle.dumps, pickle.HIGHEST_PROTOCOL
        return lambda obj: sha256(dumps(obj, protocol=proto)).digest()
    if name == "sha256_cbor":
        return lambda obj: hashlib.sha256(cbor_canonical(obj)).digest()
    if name == "xxhash":
        return lambda obj: _xxh128(_pickle(obj))
    if name == "xxhash_cbor":
        return lambda obj: _xxh128(cbor_canonical(obj))
    raise ValueError(f"unknown prefix-caching hash algorithm {name!r} (one of {ALGORITHMS})")


def external_hash(block_hash: bytes | int) -> int:
    """The hash as KV events carry it: the low 64 bits, big-endian (an int passes through)."""
    if isinstance(block_hash, int):
        return block_hash & _MASK64
    return int.from_bytes(block_hash, "big") & _MASK64


@dataclass(frozen=True)
class BlockHasher:
    """The engine's hashing settings: algorithm, NONE_HASH seed and block size.

    ``seed`` is the engine's ``PYTHONHASHSEED`` when it sets one; vLLM picks a
    random seed for the xxhash algorithms otherwise, which no router can match,
    so those need an explicit seed (:meth:`__post_init__` refuses without).
    """

    block_size: int = 16
    algorithm: str = "sha256"
    seed: str | None = None

    def __post_init__(self) -> None:
        hash_function(self.algorithm)
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, not {self.block_size}")
        if self.algorithm.startswith("xxhash") and self.seed is None:
            raise ValueError(
                f"{self.algorithm}: vLLM seeds it randomly per process unless PYTHONHASHSEED "
                "is set; set the same seed here (hash_seed) as on the workers"
            )

    @functools.cached_property
    def none_hash(self) -> bytes:
        return hash_function(self.algorithm)(self.seed if self.seed is not None else DEFAULT_SEED)

    def extra_keys(
        self, block_index: int, *, cache_salt: str | None, lora: tuple[str, str] | None
    ) -> tuple[Any, ...] | None:
        """``generate_block_hash_extra_keys`` for a text-only request."""
        keys: list[Any] = []
        if lora is not None:
            keys.append(("lora", lora[0], lora[1]))
        if block_index == 0 and cache_salt:
            keys.append(("cache_salt", cache_salt))
        return tuple(keys) if keys else None

    def block_hashes(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
    ) -> list[bytes]:
        """The full hashes of every full block of ``token_ids`` (a partial tail has none).

        Each prompt is hashed once per request, on the router's event loop: the
        loop is kept to one slice, one serialization and one digest per block.
        """
        fn = hash_function(self.algorithm)
        parent = self.none_hash
        bs = self.block_size
        tokens = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
        n = len(tokens) // bs * bs
        if not n:
            return []
        extra = self.extra_keys(0, cache_salt=cache_salt, lora=lora)
        parent = fn((parent, tokens[:bs], extra))
        out = [parent]
        append = out.append
        extra = self.extra_keys(1, cache_salt=cache_salt, lora=lora)
        for i in range(bs, n, bs):
            parent = fn((parent, tokens[i : i + bs], extra))
            append(parent)
        return out

    def external_hashes(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
    ) -> list[int]:
        """:meth:`block_hashes` as KV events name them (the router's index keys)."""
        from_bytes = int.from_bytes
        return [
            from_bytes(h, "big") & _MASK64
            for h in self.block_hashes(token_ids, cache_salt=cache_salt, lora=lora)
        ]


def seed_from_environment() -> str | None:
    """The ``PYTHONHASHSEED`` of this process, for a router started beside its workers."""
    return os.environ.get("PYTHONHASHSEED")
