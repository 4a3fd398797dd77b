"""The stand-in model runner's own correctness, before any real connector runs on it.

Each claim the end-to-end tests rest on is checked here: the paged layouts are
vLLM's; computing only a suffix over a prefix read back out of the paged blocks
reproduces a full prefill bit for bit (the stand-in's model is batch-invariant;
transformers' own kernels stay within a stated tolerance); greedy generations
match; a wrong KV (other
weights, one perturbed slot, a slot never written) visibly changes the output,
so the equality assertions can fail; and the stand-in drives a connector in
vLLM's call order, proven with an in-memory dictionary connector (a test double
for the connector, as the runner is for vLLM's GPU runner).

All of it needs transformers, which lives in ``.venv-vllm``: hence the ``vllm``
marker (the tier ``make pytest-vllm`` selects), though only the stride test and
the scheduler-driver test import vLLM itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from .standin import (
    KVLayout,
    RecordingConnector,
    RequestView,
    StandInForwardContext,
    StandInModelRunner,
    StepPlan,
    TinyLlamaSpec,
    VllmSchedulerDriver,
    allocate_kv_layer,
    gather_kv,
    iter_layers,
    requires_transformers,
    requires_vllm,
    scatter_kv,
    slot_mapping,
    write_model_dir,
)

pytestmark = [pytest.mark.vllm, requires_transformers]

SPEC = TinyLlamaSpec()
BLOCK = 16
CHUNK = 32  # connector chunk: two engine blocks, as kvoffload's chunk is a multiple of the block
PROMPT_LEN = 150  # 9 full blocks and a partial one
#: Without batch invariance, fp32 logits of a split prefill differ from a one-shot
#: prefill's by at most 5.5e-6 measured (logit std ~1.1); the bound leaves ~20x.
FAST_KERNELS_ATOL = 1e-4


def prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, SPEC.vocab_size, (length,), generator=gen).tolist()


@pytest.fixture(scope="module")
def model_seed0() -> Any:
    return SPEC.build_model()


def runner(
    layout: KVLayout = KVLayout.LBNHC, model: Any = None, **kwargs: Any
) -> StandInModelRunner:
    return StandInModelRunner(SPEC, layout=layout, block_size=BLOCK, model=model, **kwargs)


# --------------------------------------------------------------------------
# Paged layouts
# --------------------------------------------------------------------------


def _physical_k(layout: KVLayout, kv_layer: torch.Tensor, block: int, offset: int) -> torch.Tensor:
    """K of one slot, read by indexing the layout's documented memory order."""
    d = SPEC.head_dim
    if layout is KVLayout.LBNHC:
        phys = kv_layer.permute(0, 2, 1, 3)  # back to the allocation order [B, N, H, 2D]
        assert phys.is_contiguous()
        return phys[block, offset, :, :d]
    if layout is KVLayout.LBHNC:
        assert kv_layer.is_contiguous()
        return kv_layer[block, :, offset, :d]
    assert kv_layer.is_contiguous()
    if layout is KVLayout.SPLIT_NHD:
        return kv_layer[0, block, offset]
    return kv_layer[0, block, :, offset]


@pytest.mark.parametrize("layout", list(KVLayout))
def test_scatter_gather_round_trip_lands_where_the_layout_says(layout: KVLayout) -> None:
    num_blocks, h, d = 12, SPEC.num_kv_heads, SPEC.head_dim
    kv_layer = allocate_kv_layer(
        layout, num_blocks=num_blocks, block_size=BLOCK, num_kv_heads=h, head_size=d,
        dtype=torch.float32,
    )  # fmt: skip
    # Out-of-order, non-adjacent blocks and a partial last block, as a paged
    # cache really hands them out.
    blocks = [7, 2, 10, 5]
    slots = slot_mapping(blocks, 3, 57, BLOCK)
    assert slots[0].item() == 7 * BLOCK + 3 and slots[-1].item() == 5 * BLOCK + 56 - 48
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(len(slots), h, d, generator=gen)
    values = torch.randn(len(slots), h, d, generator=gen)
    scatter_kv(layout, kv_layer, slots, keys, values)

    got_k, got_v = gather_kv(layout, kv_layer, slots)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    # Independent of gather: the bytes sit where the layout's memory order says.
    for i in (0, 17, len(slots) - 1):
        block, offset = divmod(int(slots[i]), BLOCK)
        assert torch.equal(_physical_k(layout, kv_layer, block, offset), keys[i])
    # Everything else still holds the poison: the scatter wrote nothing stray.
    written = int(torch.isfinite(kv_layer).sum())
    assert written == 2 * len(slots) * h * d


