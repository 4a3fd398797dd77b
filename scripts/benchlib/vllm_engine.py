"""An engine for the router benchmarks: vLLM 0.33's real v1 scheduler, a stand-in runner.

:class:`VllmWorker` owns a real ``vllm.v1.core.sched.scheduler.Scheduler``
with its real KV-cache manager (prefix caching, chunked prefill under a token
budget, several prefills and decodes per step, preemption when the blocks run
out), driven step by step as an engine core drives it with a model runner. The
model runner is a STAND-IN (a test double: no GPU here): it computes nothing,
samples one token where vLLM scheduled a prompt's last chunk, and each step
takes the time of a step-time model of the batch vLLM scheduled
(:class:`StepModel`)::

    step = step_s                                             (launch, sampling, weights)
         + Σ_prefill chunks f_r · (token_s · n + attn_s · n · (2·c + n))
         + Σ_decodes (token_s + decode_ctx_s · context)

for a chunk of ``n`` tokens after ``c`` computed ones, ``f_r`` the request's
prefill noise (lognormal, mean 1). The scheduler publishes vLLM's own KV
events (``BlockStored``/``BlockRemoved`` from the block pool) through its
``kv_event_publisher``: kept here msgspec-encoded as vLLM's ZMQ publisher
encodes them (the simulator, ``scripts/sim_vllm.py``), or vLLM's real ZMQ
publisher put in its place (the live engine, :mod:`benchlib.live_engine`).

Used by ``scripts/sim_router.py --engine vllm`` (through ``sim_vllm.py``) and
``scripts/bench_router_live.py``. Importing this module imports vLLM (run
under the vLLM venv).
"""

from __future__ import annotations

import math
import random
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
from transformers import LlamaConfig
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvoffload.events.wire import EventBatch, decode_batch

VOCAB = 1 << 30
MAX_LEN = 262_144
_model_dir: Path | None = None


@dataclass(frozen=True)
class StepModel:
    """The stand-in runner's step time (the simulated truth; the router never sees it)."""

    step_s: float = 0.025
    token_s: float = 1.0 / 9_000
    attn_s: float = 1.2e-9
    decode_ctx_s: float = 1.5e-8

    def prefill_s(self, m: int, cached: int = 0, budget: int = 8192) -> float:
        """An idle worker's time to first token for ``m`` new tokens after ``cached``."""
        steps = max(1, math.ceil(m / budget))
        return self.step_s * steps + self.token_s * m + self.attn_s * m * (2 * cached + m)


def tokens_of(blocks: Sequence[int], n: int, block: int) -> list[int]:
    out: list[int] = []
    for h in blocks:
        base = (h * block) % (VOCAB - block)
        out.extend(range(base, base + block))
        if len(out) >= n:
            break
    return out[:n]


def _tiny_model() -> Path:
    global _model_dir
    if _model_dir is None:
        d = Path(tempfile.mkdtemp(prefix="sim-vllm-"))
        LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=MAX_LEN,
        ).save_pretrained(d)
        _model_dir = d
    return _model_dir


