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

from .common import requires_transformers, requires_vllm
from .doubles import (
    Generation,
    RecordingConnector,
    RequestView,
    ScheduledRequest,
    SchedulerHooks,
    StandInAttentionLayer,
    StandInAttentionMetadata,
    StandInForwardContext,
    StepOutput,
    StepPlan,
    TransferResults,
    WorkerConnector,
)
from .driver import (
    VllmRequestResult,
    VllmSchedulerDriver,
    build_vllm_scheduler,
    write_model_dir,
)
from .engine import engine_main
from .kv import KVLayout, allocate_kv_layer, gather_kv, kv_block_views, scatter_kv, slot_mapping
from .model import TinyLlamaSpec, make_batch_invariant
from .runner import BlockAllocator, StandInModelRunner, iter_layers

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
    "build_vllm_scheduler",
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