@requires_vllm
@pytest.mark.parametrize("name", ["LBNHC", "LBHNC"])
def test_standardized_layouts_have_vllm_strides(name: str) -> None:
    # Imports vLLM: the layouts are only worth testing connectors on if they
    # are the ones vLLM 0.33 really allocates.
    from vllm.v1.kv_cache_interface import FullAttentionSpec, compute_layout_strides
    from vllm.v1.kv_cache_layout import KVCacheLayout

    num_blocks = 8
    kv_spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=SPEC.num_kv_heads, head_size=SPEC.head_dim,
        dtype=torch.float32,
    )  # fmt: skip
    # Byte strides over [L, B, H, N, C-bytes].
    want = compute_layout_strides(kv_spec, num_blocks, 1, KVCacheLayout[name])
    ours = allocate_kv_layer(
        KVLayout[name], num_blocks=num_blocks, block_size=BLOCK,
        num_kv_heads=SPEC.num_kv_heads, head_size=SPEC.head_dim, dtype=torch.float32,
    )  # fmt: skip
    assert ours.shape == (num_blocks, SPEC.num_kv_heads, BLOCK, 2 * SPEC.head_dim)
    assert tuple(s * ours.element_size() for s in ours.stride()[:3]) == want[1:4]
    assert ours.stride(3) == 1


# --------------------------------------------------------------------------
# The model math
# --------------------------------------------------------------------------


def test_weights_are_a_function_of_the_seed() -> None:
    # Engines in different processes must build the same model from one spec,
    # and another seed (another "revision") must give other weights.
    a = SPEC.build_model().state_dict()
    b = SPEC.build_model().state_dict()
    c = TinyLlamaSpec(weight_seed=1).build_model().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(not torch.equal(a[k], c[k]) for k in a if k.endswith("proj.weight"))


@pytest.mark.parametrize(
    ("layout", "prefix_len"),
    [
        (KVLayout.LBNHC, 16),
        (KVLayout.LBNHC, 64),
        (KVLayout.LBNHC, 128),
        (KVLayout.LBHNC, 64),
        (KVLayout.SPLIT_NHD, 64),
        (KVLayout.SPLIT_HND, 64),
        (KVLayout.LBNHC, 37),  # the prefix ends mid-block
        (KVLayout.LBNHC, 5),  # a prefix shorter than a block
        (KVLayout.LBNHC, 149),  # one token left: vLLM's recompute after a full hit
    ],
)
def test_suffix_over_paged_prefix_equals_full_prefill(
    model_seed0: Any, layout: KVLayout, prefix_len: int
) -> None:
    r = runner(layout, model_seed0)
    tokens = prompt(0)
    full_blocks = r.allocator.allocate(10)
    full = r.prefill("full", tokens, full_blocks)

    split_blocks = r.allocator.allocate(10)
    r.prefill("prefix", tokens[:prefix_len], split_blocks)
    suffix = r.prefill("suffix", tokens, split_blocks, num_computed_tokens=prefix_len)

    assert suffix.shape == (PROMPT_LEN - prefix_len, SPEC.vocab_size)
    assert torch.isfinite(suffix).all()
    assert torch.equal(suffix, full[prefix_len:])
    # ...and the blocks hold the same KV bytes, prefix and suffix alike.
    a = r.read_kv(full_blocks, 0, PROMPT_LEN)
    b = r.read_kv(split_blocks, 0, PROMPT_LEN)
    assert all(torch.equal(x, y) for x, y in zip(iter_layers(a), iter_layers(b), strict=True))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_fast_kernels_agree_within_stated_tolerance(attn: str) -> None:
    """transformers' batched kernels, for the record: BLAS picks kernels by batch
    shape, so equality is not theirs to give; closeness and the argmax are."""
    spec = TinyLlamaSpec(batch_invariant=False, attn_implementation=attn)
    r = StandInModelRunner(spec, block_size=BLOCK)
    tokens = prompt(1, 200)
    full = r.prefill("full", tokens, r.allocator.allocate(13))
    for prefix_len in (170, 195, 199):  # 30, 5 and 1 rows: different kernels
        blocks = r.allocator.allocate(13)
        r.prefill("prefix", tokens[:prefix_len], blocks)
        suffix = r.prefill("suffix", tokens, blocks, num_computed_tokens=prefix_len)
        torch.testing.assert_close(suffix, full[prefix_len:], rtol=0, atol=FAST_KERNELS_ATOL)
        assert torch.equal(suffix.argmax(-1), full[prefix_len:].argmax(-1))
        r.allocator.free(blocks)


