"""A CPU STAND-IN for vLLM's GPU model runner: a test double, not part of kvoffload.

vLLM's GPU model runner (CUDA kernels, FlashAttention, CUDA graphs) cannot run
on this machine, yet a KV connector can only be proven end to end against
something that owns paged KV caches, runs a real model over them and calls the
connector the way the runner does. This module is that something, on CPU:

* **Paged KV caches as vLLM lays them out.** One tensor per attention layer,
  named like vLLM's layers (``model.layers.{i}.self_attn.attn``), in one of the
  layouts of :class:`KVLayout`. vLLM 0.33 (the version in ``.venv-vllm``)
  hands connectors the *standardized* per-layer view ``[num_blocks, H, N, 2*D]``
  (RFC #42082: K in ``[..., :D]``, V in ``[..., D:]``) whose physical order is
  ``[B, N, H, C]`` (``LBNHC``, "NHD", FlashAttention's default) or
  ``[B, H, N, C]`` (``LBHNC``, "HND"); vLLM before 0.33 used
  ``[2, num_blocks, block_size, H, D]`` (NHD) or ``[2, num_blocks, H,
  block_size, D]`` (HND). All four are here, so a connector can be run
  against the layout it will really get. Fresh and released blocks are filled
  with a poison value (NaN by default): a slot read before anything wrote it
  turns the logits into NaN instead of passing unnoticed.
* **A real model over those caches.** A transformers Llama
  (:class:`TinyLlamaSpec`; the weight seed stands for the model revision).
  Each forward gathers the request's cached prefix K/V out of the paged blocks
  into a transformers ``DynamicCache``, runs the model on the scheduled tokens
  only, with ``position_ids`` continuing after the prefix, and scatters the new
  K/V back into the blocks through the slot mapping. K is stored after RoPE,
  as vLLM stores it. No KV survives between steps anywhere but in the paged
  blocks, so whatever a connector writes into them is exactly what the next
  forward attends to. (transformers 5.x dropped ``cache_position`` from
  Llama's forward: the cache length plus ``position_ids`` place the tokens.)
* **The runner's call order for a KV connector**, once per step
  (``GPUModelRunner.execute_model``, ``KVConnectorModelRunnerMixin.
  _get_kv_connector_output`` and ``maybe_transfer_kv_layer`` in vLLM 0.33):
  ``handle_preemptions(meta)`` → ``bind_connector_metadata(meta)`` →
  ``start_load_kv(forward_context)`` (after the forward instead when the step
  has no synchronous load, as vLLM does) → per layer ``wait_for_layer_load``
  before attention reads it and ``save_kv_layer`` after its KV is written →
  ``wait_for_save`` → ``get_transfer_results`` (whose base implementation is
  ``get_finished``; the stand-in calls ``get_finished`` when the connector
  has no ``get_transfer_results``) → ``get_block_ids_with_load_errors`` →
  ``build_connector_worker_meta`` → ``clear_connector_metadata``. Methods a
  connector lacks (all but the abstract ones of ``KVConnectorBase_V1``) are
  skipped. A step with nothing to compute still runs the connector, with no
  attention metadata, like vLLM's ``kv_connector_no_forward``.
* **Two ways to schedule.** :meth:`StandInModelRunner.generate` is a
  one-request mini-scheduler that needs no vLLM (the connector's scheduler
  side plugs in through :class:`SchedulerHooks`); :class:`VllmSchedulerDriver`
  puts vLLM 0.33's real ``Scheduler`` in charge, with the connector loaded by
  name through ``kv_transfer_config`` exactly as vLLM loads it, and KV caches
  allocated by vLLM's ``allocate_kv_cache``. ``python -m tests.e2e.standin
  JOB.json`` runs one such engine as its own process (:func:`engine_main`).

Approximations, stated so no test leans on them unawares:

* transformers runs every layer in one call, so ``wait_for_layer_load`` is
  called for every layer (in layer order) before the forward and
  ``save_kv_layer`` for every layer (in layer order) after it: a connector that
  pipelines per layer is exercised for correctness, not for overlap.
* Requests of one step run one after another (no padding into one batch), but
  inside one connector step: the connector sees one bind, one ``save_kv_layer``
  per layer and one ``wait_for_save`` for all of them.
* :meth:`StandInModelRunner.generate` is not vLLM's scheduler: it consults
  the connector's scheduler side in vLLM's order, allocates every block of the
  request up front,
  caps a full hit at ``len(prompt) - 1`` so one token is computed, waits for
  asynchronous loads and delayed frees with empty steps, and on reported load
  errors recomputes from the first bad block (vLLM's ``recompute`` policy).
* ``forward_context`` and ``attn_metadata`` are small stand-in dataclasses
  carrying the fields of vLLM's ``ForwardContext`` and
  ``FlashAttentionMetadata`` that connectors read.
* No speculative decoding, no sampling but greedy, no pipeline or tensor
  parallelism: one worker, one KV-cache group.

Exactness: by default (``TinyLlamaSpec.batch_invariant``) every linear layer
runs one row at a time and attention one query position at a time, so a
position's KV and logits depend on the tokens up to it and on nothing else:
not on how many tokens the step holds, where the step starts, or whether the
prefix was computed here or loaded. "Prefix loaded + suffix computed" must then
equal "all computed" bit for bit, in fp32 and in bf16, and any difference is a
difference in the KV. Without it (transformers' eager or SDPA attention over
whole-batch GEMMs) MKL picks kernels by batch shape, and the same token's row
differs in its last bits between, say, a 170-token and a 200-token prefill or
a 1-token step (measured on this machine: logits within 5.5e-6 at a logit std
of ~1.1, greedy tokens equal).
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import json
import math
import sys
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import pytest
import torch

if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM

__all__ = [
    "BlockAllocator",
    "Generation",
    "KVLayout",
    "RecordingConnector",
    "RequestView",
    "ScheduledRequest",
    "SchedulerHooks",
    "StandInAttentionLayer",
    "StandInAttentionMetadata",
    "StandInForwardContext",
    "StandInModelRunner",
    "StepOutput",
    "StepPlan",
    "TinyLlamaSpec",
    "TransferResults",
    "VllmRequestResult",
    "VllmSchedulerDriver",
    "WorkerConnector",
    "allocate_kv_layer",
    "engine_main",
    "gather_kv",
    "iter_layers",
    "kv_block_views",
    "make_batch_invariant",
    "requires_transformers",
    "requires_vllm",
    "scatter_kv",
    "slot_mapping",
    "write_model_dir",
]

#: Skip marker for modules that build models: transformers lives only in
#: ``.venv-vllm`` (the ``vllm`` test tier), not in the main ``.venv``.
requires_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is installed only in .venv-vllm (make pytest-vllm)",
)

#: Skip marker for tests that import vLLM itself.
requires_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is installed only in .venv-vllm (make pytest-vllm)",
)

#: vLLM's attention layer names for a Llama: what connectors key layers by.
LAYER_NAME = "model.layers.{}.self_attn.attn"


# --------------------------------------------------------------------------
# Paged KV cache layouts
# --------------------------------------------------------------------------


class KVLayout(enum.Enum):
    """One layer's paged KV cache tensor, as a connector receives it.

    ``B`` blocks, ``N`` tokens per block, ``H`` KV heads, ``D`` head size.
    """

    #: vLLM >= 0.33 standardized view ``[B, H, N, 2D]``, physically
    #: ``[B, N, H, 2D]`` (NHD). FlashAttention's layout and vLLM's default.
    LBNHC = "LBNHC"
    #: vLLM >= 0.33 standardized view ``[B, H, N, 2D]``, contiguous (HND).
    LBHNC = "LBHNC"
    #: vLLM < 0.33 FlashAttention: ``[2, B, N, H, D]`` (NHD).
    SPLIT_NHD = "SPLIT_NHD"
    #: vLLM < 0.33 HND backends: ``[2, B, H, N, D]``.
    SPLIT_HND = "SPLIT_HND"

    @property
    def cache_layout(self) -> str:
        """The name the compatibility contract uses (``LayerLayout.cache_layout``)."""
        return "NHD" if self in (KVLayout.LBNHC, KVLayout.SPLIT_NHD) else "HND"


def allocate_kv_layer(
    layout: KVLayout,
    *,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    fill: float = math.nan,
) -> torch.Tensor:
    """One layer's paged cache in ``layout``, every slot set to ``fill``."""
    b, n, h, d = num_blocks, block_size, num_kv_heads, head_size
    if layout is KVLayout.LBNHC:
        # Allocated in physical order, handed out in the logical [B, H, N, 2D]
        # order: the same strides vLLM's create_kv_cache_views produces.
        return torch.full((b, n, h, 2 * d), fill, dtype=dtype).permute(0, 2, 1, 3)
    if layout is KVLayout.LBHNC:
        return torch.full((b, h, n, 2 * d), fill, dtype=dtype)
    if layout is KVLayout.SPLIT_NHD:
        return torch.full((2, b, n, h, d), fill, dtype=dtype)
    return torch.full((2, b, h, n, d), fill, dtype=dtype)


