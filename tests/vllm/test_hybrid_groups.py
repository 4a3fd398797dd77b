"""Hybrid models (vLLM's hybrid KV-cache manager) through the connector.

vLLM 0.33's real scheduler with its ``HybridKVCacheCoordinator`` (one
full-attention group, one sliding-window or Mamba group), the workers'
connector over real CPU caches allocated by vLLM (the CPU stand-in for the
model runner, ``hybrid.HybridEngine``), and a real sidecar. Before this
change the connector refused every model with more than one KV-cache group,
so each of these engines failed to start.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

import torch

from kvoffload.integrations.vllm.connector import KVOffloadConnector

from ..sidecar_proc import DevSidecar
from .engine import make_request, make_vllm_config
from .hybrid import FULL_LAYERS, OTHER_LAYERS, HybridEngine, state_value

pytestmark = pytest.mark.vllm

BS = 16
WINDOW = 48  # tokens: a hit needs ceil(47 / 16) = 3 chunks before its boundary


def settings(sidecar: DevSidecar, tenant: str, **over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "tenant": tenant,
        "socket_path": str(sidecar.socket_path),
        "chunk_tokens": BS,
        "staging_bytes": 1 << 20,
        "attention_backend": "FLASH_ATTN",
        "load_mode": "sync",
        "save_mode": "sync",
    }
    base.update(over)
    return base


@pytest.fixture
def engines(tiny_model: Path) -> Iterator[Any]:
    made: list[HybridEngine] = []

    def make(kind: str, extra: dict[str, Any], window: int = WINDOW) -> HybridEngine:
        cfg = make_vllm_config(tiny_model, extra, block_size=BS)
        # What vLLM decides for a hybrid model with an HMA connector.
        cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
        if kind == "mamba":
            cfg.cache_config.mamba_cache_mode = "align"
        e = HybridEngine(cfg, kind, window=window)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + 31 * i + 5) % 997 for i in range(n)]


def first_schedule(e: HybridEngine, rid: str, tokens: list[int]) -> tuple[int, int]:
    """Run a request until its first step and return (first position, tokens) of it."""
    e.add(make_request(rid, tokens, block_size=BS, max_tokens=2))
    e.run_until(lambda: bool(e.schedules(rid)))
    return e.schedules(rid)[0]


def finish(e: HybridEngine) -> None:
    e.run_until(lambda: not e.scheduler.requests)


def test_the_connector_declares_hma() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    assert supports_hma(KVOffloadConnector)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sliding_window_hit_loads_only_the_window(
    engines: Any, sidecar: DevSidecar, tenant: str, mode: str
) -> None:
    tokens = prompt_of(200)
    a = engines("sliding_window", settings(sidecar, tenant, save_mode=mode))
    a.add(make_request("a", tokens, block_size=BS, max_tokens=2))
    finish(a)
    # The full-attention group stored all 12 whole chunks; the sliding-window
    # group only what vLLM still held once the prompt was processed: its window.
    b = engines("sliding_window", settings(sidecar, tenant, load_mode=mode))
    start = first_schedule(b, "b", tokens)
    assert start == (192, 8)  # 12 chunks from the store, vLLM computes the rest
    full_ids = b.group_block_ids("b", 0)
    sw_ids = b.group_block_ids("b", 1)
    want = b.expected(tokens)
    for name in FULL_LAYERS:
        assert torch.equal(b.read("b", 0, name, range(192)), want[name][:192])
    # Only the window before the boundary is allocated (and loaded) in the
    # sliding-window group: vLLM holds null blocks below it.
    kept = [i for i, bid in enumerate(sw_ids[:12]) if bid != 0]
    assert kept == [9, 10, 11]
    for name in OTHER_LAYERS:
        assert torch.equal(b.read("b", 1, name, range(144, 192)), want[name][144:192])
    assert len([x for x in full_ids[:12] if x != 0]) == 12
    finish(b)
    assert b.connector_total("chunks_loaded") == 12 + 3
    assert b.connector_total("chunks_load_failed") == 0


def test_a_window_gone_is_a_miss(engines: Any, sidecar: DevSidecar, tenant: str) -> None:
    """The full-attention prefix is there, the window before its boundary is not."""
    tokens = prompt_of(200)
    a = engines("sliding_window", settings(sidecar, tenant))
    a.add(make_request("a", tokens, block_size=BS, max_tokens=2))
    finish(a)
    # Same first 100 tokens: the full group holds 6 chunks of them, but the
    # sliding-window group's chunks 3..5 were freed by vLLM before they could
    # be saved (only the prompt's last window was): no boundary serves both.
    other = tokens[:100] + prompt_of(100, seed=5)
    b = engines("sliding_window", settings(sidecar, tenant))
    assert first_schedule(b, "b", other)[0] == 0
    finish(b)
    assert b.connector_total("chunks_loaded") == 0


def test_a_missing_pool_is_a_miss(engines: Any, sidecar: DevSidecar, tenant: str) -> None:
    """Another window: the sliding-window pool is another namespace, so it is absent,
    and the full-attention chunks alone are never loaded."""
    tokens = prompt_of(200)
    a = engines("sliding_window", settings(sidecar, tenant))
    a.add(make_request("a", tokens, block_size=BS, max_tokens=2))
    finish(a)
    b = engines("sliding_window", settings(sidecar, tenant), window=64)
    assert first_schedule(b, "b", tokens)[0] == 0
    finish(b)
    assert b.connector_total("chunks_loaded") == 0
    # The same engine as the first one does hit (the store is there).
    c = engines("sliding_window", settings(sidecar, tenant))
    assert first_schedule(c, "c", tokens)[0] == 192


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_mamba_state_at_the_boundary(
    engines: Any, sidecar: DevSidecar, tenant: str, mode: str
) -> None:
    tokens = prompt_of(200)
    a = engines("mamba", settings(sidecar, tenant, save_mode=mode))
    a.add(make_request("a", tokens, block_size=BS, max_tokens=2))
    finish(a)
    b = engines("mamba", settings(sidecar, tenant, load_mode=mode))
    assert first_schedule(b, "b", tokens) == (192, 8)
    want = b.expected(tokens)
    for name in FULL_LAYERS:
        assert torch.equal(b.read("b", 0, name, range(192)), want[name][:192])
    state_ids = b.group_block_ids("b", 1)
    boundary_block = state_ids[11]
    assert boundary_block != 0
    for j, name in enumerate(OTHER_LAYERS):
        expect = state_value(2 * j + 1, tokens[:192], b.state_bytes)
        assert torch.equal(b.state_page(name, boundary_block), expect)
    finish(b)
    # Every full-attention chunk, and one state.
    assert b.connector_total("chunks_loaded") == 12 + 1


def test_mamba_without_the_state_is_a_miss(engines: Any, sidecar: DevSidecar, tenant: str) -> None:
    """The full prefix of 6 chunks is there; no state was kept at any boundary up to it."""
    tokens = prompt_of(200)
    a = engines("mamba", settings(sidecar, tenant))
    a.add(make_request("a", tokens, block_size=BS, max_tokens=2))
    finish(a)
    other = tokens[:100] + prompt_of(100, seed=5)
    b = engines("mamba", settings(sidecar, tenant))
    assert first_schedule(b, "b", other)[0] == 0
    finish(b)
    assert b.connector_total("chunks_loaded") == 0