def test_bf16_suffix_over_paged_prefix_equals_full_prefill() -> None:
    r = StandInModelRunner(SPEC, block_size=BLOCK, dtype=torch.bfloat16)
    assert r.kv_caches[r.layer_names[0]].dtype == torch.bfloat16
    tokens = prompt(3)
    full = r.prefill("full", tokens, r.allocator.allocate(10))
    blocks = r.allocator.allocate(10)
    r.prefill("prefix", tokens[:96], blocks)
    assert torch.equal(r.prefill("suffix", tokens, blocks, num_computed_tokens=96), full[96:])


@pytest.mark.parametrize("max_tokens_per_step", [None, CHUNK, 7])
def test_greedy_generation_over_reused_prefix_is_identical(
    model_seed0: Any, max_tokens_per_step: int | None
) -> None:
    r = runner(model=model_seed0)
    tokens = prompt(4)
    baseline = r.generate("base", tokens, 24)
    # The output must not be degenerate, or "identical" would prove little.
    assert len(set(baseline.tokens)) > 12

    blocks = r.allocator.allocate(12)
    r.prefill("prefix", tokens[:128], blocks)
    reused = r.generate(
        "reuse", tokens, 24, block_ids=blocks, num_local_computed_tokens=128,
        max_tokens_per_step=max_tokens_per_step,
    )  # fmt: skip
    assert reused.prefill_logits.shape[0] == PROMPT_LEN - 128
    assert reused.tokens == baseline.tokens
    assert torch.equal(reused.sampled_logits, baseline.sampled_logits)
    assert all(
        torch.equal(x, y)
        for x, y in zip(iter_layers(reused.kv), iter_layers(baseline.kv), strict=True)
    )


@requires_vllm
def test_vllm_scheduler_driving_the_stand_in_matches_the_plain_runner(
    model_seed0: Any, tmp_path: Path
) -> None:
    """vLLM's own scheduler in charge: chunked prefill (64-token steps), blocks
    handed out step by step, and a hit in vLLM's local prefix cache. The
    runner follows the SchedulerOutputs alone and must reproduce the plain run."""
    driver = VllmSchedulerDriver(
        SPEC, write_model_dir(SPEC, tmp_path), model=model_seed0, max_num_batched_tokens=64
    )
    try:
        tokens = prompt(13)
        plain = runner(model=model_seed0)
        first = driver.generate("first", tokens, 12)
        want = plain.generate("first", tokens, 12)
        assert first.num_local_cached_tokens == 0 and first.prefill_start == 0
        assert [start for start, _ in first.prefill_chunks] == [0, 64, 128]
        assert first.tokens == want.tokens
        assert torch.equal(torch.stack(first.sampled_logits), want.sampled_logits)
        assert torch.equal(first.prefill_logits(), want.prefill_logits)

        # Shares nine full blocks with the first: vLLM computes only the rest.
        longer = tokens[:144] + prompt(14, 20)
        second = driver.generate("second", longer, 12)
        want = plain.generate("second", longer, 12)
        assert second.num_local_cached_tokens == 144 and second.prefill_start == 144
        assert second.tokens == want.tokens
        assert torch.equal(torch.stack(second.sampled_logits), want.sampled_logits)
        assert torch.equal(second.prefill_logits(), want.prefill_logits[144:])
        assert all(
            torch.equal(x, y[: len(longer)])
            for x, y in zip(iter_layers(second.prompt_kv), iter_layers(want.kv), strict=True)
        )
    finally:
        driver.close()


# --------------------------------------------------------------------------
# The tests can fail: a wrong KV shows
# --------------------------------------------------------------------------


