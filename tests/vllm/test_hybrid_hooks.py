"""Hybrid models: vLLM's hit rule at chunk granularity, KV events per group,
sleep mode and cache reset.

The rule (``groups.hit_boundary``) is checked against stores given as sets of
(group, chunk); the rest on vLLM's real scheduler with the CPU stand-in
runner (``hybrid.HybridEngine``) and a real sidecar.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import BlockStored

from kvoffload.integrations.vllm.groups import FULL, MAMBA, SLIDING, GroupSpec, hit_boundary

from ..sidecar_proc import DevSidecar
from .engine import make_request, make_vllm_config
from .hybrid import HybridEngine

pytestmark = pytest.mark.vllm

CT = 16


def _store(held: set[tuple[int, int]]) -> Any:
    calls: list[tuple[int, int, int]] = []

    def present(group: int, lo: int, hi: int) -> int:
        calls.append((group, lo, hi))
        n = 0
        while lo + n < hi and (group, lo + n) in held:
            n += 1
        return n

    present.calls = calls  # type: ignore[attr-defined]
    return present


FULL_G = GroupSpec(0, FULL, CT, ("a",))
SW_G = GroupSpec(1, SLIDING, CT, ("b",), sliding_window=48)  # 3 chunks
SW_SMALL = GroupSpec(2, SLIDING, CT, ("c",), sliding_window=17)  # ceil(16 / 16) = 1 chunk
MAMBA_G = GroupSpec(1, MAMBA, CT, ("m",), mamba_cache_mode="align")


def test_full_attention_is_a_prefix() -> None:
    held = {(0, c) for c in range(10) if c != 6}
    assert hit_boundary([FULL_G], CT, 10, 0, _store(held)) == 6


def test_sliding_window_needs_only_the_window_before_the_boundary() -> None:
    held = {(0, c) for c in range(10)} | {(1, c) for c in (7, 8, 9)}
    assert hit_boundary([FULL_G, SW_G], CT, 10, 0, _store(held)) == 10


def test_a_gap_in_the_window_moves_the_boundary_left_until_it_converges() -> None:
    # Window [7, 10) lacks 8; [5, 8) lacks 7 ... the run 2, 3, 4 serves boundary 5.
    held = {(0, c) for c in range(10)} | {(1, c) for c in (2, 3, 4, 7, 9)}
    assert hit_boundary([FULL_G, SW_G], CT, 10, 0, _store(held)) == 5
    # A second window, smaller, lowers the boundary to 4: the first window is
    # asked again, for [1, 4), and holds.
    held |= {(2, 3), (2, 9), (1, 1)}
    assert hit_boundary([FULL_G, SW_G, SW_SMALL], CT, 10, 0, _store(held)) == 4
    held -= {(1, 1)}
    # Boundary 4: window [1, 4) of group 1 lacks chunk 1: nothing serves every group.
    assert hit_boundary([FULL_G, SW_G, SW_SMALL], CT, 10, 0, _store(held)) == 0


def test_a_window_at_the_start_of_the_sequence_is_shorter() -> None:
    held = {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert hit_boundary([FULL_G, SW_G], CT, 2, 0, _store(held)) == 2


def test_mamba_needs_the_state_at_an_aligned_boundary() -> None:
    held = {(0, c) for c in range(10)} | {(1, 2), (1, 4), (1, 8)}
    assert hit_boundary([FULL_G, MAMBA_G], CT, 10, 0, _store(held)) == 9
    # Align mode with Mamba blocks of 4 chunks: boundaries 4 and 8 only.
    assert hit_boundary([FULL_G, MAMBA_G], CT, 10, 0, _store(held), mamba_align=4) == 0
    held.add((1, 7))
    assert hit_boundary([FULL_G, MAMBA_G], CT, 10, 0, _store(held), mamba_align=4) == 8


def test_no_hit_beyond_what_vllm_already_has() -> None:
    held = {(0, c) for c in range(4)}
    assert hit_boundary([FULL_G], CT, 10, 4 * CT, _store(held)) == 0


def test_a_missing_pool_is_no_hit_at_all() -> None:
    held = {(0, c) for c in range(10)}
    assert hit_boundary([FULL_G, SW_G], CT, 10, 0, _store(held)) == 0


# -- on vLLM's scheduler -------------------------------------------------------------


@pytest.fixture
def engine(tiny_model: Path, sidecar: DevSidecar, tenant: str) -> Iterator[HybridEngine]:
    cfg = make_vllm_config(
        tiny_model,
        {
            "tenant": tenant,
            "socket_path": str(sidecar.socket_path),
            "chunk_tokens": CT,
            "staging_bytes": 1 << 20,
            "attention_backend": "FLASH_ATTN",
            "load_mode": "sync",
            "save_mode": "async",
        },
        block_size=CT,
    )
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    cfg.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    e = HybridEngine(cfg, "sliding_window", window=48)
    yield e
    e.close()


def test_storage_events_name_the_group_and_its_window(engine: HybridEngine) -> None:
    published: list[Any] = []
    with mock.patch.object(
        engine.scheduler.kv_event_publisher, "publish", side_effect=published.append
    ):
        engine.add(make_request("a", [(31 * i + 5) % 997 for i in range(100)], block_size=CT))
        engine.run_until(lambda: not engine.scheduler.requests)
    stored = [
        ev
        for batch in published
        for ev in batch.events
        if isinstance(ev, BlockStored) and ev.medium == "STORAGE"
    ]
    by_group: dict[int | None, list[BlockStored]] = {}
    for ev in stored:
        by_group.setdefault(ev.group_idx, []).append(ev)
    assert set(by_group) == {0, 1}
    assert all(ev.kv_cache_spec_kind == "full_attention" for ev in by_group[0])
    assert all(
        ev.kv_cache_spec_kind == "sliding_window" and ev.kv_cache_spec_sliding_window == 48
        for ev in by_group[1]
    )
    # Every whole chunk of the full group; the window's chunks of the other.
    assert len(by_group[0]) == 6 and len(by_group[1]) == 3


def test_sleep_mode_drains_saves_and_wakes_up(engine: HybridEngine) -> None:
    tokens = [(31 * i + 5) % 997 for i in range(100)]
    engine.add(make_request("a", tokens, block_size=CT))
    engine.run_until(lambda: not engine.scheduler.requests)
    for w in engine.workers:
        w.unregister_kv_caches()
        w.unregister_kv_caches()  # idempotent, as vLLM requires
        with pytest.raises(RuntimeError, match="sleeps"):
            w.worker_side._require_cache()
        w.restore_kv_caches()
    engine.add(make_request("b", [*tokens, 1, 2, 3], block_size=CT))
    engine.run_until(lambda: not engine.scheduler.requests)
    assert engine.connector_total("chunks_save_failed") == 0


def test_reset_cache_is_refused_in_one_line(
    engine: HybridEngine, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING"):
        assert engine.scheduler.reset_prefix_cache(reset_connector=True) is False
    lines = [r.getMessage() for r in caplog.records if "reset_cache" in r.getMessage()]
    assert len(lines) == 1 and "kvoffload invalidate" in lines[0]


class _Blocks:
    """A test double of vLLM's ``KVCacheBlocks``: only ``get_block_ids``."""

    def __init__(self, ids: tuple[list[int], ...]) -> None:
        self._ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self._ids


