"""A hybrid-model CPU engine: vLLM's real scheduler and hybrid KV-cache manager (HMA).

``HybridEngine`` is ``engine.Engine`` (the CPU stand-in for vLLM's model
runner, see there) with the model's layers split into KV-cache groups the
way vLLM's hybrid allocator splits a hybrid model: full-attention layers in
one group, sliding-window (or Mamba) layers in another, each group with a
block table of its own, planned by vLLM's own planner and allocated by its
own ``allocate_kv_cache``. The fake forward writes each layer's KV only into
the blocks vLLM allocated for that layer's group (a sliding-window group's
blocks outside the window are vLLM's null block), and a Mamba layer's state
page of every block that ends inside the step: a function of every token
before the block's end, so a state loaded for the wrong prefix is seen.

Importing this module imports vLLM (after ``pytest.importorskip("vllm")``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from .engine import HEAD_DIM, NUM_KV_HEADS, Engine, attention_term, kv_value

#: Four layers: the even ones full attention (group 0), the odd ones the other kind.
HYBRID_LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
FULL_LAYERS = HYBRID_LAYERS[0::2]
OTHER_LAYERS = HYBRID_LAYERS[1::2]
#: A Mamba page padded to the attention page (vLLM unifies page sizes).
MAMBA_SHAPES = ((4, 32), (8, 32))


def _attn_page(block_size: int) -> int:
    return 2 * block_size * NUM_KV_HEADS * HEAD_DIM * 4


def group_specs(kind: str, block_size: int, window: int) -> list[KVCacheGroupSpec]:
    full = FullAttentionSpec(
        block_size=block_size, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32
    )
    other: Any
    if kind == "sliding_window":
        other = SlidingWindowSpec(
            block_size=block_size,
            num_kv_heads=NUM_KV_HEADS,
            head_size=HEAD_DIM,
            dtype=torch.float32,
            sliding_window=window,
        )
    else:
        other = MambaSpec(
            block_size=block_size,
            shapes=MAMBA_SHAPES,
            dtypes=(torch.float32, torch.float32),
            page_size_padded=_attn_page(block_size),
            mamba_cache_mode="align",
        )
    return [KVCacheGroupSpec(list(FULL_LAYERS), full), KVCacheGroupSpec(list(OTHER_LAYERS), other)]


def state_value(layer: int, tokens: Sequence[int], nbytes: int) -> torch.Tensor:
    """The fake Mamba state after ``tokens`` (all of them, in order), as bytes."""
    t = torch.tensor(list(tokens), dtype=torch.float64)
    digest = float(torch.remainder((t * torch.arange(1, len(t) + 1)).sum(), 997.0))
    n = nbytes // 4
    vals = ((torch.arange(n, dtype=torch.float64) * 3 + digest * 7 + layer * 11) % 251) / 8
    return vals.to(torch.float32).view(torch.uint8)


class HybridEngine(Engine):
    """``Engine`` over a hybrid model: ``kind`` is ``sliding_window`` or ``mamba``."""

    def __init__(
        self, vllm_config: VllmConfig, kind: str, window: int = 48, num_blocks: int = 256
    ) -> None:
        self.kind = kind
        self.window = window
        super().__init__(vllm_config, num_blocks=num_blocks)
        self._place = {
            name: (t.offset + i * t.layer_stride, t.block_stride)
            for t in self.kv_cache_config.kv_cache_tensors
            for i, name in enumerate(t.layers)
        }
        self.state_bytes = sum(
            int(torch.tensor(s).prod()) * 4 for s in MAMBA_SHAPES
        )  # real (unpadded) page

    def plan_kv_cache(self, vllm_config: VllmConfig, num_blocks: int) -> KVCacheConfig:
        cc = vllm_config.cache_config
        cc.num_gpu_blocks_override = num_blocks
        kvc = get_kv_cache_config_from_groups(
            vllm_config, group_specs(self.kind, cc.block_size, self.window), 1 << 40
        )
        cc.num_gpu_blocks = kvc.num_blocks
        return kvc

    def group_block_ids(self, req_id: str, group: int) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[group])

    # -- the fake forward, per group ------------------------------------------------

    def _forward(self, so: Any) -> dict[str, list[int]]:
        starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        sampled: dict[str, list[int]] = {}
        from .engine import sample_token

        for req_id, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            start, end = starts[req_id], starts[req_id] + n
            known = list(req.all_token_ids)
            mine = self._sampled.setdefault(req_id, {})
            history = [known[p] if p < len(known) else mine[p] for p in range(end)]
            self._write(req_id, start, end, history)
            if end >= req.num_tokens:
                mine[end] = sample_token(end)
                sampled[req_id] = [mine[end]]
            else:
                sampled[req_id] = []
        return sampled

    def _write(self, req_id: str, start: int, end: int, history: list[int]) -> None:
        for w in self.workers:
            for name in HYBRID_LAYERS:
                w.wait_for_layer_load(name)
        bs = self.block_size
        full = self.group_block_ids(req_id, 0)
        other = self.group_block_ids(req_id, 1)
        caches = self.rank_caches[0]
        # Layer 0 first: the later layers depend on what its cache holds.
        expected = self.expected(history)
        for p in range(start, end):
            b, o = full[p // bs], p % bs
            for name in FULL_LAYERS:
                caches[name][b, :, o, :] = expected[name][p]
            if self.kind == "sliding_window":
                b2 = other[p // bs]
                if b2 != 0:
                    for name in OTHER_LAYERS:
                        caches[name][b2, :, o, :] = expected[name][p]
        if self.kind == "mamba":
            for blk in range(start // bs, end // bs):
                bid = other[blk] if blk < len(other) else 0
                if bid == 0:
                    continue
                for j, name in enumerate(OTHER_LAYERS):
                    self.state_page(name, bid).copy_(
                        state_value(2 * j + 1, history[: (blk + 1) * bs], self.state_bytes)
                    )

    def state_page(self, name: str, block: int) -> torch.Tensor:
        off, stride = self._place[name]
        t = self.rank_caches[0][name]
        storage = t.untyped_storage()
        raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
        at = off + block * stride
        return raw[at : at + self.state_bytes]

    def expected(self, tokens: Sequence[int]) -> dict[str, torch.Tensor]:
        """Every attention layer's KV of a clean forward over ``tokens``: ``[n, heads, K|V]``."""
        positions = torch.arange(len(tokens))
        t = torch.tensor(list(tokens))
        heads = torch.arange(NUM_KV_HEADS)
        layer0 = kv_value(0, positions, t, heads, torch.float32)
        digest = layer0[:, 0, 0].double()
        term = attention_term(digest).view(-1, 1, 1)
        out = {HYBRID_LAYERS[0]: layer0}
        names = HYBRID_LAYERS if self.kind == "sliding_window" else FULL_LAYERS
        for i, name in enumerate(names):
            if i == 0:
                continue
            layer = HYBRID_LAYERS.index(name)
            out[name] = (kv_value(layer, positions, t, heads, torch.float32).double() + term).to(
                torch.float32
            )
        return out

    def read(self, req_id: str, group: int, name: str, positions: Sequence[int]) -> torch.Tensor:
        ids = self.group_block_ids(req_id, group)
        bs = self.block_size
        return torch.stack(
            [self.rank_caches[0][name][ids[p // bs], :, p % bs, :].clone() for p in positions]
        )
