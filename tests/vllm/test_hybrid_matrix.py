"""The compatibility matrix over group layouts: change one group, and engine B must miss.

Engine A (vLLM's real scheduler and hybrid KV-cache manager, the CPU stand-in
for its model runner, ``hybrid.HybridEngine``) stores a 200-token prompt
through the connector to a real sidecar. Engine B runs the same prompt with
one thing of its KV-cache groups changed. Each change is one a hit could be
served across if the store named chunks by tokens and layers alone: B's
lookup rule finds, for its own groups, every chunk it would need among what A
stored (a 32-token window needs two chunks before the boundary, A kept
three; a Mamba group needs one page at the boundary, A kept three there).
KV of a model whose window or layer kind differs is another model's KV: B
must be offered nothing, and vLLM's own count of external tokens is 0.

================  ==============================================================
change            A → B
================  ==============================================================
window            sliding window 48 → 32 tokens
kind              sliding-window group → Mamba group (align mode)
kind, reversed    Mamba group → sliding-window group
================  ==============================================================

The same engine as A is the control: it hits 192 tokens, so each miss is the
contract's doing and not an empty store.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from ..sidecar_proc import DevSidecar
from .engine import make_request, make_vllm_config
from .hybrid import HybridEngine

pytestmark = pytest.mark.vllm

BS = 16
N = 200
HIT = 192


@pytest.fixture
def engines(tiny_model: Path, sidecar: DevSidecar, tenant: str) -> Iterator[Any]:
    made: list[HybridEngine] = []

    def make(kind: str, window: int = 48) -> HybridEngine:
        extra = {
            "tenant": tenant,
            "socket_path": str(sidecar.socket_path),
            "chunk_tokens": BS,
            "staging_bytes": 1 << 20,
            "attention_backend": "FLASH_ATTN",
            "load_mode": "sync",
            "save_mode": "sync",
        }
        cfg = make_vllm_config(tiny_model, extra, block_size=BS)
        cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
        if kind == "mamba":
            cfg.cache_config.mamba_cache_mode = "align"
        e = HybridEngine(cfg, kind, window=window)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


TOKENS = [(31 * i + 5) % 997 for i in range(N)]


def first_schedule(e: HybridEngine, rid: str) -> tuple[int, int]:
    e.add(make_request(rid, TOKENS, block_size=BS, max_tokens=2))
    e.run_until(lambda: bool(e.schedules(rid)))
    start = e.schedules(rid)[0]
    e.run_until(lambda: not e.scheduler.requests)
    return start


def group_fields(e: HybridEngine, group: int) -> dict[str, Any]:
    g = e.connector.contracts.contract(None, 0, group).kv_group
    assert g is not None
    return {
        "kind": g.kind,
        "layers": g.layers,
        "sliding_window": g.sliding_window,
        "mamba_cache_mode": g.mamba_cache_mode,
    }


@pytest.mark.parametrize(
    ("a_kind", "a_window", "b_kind", "b_window", "changed"),
    [
        ("sliding_window", 48, "sliding_window", 32, {"sliding_window"}),
        ("sliding_window", 48, "mamba", 48, {"kind", "sliding_window", "mamba_cache_mode"}),
        ("mamba", 48, "sliding_window", 48, {"kind", "sliding_window", "mamba_cache_mode"}),
    ],
    ids=["window", "kind", "kind-reversed"],
)
def test_another_group_layout_misses(
    engines: Any, a_kind: str, a_window: int, b_kind: str, b_window: int, changed: set[str]
) -> None:
    a = engines(a_kind, a_window)
    assert first_schedule(a, "a")[0] == 0
    # The control: an engine like A hits what A stored.
    same = engines(a_kind, a_window)
    assert first_schedule(same, "same")[0] == HIT
    assert same.connector_total("chunks_loaded") > 0

    b = engines(b_kind, b_window)
    # Only the changed group's contract differs, in exactly the fields changed.
    assert group_fields(b, 0) == group_fields(a, 0)
    fa, fb = group_fields(a, 1), group_fields(b, 1)
    assert {k for k in fa if fa[k] != fb[k]} == changed
    # Offered nothing: vLLM computes the whole prompt (a Mamba engine in align
    # mode splits it at a block boundary), nothing is loaded.
    assert first_schedule(b, "b")[0] == 0
    assert b.connector_total("chunks_loaded") == 0
    assert b.connector_total("chunks_load_failed") == 0
