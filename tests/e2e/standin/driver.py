"""vLLM's real scheduler driving the stand-in (imports vLLM when used).

A test double (see the package docstring).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .doubles import ScheduledRequest, StepPlan
from .kv import KVLayout
from .model import TinyLlamaSpec
from .runner import StandInModelRunner

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

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