def test_a_hit_vllm_did_not_allocate_in_full_is_failed_whole(
    tiny_model: Path, sidecar: DevSidecar, tenant: str
) -> None:
    """A Mamba state block missing from the allocation: the full-attention chunks
    are not loaded alone, every block of the hit is reported failed instead."""
    extra = {
        "tenant": tenant,
        "socket_path": str(sidecar.socket_path),
        "chunk_tokens": CT,
        "staging_bytes": 1 << 20,
        "attention_backend": "FLASH_ATTN",
        "load_mode": "sync",
        "save_mode": "sync",
    }
    made = []
    for _ in range(2):
        cfg = make_vllm_config(tiny_model, extra, block_size=CT)
        cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
        cfg.cache_config.mamba_cache_mode = "align"
        made.append(HybridEngine(cfg, "mamba"))
    a, b = made
    try:
        tokens = [(31 * i + 5) % 997 for i in range(100)]
        a.add(make_request("a", tokens, block_size=CT))
        a.run_until(lambda: not a.scheduler.requests)
        req = make_request("b", tokens, block_size=CT)
        sched = b.sched_side
        assert sched.get_num_new_matched_tokens(req, 0) == (96, False)
        full = list(range(10, 17))
        sched.update_state_after_alloc(req, _Blocks((full, [0] * 7)), 96)
        meta = sched.build_connector_meta(
            mock.Mock(preempted_req_ids=(), num_scheduled_tokens={}, total_num_scheduled_tokens=0)
        )
        (job,) = meta.loads
        assert job.fail
        worker = b.worker_side
        worker.start_load_kv(meta)
        assert worker.get_block_ids_with_load_errors() == set(full[:6])
    finally:
        for e in made:
            e.close()