def test_kv_of_other_weights_changes_the_output(model_seed0: Any) -> None:
    """Reusing seed-0 KV under seed-1 weights (a model revision mix-up) changes
    logits and tokens: a connector that ignored the revision would be caught."""
    tokens = prompt(5)
    r0 = runner(model=model_seed0)
    blocks0 = r0.allocator.allocate(12)
    r0.prefill("prefix", tokens[:128], blocks0)
    kv_seed0 = r0.read_kv(blocks0, 0, 128)

    r1 = StandInModelRunner(TinyLlamaSpec(weight_seed=1), block_size=BLOCK)
    honest = r1.generate("honest", tokens, 16)
    blocks1 = r1.allocator.allocate(12)
    r1.prefill("prefix", tokens[:128], blocks1)
    kv_seed1 = r1.read_kv(blocks1, 0, 128)
    assert not any(
        torch.equal(x, y) for x, y in zip(iter_layers(kv_seed0), iter_layers(kv_seed1), strict=True)
    )

    # Control: seed 1's own prefix reproduces the honest run...
    own = r1.generate("own", tokens, 16, block_ids=blocks1, num_local_computed_tokens=128)
    assert own.tokens == honest.tokens
    # ...seed 0's prefix in the same blocks does not.
    r1.write_kv(blocks1, 0, kv_seed0)
    wrong = r1.generate("wrong", tokens, 16, block_ids=blocks1, num_local_computed_tokens=128)
    assert (wrong.prefill_logits - honest.prefill_logits[128:]).abs().max() > 0.1
    assert wrong.tokens != honest.tokens


def test_one_perturbed_slot_changes_the_logits(model_seed0: Any) -> None:
    # A connector that loses precision or swaps one token's KV must not pass
    # an equality check: a 1e-3 nudge to one slot of one layer shows.
    r = runner(model=model_seed0)
    tokens = prompt(6)
    blocks = r.allocator.allocate(10)
    r.prefill("prefix", tokens[:128], blocks)
    clean = r.prefill("clean", tokens, blocks, num_computed_tokens=128)
    name = r.layer_names[2]
    keys, values = r.read_kv(blocks, 70, 71)[name]
    r.write_kv(blocks, 70, {name: (keys + 1e-3, values)})
    nudged = r.prefill("nudged", tokens, blocks, num_computed_tokens=128)
    assert not torch.equal(clean, nudged)


def test_a_slot_never_written_poisons_the_output(model_seed0: Any) -> None:
    # Claiming a prefix computed without writing its KV (a connector that
    # reports a load it did not do) yields NaN, not plausible tokens.
    r = runner(model=model_seed0)
    tokens = prompt(7)
    blocks = r.allocator.allocate(10)
    r.prefill("prefix", tokens[:64], blocks)  # only 64 of the 128 claimed
    out = r.prefill("suffix", tokens, blocks, num_computed_tokens=128)
    assert torch.isnan(out).all()


# --------------------------------------------------------------------------
# The connector protocol, with an in-memory connector as the test double
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Transfer:
    req_id: str
    block_ids: tuple[int, ...]
    start: int
    end: int
    key: tuple[int, ...]  # every token up to `end`: a chained prefix key


@dataclass
class _DictMeta:
    loads: list[_Transfer] = field(default_factory=list)
    saves: list[_Transfer] = field(default_factory=list)