class _Capture:
    """The scheduler's ``kv_event_publisher``: what vLLM's ZMQ publisher sends, kept."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []
        self._enc = msgspec.msgpack.Encoder()

    def publish(self, batch: Any) -> None:
        self.payloads.append(self._enc.encode(batch))

    def shutdown(self) -> None:
        pass


@dataclass
class StepResult:
    duration_s: float
    first: list[str]
    done: list[str]
    events: list[EventBatch]
    tokens: list[str]  # the requests that got a token in this step (first ones included)


class VllmWorker:
    """One engine: vLLM's real scheduler and KV-cache manager, a stand-in runner."""

    def __init__(
        self,
        name: str,
        *,
        block_tokens: int,
        num_blocks: int,
        budget: int,
        max_num_seqs: int,
        step: StepModel,
    ) -> None:
        self.name = name
        self.block = block_tokens
        self.step_model = step
        mc = ModelConfig(
            model=str(_tiny_model()),
            skip_tokenizer_init=True,
            dtype=torch.float16,
            seed=0,
            max_model_len=MAX_LEN,
        )
        sc = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=MAX_LEN,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        )
        cc = CacheConfig(block_size=block_tokens, enable_prefix_caching=True)
        cc.kv_cache_layout = "LBNHC"
        vc = VllmConfig(
            model_config=mc,
            scheduler_config=sc,
            cache_config=cc,
            parallel_config=ParallelConfig(),
            device_config=DeviceConfig("cpu"),
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
        )
        spec = FullAttentionSpec(
            block_size=block_tokens, num_kv_heads=2, head_size=16, dtype=torch.float16
        )
        cc.num_gpu_blocks_override = num_blocks
        kvc = get_kv_cache_config_from_groups(
            vc,
            [KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(2)], spec)],
            1 << 40,
        )
        cc.num_gpu_blocks = kvc.num_blocks
        self.num_blocks = kvc.num_blocks
        self.scheduler = Scheduler(
            vllm_config=vc,
            kv_cache_config=kvc,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=block_tokens,
            log_stats=True,
        )
        self.publisher = _Capture()
        self.scheduler.kv_event_publisher = self.publisher  # type: ignore[assignment]
        self.scheduler.kv_cache_manager.block_pool.enable_kv_cache_events = True
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(block_tokens, sha256)
        self.noise: dict[str, float] = {}
        self._started: set[str] = set()
        self.started_at: dict[str, float] = {}  # first scheduled (its queue wait ends)
        self.preemptions = 0
        self.hit_tokens = 0  # prompt tokens vLLM's prefix cache served

    # -- what a router can see -----------------------------------------------------

    @property
    def busy(self) -> bool:
        return bool(self.scheduler.requests)

    def waiting(self) -> int:
        return len(self.scheduler.waiting)

    def running(self) -> int:
        return len(self.scheduler.running)

    def kv_usage(self) -> float:
        return float(self.scheduler.kv_cache_manager.usage)

    def active_blocks(self) -> int:
        bs = self.block
        return sum(math.ceil(r.num_tokens / bs) for r in self.scheduler.requests.values())

    # -- requests and steps --------------------------------------------------------

    def add(self, rid: str, tokens: list[int], out: int, noise: float) -> None:
        params = SamplingParams(max_tokens=max(1, out), ignore_eos=True)
        params.update_from_generation_config({}, VOCAB - 1)
        self.scheduler.add_request(
            Request(
                request_id=rid,
                prompt_token_ids=tokens,
                sampling_params=params,
                pooling_params=None,
                block_hasher=self._hasher,
            )
        )
        self.noise[rid] = noise

    def step(self, now: float) -> StepResult | None:
        """One engine-core step starting at ``now``; None when vLLM scheduled nothing."""
        sched = self.scheduler
        so = sched.schedule()
        if so.total_num_scheduled_tokens == 0:
            self._drain_events()
            return None
        for new in so.scheduled_new_reqs:
            self.started_at.setdefault(new.req_id, now)
        starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        self.preemptions += len(getattr(so, "preempted_req_ids", None) or ())
        m = self.step_model
        t = m.step_s
        ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in ids:
            n = so.num_scheduled_tokens[rid]
            req = sched.requests[rid]
            c = starts[rid]
            if c < req.num_prompt_tokens:
                f = self.noise.get(rid, 1.0)
                t += f * (m.token_s * n + m.attn_s * n * (2 * c + n))
            else:
                t += m.token_s + m.decode_ctx_s * c
            sampled.append([1] if c + n >= req.num_tokens else [])
        outputs = sched.update_from_output(
            so,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=sampled,
            ),
        )
        first: list[str] = []
        done: list[str] = []
        tokens: list[str] = []
        for eco in outputs.values():
            for o in eco.outputs:
                rid = o.request_id
                if o.new_token_ids:
                    tokens.append(rid)
                if o.new_token_ids and rid not in self._started:
                    self._started.add(rid)
                    first.append(rid)
                    ps = o.prefill_stats
                    self.hit_tokens += ps.num_local_cached_tokens if ps is not None else 0
                if o.finish_reason is not None:
                    done.append(rid)
                    self.noise.pop(rid, None)
                    self._started.discard(rid)
        return StepResult(t, first, done, self._drain_events(), tokens)

    def _drain_events(self) -> list[EventBatch]:
        out = [decode_batch(p) for p in self.publisher.payloads]
        self.publisher.payloads.clear()
        return out


def lognormal(rng: random.Random, sigma: float) -> float:
    return math.exp(rng.gauss(0.0, sigma) - sigma * sigma / 2) if sigma > 0 else 1.0


def scaled(
    reqs: Sequence[Any],
    missing: Sequence[int],
    step: StepModel,
    budget: int,
    workers: int,
    target: float,
) -> list[Any]:
    """Arrival times scaled so that the prefill work left with an infinite cache keeps
    the workers busy ``target`` of the time (as the simple engine's load levels)."""
    from dataclasses import replace

    work = sum(step.prefill_s(m, r.n - m, budget) for r, m in zip(reqs, missing, strict=True))
    span = max(r.arrival for r in reqs) or 1.0
    factor = (work / (workers * span)) / target
    return [replace(r, arrival=r.arrival * factor) for r in reqs]
