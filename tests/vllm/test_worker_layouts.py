"""The worker's gather/scatter over KV caches allocated by vLLM itself, in every layout.

vLLM 0.33 allocates one backing buffer and hands each layer a logical
``[block, head, token, K|V]`` view whose strides are the resolved
``KVCacheLayout``. These tests allocate exactly that (``allocate_kv_cache``
with the planner's ``KVCacheConfig``), and check that a chunk gathered from
any layout is the documented packed object, and scatters back bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

import torch
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvoffload.client import as_byte_view
from kvoffload.integrations.vllm.common import (
    ChunkRef,
    KVOffloadConfigError,
    KVSpec,
    attention_spec,
)
from kvoffload.integrations.vllm.paged import PagedCache, _BadChunk, build_paged_cache

from .engine import HEAD_DIM, LAYER_NAMES, NUM_KV_HEADS, make_kv_cache_config, make_vllm_config

pytestmark = pytest.mark.vllm

BS = 16
CT = 32
NUM_BLOCKS = 24
LAYOUTS = [layout.name for layout in KVCacheLayout]


def allocate(
    tiny_model: Path, layout: str, kernel_block: int | None = None, dtype: str = "float32"
) -> tuple[dict[str, torch.Tensor], KVSpec]:
    cfg = make_vllm_config(
        tiny_model,
        {"tenant": "acme", "attention_backend": "FLASH_ATTN", "chunk_tokens": CT},
        layout=layout,
        dtype=dtype,
    )
    kvc = make_kv_cache_config(cfg, NUM_BLOCKS)
    caches = allocate_kv_cache(
        kvc,
        torch.device("cpu"),
        KVCacheLayout[layout],
        kernel_block_sizes=None if kernel_block is None else [kernel_block],
    )
    gen = torch.Generator().manual_seed(0)
    for t in caches.values():
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return caches, attention_spec(kvc)


def token_kv(caches: dict[str, torch.Tensor], name: str, block: int, tok: int) -> torch.Tensor:
    """``[heads, K|V]`` of one token, by plain indexing of vLLM's logical view."""
    t = caches[name]
    ratio = t.shape[0] // NUM_BLOCKS
    kb = BS // ratio  # tokens per kernel block
    return t[block * ratio + tok // kb, :, tok % kb, :]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_is_k_then_v_token_major(tiny_model: Path, layout: str) -> None:
    caches, spec = allocate(tiny_model, layout)
    cache = build_paged_cache(caches, spec, NUM_BLOCKS)
    blocks = [5, 9, 2, 7]  # two chunks of two blocks, deliberately out of order
    packed = cache.gather(blocks, 2)
    assert len(packed) == len(LAYER_NAMES)
    for layer, name in enumerate(LAYER_NAMES):
        for c in range(2):
            toks = [token_kv(caches, name, blocks[2 * c + t // BS], t % BS) for t in range(CT)]
            kv = torch.stack(toks)  # [tokens, heads, K|V]
            want = torch.cat((kv[..., :HEAD_DIM].flatten(), kv[..., HEAD_DIM:].flatten()))
            assert packed[layer].shape == (2, cache.layer_nbytes(CT) // 4)
            assert torch.equal(packed[layer][c], want)


def test_layouts_really_differ(tiny_model: Path) -> None:
    strides = {
        layout: tuple(allocate(tiny_model, layout)[0][LAYER_NAMES[0]].stride())
        for layout in LAYOUTS
    }
    assert len(set(strides.values())) == len(LAYOUTS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scatter_round_trip_and_partial_chunk(tiny_model: Path, layout: str) -> None:
    caches, spec = allocate(tiny_model, layout)
    cache = build_paged_cache(caches, spec, NUM_BLOCKS)
    (p0, p1) = (cache.gather([5, 9], 1)[i][0] for i in range(len(LAYER_NAMES)))
    layers = [as_byte_view(p0), as_byte_view(p1)]
    before = {n: t.clone() for n, t in caches.items()}
    cache.scatter(ChunkRef(0, (b"k",), (11, 12)), CT, layers)
    # Only the second block of the chunk: the first is vLLM's local prefix hit.
    cache.scatter(ChunkRef(0, (b"k",), (13,), first_block=1), CT, layers)
    for name in LAYER_NAMES:
        t, old = caches[name], before[name]
        assert torch.equal(t[11], old[5]) and torch.equal(t[12], old[9])
        assert torch.equal(t[13], old[9])
        untouched = [b for b in range(NUM_BLOCKS) if b not in (11, 12, 13)]
        assert torch.equal(t[untouched], old[untouched])


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_kernel_blocks_smaller_than_vllm_blocks(tiny_model: Path, layout: str) -> None:
    """A backend with 8-token kernel blocks: vLLM's views count kernel blocks."""
    caches, spec = allocate(tiny_model, layout, kernel_block=8)
    assert caches[LAYER_NAMES[0]].shape[0] == 2 * NUM_BLOCKS
    cache = build_paged_cache(caches, spec, NUM_BLOCKS)
    assert cache.ratio == 2
    packed = cache.gather([3, 4], 1)
    kv = torch.stack([token_kv(caches, LAYER_NAMES[1], [3, 4][t // BS], t % BS) for t in range(CT)])
    assert torch.equal(
        packed[1][0], torch.cat((kv[..., :HEAD_DIM].flatten(), kv[..., HEAD_DIM:].flatten()))
    )
    cache.scatter(ChunkRef(0, (b"k",), (20, 21)), CT, [as_byte_view(p[0]) for p in packed])
    for name in LAYER_NAMES:
        for t in range(CT):
            assert torch.equal(
                token_kv(caches, name, [20, 21][t // BS], t % BS),
                token_kv(caches, name, [3, 4][t // BS], t % BS),
            )


def test_bfloat16_bytes_travel_unchanged(tiny_model: Path) -> None:
    caches, spec = allocate(tiny_model, "LBHNC", dtype="bfloat16")
    cache = build_paged_cache(caches, spec, NUM_BLOCKS)
    assert cache.layer_nbytes(CT) == CT * NUM_KV_HEADS * 2 * HEAD_DIM * 2
    packed = cache.gather([1, 2], 1)
    cache.scatter(ChunkRef(0, (b"k",), (3, 4)), CT, [as_byte_view(p[0]) for p in packed])
    for name in LAYER_NAMES:
        assert torch.equal(caches[name][3:5], caches[name][1:3])


def test_a_chunk_of_the_wrong_shape_is_refused(tiny_model: Path) -> None:
    caches, spec = allocate(tiny_model, "LBNHC")
    cache: PagedCache = build_paged_cache(caches, spec, NUM_BLOCKS)
    good = [as_byte_view(p[0]) for p in cache.gather([1, 2], 1)]
    with pytest.raises(_BadChunk, match="layers"):
        cache.scatter(ChunkRef(0, (b"k",), (3, 4)), CT, good[:1])
    with pytest.raises(_BadChunk, match="bytes"):
        cache.scatter(ChunkRef(0, (b"k",), (3, 4)), CT, [good[0], good[1][:-4]])


def test_unsupported_tensors_are_refused(tiny_model: Path) -> None:
    caches, spec = allocate(tiny_model, "LBNHC")
    legacy = {n: torch.zeros(2, NUM_BLOCKS, BS, NUM_KV_HEADS, HEAD_DIM) for n in LAYER_NAMES}
    with pytest.raises(KVOffloadConfigError, match=r"shape \(2, 24, 16, 2, 16\)"):
        build_paged_cache(legacy, spec, NUM_BLOCKS)
    wrong_dtype = {n: t.to(torch.float16) for n, t in caches.items()}
    with pytest.raises(KVOffloadConfigError, match="dtype"):
        build_paged_cache(wrong_dtype, spec, NUM_BLOCKS)
    with pytest.raises(KVOffloadConfigError, match="lacks layers"):
        build_paged_cache({LAYER_NAMES[0]: caches[LAYER_NAMES[0]]}, spec, NUM_BLOCKS)
    with pytest.raises(KVOffloadConfigError, match="do not split"):
        build_paged_cache(caches, spec, NUM_BLOCKS + 1)


def test_layers_sharing_one_cache_are_stored_once(tiny_model: Path) -> None:
    caches, spec = allocate(tiny_model, "LBNHC")
    shared = {**caches, "model.layers.2.self_attn.attn": caches[LAYER_NAMES[0]]}
    spec3 = KVSpec(
        spec.block_size,
        spec.num_kv_heads,
        spec.head_dim,
        spec.dtype,
        (*spec.layer_names, "model.layers.2.self_attn.attn"),
    )
    cache = build_paged_cache(shared, spec3, NUM_BLOCKS)
    assert cache.layer_names == tuple(LAYER_NAMES)
