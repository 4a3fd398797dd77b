"""End to end on a real transformers model with sliding-window attention.

A tiny Qwen2 (random weights, four layers alternating full and sliding-window
attention, window 48) computes the KV of a prompt; engine A (vLLM's real
scheduler and hybrid KV-cache manager, the CPU stand-in for its model runner,
``hybrid.HybridEngine``) holds it in vLLM's blocks of the two groups and
saves it through the connector to a real sidecar. Engine B loads the hit from
the store; the model then continues from B's blocks only (full-attention
layers: every position before the boundary; sliding-window layers: only the
window, nothing else was loaded) and its logits equal those of a full
recompute of the prompt.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

import torch
import transformers

from ..sidecar_proc import DevSidecar
from .engine import HEAD_DIM, NUM_KV_HEADS, make_request, make_vllm_config
from .hybrid import HYBRID_LAYERS, HybridEngine

pytestmark = pytest.mark.vllm

BS = 16
WINDOW = 48
N = 200
HIT = 192  # 12 whole chunks; vLLM computes the last 8 tokens itself


def tiny_qwen2() -> Any:
    cfg = transformers.Qwen2Config(
        vocab_size=1000,
        hidden_size=NUM_KV_HEADS * 2 * HEAD_DIM,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=1024,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=0,
        layer_types=["full_attention", "sliding_attention"] * 2,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg).eval()


class ModelKVEngine(HybridEngine):
    """The stand-in forward writes the model's own KV (captured from a full run)."""

    kv: ClassVar[dict[str, torch.Tensor]] = {}

    def expected(self, tokens: Sequence[int]) -> dict[str, torch.Tensor]:
        # Decoded positions past the prompt are never compared: zeros.
        pad = max(0, len(tokens) - N)
        return {
            name: torch.cat((kv, kv.new_zeros(pad, *kv.shape[1:])))[: len(tokens)]
            for name, kv in self.kv.items()
        }


@pytest.fixture
def model_and_kv() -> tuple[Any, list[int], torch.Tensor, dict[str, torch.Tensor]]:
    model = tiny_qwen2()
    tokens = [(31 * i + 5) % 997 for i in range(N)]
    with torch.no_grad():
        cache = transformers.DynamicCache()  # no config: every layer keeps every position
        out = model(torch.tensor([tokens]), past_key_values=cache, use_cache=True)
    kv = {}
    for name, layer in zip(HYBRID_LAYERS, cache.layers, strict=True):
        k, v = layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)  # [N, H, D]
        kv[name] = torch.cat((k, v), -1).contiguous()
    return model, tokens, out.logits[0], kv


@pytest.fixture
def engines(tiny_model: Path) -> Iterator[Any]:
    made: list[HybridEngine] = []

    def make(extra: dict[str, Any]) -> HybridEngine:
        cfg = make_vllm_config(tiny_model, extra, block_size=BS)
        cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
        e = ModelKVEngine(cfg, "sliding_window", window=WINDOW)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def continue_from(model: Any, tokens: list[int], past: list[torch.Tensor]) -> torch.Tensor:
    """The model's logits for tokens[HIT:] on top of ``past`` (one [HIT, H, K|V] per layer)."""
    data = [
        (p[..., :HEAD_DIM].transpose(0, 1)[None], p[..., HEAD_DIM:].transpose(0, 1)[None])
        for p in past
    ]
    cache = transformers.DynamicCache(ddp_cache_data=data)
    with torch.no_grad():
        out = model(
            torch.tensor([tokens[HIT:]]),
            past_key_values=cache,
            position_ids=torch.arange(HIT, len(tokens))[None],
            use_cache=True,
        )
    return out.logits[0]


def test_reused_sliding_window_kv_gives_the_full_recompute_logits(
    engines: Any, sidecar: DevSidecar, tenant: str, model_and_kv: Any
) -> None:
    model, tokens, full_logits, kv = model_and_kv
    ModelKVEngine.kv = kv
    extra = {
        "tenant": tenant,
        "socket_path": str(sidecar.socket_path),
        "chunk_tokens": BS,
        "staging_bytes": 1 << 20,
        "attention_backend": "FLASH_ATTN",
        "load_mode": "sync",
        "save_mode": "sync",
    }
    a = engines(extra)
    a.add(make_request("a", tokens, block_size=BS, max_tokens=2))
    a.run_until(lambda: not a.scheduler.requests)

    b = engines(extra)
    b.add(make_request("b", tokens, block_size=BS, max_tokens=2))
    b.run_until(lambda: bool(b.schedules("b")))
    assert b.schedules("b")[0] == (HIT, N - HIT)
    # What B's blocks hold, nothing else: the sliding-window layers' blocks
    # below the window are vLLM's null block, never loaded (zeros here).
    past = []
    for i, name in enumerate(HYBRID_LAYERS):
        group = i % 2
        ids = b.group_block_ids("b", group)
        rows = []
        for p in range(HIT):
            bid = ids[p // BS]
            if bid == 0:
                assert group == 1 and p < HIT - WINDOW + 1
                rows.append(torch.zeros(NUM_KV_HEADS, 2 * HEAD_DIM))
            else:
                rows.append(b.rank_caches[0][name][bid, :, p % BS, :].clone())
        past.append(torch.stack(rows))
    assert b.connector_total("chunks_loaded") == 12 + 3
    reused = continue_from(model, tokens, past)
    assert torch.allclose(reused, full_logits[HIT:], rtol=0, atol=1e-5), (
        (reused - full_logits[HIT:]).abs().max()
    )
    # The check has teeth: one wrong position inside the window changes them.
    past[1][HIT - 10] += 1.0
    assert not torch.allclose(continue_from(model, tokens, past), full_logits[HIT:], atol=1e-5)
    b.run_until(lambda: not b.scheduler.requests)
