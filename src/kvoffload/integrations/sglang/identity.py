"""What a SGLang HiCache page is to kvoffload: settings, contract and chunk key.

Pure Python (no SGLang, no torch), so it is tested in every environment.

SGLang names an L3 page by a SHA-256 hex string chained over the token ids of
every page before it, seeded with the request's ``extra_key``/``cache_salt``
(``sglang.srt.mem_cache.utils.storage_namespace_seed``). The string says
nothing about the model, the shard or the page's shape, so it is never used as
a kvoffload key by itself: the chunk key is a keyed BLAKE2b of it under the
tenant's salt, bound to the namespace (the :class:`CompatContract`
fingerprint of model, shard coordinates, host-pool layout, page size and
dtype) and to the pool the page belongs to (``kv``, ``mamba``, ...). Another
tenant, another model, another TP slice or another layout therefore derives
other keys, and its pages are misses, never hits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...client import DEFAULT_SOCKET_PATH
from ...contract import CompatContract, LayerLayout, Shard, validate_tenant
from ...errors import ConnectorConfigError
from ...keys import KEY_SIZE, root_key

#: Keys of ``--hicache-storage-backend-extra-config`` that SGLang itself reads.
SGLANG_KEYS = frozenset(
    {"backend_name", "module_path", "class_name", "interface_v1", "allocator", "tp_lcm_size"}
)
#: Keys this backend reads.
OWN_KEYS = frozenset(
    {
        "socket_path",
        "tenant",
        "model_revision",
        "tokenizer_hash",
        "lora_id",
        "staging_bytes",
        "timeout_s",
        "ttl_s",
        "inplace",
    }
)
#: ``inplace``: "auto" moves pages in place where the host pool is shared memory
#: (``"allocator": "shm"``) and the sidecar serves it; "off" always stages.
INPLACE_MODES = ("auto", "off")
DEFAULT_TENANT = "sglang"
DEFAULT_STAGING_BYTES = 64 << 20
_PERSON = b"kvo-sglang-v1"


#: A bad ``extra_config``: the message is one line naming the key. The package's
#: one error for an engine integration's config (kvoffload.errors), under SGLang's name.
SettingsError = ConnectorConfigError


@dataclass(frozen=True)
class Settings:
    socket_path: str = DEFAULT_SOCKET_PATH
    tenant: str = DEFAULT_TENANT
    model_revision: str | None = None
    tokenizer_hash: str = "sglang-token-ids"
    lora_id: str | None = None
    staging_bytes: int = DEFAULT_STAGING_BYTES
    timeout_s: float = 10.0
    ttl_s: float | None = None
    inplace: str = "auto"

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> Settings:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - SGLANG_KEYS - OWN_KEYS)
        if unknown:
            raise SettingsError(
                f"kvoffload: unknown key(s) {', '.join(map(repr, unknown))} in "
                f"--hicache-storage-backend-extra-config; known: {', '.join(sorted(OWN_KEYS))}"
            )
        own = {k: extra[k] for k in OWN_KEYS if k in extra}
        for name in ("socket_path", "tenant", "model_revision", "tokenizer_hash", "lora_id"):
            if name in own and not (isinstance(own[name], str) and own[name]):
                raise SettingsError(f"kvoffload: extra_config {name!r} must be a non-empty string")
        for name in ("staging_bytes",):
            v = own.get(name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 4096):
                raise SettingsError(f"kvoffload: extra_config {name!r} must be an int >= 4096")
        for name in ("timeout_s", "ttl_s"):
            v = own.get(name)
            if v is not None and (not isinstance(v, int | float) or isinstance(v, bool) or v <= 0):
                raise SettingsError(f"kvoffload: extra_config {name!r} must be a positive number")
        if own.get("inplace", "auto") not in INPLACE_MODES:
            raise SettingsError(
                f"kvoffload: extra_config 'inplace' must be one of {', '.join(INPLACE_MODES)}, "
                f"got {own['inplace']!r}"
            )
        try:
            validate_tenant(own.get("tenant", DEFAULT_TENANT))
        except ValueError as exc:
            raise SettingsError(f"kvoffload: extra_config 'tenant': {exc}") from None
        return cls(**own)


@dataclass(frozen=True)
class PoolShape:
    """What a host pool says about one page: SGLang's ``HostKVCache`` attributes."""

    pool: str
    kind: str
    layout: str
    dtype: str
    page_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    #: Bytes of one page (``get_dummy_flat_data_page``), and how they split into
    #: the chunk's layers (the contiguous runs of one page in the pool).
    page_bytes: int
    layer_bytes: tuple[int, ...]
    #: How a page splits into chunks, each the layer sizes of one run of
    #: adjacent memory (K and V of a ``page_first`` page: two chunks), so that
    #: a chunk can move in place (protocol-v1 §5.34); empty: one chunk of
    #: ``layer_bytes``. Decided by the layout alone (:func:`chunk_plan`).
    chunks: tuple[tuple[int, ...], ...] = ()

    @property
    def plan(self) -> tuple[tuple[int, ...], ...]:
        """The layer sizes of each chunk of a page, in page order."""
        return self.chunks or (self.layer_bytes,)


