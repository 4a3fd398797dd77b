"""What the LMCache adapter decides without LMCache: its settings, the cache salt's
tenant and an object's kvoffload identity (contract, namespace, chunk key).

Nothing here imports LMCache, so it runs (and is tested) in kvoffload's own
environment. :mod:`.adapter` feeds it the fields of LMCache's ``ObjectKey``.

Identity (docs/lmcache.md, "Keys"): an ``ObjectKey`` is
``(chunk_hash, model_name, kv_rank, object_group_id, cache_salt)``. LMCache's
``chunk_hash`` already chains the whole token prefix, so the adapter does not
see tokens; it derives the chunk key with kvoffload's own key schedule
(:mod:`kvoffload.keys`) from the namespace root and one chunk of no tokens
whose extra keys are every field of the ``ObjectKey``::

    contract  = the operator's contract fields, model_revision = model_name by
                default, tenant_namespace = the salt's tenant, shard from kv_rank
    namespace = contract.fingerprint()
    key       = next_key(root_key(namespace, salt), salt, [],
                         ["lmcache-object-v1", chunk_hash,
                          u32 kv_rank || u32 object_group_id, cache_salt])

where ``salt`` is the tenant's secret salt from the sidecar. So two cache salts
never share a chunk, not even when the policy maps both to one tenant, and an
object under another model name, rank or group is another chunk.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...contract import (
    DEFAULT_CHUNK_TOKENS,
    TENANT_RE,
    CompatContract,
    LayerLayout,
    Shard,
)
from ...errors import ConnectorConfigError, ContractError
from ...keys import next_key, root_key

#: The first extra key of every chunk key this adapter derives (domain separation
#: from the vLLM connector's token-derived keys).
KEY_LABEL = b"lmcache-object-v1"
DEFAULT_SOCKET = "/run/kvoffload/kvoffload.sock"
DEFAULT_STAGING_BYTES = 64 << 20

#: The contract fields an operator may set; the rest come from the ObjectKey.
_CONTRACT_DEFAULTS: dict[str, Any] = {
    "tokenizer_hash": "lmcache-chunk-hash",
    "chat_template_version": "none",
    "attention_backend": "lmcache-mp",
    "kv_dtype": "opaque",
    "block_size": DEFAULT_CHUNK_TOKENS,
    "chunk_tokens": DEFAULT_CHUNK_TOKENS,
    "layer_layout": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1},
    "rope_config": {},
    "lora_id": None,
}
_KNOWN = {
    "socket",
    "tenants",
    "default_tenant",
    "salt_as_tenant",
    "max_capacity_bytes",
    "staging_bytes",
    "timeout_s",
    "contract",
    "usage_refresh_s",
}


def _int(d: Mapping[str, Any], name: str, default: int, low: int) -> int:
    v = d.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ConnectorConfigError(f"adapter_params.{name} must be an integer >= {low}, got {v!r}")
    return v


def _float(d: Mapping[str, Any], name: str, default: float) -> float:
    v = d.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
        raise ConnectorConfigError(f"adapter_params.{name} must be a positive number, got {v!r}")
    return float(v)


def _tenant(v: Any, where: str) -> str:
    if not isinstance(v, str) or not TENANT_RE.fullmatch(v):
        raise ConnectorConfigError(
            f"{where} must be a kvoffload tenant id (1-64 of [A-Za-z0-9._-]), got {v!r}"
        )
    return v


@dataclass(frozen=True)
class Settings:
    """The plugin's ``adapter_params``, checked (see docs/lmcache.md, "Config")."""

    socket: str = DEFAULT_SOCKET
    #: cache_salt -> tenant; "" is the unsalted requests' salt.
    tenants: Mapping[str, str] = field(default_factory=dict)
    #: The tenant of a salt absent from ``tenants`` ("" included); None: not cached.
    default_tenant: str | None = "default"
    #: An unmapped salt that is a valid tenant id is its own tenant.
    salt_as_tenant: bool = False
    #: 0: the sidecar's capacity (its ``capacity_bytes``), if it has one.
    max_capacity_bytes: int = 0
    staging_bytes: int = DEFAULT_STAGING_BYTES
    timeout_s: float = 30.0
    usage_refresh_s: float = 1.0
    contract: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Settings:
        d = dict(d or {})
        unknown = sorted(set(d) - _KNOWN)
        if unknown:
            raise ConnectorConfigError(
                f"adapter_params: unknown key {unknown[0]!r} (known: {', '.join(sorted(_KNOWN))})"
            )
        sock = d.get("socket", DEFAULT_SOCKET)
        if not isinstance(sock, str) or not sock:
            raise ConnectorConfigError(f"adapter_params.socket must be a path, got {sock!r}")
        tenants = d.get("tenants", {})
        if not isinstance(tenants, Mapping):
            raise ConnectorConfigError("adapter_params.tenants must map cache salts to tenants")
        tmap = {}
        for salt, tenant in tenants.items():
            if not isinstance(salt, str):
                raise ConnectorConfigError(f"adapter_params.tenants: salt {salt!r} is not a string")
            tmap[salt] = _tenant(tenant, f"adapter_params.tenants[{salt!r}]")
        default = d.get("default_tenant", "default")
        if default is not None:
            default = _tenant(default, "adapter_params.default_tenant")
        sat = d.get("salt_as_tenant", False)
        if not isinstance(sat, bool):
            raise ConnectorConfigError(
                f"adapter_params.salt_as_tenant must be true or false, got {sat!r}"
            )
        contract = d.get("contract", {})
        if not isinstance(contract, Mapping):
            raise ConnectorConfigError("adapter_params.contract must be an object")
        for k in contract:
            if k not in _CONTRACT_DEFAULTS and k != "model_revision":
                raise ConnectorConfigError(
                    f"adapter_params.contract: {k!r} cannot be set (settable: "
                    f"model_revision, {', '.join(sorted(_CONTRACT_DEFAULTS))})"
                )
        s = cls(
            socket=sock,
            tenants=tmap,
            default_tenant=default,
            salt_as_tenant=sat,
            max_capacity_bytes=_int(d, "max_capacity_bytes", 0, 0),
            staging_bytes=_int(d, "staging_bytes", DEFAULT_STAGING_BYTES, 1 << 16),
            timeout_s=_float(d, "timeout_s", 30.0),
            usage_refresh_s=_float(d, "usage_refresh_s", 1.0),
            contract=dict(contract),
        )
        try:  # a bad contract field fails at start, not on the first store
            s.contract_for("default", "probe-model", 0)
        except ContractError as exc:
            raise ConnectorConfigError(f"adapter_params.contract: {exc}") from None
        return s

    def tenant_of(self, cache_salt: str) -> str | None:
        """The tenant of ``cache_salt``; None: this salt is not cached (never hits)."""
        t = self.tenants.get(cache_salt)
        if t is not None:
            return t
        if cache_salt and self.salt_as_tenant and TENANT_RE.fullmatch(cache_salt):
            return cache_salt
        return self.default_tenant

    def salts_alone(self) -> dict[str, str]:
        """Salts that are their tenant's only mapped salt: their usage is the tenant's."""
        count: dict[str, int] = {}
        for t in self.tenants.values():
            count[t] = count.get(t, 0) + 1
        return {s: t for s, t in self.tenants.items() if count[t] == 1}

    @property
    def chunk_tokens(self) -> int:
        """Tokens of one LMCache chunk (the contract's ``chunk_tokens``)."""
        return int({**_CONTRACT_DEFAULTS, **self.contract}["chunk_tokens"])

    def contract_for(self, tenant: str, model_name: str, kv_rank: int) -> CompatContract:
        f = {**_CONTRACT_DEFAULTS, **self.contract}
        return CompatContract(
            model_revision=str(f.get("model_revision") or model_name),
            tokenizer_hash=f["tokenizer_hash"],
            chat_template_version=f["chat_template_version"],
            attention_backend=f["attention_backend"],
            kv_dtype=f["kv_dtype"],
            block_size=f["block_size"],
            chunk_tokens=f["chunk_tokens"],
            layer_layout=LayerLayout(**f["layer_layout"]),
            rope_config=f["rope_config"],
            lora_id=f["lora_id"],
            tenant_namespace=tenant,
            shard=shard_of(kv_rank),
        )


