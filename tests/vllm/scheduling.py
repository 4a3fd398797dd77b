"""Helpers shared by the tests (moved out of test_scheduler_real.py)."""

from __future__ import annotations

from typing import Any

import torch

from kvoffload.client import SidecarClient
from kvoffload.keys import chunk_keys
from tests.sidecar_proc import DevSidecar
from tests.vllm.engine import Engine

CT = 32  # chunk_tokens: two 16-token blocks


def settings(sidecar: DevSidecar, tenant: str, **over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "tenant": tenant,
        "socket_path": str(sidecar.socket_path),
        "chunk_tokens": CT,
        "staging_bytes": 1 << 20,
        # vLLM has no platform here to select a backend from.
        "attention_backend": "FLASH_ATTN",
        "load_mode": "sync",
        "save_mode": "async",
    }
    base.update(over)
    return base


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + 31 * i + 5) % 997 for i in range(n)]


def stored_chunks(
    engine: Engine, sidecar: DevSidecar, tenant: str, tokens: list[int], shard: int = 0
) -> int:
    """Leading chunks of ``tokens`` the sidecar holds for a shard, keys derived
    independently of the connector (library ``chunk_keys`` over the engine's contract)."""
    with SidecarClient(sidecar.socket_path, tenant, staging_bytes=4096) as c:
        salt = c.salt
        assert salt is not None
        contract = engine.connector.contracts.contract(None, shard)
        return c.lookup(chunk_keys(contract, salt, tokens))


def assert_kv(engine: Engine, req_id: str, tokens: list[int], upto: int, rank: int = 0) -> None:
    got = engine.read_kv(engine.block_ids(req_id), torch.arange(upto), rank)
    want = engine.expected_kv(tokens[:upto], rank)
    for layer, (g, w) in enumerate(zip(got, want, strict=True)):
        bad = (g != w).any(-1).any(-1).nonzero().flatten().tolist()
        assert not bad, f"rank {rank} layer {layer}: wrong KV at positions {bad[:10]}…"


def rewound_to(steps: list[tuple[int, int]], start: int, upto: int) -> bool:
    """Whether a later step recomputed from ``start`` through at least ``upto``.

    With async scheduling a decode step may already be in flight when a sync
    load's failure comes back; vLLM drops its output and the recompute then
    also covers the token(s) sampled meanwhile.
    """
    return any(s == start and s + n >= upto for s, n in steps)