#: A page that is more runs of adjacent memory than this stays one chunk (of
#: many layers), moved through staging: ``layer_first`` (two runs per layer)
#: would otherwise be dozens of small chunks per page.
MAX_CHUNKS_PER_PAGE = 2


def chunk_plan(runs: list[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """:attr:`PoolShape.chunks` from a page's runs of adjacent memory (each the
    sizes of its contiguous parts): one chunk per run, or one chunk (``()``)."""
    if 1 < len(runs) <= MAX_CHUNKS_PER_PAGE:
        return tuple(runs)
    return ()


@dataclass(frozen=True)
class Coordinates:
    """The rank's place, from ``HiCacheStorageConfig``."""

    model_name: str | None
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    cp_rank: int
    cp_size: int
    dcp_rank: int
    dcp_size: int
    is_mla: bool
    split_heads: bool = False


def make_contract(s: Settings, c: Coordinates, p: PoolShape) -> CompatContract:
    """The namespace of one pool's pages on one rank.

    MLA KV is the same on every TP rank: the shard is (0, 1) so every rank
    reads what the one writer stored. A TP-sharded pool (MHA KV, and Mamba
    state even on MLA models, as SGLang's own file backend keys it) carries
    the rank. Context-parallel ranks hold disjoint slices of a page and DCP
    shards differ: both are part of the namespace. DP attention replicas with
    the same attention-TP rank hold the same heads and share pages.
    """
    model = s.model_revision or c.model_name
    if not model:
        raise SettingsError(
            "kvoffload: no model name: pass --served-model-name/--model-path to SGLang "
            "or 'model_revision' in extra_config"
        )
    if c.split_heads:
        raise SettingsError(
            "kvoffload: tp_lcm_size head splitting is not supported; drop 'tp_lcm_size'"
        )
    replicated = c.is_mla and p.pool != "mamba"
    shard = Shard(
        tp_rank=0 if replicated else c.tp_rank,
        tp_size=1 if replicated else c.tp_size,
        pp_rank=c.pp_rank,
        pp_size=c.pp_size,
    )
    backend = (
        f"sglang-hicache;pool={p.pool};kind={p.kind};layout={p.layout}"
        f";cp={c.cp_rank}/{c.cp_size};dcp={c.dcp_rank}/{c.dcp_size}"
        f";page_bytes={p.page_bytes};layers={len(p.layer_bytes)}"
    )
    if len(p.plan) > 1:
        backend += f";chunks={len(p.plan)}"
    return CompatContract(
        model_revision=model,
        tokenizer_hash=s.tokenizer_hash,
        chat_template_version="n/a",
        attention_backend=backend,
        kv_dtype=p.dtype,
        block_size=p.page_size,
        chunk_tokens=p.page_size,
        layer_layout=LayerLayout(
            num_layers=p.num_layers, num_kv_heads=p.num_heads, head_dim=p.head_dim
        ),
        tenant_namespace=s.tenant,
        lora_id=s.lora_id,
        shard=shard,
    )


class KeyMapper:
    """SGLang page keys → kvoffload chunk keys of one namespace and pool: ``parts``
    per page (its chunks, :attr:`PoolShape.plan`), page by page."""

    def __init__(self, contract: CompatContract, pool: str, parts: int = 1) -> None:
        self.contract = contract
        self.namespace = contract.fingerprint()
        self.parts = parts
        self._pool = pool.encode()
        self._salt: bytes | None = None
        self._root = b""

    def keys(self, salt: bytes, page_keys: list[str]) -> list[bytes]:
        if salt != self._salt:
            self._root = root_key(self.namespace, salt)
            self._salt = salt
        prefix = self._root + len(self._pool).to_bytes(2, "little") + self._pool
        # A page key is hex: a part's suffix (after a NUL) never makes another page's key.
        suffixes = [b""] if self.parts == 1 else [b"\0" + bytes([j]) for j in range(self.parts)]
        out = []
        for k in page_keys:
            if not isinstance(k, str):
                raise TypeError(f"SGLang page key must be str, got {type(k).__name__}")
            for sfx in suffixes:
                out.append(
                    hashlib.blake2b(
                        prefix + k.encode() + sfx, digest_size=KEY_SIZE, key=salt, person=_PERSON
                    ).digest()
                )
        return out
