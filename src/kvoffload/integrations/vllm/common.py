"""Shared pieces of the vLLM connector: typed settings, the contract, metadata.

Chunk object layout
-------------------
A chunk is ``chunk_tokens`` consecutive tokens (a multiple of the engine's
block size) of one request, for one parallel shard (TP rank × PP stage). Its
stored object is a list of layers, one entry per attention layer of the
shard in ascending layer index. Each entry holds the chunk's K and V, packed
back to back, C-contiguous, in the KV-cache dtype exactly as the engine
stores it (an fp8 cache stays fp8)::

    layer = K[token, kv_head, dim]  ++  V[token, kv_head, dim]
    len(layer) = chunk_tokens * num_kv_heads * head_dim * 2 * itemsize

Token order is position order; kv heads are the shard's own. This is one
fixed layout ("NHD" for K and for V) whatever physical layout the engine
uses (vLLM 0.33 picks one of six ``KVCacheLayout`` permutations per
platform and backend): the worker gathers and scatters through vLLM's
logical ``[block, head, token, K|V]`` view, so an engine that keeps its
cache head-major (HND) and one that keeps it token-major (NHD) write and
read the same objects. ``LayerLayout.cache_layout`` in the contract names
this object layout, so it is always ``"NHD"``.

Everything here but :func:`make_client` is derivation from vLLM's config
objects; the metadata classes subclass vLLM's, so this module imports vLLM.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvoffload.errors import ContractError, KVOffloadConfigError

from ...client import DEFAULT_SOCKET_PATH, DEFAULT_STAGING_BYTES, SidecarClient
from ...contract import (
    DEFAULT_CHUNK_TOKENS,
    CompatContract,
    LayerLayout,
    Shard,
    canonical_json,
    validate_tenant,
)
from ...protocol import EngineBlocks
from .groups import (
    GroupSpec,
    KVSpec,
    _no_attention,
    attention_spec,
    check_chunking,
    describe_groups,
    group_contract,
    kv_spec_of,
    needs_groups,
)

Mode = Literal["sync", "async"]
_MODES: tuple[Mode, ...] = ("sync", "async")

#: The object layout of every chunk (see the module docstring).
CHUNK_CACHE_LAYOUT = "NHD"

#: Socket timeout of the scheduler's lookups and the workers' loads and saves.
DEFAULT_TIMEOUT_S = 5.0


# -- the typed extra config ----------------------------------------------------


@dataclass(frozen=True)
class KVOffloadSettings:
    """``kv_connector_extra_config``, validated once at start.

    Only ``tenant`` is required. See ``README.md`` next to this file for what
    each field means.
    """

    tenant: str
    socket_path: str = DEFAULT_SOCKET_PATH
    tokenizer_hash: str | None = None
    chat_template_version: str = "none"
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    staging_bytes: int = DEFAULT_STAGING_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    load_mode: Mode = "async"
    save_mode: Mode = "async"
    ttl_s: float | None = None
    model_revision: str | None = None
    attention_backend: str | None = None
    direct: bool = False
    #: Whole-chunk loads as sealed direct reads where the sidecar offers them
    #: (protocol-v1.md §5.33): the worker verifies and decrypts each handed
    #: object itself; older sidecars and older objects load through staging.
    sealed_direct: bool = False
    #: KV events (docs/spec/events-v1.md §3.2): publish the token ids of stored
    #: blocks too. Off by default: events are request-derived data.
    events_token_ids: bool = False
    #: ``LOCAL`` (the node's store) or ``REMOTE`` (a store root shared by nodes).
    events_locality: str = "LOCAL"
    #: Sync loads hand each layer to the forward pass as soon as the sidecar
    #: verified it (protocol-v1.md §5.26), so layer i+1 streams while layer i
    #: computes; false: the whole chunk is loaded before the forward starts.
    layerwise: bool = True
    #: Load a hit only when the tier's measured load rate beats the engine's
    #: measured prefill rate (``kvoffload.integrations.payoff``); false: always load.
    recompute_guard: bool = True
    #: The engine's prefill rate, tokens/s, when known; unset: measured from its steps.
    prefill_tokens_per_s: float | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> KVOffloadSettings:
        """Validate the untyped dict vLLM hands over; the error names the bad field."""
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise KVOffloadConfigError(
                f"kv_connector_extra_config must be a mapping, got {type(extra).__name__}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in extra if k not in known)
        if unknown:
            raise KVOffloadConfigError(
                f"kv_connector_extra_config: unknown field(s) {', '.join(unknown)}; "
                f"known fields: {', '.join(sorted(known))}"
            )
        if "tenant" not in extra:
            raise KVOffloadConfigError("kv_connector_extra_config.tenant is required")
        values: dict[str, Any] = {}
        for name, check in _CHECKS.items():
            if name in extra:
                values[name] = check(name, extra[name])
        return cls(**values)


def _bad(name: str, want: str, got: object) -> KVOffloadConfigError:
    return KVOffloadConfigError(f"kv_connector_extra_config.{name}: expected {want}, got {got!r}")


def _check_tenant(name: str, v: object) -> str:
    try:
        return validate_tenant(cast(str, v))
    except ContractError as exc:
        raise KVOffloadConfigError(f"kv_connector_extra_config.{name}: {exc}") from None


def _check_str(name: str, v: object) -> str:
    if not isinstance(v, str) or not v:
        raise _bad(name, "a non-empty string", v)
    return v


def _check_opt_str(name: str, v: object) -> str | None:
    return None if v is None else _check_str(name, v)


def _check_pos_int(name: str, v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise _bad(name, "a positive integer", v)
    return v


def _check_pos_float(name: str, v: object) -> float:
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
        raise _bad(name, "a positive number", v)
    return float(v)


def _check_opt_pos_float(name: str, v: object) -> float | None:
    return None if v is None else _check_pos_float(name, v)


def _check_bool(name: str, v: object) -> bool:
    if not isinstance(v, bool):
        raise _bad(name, "true or false", v)
    return v


def _check_mode(name: str, v: object) -> Mode:
    if v == "sync" or v == "async":
        return v
    raise _bad(name, " or ".join(repr(m) for m in _MODES), v)


def _check_locality(name: str, v: object) -> str:
    if not isinstance(v, str) or v.upper() not in ("LOCAL", "REMOTE"):
        raise _bad(name, "'LOCAL' or 'REMOTE'", v)
    return v.upper()


_CHECKS: dict[str, Callable[[str, object], Any]] = {
    "tenant": _check_tenant,
    "socket_path": _check_str,
    "tokenizer_hash": _check_opt_str,
    "chat_template_version": _check_str,
    "chunk_tokens": _check_pos_int,
    "staging_bytes": _check_pos_int,
    "timeout_s": _check_pos_float,
    "load_mode": _check_mode,
    "save_mode": _check_mode,
    "ttl_s": _check_opt_pos_float,
    "model_revision": _check_opt_str,
    "attention_backend": _check_opt_str,
    "recompute_guard": _check_bool,
    "prefill_tokens_per_s": _check_opt_pos_float,
    "direct": _check_bool,
    "sealed_direct": _check_bool,
    "events_token_ids": _check_bool,
    "events_locality": _check_locality,
    "layerwise": _check_bool,
}


# -- the contract ----------------------------------------------------------------


def layer_index(layer_name: str) -> int | None:
    """The layer number in a vLLM layer name (``model.layers.7.self_attn.attn`` → 7).

    None unless the name holds exactly one integer component.
    """
    ints = [int(part) for part in layer_name.split(".") if part.isdigit()]
    return ints[0] if len(ints) == 1 else None


def ordered_layer_names(names: Sequence[str]) -> list[str]:
    """Layer names in ascending layer index: the order of layers in a chunk object.

    vLLM's own order is by registration, which is the same on every engine of
    one vLLM version; sorting by index keeps objects portable across versions.
    """
    indexed = [(layer_index(n), n) for n in names]
    if all(i is not None for i, _ in indexed):
        return [n for _, n in sorted(indexed, key=lambda p: (cast(int, p[0]), p[1]))]
    return list(names)


def _plain(value: Any) -> Any:
    """A config value as plain JSON data (the contract's canonical encoding needs it)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value)


def rope_config(hf_config: Any) -> dict[str, Any]:
    """Every RoPE setting the HF config exposes, as found.

    transformers 5 moved ``rope_theta``/``rope_scaling`` into
    ``rope_parameters`` (``rope_scaling`` stays as an alias); older configs
    carry the two top-level attributes. Recording whichever exist, unchanged,
    can only make engines on different transformers versions miss each
    other's chunks, never reuse across a real RoPE difference.
    """
    out: dict[str, Any] = {}
    for name in (
        "rope_parameters",
        "rope_scaling",
        "rope_theta",
        "partial_rotary_factor",
        "rotary_dim",
        "rotary_emb_base",
    ):
        v = getattr(hf_config, name, None)
        if v is not None:
            out[name] = _plain(v)
    return out


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def model_revision(model_config: Any) -> str:
    """``model@revision``, plus whatever else changes the weights the KV comes from."""
    rev = f"{model_config.model}@{model_config.revision or 'default'}"
    quant = getattr(model_config, "quantization", None)
    if quant:
        rev += f"+quantization={quant}"
    overrides = getattr(model_config, "hf_overrides", None)
    if isinstance(overrides, Mapping) and overrides:
        digest = hashlib.blake2b(canonical_json(_plain(overrides)), digest_size=8).hexdigest()
        rev += f"+hf_overrides={digest}"
    elif callable(overrides):
        rev += f"+hf_overrides={getattr(overrides, '__qualname__', repr(overrides))}"
    return rev


def kv_dtype_name(model_config: Any, cache_config: Any) -> str:
    """The cache dtype; a quantized cache also names the dtype it was quantized from."""
    model_dtype = _dtype_name(model_config.dtype)
    cache_dtype = str(cache_config.cache_dtype)
    if cache_dtype in ("auto", model_dtype):
        return model_dtype
    return f"{cache_dtype}/{model_dtype}"


def configured_attention_backend(vllm_config: Any) -> str:
    """The attention backend the workers will run, as the scheduler process can tell.

    ``--attention-backend`` when given (and not overridden per layer kind);
    otherwise vLLM's selector, run the way the workers run it. The workers
    check the result against their real layers at ``register_kv_caches``.
    """
    attention = vllm_config.attention_config
    if attention.backend is not None and not attention.backend_per_kind:
        return str(attention.backend.name)
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    try:
        backends = get_current_attn_backends(vllm_config, None)
    except Exception as exc:
        raise KVOffloadConfigError(
            f"cannot determine the attention backend ({exc}); pin it with --attention-backend "
            "or kv_connector_extra_config.attention_backend"
        ) from exc
    return "+".join(sorted({b.get_name() for b in backends}))


def registered_attention_backend(vllm_config: Any, layer_names: Sequence[str]) -> str | None:
    """The backend(s) of the model's registered attention layers; None without a model."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, list(layer_names))
    if not layers:
        return None
    return "+".join(sorted({layer.get_attn_backend().get_name() for layer in layers.values()}))


class EngineContracts:
    """The engine's contract, one variant per (LoRA adapter, parallel shard).

    Shard ``s`` is ``pp_rank * tp_size + tp_rank``. The scheduler derives every
    shard's chunk keys (it has the tokens, the workers do not), each worker
    uses its own.
    """

    def __init__(
        self,
        base: CompatContract,
        *,
        tp_size: int,
        pp_size: int,
        layers_per_stage: Sequence[int],
        spec: KVSpec,
        groups: Sequence[GroupSpec] = (),
        mamba_align: int | None = None,
    ) -> None:
        if len(layers_per_stage) != pp_size:
            raise ValueError("one layer count per pipeline stage expected")
        self.base = base
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.layers_per_stage = tuple(layers_per_stage)
        self.spec = spec
        #: A hybrid model's KV-cache groups (empty: one group, no ``kv_group``).
        self.groups = tuple(groups)
        self.mamba_align = mamba_align
        self._contracts: dict[tuple[str | None, int, int], CompatContract] = {}
        self._namespaces: dict[tuple[str | None, int, int], bytes] = {}

    @property
    def hybrid(self) -> bool:
        return bool(self.groups)

    @property
    def num_groups(self) -> int:
        return max(1, len(self.groups))

    @property
    def num_shards(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def chunk_tokens(self) -> int:
        return self.base.chunk_tokens

    @property
    def block_size(self) -> int:
        return self.base.block_size

    def shard_index(self, tp_rank: int, pp_rank: int) -> int:
        if not (0 <= tp_rank < self.tp_size and 0 <= pp_rank < self.pp_size):
            raise ValueError(
                f"rank tp={tp_rank} pp={pp_rank} outside {self.tp_size}x{self.pp_size}"
            )
        return pp_rank * self.tp_size + tp_rank

    def contract(self, lora_id: str | None, shard: int, group: int = 0) -> CompatContract:
        k = (lora_id, shard, group)
        c = self._contracts.get(k)
        if c is None and self.groups and group >= 0:
            g = self.groups[group]
            one = self.contract(lora_id, shard, -1)
            c = self._contracts[k] = group_contract(one, g, len(self.groups), layer_numbers(g))
        elif c is None:
            pp_rank, tp_rank = divmod(shard, self.tp_size)
            c = dataclasses.replace(
                self.base,
                lora_id=lora_id,
                shard=Shard(tp_rank, self.tp_size, pp_rank, self.pp_size),
                layer_layout=dataclasses.replace(
                    self.base.layer_layout, num_layers=self.layers_per_stage[pp_rank]
                ),
            )
            self._contracts[k] = c
        return c

    def namespace(self, lora_id: str | None, shard: int, group: int = 0) -> bytes:
        k = (lora_id, shard, group)
        ns = self._namespaces.get(k)
        if ns is None:
            ns = self._namespaces[k] = self.contract(lora_id, shard, group).fingerprint()
        return ns

    @classmethod
    def from_vllm(
        cls, vllm_config: Any, kv_cache_config: Any, settings: KVOffloadSettings
    ) -> EngineContracts:
        """Everything vLLM knows about what shapes the KV, plus the settings for the rest."""
        mc = vllm_config.model_config
        cc = vllm_config.cache_config
        pc = vllm_config.parallel_config
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            if getattr(pc, name, 1) != 1:
                raise KVOffloadConfigError(
                    f"kvoffload does not support context parallelism ({name}="
                    f"{getattr(pc, name)}): a rank holds only some tokens of a block"
                )
        quant_ok = not getattr(cc, "calculate_kv_scales", False)
        groups: list[GroupSpec] = []
        mamba_align = None
        if not needs_groups(kv_cache_config):
            spec = attention_spec(kv_cache_config, quant_ok=quant_ok)
        else:
            groups = describe_groups(
                kv_cache_config, lambda s, n: kv_spec_of(s, n, quant_ok=quant_ok)
            )
            mamba_align = check_chunking(groups, settings.chunk_tokens)
            spec = next((g.attn for g in groups if g.attn is not None), None) or _no_attention()
            if int(pc.pipeline_parallel_size) != 1:
                raise KVOffloadConfigError(
                    "kvoffload does not support hybrid KV-cache groups with pipeline parallelism"
                )
        if settings.chunk_tokens % spec.block_size:
            raise KVOffloadConfigError(
                f"kv_connector_extra_config.chunk_tokens ({settings.chunk_tokens}) must be a "
                f"multiple of the block size ({spec.block_size})"
            )
        kv_heads = int(mc.get_num_kv_heads(pc))
        head_dim = int(mc.get_head_size())
        if groups:
            # Each group's spec is what its layers hold (models mix head sizes).
            kv_heads, head_dim = spec.num_kv_heads, spec.head_dim
        if (kv_heads, head_dim) != (spec.num_kv_heads, spec.head_dim):
            raise KVOffloadConfigError(
                f"model config says {kv_heads} KV heads × {head_dim} per shard, the KV cache "
                f"holds {spec.num_kv_heads} × {spec.head_dim}"
            )
        tp, pp = int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)
        layers = _layers_per_stage(mc, spec.layer_names, pp)
        if min(layers) == 0:
            raise KVOffloadConfigError(
                f"a pipeline stage holds no attention layer (layers per stage: {layers})"
            )
        tokenizer_hash = settings.tokenizer_hash or default_tokenizer_hash(mc)
        backend = settings.attention_backend or configured_attention_backend(vllm_config)
        try:
            base = CompatContract(
                model_revision=settings.model_revision or model_revision(mc),
                tokenizer_hash=tokenizer_hash,
                chat_template_version=settings.chat_template_version,
                attention_backend=backend,
                kv_dtype=kv_dtype_name(mc, cc),
                block_size=spec.block_size,
                layer_layout=LayerLayout(
                    num_layers=layers[0],
                    num_kv_heads=kv_heads,
                    head_dim=head_dim,
                    cache_layout=CHUNK_CACHE_LAYOUT,
                ),
                tenant_namespace=settings.tenant,
                rope_config=rope_config(mc.hf_text_config),
                chunk_tokens=settings.chunk_tokens,
            )
        except ContractError as exc:
            raise KVOffloadConfigError(f"cannot build the compatibility contract: {exc}") from exc
        return cls(
            base,
            tp_size=tp,
            pp_size=pp,
            layers_per_stage=layers,
            spec=spec,
            groups=groups,
            mamba_align=mamba_align,
        )


def layer_numbers(group: GroupSpec) -> list[int]:
    """The group's layers as model layer numbers (positions when the names hold none)."""
    nums = [layer_index(n) for n in ordered_layer_names(group.layer_names)]
    return [n if n is not None else i for i, n in enumerate(nums)]


def default_tokenizer_hash(model_config: Any) -> str:
    """``tokenizer_hash`` when the setting is absent: the canonical hash of a local
    tokenizer directory's files (``kvoffload tokenizer-hash``), so that engines
    with the same tokenizer under different paths agree; otherwise (a hub id, or
    a directory without tokenizer files) ``"<tokenizer>@<revision>"``."""
    from kvoffload.tokenizer_hash import tokenizer_hash

    name = str(model_config.tokenizer)
    try:
        return tokenizer_hash(name)
    except OSError:
        return f"{name}@{getattr(model_config, 'tokenizer_revision', None) or 'default'}"


def _layers_per_stage(model_config: Any, layer_names: Sequence[str], pp: int) -> list[int]:
    """Attention layers held by each pipeline stage.

    Without pipeline parallelism: the KV-cache group's layers. With it, the
    scheduler sees only stage 0's layer names (vLLM builds the scheduler's
    KV-cache config from worker 0's), so every stage counts its share of the
    hidden layers as vLLM partitions them; each worker checks that count
    against the caches it registers and refuses to start on a mismatch.
    """
    if pp == 1:
        return [len(layer_names)]
    from vllm.distributed.utils import get_pp_indices

    total = int(model_config.get_total_num_hidden_layers())
    spans = [get_pp_indices(total, rank, pp) for rank in range(pp)]
    return [int(end) - int(start) for start, end in spans]


# -- metadata: scheduler → workers, workers → scheduler ----------------------------


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a request, placed in the engine's blocks.

    ``block_ids[j]`` holds the chunk's block ``first_block + j``, i.e. tokens
    ``[(first_block + j) * block_size, … + block_size)`` of the chunk. A save
    covers the whole chunk (``first_block`` 0); a load may start later in it,
    where vLLM's own prefix cache already holds the first blocks (those are
    shared and must not be written).
    """

    index: int
    keys: tuple[bytes, ...]  # one per shard
    block_ids: tuple[int, ...]
    first_block: int = 0
    #: A save's engine block hashes for the sidecar's KV-event feed (protocol-v1 §5.4).
    blocks: EngineBlocks | None = None
    #: The KV-cache group whose blocks these are (hybrid models; 0 otherwise).
    group: int = 0


@dataclass(frozen=True)
class LoadJob:
    req_id: str
    chunks: tuple[ChunkRef, ...]
    is_async: bool
    #: Not loadable as planned (a hybrid hit vLLM did not allocate in full):
    #: the workers report every block failed, vLLM recomputes them.
    fail: bool = False


@dataclass(frozen=True)
class SaveJob:
    job_id: int
    req_id: str
    namespaces: tuple[bytes, ...]  # one per shard
    chunks: tuple[ChunkRef, ...]
    #: The LoRA the namespaces are of, so a worker can register their contract
    #: fields with the sidecar (protocol-v1 §5.19).
    lora_id: str | None = None
    #: The KV-cache group of every chunk of the job (one job per group).
    group: int = 0


@dataclass
class KVOffloadMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One engine step's work for the workers."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    # Finished requests whose blocks the scheduler holds until every worker
    # reports them in finished_sending (after their saves completed).
    held_req_ids: set[str] = field(default_factory=set)
    # Requests preempted this step: their blocks are free again, so saves
    # still reading them must finish before the step's forward writes there.
    preempted_req_ids: set[str] = field(default_factory=set)
    # Probes of the recompute guard (payoff.py): per probe, one stored chunk's
    # key per shard, read by each worker in the background to time the tier.
    probes: list[tuple[bytes, ...]] = field(default_factory=list)


@dataclass
class KVOffloadWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Save jobs a worker finished (successfully or not) since its last report."""

    completed_saves: dict[int, int] = field(default_factory=dict)
    #: Per completed job: chunk index → workers that got ``stored`` from the sidecar.
    stored_chunks: dict[int, dict[int, int]] = field(default_factory=dict)
    #: Loads run since the last report: (chunks asked for, seconds from the request
    #: to its last verified byte), for the scheduler's recompute guard.
    load_samples: list[tuple[int, float]] = field(default_factory=list)

    def aggregate(self, other: Any) -> KVOffloadWorkerMetadata:
        if not isinstance(other, KVOffloadWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into worker metadata")
        merged = dict(self.completed_saves)
        for job, n in other.completed_saves.items():
            merged[job] = merged.get(job, 0) + n
        stored = {job: dict(c) for job, c in self.stored_chunks.items()}
        for job, counts in other.stored_chunks.items():
            into = stored.setdefault(job, {})
            for idx, n in counts.items():
                into[idx] = into.get(idx, 0) + n
        return KVOffloadWorkerMetadata(merged, stored, self.load_samples + other.load_samples)


def make_client(settings: KVOffloadSettings, *, name: str, staging_bytes: int) -> SidecarClient:
    """The one place clients are made (tests replace it to use an in-process store)."""
    return SidecarClient(
        settings.socket_path,
        settings.tenant,
        staging_bytes=staging_bytes,
        timeout_s=settings.timeout_s,
        name=name,
        direct=settings.direct,
        sealed_direct=settings.sealed_direct,
    )


__all__ = [
    "CHUNK_CACHE_LAYOUT",
    "ChunkRef",
    "EngineContracts",
    "KVOffloadConfigError",
    "KVOffloadMetadata",
    "KVOffloadSettings",
    "KVOffloadWorkerMetadata",
    "KVSpec",
    "LoadJob",
    "SaveJob",
    "attention_spec",
    "configured_attention_backend",
    "kv_dtype_name",
    "layer_index",
    "make_client",
    "model_revision",
    "ordered_layer_names",
    "registered_attention_backend",
    "rope_config",
]