def shard_of(kv_rank: int) -> Shard:
    """LMCache's ``kv_rank`` is ``(world << 24) | (rank << 16) | (local_world << 8) | local``;
    its tensor-parallel coordinates, or the single shard where they do not parse."""
    world, rank = (kv_rank >> 24) & 0xFF, (kv_rank >> 16) & 0xFF
    if 0 <= rank < world:
        return Shard(tp_rank=rank, tp_size=world)
    return Shard()


def announces(kv_rank: int, object_group_id: int) -> bool:
    """Whether this rank's object of a chunk is the one whose engine hash the
    sidecar's KV-event feed carries: tensor-parallel rank 0, object group 0."""
    return shard_of(kv_rank).tp_rank == 0 and object_group_id == 0


def object_chunk_key(
    namespace: bytes,
    salt: bytes,
    chunk_hash: bytes,
    kv_rank: int,
    object_group_id: int,
    cache_salt: str,
) -> bytes:
    """The kvoffload chunk key of one LMCache object (module docstring)."""
    coords = struct.pack("<II", kv_rank & 0xFFFFFFFF, object_group_id & 0xFFFFFFFF)
    extras = (KEY_LABEL, bytes(chunk_hash), coords, cache_salt.encode("utf-8"))
    return next_key(root_key(namespace, salt), salt, (), extras)
