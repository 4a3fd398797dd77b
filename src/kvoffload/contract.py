"""The compatibility contract: everything that shapes a KV cache.

KV computed under one contract may be reused only under an *equal* contract.
Reusing KV under a different model revision, tokenizer, RoPE, LoRA, dtype,
layout, shard or tenant produces fluent, wrong output, so every field here is
part of every chunk key and of the AEAD associated data of every object.

The fingerprint is BLAKE2b-256 (person ``kvo-ns-v1``) over the *canonical
encoding* of the contract, specified in ``docs/spec/contract-v1.md``:

* a JSON object with keys sorted by code point, no whitespace, UTF-8, strings
  NFC-normalised, ``ensure_ascii`` off;
* every number that is not a bool is converted to a float and written as the
  string ``float.hex(x)`` (so ``8``, ``8.0`` and ``8e0`` are one value; NaN and
  infinities are refused);
* nested mappings are encoded the same way, recursively; sequences keep their
  order; ``None`` is ``null``;
* the top-level object carries ``"contract": 1``, the version of this encoding;
  a contract of one KV-cache group of a hybrid model (``kv_group`` set) is
  encoding version 2: the same object plus a ``kv_group`` object
  (contract-v1.md §7). A model with one group never carries it, so its
  fingerprints are those of version 1.

So neither field order, dict ordering nor float formatting can change the
fingerprint, while any change of value does.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvoffload.errors import ContractError

CONTRACT_ENCODING_VERSION = 1
#: The encoding of a contract that names one KV-cache group (contract-v1.md §7).
CONTRACT_GROUP_ENCODING_VERSION = 2
#: What a KV-cache group holds (contract-v1.md §7).
KV_GROUP_KINDS = ("full_attention", "sliding_window", "mamba")
FINGERPRINT_SIZE = 32
DEFAULT_CHUNK_TOKENS = 256

#: Tenant ids appear in paths and object headers: keep them boring.
TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

CACHE_LAYOUTS = ("NHD", "HND")
#: contract-v1 §8: a row of vLLM's native-offloading primary tier as vLLM wrote
#: it, named by the BLAKE2b-128 of its geometry (kvoffload's vLLM tier).
VLLM_ROW_LAYOUT_RE = re.compile(r"^vllm-row-v1:[0-9a-f]{32}$")


def validate_tenant(tenant: str) -> str:
    if not isinstance(tenant, str) or not TENANT_RE.fullmatch(tenant):
        raise ContractError(
            f"invalid tenant id {tenant!r}: 1-64 characters of [A-Za-z0-9._-], "
            "starting with a letter or digit"
        )
    return tenant


def _canon(value: Any, where: str) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        f = float(value)
        if not math.isfinite(f):
            raise ContractError(f"{where}: non-finite number {value!r}")
        return f.hex()
    if isinstance(value, str):
        return unicodedata.normalize("NFC", value)
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ContractError(f"{where}: mapping keys must be strings, got {k!r}")
            out[unicodedata.normalize("NFC", k)] = _canon(v, f"{where}.{k}")
        return out
    if isinstance(value, Sequence):
        return [_canon(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ContractError(f"{where}: unsupported type {type(value).__name__}")


def canonical_json(value: Mapping[str, Any]) -> bytes:
    """The canonical encoding described in the module docstring."""
    return json.dumps(
        _canon(value, "contract"),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    ).encode("utf-8")


def _freeze(value: Any) -> Any:
    """Make a nested config hashable so the contract can stay frozen."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple) and all(
        isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str) for i in value
    ):
        return {k: _thaw(v) for k, v in value}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


