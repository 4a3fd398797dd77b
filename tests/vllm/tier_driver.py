"""Drive vLLM's real ``TieringOffloadingSpec`` and ``TieringOffloadingManager`` on CPU.

The scheduler side is vLLM's own code throughout (spec, manager, CPU primary
tier on a real ``SharedOffloadRegion`` in /dev/shm, the secondary tiers). Only
the GPU side is a stand-in, named :func:`gpu_stand_in_write`: where vLLM's
worker would copy GPU blocks into the primary tier's slots, it writes known
bytes into them.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

TIER_MODULE = "kvoffload.integrations.vllm.tier"
#: One chunk: 2 blocks of 16 tokens, 64 KiB per block per worker.
BLOCK_BYTES = 64 << 10
BLOCKS_PER_CHUNK = 2


def kvoffload_tier(socket_path: str, tenant: str, **extra: Any) -> dict[str, Any]:
    return {
        "type": "KVOffloadTier",
        "module_path": TIER_MODULE,
        "tenant": tenant,
        "socket_path": socket_path,
        "model_revision": "tiny-test@1",
        "tokenizer_hash": "tok-test",
        "timeout_s": 2.0,
        "staging_bytes": 4 << 20,
        **extra,
    }


def make_spec(
    tiers: Sequence[dict[str, Any]],
    *,
    num_chunks: int = 4,
    world_size: int = 1,
    events: bool = False,
    block_bytes: int = BLOCK_BYTES,
) -> TieringOffloadingSpec:
    """A ``TieringOffloadingSpec`` as vLLM's OffloadingConnector makes one."""
    chunk = block_bytes * BLOCKS_PER_CHUNK * world_size
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("model.layers.0.attn", "model.layers.1.attn"), 0),),
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=events,
        extra_config={
            "cpu_bytes_to_use": chunk * num_chunks,
            "secondary_tiers": [dict(t) for t in tiers],
            "tier_poll_interval_s": 0,
        },
        engine_id=f"kvo-tier-test-{uuid.uuid4().hex[:10]}",
        model=OffloadingModelConfig(name="tiny-test", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=BLOCKS_PER_CHUNK),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )
    return TieringOffloadingSpec(config)


def offload_keys(seed: str, n: int, group: int = 0) -> list[OffloadKey]:
    """Chained block hashes as vLLM makes them (sha256 of the parent and the chunk)."""
    keys: list[OffloadKey] = []
    parent = hashlib.sha256(seed.encode()).digest()
    for i in range(n):
        parent = hashlib.sha256(parent + i.to_bytes(4, "little")).digest()
        keys.append(make_offload_key(parent, group))
    return keys


def rows_of(mgr: TieringOffloadingManager) -> np.ndarray:
    """The primary tier's region as (num_chunks, row_bytes) uint8, no copy."""
    return np.asarray(mgr.primary_tier.get_kv_memoryview()).view(np.uint8)


def chunk_bytes(seed: str, i: int, size: int) -> np.ndarray:
    return np.frombuffer(hashlib.shake_256(f"{seed}/{i}".encode()).digest(size), np.uint8)


def gpu_stand_in_write(mgr: TieringOffloadingManager, chunk_ids: Sequence[int], seed: str) -> None:
    """STAND-IN for vLLM's GPU→CPU copy (no GPU here): known bytes into the slots."""
    rows = rows_of(mgr)
    for i, c in enumerate(chunk_ids):
        rows[int(c)] = chunk_bytes(seed, i, rows.shape[1])


def step(mgr: TieringOffloadingManager) -> None:
    """The end of one scheduler step, as vLLM's scheduler connector ends it."""
    with mgr.lock:
        mgr.on_schedule_end(ScheduleEndContext((), ()))


def run_until(
    mgr: TieringOffloadingManager, cond: Callable[[], bool], what: str, limit_s: float = 60.0
) -> None:
    """Step the manager until ``cond`` holds (a bound against a hang, not a timing check)."""
    deadline = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {limit_s:g} s: {what}")
        step(mgr)
        time.sleep(0.01)


def store(
    mgr: TieringOffloadingManager, req: str, keys: Sequence[OffloadKey], seed: str
) -> list[int]:
    """One request stores ``keys``: GPU stand-in → primary tier → cascade to the tiers;
    stepped until every cascade job finished. Returns the primary slots used."""
    ctx = ReqContext(req)
    with mgr.lock:
        mgr.on_new_request(ctx)
        out = mgr.prepare_store(list(keys), ctx)
    assert out is not None, "primary tier refused the store"
    spec = out.store_spec
    assert isinstance(spec, CPULoadStoreSpec)
    ids = [int(c) for c in spec.chunk_ids]
    gpu_stand_in_write(mgr, ids, seed)
    with mgr.lock:
        mgr.complete_store(list(keys), ctx)
        mgr.on_request_finished(ctx)
    run_until(mgr, lambda: not mgr.has_pending_work(), "cascade jobs finished")
    return ids


def lookup_all(
    mgr: TieringOffloadingManager, ctx: ReqContext, keys: Sequence[OffloadKey]
) -> list[LookupResult]:
    with mgr.lock:
        return [mgr.lookup(k, ctx) for k in keys]


def resolve(
    mgr: TieringOffloadingManager, ctx: ReqContext, keys: Sequence[OffloadKey]
) -> list[LookupResult]:
    """Look ``keys`` up step after step, as the scheduler retries, until each is HIT or MISS."""
    final: dict[int, LookupResult] = {}

    def settled() -> bool:
        for i, r in enumerate(lookup_all(mgr, ctx, keys)):
            if r in (LookupResult.HIT, LookupResult.MISS):
                final.setdefault(i, r)
        return len(final) == len(keys)

    run_until(mgr, settled, "lookups resolved")
    return [final[i] for i in range(len(keys))]


def primary_rows(
    mgr: TieringOffloadingManager, ctx: ReqContext, keys: Sequence[OffloadKey]
) -> np.ndarray:
    """The primary slots of ``keys`` (HIT) as the GPU side would read them."""
    with mgr.lock:
        spec = mgr.prepare_load(list(keys), ctx)
    assert isinstance(spec, CPULoadStoreSpec)
    rows = rows_of(mgr)[[int(c) for c in spec.chunk_ids]].copy()
    with mgr.lock:
        mgr.complete_load(list(keys), ctx)
    return rows


def evict_primary(mgr: TieringOffloadingManager, num_chunks: int, seed: str = "evict") -> None:
    """Fill the primary tier with other chunks so LRU evicts everything before them."""
    store(
        mgr,
        f"evict-{uuid.uuid4().hex[:6]}",
        offload_keys(seed + uuid.uuid4().hex, num_chunks),
        seed,
    )


def tier(mgr: TieringOffloadingManager, i: int = 0) -> Any:
    return mgr.secondary_tiers[i]