LayerKV = dict[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass
class _DictStore:
    chunks: dict[tuple[int, ...], LayerKV] = field(default_factory=dict)


class _DictScheduler:
    """Scheduler side: full CHUNK-token chunks, keyed by their whole prefix."""

    def __init__(self, store: _DictStore, *, load_async: bool = False, hold: bool = False) -> None:
        self.store = store
        self.load_async = load_async
        self.hold = hold
        self._loads: list[_Transfer] = []
        self._saved_to: dict[str, int] = {}

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int, bool]:
        n, tokens = num_computed_tokens, request.prompt_token_ids
        while n + CHUNK <= len(tokens) and tokens[: n + CHUNK] in self.store.chunks:
            n += CHUNK
        hit = n - num_computed_tokens
        return hit, self.load_async and hit > 0

    def update_state_after_alloc(
        self, request: RequestView, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        start, tokens = request.num_computed_tokens, request.prompt_token_ids
        self._loads += [
            _Transfer(request.req_id, tuple(block_ids), s, s + CHUNK, tokens[: s + CHUNK])
            for s in range(start, start + num_external_tokens, CHUNK)
        ]
        self._saved_to[request.req_id] = start + num_external_tokens

    def build_connector_meta(self, plan: StepPlan) -> _DictMeta:
        meta = _DictMeta(loads=self._loads)
        self._loads = []
        for req in plan.requests:
            done = req.num_computed_tokens + req.num_scheduled_tokens
            start = self._saved_to.get(req.req_id, 0)
            while start + CHUNK <= done:
                key = req.token_ids[: start + CHUNK]
                meta.saves.append(_Transfer(req.req_id, req.block_ids, start, start + CHUNK, key))
                start += CHUNK
            self._saved_to[req.req_id] = start
        return meta

    def request_finished(self, request: RequestView, block_ids: Sequence[int]) -> bool:
        return self.hold


class _DictWorker:
    """Worker side. ``layerwise`` loads each layer in ``wait_for_layer_load``;
    ``load_async`` loads in ``get_finished`` of an empty step; ``fail_chunk``
    skips that chunk's load and reports its blocks; ``hold`` copies the saved
    blocks only after the request finished, two steps late."""

    def __init__(
        self,
        store: _DictStore,
        layout: KVLayout,
        *,
        layerwise: bool = False,
        load_async: bool = False,
        fail_chunk: int | None = None,
        hold: bool = False,
    ) -> None:
        self.store, self.layout = store, layout
        self.layerwise, self.load_async, self.fail_chunk, self.hold = (
            layerwise, load_async, fail_chunk, hold,
        )  # fmt: skip
        self.meta: _DictMeta | None = None
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.errors: set[int] = set()
        self._async_loads: list[_Transfer] = []
        self._staged: dict[tuple[int, ...], LayerKV] = {}
        self._held: dict[str, list[_Transfer]] = {}
        self._finished_for: dict[str, int] = {}

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        assert isinstance(connector_metadata, _DictMeta)
        self.meta = connector_metadata

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert isinstance(forward_context, StandInForwardContext) and self.meta is not None
        # Like vLLM's ExampleConnector: the caches come from the forward context.
        self.kv_caches = {
            n: layer.kv_cache for n, layer in forward_context.no_compile_layers.items()
        }
        if self.load_async:
            self._async_loads += self.meta.loads
        elif not self.layerwise:
            for name in self.kv_caches:
                self._load(name, self.meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.layerwise and self.meta is not None:
            self._load(layer_name, self.meta.loads)

    def _load(self, name: str, loads: list[_Transfer]) -> None:
        for t in loads:
            if self.fail_chunk is not None and t.start == self.fail_chunk * CHUNK:
                self.errors |= {t.block_ids[p // BLOCK] for p in range(t.start, t.end)}
                continue
            keys, values = self.store.chunks[t.key][name]
            slots = slot_mapping(t.block_ids, t.start, t.end, BLOCK)
            scatter_kv(self.layout, self.kv_caches[name], slots, keys, values)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        assert self.meta is not None
        for t in self.meta.saves:
            if self.hold:
                self._held.setdefault(t.req_id, []).append(t)
                continue
            slots = slot_mapping(t.block_ids, t.start, t.end, BLOCK)
            self._staged.setdefault(t.key, {})[layer_name] = gather_kv(self.layout, kv_layer, slots)

    def wait_for_save(self) -> None:
        self.store.chunks.update(self._staged)
        self._staged = {}

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        recving = set()
        for t in self._async_loads:
            for name in self.kv_caches:
                self._load(name, [t])
            recving.add(t.req_id)
        self._async_loads = []
        sending = set()
        for req_id in finished_req_ids & set(self._held):
            self._finished_for[req_id] = 0
        for req_id in list(self._finished_for):
            self._finished_for[req_id] += 1
            if self._finished_for[req_id] < 3:
                continue
            # Only now read the blocks: they must still be the request's.
            for t in {t.key: t for t in self._held.pop(req_id)}.values():
                slots = slot_mapping(t.block_ids, t.start, t.end, BLOCK)
                self.store.chunks[t.key] = {
                    n: gather_kv(self.layout, kv, slots) for n, kv in self.kv_caches.items()
                }
            del self._finished_for[req_id]
            sending.add(req_id)
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self.errors = self.errors, set()
        return errors

    def clear_connector_metadata(self) -> None:
        self.meta = None


def test_call_order_per_step_is_vllms(model_seed0: Any) -> None:
    recorder = RecordingConnector()
    r = runner(model=model_seed0, connector=recorder)
    assert recorder.calls == [("register_kv_caches", "")]
    assert recorder.registered is r.kv_caches
    recorder.calls.clear()

    r.generate("req", prompt(8), 2)
    names = r.layer_names
    forward_step = [
        ("bind_connector_metadata", ""),
        ("start_load_kv", ""),
        *[("wait_for_layer_load", n) for n in names],
        *[("save_kv_layer", n) for n in names],
        ("wait_for_save", ""),
        ("get_transfer_results", ""),
        ("get_block_ids_with_load_errors", ""),
        ("build_connector_worker_meta", ""),
        ("clear_connector_metadata", ""),
    ]
    # No attention, no layer calls: vLLM's kv_connector_no_forward.
    empty_step = [c for c in forward_step if c[0] not in ("wait_for_layer_load", "save_kv_layer")]
    # Prefill, one decode step, then the step that reports the request finished.
    assert recorder.calls == forward_step + forward_step + empty_step


def test_save_kv_layer_sees_this_steps_kv_written(model_seed0: Any) -> None:
    seen: list[str] = []

    def on_save(layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        # Every slot this step computed already holds finite KV in this layer.
        keys, values = gather_kv(KVLayout.LBNHC, kv_layer, attn_metadata.slot_mapping)
        assert torch.isfinite(keys).all() and torch.isfinite(values).all()
        assert attn_metadata.num_actual_tokens == len(attn_metadata.slot_mapping)
        seen.append(layer_name)

    r = runner(model=model_seed0, connector=RecordingConnector(on_save=on_save))
    r.prefill("req", prompt(9), r.allocator.allocate(10), max_tokens_per_step=64)
    assert seen == r.layer_names * 3  # 150 tokens in steps of 64, 64, 22


@pytest.mark.parametrize("mode", ["sync", "layerwise", "async", "hold"], ids=lambda m: f"load-{m}")
def test_dict_connector_reuse_across_runners_is_exact(model_seed0: Any, mode: str) -> None:
    """Engine A saves through the connector, a separate engine B (own caches, own
    block ids, another layout) loads the prefix and computes only the suffix."""
    store = _DictStore()
    tokens = prompt(10)
    hold = mode == "hold"
    a = runner(KVLayout.LBNHC, model_seed0, connector=_DictWorker(store, KVLayout.LBNHC, hold=hold))
    a.generate("a", tokens, 4, hooks=_DictScheduler(store, hold=hold))
    assert len(store.chunks) == 4  # the 150-token prompt holds four 32-token chunks
    assert all(torch.isfinite(t).all() for kv in store.chunks.values() for t in iter_layers(kv))

    layout = KVLayout.SPLIT_HND
    recompute = runner(layout, model_seed0).generate("b", tokens, 16)
    worker = _DictWorker(store, layout, layerwise=mode == "layerwise", load_async=mode == "async")
    b = runner(layout, model_seed0, connector=worker, num_blocks=64)
    b.allocator.allocate(5)  # B's blocks for the request differ from A's
    loaded = b.generate("b", tokens, 16, hooks=_DictScheduler(store, load_async=mode == "async"))
    assert loaded.num_external_tokens == 128
    assert loaded.prefill_logits.shape[0] == PROMPT_LEN - 128
    assert loaded.tokens == recompute.tokens
    assert torch.equal(loaded.sampled_logits, recompute.sampled_logits)
    assert torch.equal(loaded.prefill_logits, recompute.prefill_logits[128:])
    assert all(
        torch.equal(x, y)
        for x, y in zip(iter_layers(loaded.kv), iter_layers(recompute.kv), strict=True)
    )


def test_load_error_recomputes_from_first_bad_block(model_seed0: Any) -> None:
    store = _DictStore()
    tokens = prompt(11)
    a = runner(model=model_seed0, connector=_DictWorker(store, KVLayout.LBNHC))
    a.generate("a", tokens, 1, hooks=_DictScheduler(store))
    recompute = runner(model=model_seed0).generate("b", tokens, 8)

    # Chunk 2 (tokens 64..95) "fails verification": its blocks stay poisoned.
    b = runner(model=model_seed0, connector=_DictWorker(store, KVLayout.LBNHC, fail_chunk=2))
    loaded = b.generate("b", tokens, 8, hooks=_DictScheduler(store))
    assert loaded.load_error_recomputes == 1
    assert loaded.num_external_tokens == 64  # chunks 0 and 1 are kept
    assert loaded.tokens == recompute.tokens
    assert torch.equal(loaded.sampled_logits, recompute.sampled_logits)


def test_released_blocks_are_poisoned(model_seed0: Any) -> None:
    # What makes the "hold" case above meaningful: had the runner freed the
    # blocks before the connector reported the save finished, the connector
    # would have copied poison, and B would have produced NaN.
    r = runner(model=model_seed0)
    gen = r.generate("req", prompt(12), 2)
    assert r.allocator.num_free == 128
    # The KV was there before the release (the snapshot), and is poison after.
    assert all(torch.isfinite(t).all() for t in iter_layers(gen.kv))
    after = r.read_kv(gen.block_ids, 0, PROMPT_LEN)
    assert all(torch.isnan(t).all() for t in iter_layers(after))
