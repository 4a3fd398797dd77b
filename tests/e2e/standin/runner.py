"""The block allocator and the stand-in model runner.

A test double (see the package docstring).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from .doubles import (
    Generation,
    RequestView,
    ScheduledRequest,
    SchedulerHooks,
    StandInAttentionLayer,
    StandInAttentionMetadata,
    StandInForwardContext,
    StepOutput,
    StepPlan,
    WorkerConnector,
)
from .kv import KVLayout, allocate_kv_layer, gather_kv, kv_block_views, scatter_kv, slot_mapping
from .model import TinyLlamaSpec

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

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