@dataclass(frozen=True)
class LayerLayout:
    """Shape of one shard's KV cache: what a chunk holds per layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    cache_layout: str = "NHD"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ContractError(f"layer_layout.{name} must be a positive int, got {v!r}")
        layout = self.cache_layout
        if layout not in CACHE_LAYOUTS and not (
            isinstance(layout, str) and VLLM_ROW_LAYOUT_RE.fullmatch(layout)
        ):
            raise ContractError(
                f"layer_layout.cache_layout must be one of {CACHE_LAYOUTS} or "
                "vllm-row-v1:<32 hex digits>, "
                f"got {self.cache_layout!r}"
            )


@dataclass(frozen=True)
class Shard:
    """Which tensor/pipeline-parallel slice of the KV this worker holds."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        if not (0 <= self.tp_rank < self.tp_size) or not (0 <= self.pp_rank < self.pp_size):
            raise ContractError(f"invalid shard {self}")


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group of a hybrid model (vLLM's hybrid KV-cache manager).

    Each group has its own block table, so its chunks are separate objects
    under a namespace of their own: the same tokens' chunk of another group
    (other layers, another window) is never the same object.
    """

    index: int
    num_groups: int
    kind: str
    #: The group's layers, as layer numbers of the model, ascending.
    layers: tuple[int, ...]
    #: Sliding-window groups: the window in tokens; None otherwise.
    sliding_window: int | None = None
    #: Mamba groups: vLLM's ``mamba_cache_mode``; None otherwise.
    mamba_cache_mode: str | None = None
    #: Sliding-window groups: tokens kept below the window (vLLM's
    #: ``extra_retained_tokens``), None when 0.
    extra_retained_tokens: int | None = None
    #: Mamba groups: the state tensors of one layer's page (type, shapes, dtypes).
    state: str | None = None

    def __post_init__(self) -> None:
        for name in ("index", "num_groups"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ContractError(f"kv_group.{name} must be an int >= 0, got {v!r}")
        if not self.index < self.num_groups:
            raise ContractError(f"kv_group.index {self.index} outside {self.num_groups} groups")
        if self.kind not in KV_GROUP_KINDS:
            raise ContractError(f"kv_group.kind must be one of {KV_GROUP_KINDS}, got {self.kind!r}")
        layers = tuple(self.layers)
        if not layers or any(
            not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in layers
        ):
            raise ContractError(f"kv_group.layers must be layer numbers, got {self.layers!r}")
        object.__setattr__(self, "layers", layers)
        window = self.sliding_window
        if (self.kind == "sliding_window") != (window is not None):
            raise ContractError("kv_group.sliding_window is set exactly for sliding_window groups")
        if window is not None and (not isinstance(window, int) or window <= 0):
            raise ContractError(f"kv_group.sliding_window must be positive, got {window!r}")
        mode = self.mamba_cache_mode
        if (self.kind == "mamba") != (mode is not None):
            raise ContractError("kv_group.mamba_cache_mode is set exactly for mamba groups")
        if mode is not None and (not isinstance(mode, str) or not mode):
            raise ContractError(f"kv_group.mamba_cache_mode must be a string, got {mode!r}")
        extra = self.extra_retained_tokens
        if extra is not None and (not isinstance(extra, int) or extra <= 0 or window is None):
            raise ContractError(f"kv_group.extra_retained_tokens: a positive int, got {extra!r}")
        if (self.kind == "mamba") != (self.state is not None) or self.state == "":
            raise ContractError("kv_group.state describes exactly a mamba group's state")

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "num_groups": self.num_groups,
            "kind": self.kind,
            "layers": list(self.layers),
            "sliding_window": self.sliding_window,
            "mamba_cache_mode": self.mamba_cache_mode,
            "extra_retained_tokens": self.extra_retained_tokens,
            "state": self.state,
        }


@dataclass(frozen=True)
class CompatContract:
    """Every input that shapes the KV of a chunk. Equal contract ⇔ reusable KV."""

    model_revision: str
    tokenizer_hash: str
    chat_template_version: str
    attention_backend: str
    kv_dtype: str
    block_size: int
    layer_layout: LayerLayout
    tenant_namespace: str
    rope_config: Any = field(default=())
    lora_id: str | None = None
    shard: Shard = field(default_factory=Shard)
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    #: The KV-cache group of a hybrid model; None for a model with one group.
    kv_group: KVGroup | None = None

    def __post_init__(self) -> None:
        for name in (
            "model_revision",
            "tokenizer_hash",
            "chat_template_version",
            "attention_backend",
            "kv_dtype",
        ):
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise ContractError(f"{name} must be a non-empty string, got {v!r}")
        validate_tenant(self.tenant_namespace)
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ContractError(f"block_size must be a positive int, got {self.block_size!r}")
        if (
            not isinstance(self.chunk_tokens, int)
            or self.chunk_tokens <= 0
            or self.chunk_tokens % self.block_size
        ):
            raise ContractError(
                f"chunk_tokens ({self.chunk_tokens!r}) must be a positive multiple of "
                f"block_size ({self.block_size})"
            )
        if self.lora_id is not None and not isinstance(self.lora_id, str):
            raise ContractError(f"lora_id must be a string or None, got {self.lora_id!r}")
        rope = self.rope_config
        if isinstance(rope, Mapping):
            _canon(rope, "rope_config")  # validate early: NaN etc.
            object.__setattr__(self, "rope_config", _freeze(rope))
        elif not isinstance(rope, tuple):
            raise ContractError("rope_config must be a mapping")
        if self.kv_group is not None and not isinstance(self.kv_group, KVGroup):
            raise ContractError(f"kv_group must be a KVGroup or None, got {self.kv_group!r}")

    @property
    def rope(self) -> dict[str, Any]:
        out = _thaw(self.rope_config)
        return out if isinstance(out, dict) else {}

    @property
    def tenant(self) -> str:
        return self.tenant_namespace

    def to_dict(self) -> dict[str, Any]:
        out = self._v1_dict()
        if self.kv_group is not None:
            out["contract"] = CONTRACT_GROUP_ENCODING_VERSION
            out["kv_group"] = self.kv_group.to_dict()
        return out

    def _v1_dict(self) -> dict[str, Any]:
        return {
            "contract": CONTRACT_ENCODING_VERSION,
            "model_revision": self.model_revision,
            "tokenizer_hash": self.tokenizer_hash,
            "chat_template_version": self.chat_template_version,
            "attention_backend": self.attention_backend,
            "kv_dtype": self.kv_dtype,
            "block_size": self.block_size,
            "chunk_tokens": self.chunk_tokens,
            "layer_layout": {
                "num_layers": self.layer_layout.num_layers,
                "num_kv_heads": self.layer_layout.num_kv_heads,
                "head_dim": self.layer_layout.head_dim,
                "cache_layout": self.layer_layout.cache_layout,
            },
            "rope_config": self.rope,
            "lora_id": self.lora_id,
            "tenant_namespace": self.tenant_namespace,
            "shard": {
                "tp_rank": self.shard.tp_rank,
                "tp_size": self.shard.tp_size,
                "pp_rank": self.shard.pp_rank,
                "pp_size": self.shard.pp_size,
            },
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CompatContract:
        version = d.get("contract", CONTRACT_ENCODING_VERSION)
        if version not in (CONTRACT_ENCODING_VERSION, CONTRACT_GROUP_ENCODING_VERSION) or (
            isinstance(version, bool)
        ):
            raise ContractError(f"unknown contract encoding version {version!r}")
        group: KVGroup | None = None
        if version == CONTRACT_GROUP_ENCODING_VERSION:
            raw = d.get("kv_group")
            if not isinstance(raw, Mapping):
                raise ContractError("a contract of encoding version 2 needs a kv_group object")
            try:
                layers = raw.get("layers")
                if not isinstance(layers, list | tuple):
                    raise ContractError("kv_group.layers must be an array of layer numbers")
                fields = {str(k): v for k, v in raw.items() if k != "layers"}
                group = KVGroup(**fields, layers=tuple(layers))
            except TypeError as exc:
                raise ContractError(f"invalid kv_group: {exc}") from exc
        elif "kv_group" in d:
            raise ContractError("kv_group needs contract encoding version 2")
        try:
            return cls(
                model_revision=d["model_revision"],
                tokenizer_hash=d["tokenizer_hash"],
                chat_template_version=d["chat_template_version"],
                attention_backend=d["attention_backend"],
                kv_dtype=d["kv_dtype"],
                block_size=d["block_size"],
                chunk_tokens=d.get("chunk_tokens", DEFAULT_CHUNK_TOKENS),
                layer_layout=LayerLayout(**d["layer_layout"]),
                rope_config=d.get("rope_config", {}),
                lora_id=d.get("lora_id"),
                tenant_namespace=d["tenant_namespace"],
                shard=Shard(**d.get("shard", {})),
                kv_group=group,
            )
        except KeyError as exc:
            raise ContractError(f"contract field {exc.args[0]!r} is missing") from exc
        except TypeError as exc:
            raise ContractError(f"invalid contract: {exc}") from exc

    def canonical_bytes(self) -> bytes:
        return canonical_json(self.to_dict())

    def fingerprint(self) -> bytes:
        """32-byte namespace fingerprint; stable across processes and versions."""
        return hashlib.blake2b(
            self.canonical_bytes(), digest_size=FINGERPRINT_SIZE, person=b"kvo-ns-v1"
        ).digest()