def kv_block_views(layout: KVLayout, kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer as ``[B, N, H, D]`` views sharing ``kv_layer``'s storage.

    For the standardized layouts this is exactly how vLLM 0.33's FlashAttention
    backend reads the cache: ``kv_cache.transpose(1, 2).split(head_size, -1)``.
    """
    if layout in (KVLayout.LBNHC, KVLayout.LBHNC):
        bnhc = kv_layer.transpose(1, 2)
        d = bnhc.shape[-1] // 2
        return bnhc[..., :d], bnhc[..., d:]
    if layout is KVLayout.SPLIT_NHD:
        return kv_layer[0], kv_layer[1]
    return kv_layer[0].transpose(1, 2), kv_layer[1].transpose(1, 2)


def slot_mapping(block_ids: Sequence[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """vLLM's slot of each token position in ``[start, end)``: block * block_size + offset."""
    if end > len(block_ids) * block_size:
        raise ValueError(f"positions up to {end} need more than {len(block_ids)} blocks")
    positions = torch.arange(start, end, dtype=torch.int64)
    table = torch.tensor(list(block_ids), dtype=torch.int64)
    return table[positions // block_size] * block_size + positions % block_size


def scatter_kv(
    layout: KVLayout,
    kv_layer: torch.Tensor,
    slots: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """Write ``keys``/``values`` (``[T, H, D]``) into the slots ``slots`` (``[T]``)."""
    k_view, v_view = kv_block_views(layout, kv_layer)
    block_size = k_view.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_view[blocks, offsets] = keys.to(k_view.dtype)
    v_view[blocks, offsets] = values.to(v_view.dtype)


def gather_kv(
    layout: KVLayout, kv_layer: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of K and V (``[T, H, D]``) held in the slots ``slots``."""
    k_view, v_view = kv_block_views(layout, kv_layer)
    block_size = k_view.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    return k_view[blocks, offsets].clone(), v_view[blocks, offsets].clone()


# --------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------


#: The name :func:`_row_attention` is registered under in transformers.
ROW_ATTENTION = "kvoffload_standin_row_attention"


def _row_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention one query position at a time.

    ``query`` is ``[1, Hq, q, D]``, ``key``/``value`` ``[1, Hkv, kv, D]`` with the
    step's q tokens last (the runner never pads, so no mask is needed). Position
    ``p`` reduces over exactly keys ``0..p`` with the same shapes whatever else
    the step holds; GQA repeats KV heads as transformers' ``repeat_kv`` does.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    groups = query.shape[1] // key.shape[1]
    keys = key.repeat_interleave(groups, dim=1)
    values = value.repeat_interleave(groups, dim=1)
    out = query.new_empty(query.shape[0], q_len, query.shape[1], query.shape[3])
    for i in range(q_len):
        p = kv_len - q_len + i
        scores = torch.matmul(query[:, :, i : i + 1], keys[:, :, : p + 1].transpose(2, 3))
        probs = torch.softmax(scores * scaling, dim=-1, dtype=torch.float32).to(query.dtype)
        out[:, i] = torch.matmul(probs, values[:, :, : p + 1])[:, :, 0]
    return out, None


def _register_row_attention() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(ROW_ATTENTION, _row_attention)
    return ROW_ATTENTION


def _row_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    out = torch.cat([torch.nn.functional.linear(rows[i : i + 1], self.weight, self.bias)
                     for i in range(rows.shape[0])])  # fmt: skip
    return out.reshape(*x.shape[:-1], out.shape[-1])


def make_batch_invariant(model: torch.nn.Module) -> None:
    """Make every linear layer compute one row at a time.

    BLAS picks its kernels by the shape of the whole batch: the same token's
    row comes out with different low bits from a 200-row prefill, a 170-row
    prefill or a 1-row decode step (measured: up to ~5e-6 in the logits with
    MKL), so "prefix loaded + suffix computed" could never be compared bit for
    bit with "all computed". With every GEMM at one row, and attention one
    position at a time (:func:`_row_attention`), all that remains per row is
    the same shapes in the same order. vLLM has the same problem on GPUs and
    the same cure (``VLLM_BATCH_INVARIANT``).
    """
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = types.MethodType(_row_linear, module)  # type: ignore[method-assign]


@dataclass(frozen=True)
class TinyLlamaSpec:
    """A Llama small enough for two CPU cores, random weights from ``weight_seed``.

    ``weight_seed`` stands for the model revision: two specs that differ only
    in it are two revisions of one architecture, whose KV must never be mixed.
    ``initializer_range`` is 0.1 rather than Llama's 0.02 so that logits spread
    wide enough for greedy tokens to depend on the context (with 0.02 a wrong
    KV could still yield the same argmax).
    """

    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    initializer_range: float = 0.1
    weight_seed: int = 0
    #: Compute every token position by itself (see :func:`make_batch_invariant`):
    #: its KV and logits are then a function of the tokens up to it and of
    #: nothing else, so any difference between two runs is a difference in the
    #: KV they attended to.
    batch_invariant: bool = True
    #: transformers' attention when ``batch_invariant`` is off ("eager", "sdpa").
    attn_implementation: str = "eager"

    @property
    def model_revision(self) -> str:
        """What a compatibility contract's ``model_revision`` would say."""
        return (
            f"tiny-llama-l{self.num_layers}-h{self.hidden_size}-kv{self.num_kv_heads}"
            f"x{self.head_dim}-v{self.vocab_size}@seed{self.weight_seed}"
        )

    @property
    def rope_config(self) -> dict[str, Any]:
        return {"rope_type": "default", "rope_theta": self.rope_theta}

    def layer_names(self) -> list[str]:
        return [LAYER_NAME.format(i) for i in range(self.num_layers)]

    def hf_config(self) -> LlamaConfig:
        from transformers import LlamaConfig

        # Not a declared LlamaConfig field: PretrainedConfig takes it from kwargs.
        extra: dict[str, Any] = {
            "attn_implementation": (
                _register_row_attention() if self.batch_invariant else self.attn_implementation
            )
        }
        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=self.rope_config,
            initializer_range=self.initializer_range,
            tie_word_embeddings=False,
            **extra,
        )

    def build_model(self, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
        """The model, deterministic in ``weight_seed`` (the caller's RNG is left alone)."""
        from transformers import LlamaForCausalLM

        with torch.random.fork_rng():
            torch.manual_seed(self.weight_seed)
            model: Any = LlamaForCausalLM(self.hf_config())  # type: ignore[no-untyped-call]
        model = model.to(dtype).eval()
        model.requires_grad_(False)
        if self.batch_invariant:
            make_batch_invariant(model)
        return cast("LlamaForCausalLM", model)


# --------------------------------------------------------------------------
# Stand-ins for the vLLM objects a connector receives
# --------------------------------------------------------------------------


@dataclass
class StandInAttentionLayer:
    """Stand-in for vLLM's ``Attention`` module in ``no_compile_layers``: connectors
    (vLLM's ExampleConnector among them) read ``layer.kv_cache`` from it."""

    layer_name: str
    kv_cache: torch.Tensor


@dataclass(frozen=True)
class StandInAttentionMetadata:
    """Stand-in for vLLM 0.33's ``FlashAttentionMetadata``: the fields a connector
    reads, for the requests of one step laid end to end."""

    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    max_seq_len: int
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks], zero-padded
    slot_mapping: torch.Tensor  # int64 [num_actual_tokens]
    causal: bool = True


@dataclass
class StandInForwardContext:
    """Stand-in for vLLM's ``ForwardContext``. ``attn_metadata`` is None in a step
    with nothing to compute (as in ``kv_connector_no_forward``).
    ``virtual_engine`` is gone from vLLM 0.33 and kept (always 0) for connectors
    written against earlier versions."""

    no_compile_layers: dict[str, StandInAttentionLayer]
    attn_metadata: dict[str, StandInAttentionMetadata] | None
    slot_mapping: dict[str, torch.Tensor]
    virtual_engine: int = 0
    additional_kwargs: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------
# What plugs in: the connector's worker side and its scheduler side
# --------------------------------------------------------------------------


class WorkerConnector(Protocol):
    """The worker methods of vLLM's ``KVConnectorBase_V1`` the stand-in calls.

    Duck-typed extras, used when present: ``register_kv_caches(kv_caches)`` (once,
    at construction), ``handle_preemptions(metadata)``,
    ``get_transfer_results(finished_req_ids)`` (preferred over ``get_finished``,
    as vLLM 0.33 does), ``get_block_ids_with_load_errors()``,
    ``build_connector_worker_meta()``.
    """

    def bind_connector_metadata(self, connector_metadata: Any) -> None: ...

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...

    def wait_for_layer_load(self, layer_name: str) -> None: ...

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None: ...

    def wait_for_save(self) -> None: ...

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]: ...

    def clear_connector_metadata(self) -> None: ...


@dataclass(frozen=True)
class RequestView:
    """What the mini-scheduler tells the connector's scheduler side about a request."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    all_token_ids: tuple[int, ...]
    num_computed_tokens: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step.

    The KV of ``token_ids[:num_computed_tokens]`` must be in ``block_ids`` when
    the forward runs: already there (a local hit), or written by the connector
    in ``start_load_kv`` (the last ``num_external_tokens`` of them).
    """

    req_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    num_scheduled_tokens: int
    num_external_tokens: int = 0


@dataclass(frozen=True)
class StepPlan:
    """One step, in the terms of vLLM's ``SchedulerOutput``."""

    step: int
    requests: tuple[ScheduledRequest, ...] = ()
    #: Requests that finished before this step (vLLM passes them to ``get_finished``).
    finished_req_ids: frozenset[str] = frozenset()


class SchedulerHooks(Protocol):
    """The connector's scheduler side, consulted by :meth:`StandInModelRunner.generate`
    in vLLM's order. An adapter maps these onto a real connector's
    ``get_num_new_matched_tokens`` / ``update_state_after_alloc`` /
    ``build_connector_meta`` / ``request_finished``."""

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """(tokens loadable beyond ``num_computed_tokens``, whether the load is async)."""
        ...

    def update_state_after_alloc(
        self, request: RequestView, block_ids: Sequence[int], num_external_tokens: int
    ) -> None: ...

    def build_connector_meta(self, plan: StepPlan) -> Any: ...

    def request_finished(self, request: RequestView, block_ids: Sequence[int]) -> bool:
        """True when the connector still reads the blocks: they are held until
        ``get_finished`` reports the request in ``finished_sending``."""
        ...


@dataclass
class StepOutput:
    """What one step produced: logits of every scheduled position, and the
    connector's report (vLLM's ``KVConnectorOutput``)."""

    plan: StepPlan
    logits: dict[str, torch.Tensor]  # req_id -> float32 [num_scheduled_tokens, vocab]
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    #: ``build_connector_worker_meta()``, for connectors that report to their scheduler side.
    worker_meta: Any = None


@dataclass
class Generation:
    """One request run to completion by :meth:`StandInModelRunner.generate`."""

    req_id: str
    prompt: tuple[int, ...]
    #: Greedily sampled tokens.
    tokens: list[int]
    #: float32 ``[max_new_tokens, vocab]``: the logits each token was chosen from.
    sampled_logits: torch.Tensor
    #: float32 ``[n, vocab]``: logits of the prompt positions this run computed
    #: (the last ``n`` positions of the prompt).
    prefill_logits: torch.Tensor
    num_local_computed_tokens: int
    #: Prompt tokens whose KV the connector supplied (after any load-error recompute).
    num_external_tokens: int
    #: Times a reported load error made the run recompute from the first bad block.
    load_error_recomputes: int
    block_ids: tuple[int, ...]
    #: layer name -> (K, V), each ``[T, H, D]``: the request's KV read back from the
    #: paged blocks at the end (T = prompt + sampled tokens - 1).
    kv: dict[str, tuple[torch.Tensor, torch.Tensor]]
    steps: list[StepOutput]


@dataclass
class TransferResults:
    """vLLM 0.33's ``KVConnectorTransferResults``, without importing vLLM."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


class RecordingConnector:
    """Wraps a worker connector (or nothing) and records each call, in order.

    ``calls`` holds ``(method, detail)``; ``detail`` is the layer name for the
    per-layer methods and ``""`` otherwise. ``on_save`` sees each
    ``save_kv_layer`` call before it is forwarded (to check what the blocks hold
    at that moment).
    """

    def __init__(
        self,
        inner: WorkerConnector | None = None,
        on_save: Callable[[str, torch.Tensor, Any], None] | None = None,
    ) -> None:
        self.inner = inner
        self.on_save = on_save
        self.calls: list[tuple[str, str]] = []
        self.registered: dict[str, torch.Tensor] | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.calls.append(("register_kv_caches", ""))
        self.registered = kv_caches
        register = getattr(self.inner, "register_kv_caches", None)
        if register is not None:
            register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self.calls.append(("bind_connector_metadata", ""))
        if self.inner is not None:
            self.inner.bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.calls.append(("start_load_kv", ""))
        if self.inner is not None:
            self.inner.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append(("wait_for_layer_load", layer_name))
        if self.inner is not None:
            self.inner.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self.calls.append(("save_kv_layer", layer_name))
        if self.on_save is not None:
            self.on_save(layer_name, kv_layer, attn_metadata)
        if self.inner is not None:
            self.inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self.calls.append(("wait_for_save", ""))
        if self.inner is not None:
            self.inner.wait_for_save()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        self.calls.append(("handle_preemptions", ""))
        preemptions = getattr(self.inner, "handle_preemptions", None)
        if preemptions is not None:
            preemptions(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self.calls.append(("get_finished", ""))
        if self.inner is None:
            return None, None
        return self.inner.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> TransferResults:
        self.calls.append(("get_transfer_results", ""))
        results = getattr(self.inner, "get_transfer_results", None)
        if results is not None:
            r = results(finished_req_ids)
            return TransferResults(
                set(r.finished_sending or ()),
                set(r.finished_recving or ()),
                set(getattr(r, "failed_recving", None) or ()),
            )
        if self.inner is None:
            return TransferResults()
        sending, recving = self.inner.get_finished(finished_req_ids)
        return TransferResults(set(sending or ()), set(recving or ()))

    def get_block_ids_with_load_errors(self) -> set[int]:
        self.calls.append(("get_block_ids_with_load_errors", ""))
        errors = getattr(self.inner, "get_block_ids_with_load_errors", None)
        return set(errors()) if errors is not None else set()

    def build_connector_worker_meta(self) -> Any:
        self.calls.append(("build_connector_worker_meta", ""))
        meta = getattr(self.inner, "build_connector_worker_meta", None)
        return meta() if meta is not None else None

    def clear_connector_metadata(self) -> None:
        self.calls.append(("clear_connector_metadata", ""))
        if self.inner is not None:
            self.inner.clear_connector_metadata()


# --------------------------------------------------------------------------
# Blocks and the runner
# --------------------------------------------------------------------------


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run the forwards on one thread: for tensors this small, waking OpenMP
    workers costs ~20x the arithmetic (measured on two cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class BlockAllocator:
    """A free list of block ids, handed out lowest first (deterministic)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {count}, {len(self._free)} free")
        taken, self._free = self._free[:count], self._free[count:]
        return taken

    def free(self, block_ids: Sequence[int]) -> None:
        self._free = sorted(set(self._free) | set(block_ids))


class StandInModelRunner:
    """The stand-in for vLLM's GPU model runner (see the module docstring).

    ``connector`` is any object with :class:`WorkerConnector`'s methods, or None
    to run without one. Per-step connector metadata comes from the caller:
    :meth:`execute_step` takes it directly, :meth:`generate` gets it from a
    :class:`SchedulerHooks`.
    """

    def __init__(
        self,
        spec: TinyLlamaSpec,
        *,
        num_blocks: int = 128,
        block_size: int = 16,
        layout: KVLayout = KVLayout.LBNHC,
        dtype: torch.dtype = torch.float32,
        connector: WorkerConnector | None = None,
        poison: float = math.nan,
        model: LlamaForCausalLM | None = None,
        kv_caches: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """``kv_caches``, when given, are caches allocated elsewhere (vLLM's own
        ``allocate_kv_cache``: standardized views in ``layout``), poisoned here
        and used as they are; ``num_blocks`` must then match them."""
        self.spec = spec
        self.block_size = block_size
        self.layout = layout
        self.dtype = dtype
        self.poison = poison
        self.model = model if model is not None else spec.build_model(dtype)
        self.layer_names = spec.layer_names()
        if kv_caches is not None:
            if layout not in (KVLayout.LBNHC, KVLayout.LBHNC):
                raise ValueError("caches allocated by vLLM are standardized views")
            self.kv_caches = {name: kv_caches[name] for name in self.layer_names}
            for cache in self.kv_caches.values():
                if cache.shape[0] != num_blocks or cache.dtype != dtype:
                    raise ValueError(f"cache {tuple(cache.shape)} {cache.dtype} does not fit")
                cache.fill_(poison)
        else:
            self.kv_caches = {
                name: allocate_kv_layer(
                    layout,
                    num_blocks=num_blocks,
                    block_size=block_size,
                    num_kv_heads=spec.num_kv_heads,
                    head_size=spec.head_dim,
                    dtype=dtype,
                    fill=poison,
                )
                for name in self.layer_names
            }
        self.allocator = BlockAllocator(num_blocks)
        self.connector = connector
        self._next_step = 0
        register = getattr(connector, "register_kv_caches", None)
        if register is not None:
            register(self.kv_caches)

    # -- paged cache access -------------------------------------------------

    def read_kv(
        self, block_ids: Sequence[int], start: int, end: int
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the K/V of token positions ``[start, end)`` of a request."""
        slots = slot_mapping(block_ids, start, end, self.block_size)
        with _one_thread():
            return {
                name: gather_kv(self.layout, self.kv_caches[name], slots)
                for name in self.layer_names
            }

    def write_kv(
        self,
        block_ids: Sequence[int],
        start: int,
        kv: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Write per-layer K/V (``[T, H, D]``) for positions ``[start, start + T)``."""
        with _one_thread():
            for name, (keys, values) in kv.items():
                slots = slot_mapping(block_ids, start, start + keys.shape[0], self.block_size)
                scatter_kv(self.layout, self.kv_caches[name], slots, keys, values)

    def release_blocks(self, block_ids: Sequence[int]) -> None:
        """Free blocks and poison them, as if another request took them over: a
        connector still reading them afterwards reads poison, not stale KV."""
        index = torch.tensor(list(block_ids), dtype=torch.int64)
        for name in self.layer_names:
            k_view, v_view = kv_block_views(self.layout, self.kv_caches[name])
            k_view[index] = self.poison
            v_view[index] = self.poison
        self.allocator.free(block_ids)

    # -- one step -----------------------------------------------------------

    def new_plan(
        self,
        requests: Sequence[ScheduledRequest] = (),
        finished_req_ids: frozenset[str] = frozenset(),
    ) -> StepPlan:
        plan = StepPlan(self._next_step, tuple(requests), finished_req_ids)
        self._next_step += 1
        return plan

    def execute_step(
        self, plan: StepPlan, connector_metadata: Any = None, *, has_sync_kv_loads: bool = True
    ) -> StepOutput:
        """Run one step: the connector calls in vLLM's order around the forwards.

        ``has_sync_kv_loads`` False (vLLM's ``SchedulerOutput.has_sync_kv_loads``)
        moves ``start_load_kv`` after the forward, where vLLM 0.33 starts loads
        that no request of this step waits for.
        """
        context = self._forward_context(plan)
        connector = self.connector
        if connector is not None:
            preemptions = getattr(connector, "handle_preemptions", None)
            if preemptions is not None and connector_metadata is not None:
                preemptions(connector_metadata)
            connector.bind_connector_metadata(connector_metadata)
            if has_sync_kv_loads:
                connector.start_load_kv(context)
            if plan.requests:
                for name in self.layer_names:
                    connector.wait_for_layer_load(name)

        with _one_thread():
            logits = {req.req_id: self._forward(req) for req in plan.requests}
        out = StepOutput(plan=plan, logits=logits)

        if connector is not None:
            if not has_sync_kv_loads:
                connector.start_load_kv(context)
            if plan.requests:
                assert context.attn_metadata is not None
                for name in self.layer_names:
                    connector.save_kv_layer(name, self.kv_caches[name], context.attn_metadata[name])
            connector.wait_for_save()
            self._collect_transfer_results(connector, plan, out)
            errors = getattr(connector, "get_block_ids_with_load_errors", None)
            if errors is not None:
                out.invalid_block_ids = set(errors())
            worker_meta = getattr(connector, "build_connector_worker_meta", None)
            if worker_meta is not None:
                out.worker_meta = worker_meta()
            connector.clear_connector_metadata()
        return out

    def _collect_transfer_results(
        self, connector: WorkerConnector, plan: StepPlan, out: StepOutput
    ) -> None:
        finished = set(plan.finished_req_ids)
        transfer_results = getattr(connector, "get_transfer_results", None)
        if transfer_results is not None:
            results = transfer_results(finished)
            out.finished_sending = set(results.finished_sending or ())
            out.finished_recving = set(results.finished_recving or ())
            out.failed_recving = set(getattr(results, "failed_recving", None) or ())
        else:
            sending, recving = connector.get_finished(finished)
            out.finished_sending = set(sending or ())
            out.finished_recving = set(recving or ())

    def _forward_context(self, plan: StepPlan) -> StandInForwardContext:
        layers = {
            name: StandInAttentionLayer(name, self.kv_caches[name]) for name in self.layer_names
        }
        if not plan.requests:
            return StandInForwardContext(layers, None, {})
        metadata = self._attention_metadata(plan)
        return StandInForwardContext(
            no_compile_layers=layers,
            attn_metadata=dict.fromkeys(self.layer_names, metadata),
            slot_mapping=dict.fromkeys(self.layer_names, metadata.slot_mapping),
        )

    def _attention_metadata(self, plan: StepPlan) -> StandInAttentionMetadata:
        query_lens = [r.num_scheduled_tokens for r in plan.requests]
        seq_lens = [r.num_computed_tokens + r.num_scheduled_tokens for r in plan.requests]
        width = max(len(r.block_ids) for r in plan.requests)
        table = torch.zeros((len(plan.requests), width), dtype=torch.int32)
        for i, r in enumerate(plan.requests):
            table[i, : len(r.block_ids)] = torch.tensor(r.block_ids, dtype=torch.int32)
        slots = torch.cat(
            [
                slot_mapping(r.block_ids, r.num_computed_tokens, seq_len, self.block_size)
                for r, seq_len in zip(plan.requests, seq_lens, strict=True)
            ]
        )
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        return StandInAttentionMetadata(
            num_actual_tokens=sum(query_lens),
            max_query_len=max(query_lens),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            max_seq_len=max(seq_lens),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=table,
            slot_mapping=slots,
        )

    def _forward(self, req: ScheduledRequest) -> torch.Tensor:
        """Compute ``req``'s scheduled tokens over the prefix held in its blocks."""
        from transformers import DynamicCache

        start = req.num_computed_tokens
        end = start + req.num_scheduled_tokens
        if req.num_scheduled_tokens <= 0 or end > len(req.token_ids):
            raise ValueError(f"{req.req_id}: cannot compute positions [{start}, {end})")
        cache = DynamicCache(config=self.model.config)
        if start > 0:
            # The prefix comes out of the paged blocks, never from an earlier
            # step's Python objects: what the blocks hold is what attention sees.
            for i, (keys, values) in enumerate(self.read_kv(req.block_ids, 0, start).values()):
                # [T, H, D] -> transformers' [batch, H, T, D]
                cache.update(
                    keys.permute(1, 0, 2).unsqueeze(0), values.permute(1, 0, 2).unsqueeze(0), i
                )
        input_ids = torch.tensor([req.token_ids[start:end]], dtype=torch.int64)
        position_ids = torch.arange(start, end, dtype=torch.int64).unsqueeze(0)
        with torch.inference_mode():
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
            )
        new_kv = {
            name: (
                layer.keys[0, :, start:end].permute(1, 0, 2),
                layer.values[0, :, start:end].permute(1, 0, 2),
            )
            for name, layer in zip(self.layer_names, cast(list[Any], cache.layers), strict=True)
        }
        self.write_kv(req.block_ids, start, new_kv)
        logits: torch.Tensor = out.logits[0].float()
        return logits

    # -- a request from prompt to last token -------------------------------

    def prefill(
        self,
        req_id: str,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        *,
        num_computed_tokens: int = 0,
        max_tokens_per_step: int | None = None,
        connector_metadata: Callable[[StepPlan], Any] | None = None,
    ) -> torch.Tensor:
        """Compute positions ``[num_computed_tokens, len(token_ids))`` over KV already
        in ``block_ids`` (in chunks of ``max_tokens_per_step``, one step each);
        float32 logits ``[len(token_ids) - num_computed_tokens, vocab]``."""
        tokens, blocks = tuple(token_ids), tuple(block_ids)
        done, chunks = num_computed_tokens, []
        while done < len(tokens):
            n = len(tokens) - done
            if max_tokens_per_step is not None:
                n = min(n, max_tokens_per_step)
            plan = self.new_plan([ScheduledRequest(req_id, tokens, blocks, done, n)])
            meta = connector_metadata(plan) if connector_metadata is not None else None
            chunks.append(self.execute_step(plan, meta).logits[req_id])
            done += n
        return torch.cat(chunks)

    def generate(
        self,
        req_id: str,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        hooks: SchedulerHooks | None = None,
        block_ids: Sequence[int] | None = None,
        num_local_computed_tokens: int = 0,
        max_tokens_per_step: int | None = None,
        free_blocks: bool = True,
        transfer_timeout_s: float = 30.0,
    ) -> Generation:
        """Prefill ``prompt`` and decode ``max_new_tokens`` greedy tokens.

        ``block_ids`` (caller-owned, never freed here) may already hold the KV of
        the first ``num_local_computed_tokens`` tokens, like vLLM's local prefix
        cache; without them the runner allocates blocks and, with
        ``free_blocks``, releases (poisons) them once the connector is done.
        ``hooks`` is the connector's scheduler side; it decides how many tokens
        the connector supplies and builds each step's metadata.
        """
        if max_new_tokens < 1 or not prompt:
            raise ValueError("need a prompt and at least one new token")
        prompt_t = tuple(prompt)
        needed = -(-(len(prompt_t) + max_new_tokens) // self.block_size)
        owned = block_ids is None
        blocks = tuple(self.allocator.allocate(needed) if block_ids is None else block_ids)
        if len(blocks) < needed:
            raise ValueError(f"{req_id}: {len(blocks)} blocks given, {needed} needed")
        steps: list[StepOutput] = []

        def view(tokens: tuple[int, ...], computed: int) -> RequestView:
            return RequestView(req_id, prompt_t, tokens, computed, blocks)

        def run(plan: StepPlan) -> StepOutput:
            meta = hooks.build_connector_meta(plan) if hooks is not None else None
            out = self.execute_step(plan, meta)
            steps.append(out)
            return out

        def first_bad_position(invalid: set[int]) -> int | None:
            bad = [i for i, b in enumerate(blocks) if b in invalid]
            return bad[0] * self.block_size if bad else None

        local = num_local_computed_tokens
        external, load_async = 0, False
        if hooks is not None:
            external, load_async = hooks.get_num_new_matched_tokens(view(prompt_t, local), local)
            hooks.update_state_after_alloc(view(prompt_t, local), blocks, external)
        computed = local + external
        recomputes = 0

        if load_async and external > 0:
            # vLLM's WAITING_FOR_REMOTE_KVS: empty steps until the load reports in.
            deadline = time.monotonic() + transfer_timeout_s
            while True:
                out = run(self.new_plan())
                bad = first_bad_position(out.invalid_block_ids)
                if req_id in out.failed_recving:
                    computed, recomputes = local, recomputes + 1
                elif bad is not None and bad < computed:
                    computed, recomputes = max(local, bad), recomputes + 1
                if req_id in out.finished_recving:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{req_id}: asynchronous KV load never finished")
                time.sleep(0.001)
            loading_now = 0
        else:
            loading_now = external

        # A full hit still computes the last prompt token: its logits pick the
        # first new token (vLLM does the same).
        computed = min(computed, len(prompt_t) - 1)
        loading_now = min(loading_now, max(0, computed - local))

        prefill_logits: list[torch.Tensor] = []
        first_computed = computed
        while computed < len(prompt_t):
            n = len(prompt_t) - computed
            if max_tokens_per_step is not None:
                n = min(n, max_tokens_per_step)
            sched = ScheduledRequest(req_id, prompt_t, blocks, computed, n, loading_now)
            out = run(self.new_plan([sched]))
            bad = first_bad_position(out.invalid_block_ids)
            if loading_now and bad is not None and bad < computed:
                # The forward attended to KV that failed verification: drop its
                # output and recompute from the first bad block, as vLLM does.
                computed = first_computed = max(local, bad)
                prefill_logits.clear()
                recomputes += 1
                loading_now = 0
                continue
            loading_now = 0
            prefill_logits.append(out.logits[req_id])
            computed += n

        tokens = list(prompt_t)
        sampled: list[torch.Tensor] = [prefill_logits[-1][-1]]
        tokens.append(int(sampled[-1].argmax()))
        for _ in range(max_new_tokens - 1):
            sched = ScheduledRequest(req_id, tuple(tokens), blocks, len(tokens) - 1, 1)
            out = run(self.new_plan([sched]))
            sampled.append(out.logits[req_id][-1])
            tokens.append(int(sampled[-1].argmax()))

        final = tuple(tokens)
        kv = self.read_kv(blocks, 0, len(final) - 1)
        held = (
            hooks.request_finished(view(final, len(final) - 1), blocks)
            if hooks is not None
            else False
        )
        self._finish(req_id, held, run, transfer_timeout_s)
        if owned and free_blocks:
            self.release_blocks(blocks)
        return Generation(
            req_id=req_id,
            prompt=prompt_t,
            tokens=tokens[len(prompt_t) :],
            sampled_logits=torch.stack(sampled),
            prefill_logits=torch.cat(prefill_logits),
            num_local_computed_tokens=local,
            num_external_tokens=max(0, first_computed - local),
            load_error_recomputes=recomputes,
            block_ids=blocks,
            kv=kv,
            steps=steps,
        )

    def _finish(
        self,
        req_id: str,
        held: bool,
        run: Callable[[StepPlan], StepOutput],
        timeout_s: float,
    ) -> None:
        """The step after the last token tells the connector the request finished;
        held blocks stay held until the connector reports the save done."""
        if self.connector is None:
            return
        out = run(self.new_plan(finished_req_ids=frozenset({req_id})))
        deadline = time.monotonic() + timeout_s
        while held and req_id not in out.finished_sending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{req_id}: connector never reported the save finished")
            time.sleep(0.001)
            out = run(self.new_plan())


def iter_layers(kv: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> Iterator[torch.Tensor]:
    """Every K and V tensor of a per-layer KV mapping, in layer order."""
    for keys, values in kv.values():
        yield keys
        yield values


# --------------------------------------------------------------------------
# vLLM's real scheduler driving the stand-in (imports vLLM when used)
# --------------------------------------------------------------------------


def write_model_dir(spec: TinyLlamaSpec, folder: Path) -> Path:
    """A model folder vLLM's ``ModelConfig`` accepts: config.json only (no weights,
    no tokenizer; the stand-in builds the weights from the seed)."""
    spec.hf_config().save_pretrained(folder)
    if not (folder / "config.json").is_file():
        raise RuntimeError(f"no config.json written to {folder}")
    return folder


@dataclass
class VllmRequestResult:
    """One request as the driver saw it run under vLLM's scheduler."""

    req_id: str
    prompt: tuple[int, ...]
    #: Tokens vLLM accepted (``EngineCoreOutput.new_token_ids``), in order.
    tokens: list[int] = field(default_factory=list)
    #: float32 ``[len(tokens), vocab]``: the logits each accepted token came from.
    sampled_logits: list[torch.Tensor] = field(default_factory=list)
    #: (start position, float32 logits of the positions computed from it), prefill only.
    prefill_chunks: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    #: The prompt's KV read out of the blocks right after the prefill's last step.
    prompt_kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    #: vLLM's own accounting (``PrefillStats``): tokens from the local prefix cache
    #: and from the connector.
    num_local_cached_tokens: int = 0
    num_external_cached_tokens: int = 0
    finished: bool = False

    @property
    def prefill_start(self) -> int:
        return self.prefill_chunks[0][0] if self.prefill_chunks else len(self.prompt)

    def prefill_logits(self) -> torch.Tensor:
        """Logits of prompt positions ``[prefill_start, len(prompt))``."""
        return torch.cat([logits for _, logits in self.prefill_chunks])


@dataclass
class _RunnerRequestState:
    """What a model runner keeps per request (vLLM's ``CachedRequestState``)."""

    prompt: tuple[int, ...]
    output: list[int]
    block_ids: list[int]
    num_computed_tokens: int


def build_vllm_scheduler(
    spec: TinyLlamaSpec,
    model_dir: Path,
    *,
    dtype: torch.dtype,
    block_size: int,
    layout: KVLayout,
    num_blocks: int,
    max_num_batched_tokens: int,
    transfer: Any,
    tp: int = 1,
) -> tuple[Any, Any, Any]:
    """vLLM 0.33's real config, KV-cache config and ``Scheduler`` for the tiny model.

    ``transfer`` is a ``KVTransferConfig`` or None; with ``tp`` > 1 each rank holds
    ``num_kv_heads // tp`` heads. Returns ``(vllm_config, kv_cache_config, scheduler)``.
    """
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    max_len = spec.max_position_embeddings
    model_config = ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype=dtype,
        seed=0,
        max_model_len=max_len,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    # vLLM's engine core resolves the layout from the workers' backends;
    # the stand-in's "backend" takes either standardized layout.
    cache_config.kv_cache_layout = layout.value
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )
    kv_spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=spec.num_kv_heads // tp,
        head_size=spec.head_dim,
        dtype=dtype,
    )
    cache_config.num_gpu_blocks_override = num_blocks
    kv_cache_config = get_kv_cache_config_from_groups(
        vllm_config, [KVCacheGroupSpec(spec.layer_names(), kv_spec)], 1 << 40
    )
    cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        log_stats=True,
    )
    return vllm_config, kv_cache_config, scheduler


class VllmSchedulerDriver:
    """vLLM 0.33's real v1 ``Scheduler`` driving the stand-in runner, step by step.

    What vLLM's engine core does with a GPU model runner, on CPU: ``schedule()``
    → the runner updates its per-request state from the ``SchedulerOutput``
    alone (new requests, appended or replaced block ids, computed-token counts)
    → the stand-in executes the step with the step's connector metadata →
    greedy sampling where a request's prefill is complete → a
    ``ModelRunnerOutput`` with the connector's ``KVConnectorOutput`` →
    ``update_from_output``. The scheduler builds the connector's scheduler side
    itself from ``kv_transfer_config``; the worker side comes from vLLM's
    ``KVConnectorFactory``, so any ``KVConnectorBase_V1`` plugs in by name and
    module path. The KV caches are allocated by vLLM's ``allocate_kv_cache`` in
    the resolved layout and handed to the stand-in as they are.
    """

    def __init__(
        self,
        spec: TinyLlamaSpec,
        model_dir: Path,
        *,
        kv_connector: str | None = None,
        kv_connector_module_path: str | None = None,
        kv_connector_extra_config: Mapping[str, Any] | None = None,
        num_blocks: int = 128,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        layout: KVLayout = KVLayout.LBNHC,
        max_num_batched_tokens: int = 2048,
        kv_load_failure_policy: str = "recompute",
        model: LlamaForCausalLM | None = None,
    ) -> None:
        """``kv_load_failure_policy`` is vLLM's: "recompute" (what kvoffload's
        design asks for: a failed load is a miss) or "fail" (vLLM 0.33's default)."""
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.worker.utils import allocate_kv_cache

        if layout not in (KVLayout.LBNHC, KVLayout.LBHNC):
            raise ValueError("vLLM 0.33 allocates standardized layouts only")
        transfer = (
            None
            if kv_connector is None
            else KVTransferConfig(
                kv_connector=kv_connector,
                kv_connector_module_path=kv_connector_module_path,
                kv_role="kv_both",
                kv_connector_extra_config=dict(kv_connector_extra_config or {}),
                kv_load_failure_policy=kv_load_failure_policy,  # type: ignore[arg-type]
            )
        )
        self.vllm_config, self.kv_cache_config, self.scheduler = build_vllm_scheduler(
            spec,
            model_dir,
            dtype=dtype,
            block_size=block_size,
            layout=layout,
            num_blocks=num_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            transfer=transfer,
        )
        cache_config = self.vllm_config.cache_config
        self.worker_connector: Any = (
            None
            if transfer is None
            else KVConnectorFactory.create_connector(
                self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config
            )
        )
        kv_caches = allocate_kv_cache(
            self.kv_cache_config,
            torch.device("cpu"),
            cache_config.get_resolved_kv_cache_layout(),
        )
        self._start(
            spec,
            block_size=block_size,
            layout=layout,
            dtype=dtype,
            model=model,
            kv_caches=kv_caches,
        )

    def _start(
        self,
        spec: TinyLlamaSpec,
        *,
        block_size: int,
        layout: KVLayout,
        dtype: torch.dtype,
        model: Any,
        kv_caches: Any,
    ) -> None:
        """The end of every constructor: the stand-in runner over ``kv_caches``
        (with ``self.worker_connector``) and empty request state."""
        self.runner = StandInModelRunner(
            spec,
            num_blocks=self.kv_cache_config.num_blocks,
            block_size=block_size,
            layout=layout,
            dtype=dtype,
            connector=self.worker_connector,
            model=model,
            kv_caches=kv_caches,
        )
        self.block_size = block_size
        self.eos_token_id = spec.vocab_size - 1
        self.results: dict[str, VllmRequestResult] = {}
        self._states: dict[str, _RunnerRequestState] = {}
        self._pending_logits: dict[str, torch.Tensor] = {}
        self.steps = 0

    # -- requests ----------------------------------------------------------------

    def add_request(self, req_id: str, prompt: Sequence[int], max_new_tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        params = SamplingParams(max_tokens=max_new_tokens, ignore_eos=True)
        params.update_from_generation_config({}, self.eos_token_id)
        self.scheduler.add_request(
            Request(
                request_id=req_id,
                prompt_token_ids=list(prompt),
                sampling_params=params,
                pooling_params=None,
                block_hasher=get_request_block_hasher(self.block_size, sha256),
            )
        )
        self.results[req_id] = VllmRequestResult(req_id, tuple(prompt))

    def run(self, max_steps: int = 10_000, timeout_s: float = 60.0) -> None:
        """Step until every request finished and the scheduler let go of every
        block (held blocks wait for the connector's ``finished_sending``)."""
        deadline = time.monotonic() + timeout_s
        for _ in range(max_steps):
            if not self.scheduler.requests and all(r.finished for r in self.results.values()):
                return
            if time.monotonic() > deadline:
                break
            if not self.step():
                time.sleep(0.002)  # only background transfers left: let them run
        waiting = {r: str(q.status) for r, q in self.scheduler.requests.items()}
        unfinished = [r for r, res in self.results.items() if not res.finished]
        raise TimeoutError(
            f"after {self.steps} steps: scheduler still holds {waiting}; "
            f"no finish seen for {unfinished}"
        )

    def generate(
        self, req_id: str, prompt: Sequence[int], max_new_tokens: int
    ) -> VllmRequestResult:
        self.add_request(req_id, prompt, max_new_tokens)
        self.run()
        return self.results[req_id]

    # -- one engine-core step ---------------------------------------------------------

    def step(self) -> bool:
        """One engine-core step; whether it computed anything."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.scheduler.schedule()
        self.steps += 1
        plan = self._plan(so)
        out = self.runner.execute_step(
            plan, so.kv_connector_metadata, has_sync_kv_loads=bool(so.has_sync_kv_loads)
        )
        sampled: dict[str, list[int]] = {}
        for req in plan.requests:
            sampled[req.req_id] = self._record(req, out.logits[req.req_id])
        req_ids = [r.req_id for r in plan.requests]
        connector_output = None
        if self.worker_connector is not None:
            connector_output = KVConnectorOutput(
                finished_sending=out.finished_sending or None,
                finished_recving=out.finished_recving or None,
                failed_recving=out.failed_recving,
                invalid_block_ids=out.invalid_block_ids,
                kv_connector_worker_meta=out.worker_meta,
            )
        engine_outputs = self.scheduler.update_from_output(
            so,
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=[sampled[r] for r in req_ids],
                kv_connector_output=connector_output,
            ),
        )
        for outputs in engine_outputs.values():
            for o in outputs.outputs:
                self._accept(o)
        return bool(plan.requests)

    def _plan(self, so: Any) -> StepPlan:
        """Update per-request state from the ``SchedulerOutput`` alone, as a runner must."""
        for req_id in so.finished_req_ids:
            self._states.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self._states[new.req_id] = _RunnerRequestState(
                tuple(new.prompt_token_ids), [], list(new.block_ids[0]), new.num_computed_tokens
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._states[req_id]
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_blocks[0]) if new_blocks is not None else []
            elif new_blocks is not None:
                state.block_ids += new_blocks[0]
            state.num_computed_tokens = cached.num_computed_tokens[i]
        requests = []
        for req_id, n in so.num_scheduled_tokens.items():
            state = self._states[req_id]
            requests.append(
                ScheduledRequest(
                    req_id,
                    state.prompt + tuple(state.output),
                    tuple(state.block_ids),
                    state.num_computed_tokens,
                    n,
                )
            )
        return self.runner.new_plan(requests, frozenset(so.finished_req_ids))

    def _record(self, req: ScheduledRequest, logits: torch.Tensor) -> list[int]:
        """Keep the step's logits; sample greedily where the request's tokens are all in."""
        result = self.results[req.req_id]
        start = req.num_computed_tokens
        end = start + req.num_scheduled_tokens
        prompt_len = len(result.prompt)
        if start < prompt_len:
            # A recompute after a failed load restarts earlier: drop what it replaces.
            kept = [(s, x[: max(0, start - s)]) for s, x in result.prefill_chunks if s < start]
            result.prefill_chunks = [(s, x) for s, x in kept if x.shape[0]]
            result.prefill_chunks.append((start, logits[: prompt_len - start]))
            if end >= prompt_len:
                result.prompt_kv = self.runner.read_kv(req.block_ids, 0, prompt_len)
        if end < len(req.token_ids):
            return []
        self._pending_logits[req.req_id] = logits[-1]
        return [int(logits[-1].argmax())]

    def _accept(self, output: Any) -> None:
        result = self.results.get(output.request_id)
        if result is None:
            return
        if output.new_token_ids:
            result.tokens += output.new_token_ids
            result.sampled_logits.append(self._pending_logits.pop(output.request_id))
            state = self._states.get(output.request_id)
            if state is not None:
                state.output += output.new_token_ids
        stats = output.prefill_stats
        if stats is not None:
            result.num_local_cached_tokens = stats.num_local_cached_tokens
            result.num_external_cached_tokens = stats.num_external_cached_tokens
        if output.finish_reason is not None:
            result.finished = True

    def close(self) -> None:
        if self.worker_connector is not None:
            self.worker_connector.shutdown()
        self.scheduler.shutdown()


# --------------------------------------------------------------------------
# One engine as its own process: python -m tests.e2e.standin JOB.json
# --------------------------------------------------------------------------


def _result_record(
    *,
    tokens: Sequence[int],
    sampled_logits: torch.Tensor,
    prefill_logits: torch.Tensor,
    prefill_start: int,
    prompt_kv: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    num_local: int,
    num_external: int,
) -> dict[str, Any]:
    return {
        "tokens": list(tokens),
        "sampled_logits": sampled_logits,
        "prefill_logits": prefill_logits,
        "prefill_start": prefill_start,
        "prompt_kv": {name: (k, v) for name, (k, v) in prompt_kv.items()},
        "num_local_cached_tokens": num_local,
        "num_external_cached_tokens": num_external,
    }


def engine_main(job_path: str) -> int:
    """Run one engine process from a JSON job; write its results with ``torch.save``.

    Job keys: ``spec`` (:class:`TinyLlamaSpec` fields), ``model_dir``,
    ``layout``, ``dtype``, ``connector`` (None, or ``name``, ``module_path``,
    ``extra_config``), ``requests`` (``req_id``, ``prompt``,
    ``max_new_tokens``; run one after another under vLLM's scheduler),
    ``recompute`` (also run every request on a plain runner without
    connector or scheduler: the "recompute everything" baseline), ``out``.
    """
    job = json.loads(Path(job_path).read_text())
    # One thread: several engines share the machine, and GEMM results must
    # not depend on how many threads each one got.
    torch.set_num_threads(1)
    spec = TinyLlamaSpec(**job["spec"])
    dtype = getattr(torch, job.get("dtype", "float32"))
    layout = KVLayout[job.get("layout", "LBNHC")]
    model = spec.build_model(dtype)
    conn = job.get("connector")
    driver = VllmSchedulerDriver(
        spec,
        Path(job["model_dir"]),
        kv_connector=conn["name"] if conn else None,
        kv_connector_module_path=conn["module_path"] if conn else None,
        kv_connector_extra_config=conn["extra_config"] if conn else None,
        num_blocks=job.get("num_blocks", 128),
        dtype=dtype,
        layout=layout,
        model=model,
    )
    out: dict[str, Any] = {"runs": {}, "recompute": {}}
    try:
        for req in job["requests"]:
            r = driver.generate(req["req_id"], req["prompt"], req["max_new_tokens"])
            out["runs"][req["req_id"]] = _result_record(
                tokens=r.tokens,
                sampled_logits=torch.stack(r.sampled_logits),
                prefill_logits=r.prefill_logits(),
                prefill_start=r.prefill_start,
                prompt_kv=r.prompt_kv,
                num_local=r.num_local_cached_tokens,
                num_external=r.num_external_cached_tokens,
            )
    finally:
        driver.close()
    if job.get("recompute"):
        plain = StandInModelRunner(spec, layout=layout, dtype=dtype, model=model)
        for req in job["requests"]:
            g = plain.generate(req["req_id"], req["prompt"], req["max_new_tokens"])
            n = len(g.prompt)
            out["recompute"][req["req_id"]] = _result_record(
                tokens=g.tokens,
                sampled_logits=g.sampled_logits,
                prefill_logits=g.prefill_logits,
                prefill_start=0,
                prompt_kv={name: (k[:n], v[:n]) for name, (k, v) in g.kv.items()},
                num_local=0,
                num_external=0,
            )
    torch.save(out, job["out"])
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.e2e.standin JOB.json")
    sys.exit(engine_main(sys.argv[1]))
