"""A CPU "engine" for the connector tests: vLLM's real scheduler, a fake forward pass.

``Engine`` owns a real ``vllm.v1.core.sched.scheduler.Scheduler`` (which
builds the scheduler-side connector itself, through
``kv_connector_module_path``) and a worker-side ``KVOffloadConnector`` over
real KV-cache tensors allocated by vLLM's own ``allocate_kv_cache`` in the
resolved layout. ``step()`` is what an engine core step does with a model
runner: schedule, bind metadata, load, "forward", save, collect the
connector's transfer results, build a ``ModelRunnerOutput`` and feed it to
``update_from_output``.

The forward pass, as vLLM's attention layers do, calls the connector's
``wait_for_layer_load`` before it touches a layer, so layer-wise loads hand
it layer 0 while later layers are still streaming. It writes a known
function of (layer, position, token, head, dim) into the KV of exactly the
positions vLLM scheduled, so a block that holds the right values for a
position vLLM did *not* schedule got them from a load.

Importing this module imports vLLM: test modules import it after
``pytest.importorskip("vllm")``.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from kvoffload.integrations.vllm import KVOffloadConnector
from kvoffload.integrations.vllm.scheduler import KVOffloadScheduler
from kvoffload.integrations.vllm.worker import KVOffloadWorker

NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_DIM = 16  # hidden 64 / 4 attention heads
VOCAB = 1000
EOS = 999
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_none_hash_ready = False


def write_tiny_llama(folder: Path) -> Path:
    """A transformers ``LlamaConfig`` (2 layers, hidden 64, 2 KV heads) saved as config.json."""
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=NUM_KV_HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        eos_token_id=EOS,
    ).save_pretrained(folder)
    if not (folder / "config.json").is_file():
        raise RuntimeError(f"no config.json written to {folder}")
    json.loads((folder / "config.json").read_text())
    return folder


def make_vllm_config(
    model_dir: Path,
    extra: dict[str, Any],
    *,
    block_size: int = 16,
    dtype: str = "float32",
    kv_role: str = "kv_both",
    max_num_batched_tokens: int = 1024,
    failure_policy: str = "recompute",
    layout: str = "LBNHC",
    tp: int = 1,
    async_scheduling: bool = True,
) -> VllmConfig:
    model = ModelConfig(
        model=str(model_dir), skip_tokenizer_init=True, dtype=dtype, seed=0, max_model_len=4096
    )
    sched = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=4096,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        # vLLM 0.33's default: the engine core schedules step t+1 before it
        # has step t's output (AsyncScheduler + a batch queue of two).
        async_scheduling=async_scheduling,
    )
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    # The engine core resolves the layout from the workers' backends before
    # building anything; here the test picks it.
    cache.kv_cache_layout = layout
    transfer = KVTransferConfig(
        kv_connector="KVOffloadConnector",
        kv_connector_module_path="kvoffload.integrations.vllm",
        kv_role=kv_role,
        kv_connector_extra_config=extra,
        kv_load_failure_policy=failure_policy,
    )
    return VllmConfig(
        model_config=model,
        scheduler_config=sched,
        cache_config=cache,
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )


def make_kv_cache_config(vllm_config: VllmConfig, num_blocks: int) -> KVCacheConfig:
    """What the engine core plans for this model (vLLM's own planner, fixed block count)."""
    cc = vllm_config.cache_config
    spec = FullAttentionSpec(
        block_size=cc.block_size,
        num_kv_heads=NUM_KV_HEADS // vllm_config.parallel_config.tensor_parallel_size,
        head_size=HEAD_DIM,
        dtype=DTYPES[str(vllm_config.model_config.dtype).removeprefix("torch.")],
    )
    cc.num_gpu_blocks_override = num_blocks
    kvc = get_kv_cache_config_from_groups(
        vllm_config, [KVCacheGroupSpec(list(LAYER_NAMES), spec)], 1 << 40
    )
    cc.num_gpu_blocks = kvc.num_blocks
    return kvc


def kv_value(
    layer: int,
    positions: torch.Tensor,
    tokens: torch.Tensor,
    heads: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Layer ``layer``'s own part of the fake KV: ``[n, len(heads), 2 * head_dim]`` (K | V).

    ``heads`` are global KV-head numbers (a TP rank holds a slice). Small
    integers over 8, exact in every float dtype used here.
    """
    h = heads.view(1, -1, 1)
    d = torch.arange(2 * HEAD_DIM).view(1, 1, -1)
    p = positions.view(-1, 1, 1)
    t = tokens.view(-1, 1, 1)
    return (((layer + 1) * 31 + p * 7 + t * 13 + h * 5 + d * 3) % 251).to(dtype) / 8


def attention_term(layer0_digest: torch.Tensor) -> torch.Tensor:
    """What the fake attention adds to every later layer at position p: a digest of
    layer 0's KV at positions < p, as *read from the caches* of every TP rank
    (the all-reduce after attention mixes the ranks' heads).

    This is the part that makes KV depend on the prefix, as in a real model: a
    layer computed over a bad prefix (a failed load, on any rank) gets
    different values, so a poisoned chunk cannot pass for a good one.
    """
    before = torch.cumsum(layer0_digest.double(), 0) - layer0_digest.double()
    return torch.remainder(before, 5.0)


def sample_token(position: int) -> int:
    """The fake model's next token after ``position`` tokens: any fixed function works."""
    return (7 * position + 11) % (VOCAB - 1)


def make_request(
    rid: str,
    tokens: Sequence[int],
    *,
    block_size: int = 16,
    max_tokens: int = 3,
    cache_salt: str | None = None,
    lora_request: Any = None,
) -> Request:
    global _none_hash_ready
    if not _none_hash_ready:
        init_none_hash(sha256)
        _none_hash_ready = True
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    params.update_from_generation_config({}, EOS)
    return Request(
        request_id=rid,
        prompt_token_ids=list(tokens),
        sampling_params=params,
        pooling_params=None,
        cache_salt=cache_salt,
        lora_request=lora_request,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


class Engine:
    """One vLLM engine: real scheduler, one worker connector and CPU KV cache per TP
    rank, a fake forward pass, vLLM's own aggregation of the workers' outputs.

    With async scheduling (vLLM 0.33's default) it steps as the engine core's
    batch queue does: the output of step t reaches ``update_from_output`` only
    after step t+1 was scheduled and executed.
    """

    def __init__(self, vllm_config: VllmConfig, num_blocks: int = 128) -> None:
        self.config = vllm_config
        self.block_size = vllm_config.cache_config.block_size
        self.tp = vllm_config.parallel_config.tensor_parallel_size
        self.heads_per_rank = NUM_KV_HEADS // self.tp
        self.kv_cache_config = self.plan_kv_cache(vllm_config, num_blocks)
        self.pipelined = bool(vllm_config.scheduler_config.async_scheduling)
        scheduler_cls = AsyncScheduler if self.pipelined else Scheduler
        self.scheduler = scheduler_cls(
            vllm_config=vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=self.block_size,
            log_stats=True,
        )
        layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
        self.workers: list[KVOffloadConnector] = []
        self.rank_caches: list[dict[str, torch.Tensor]] = []
        for rank in range(self.tp):
            # Each worker process asks vLLM's TP group for its rank; here there
            # is no process group, so the test says.
            with mock.patch(
                "kvoffload.integrations.vllm.worker.local_ranks", return_value=(rank, 0)
            ):
                worker = KVOffloadConnector(
                    vllm_config, KVConnectorRole.WORKER, self.kv_cache_config
                )
            caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), layout)
            worker.register_kv_caches(caches)
            self.workers.append(worker)
            self.rank_caches.append(caches)
        self.aggregator = KVOutputAggregator(expected_finished_count=self.tp)
        self.dtype = self.rank_caches[0][LAYER_NAMES[0]].dtype
        self.outputs: list[SchedulerOutput] = []
        self.invalid_block_ids: set[int] = set()
        #: The connector stats vLLM merged from the workers, one entry per step that had any.
        self.connector_stats: list[dict[str, int | float]] = []
        self._in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        # Tokens the fake model sampled, by request and position: with async
        # scheduling a step computes a token before the scheduler has it.
        self._sampled: dict[str, dict[int, int]] = {}

    def plan_kv_cache(self, vllm_config: VllmConfig, num_blocks: int) -> KVCacheConfig:
        """The KV-cache plan (a hybrid engine plans several groups)."""
        return make_kv_cache_config(vllm_config, num_blocks)

    # -- handles ---------------------------------------------------------------

    @property
    def connector(self) -> KVOffloadConnector:
        conn = self.scheduler.connector
        if not isinstance(conn, KVOffloadConnector):
            raise TypeError(f"scheduler built {type(conn).__name__}")
        return conn

    @property
    def sched_side(self) -> KVOffloadScheduler:
        return self.connector.scheduler_side

    @property
    def worker(self) -> KVOffloadConnector:
        return self.workers[0]

    @property
    def worker_side(self) -> KVOffloadWorker:
        return self.workers[0].worker_side

    @property
    def kv_caches(self) -> dict[str, torch.Tensor]:
        return self.rank_caches[0]

    def free_blocks(self) -> int:
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def block_ids(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def global_heads(self, rank: int) -> torch.Tensor:
        return torch.arange(rank * self.heads_per_rank, (rank + 1) * self.heads_per_rank)

    # -- running ---------------------------------------------------------------

    def add(self, request: Request) -> Request:
        self.scheduler.add_request(request)
        return request

    def step(self) -> SchedulerOutput:
        so = self.scheduler.schedule()
        self.outputs.append(so)
        output = self._execute(so)
        if not self.pipelined:
            self.scheduler.update_from_output(so, output)
            return so
        self._in_flight.appendleft((so, output))
        if len(self._in_flight) < 2 and so.total_num_scheduled_tokens > 0:
            return so  # keep this batch in flight, schedule the next one first
        old_so, old_output = self._in_flight.pop()
        self.scheduler.update_from_output(old_so, old_output)
        return so

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """What the workers do with one step, in vLLM's model-runner order."""
        meta = so.kv_connector_metadata
        for w in self.workers:
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            if so.has_sync_kv_loads:
                w.start_load_kv(None)  # vLLM starts sync loads before the forward pass
        sampled = self._forward(so)
        req_ids = list(so.num_scheduled_tokens)
        outputs: list[ModelRunnerOutput | None] = []
        for w in self.workers:
            if not so.has_sync_kv_loads:
                w.start_load_kv(None)  # ... and async ones after it
            w.wait_for_save()
            results = w.get_transfer_results(so.finished_req_ids)
            invalid = w.get_block_ids_with_load_errors()
            self.invalid_block_ids |= invalid
            out = KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                invalid_block_ids=invalid,
                failed_recving=results.failed_recving,
                kv_connector_worker_meta=w.build_connector_worker_meta(),
                # As vLLM's model runner does after each step.
                kv_connector_stats=w.get_kv_connector_stats(),
            )
            w.clear_connector_metadata()
            outputs.append(
                ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={r: i for i, r in enumerate(req_ids)},
                    sampled_token_ids=[sampled[r] for r in req_ids],
                    kv_connector_output=out,
                )
            )
        merged = self.aggregator.aggregate(outputs)
        if merged is None:
            raise RuntimeError("no output from rank 0")
        kvo = merged.kv_connector_output
        if kvo is not None and kvo.kv_connector_stats is not None:
            stats = type(self.workers[0]).build_kv_connector_stats(kvo.kv_connector_stats.data)
            self.connector_stats.append(stats.reduce())
        return merged

    def connector_total(self, name: str) -> int:
        """One connector counter summed over every step so far (all workers)."""
        return sum(int(s.get(name, 0)) for s in self.connector_stats)

    def _forward(self, so: SchedulerOutput) -> dict[str, list[int]]:
        """Write the fake KV of every scheduled position; sample where the prefill is done."""
        starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        sampled: dict[str, list[int]] = {}
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            start, end = starts[req_id], starts[req_id] + n
            known = list(req.all_token_ids)
            mine = self._sampled.setdefault(req_id, {})
            tokens = [known[p] if p < len(known) else mine[p] for p in range(start, end)]
            self.write_kv(self.block_ids(req_id), torch.arange(start, end), torch.tensor(tokens))
            if end >= req.num_tokens:  # the prefill is done: the token at `end` is sampled
                mine[end] = sample_token(end)
                sampled[req_id] = [mine[end]]
            else:
                sampled[req_id] = []
        return sampled

    def _slots(self, block_ids: Sequence[int], positions: torch.Tensor) -> tuple[Any, Any]:
        bs = self.block_size
        return torch.tensor([block_ids[int(p) // bs] for p in positions]), positions % bs

    def write_kv(
        self, block_ids: Sequence[int], positions: torch.Tensor, tokens: torch.Tensor
    ) -> None:
        """The fake forward over ``positions`` (contiguous, after everything before them)."""
        start, end = int(positions[0]), int(positions[-1]) + 1
        blocks, offsets = self._slots(block_ids, positions)
        self.wait_layer(0)
        for rank, caches in enumerate(self.rank_caches):
            caches[LAYER_NAMES[0]][blocks, :, offsets, :] = kv_value(
                0, positions, tokens, self.global_heads(rank), self.dtype
            )
        # Layer 0, each rank's first head, K[0], at every position up to here.
        upto_blocks, upto_offsets = self._slots(block_ids, torch.arange(end))
        digest = sum(
            caches[LAYER_NAMES[0]][upto_blocks, 0, upto_offsets, 0].double()
            for caches in self.rank_caches
        )
        term = attention_term(torch.as_tensor(digest))[start:end].view(-1, 1, 1)
        for layer, name in enumerate(LAYER_NAMES[1:], start=1):
            self.wait_layer(layer)
            for rank, caches in enumerate(self.rank_caches):
                own = kv_value(layer, positions, tokens, self.global_heads(rank), self.dtype)
                caches[name][blocks, :, offsets, :] = (own.double() + term).to(self.dtype)

    def wait_layer(self, layer: int) -> None:
        """What vLLM's attention layer does first: wait for the connector's load of
        that layer (``wait_for_layer_load``) on every rank, then read and write it."""
        for w in self.workers:
            w.wait_for_layer_load(LAYER_NAMES[layer])

    def read_kv(
        self, block_ids: Sequence[int], positions: torch.Tensor, rank: int = 0
    ) -> list[torch.Tensor]:
        blocks, offsets = self._slots(block_ids, positions)
        caches = self.rank_caches[rank]
        return [caches[name][blocks, :, offsets, :].clone() for name in LAYER_NAMES]

    def expected_kv(self, tokens: Sequence[int], rank: int = 0) -> list[torch.Tensor]:
        """Every layer's KV of a clean forward over ``tokens`` on a rank: ``[n, heads, K|V]``."""
        positions = torch.arange(len(tokens))
        t = torch.tensor(list(tokens))
        layer0 = kv_value(0, positions, t, self.global_heads(rank), self.dtype)
        firsts = torch.arange(0, NUM_KV_HEADS, self.heads_per_rank)
        digest = kv_value(0, positions, t, firsts, self.dtype)[:, :, 0].double().sum(1)
        term = attention_term(digest).view(-1, 1, 1)
        rest = [
            (kv_value(layer, positions, t, self.global_heads(rank), self.dtype).double() + term).to(
                self.dtype
            )
            for layer in range(1, NUM_LAYERS)
        ]
        return [layer0, *rest]

    def schedules(self, req_id: str) -> list[tuple[int, int]]:
        """(first position, token count) of every step that computed the request."""
        out = []
        for so in self.outputs:
            n = so.num_scheduled_tokens.get(req_id)
            if n is None:
                continue
            new = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
            cached = so.scheduled_cached_reqs
            new.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
            out.append((new[req_id], n))
        return out

    def run_until(self, done: Any, max_steps: int = 200) -> int:
        """Step until ``done()``; the number of steps taken."""
        for n in range(max_steps):
            if done():
                return n
            if self.step().total_num_scheduled_tokens == 0:
                # Nothing to compute, only background loads/saves in flight:
                # an idle engine loop would wait for them too.
                time.sleep(0.005)
        raise AssertionError(f"not done after {max_steps} steps")

    def run_to_completion(self, requests: Iterable[Request], max_steps: int = 200) -> None:
        """Until every request finished and every held block was released."""
        reqs = list(requests)
        self.run_until(
            lambda: all(r.is_finished() for r in reqs) and not self.scheduler.requests,
            max_steps,
        )

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()
        self.scheduler.shutdown()
