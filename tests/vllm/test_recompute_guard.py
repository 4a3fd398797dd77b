"""Never slower than recompute: the connector's recompute guard on vLLM's real
scheduler (CPU stand-in worker runner, as the other tests of this tier) and a
real sidecar; the slow tier is an injected delay in the worker's loads (a test
double of a throttled file system, named as such)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from tests.vllm.scheduling import CT, prompt_of, settings

from ..sidecar_proc import DevSidecar
from .engine import Engine, make_request, make_vllm_config

pytestmark = pytest.mark.vllm


@pytest.fixture
def engines(tiny_model: Path) -> Iterator[Any]:
    made: list[Engine] = []

    def make(extra: dict[str, Any]) -> Engine:
        e = Engine(make_vllm_config(tiny_model, extra), num_blocks=256)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


class SlowTier:
    """Test double of a throttled tier: every load of the worker's client waits
    ``delay_s`` before the real sidecar load runs."""

    def __init__(self, client: Any, delay_s: float) -> None:
        self._client, self._delay_s = client, delay_s
        self._load = client.load
        self.loads = 0

    def load(self, keys: Sequence[bytes], *args: Any, **kw: Any) -> Any:
        self.loads += 1
        time.sleep(self._delay_s)
        return self._load(keys, *args, **kw)


def first_scheduled(engine: Engine, req_id: str) -> int:
    return engine.schedules(req_id)[0][1]


def _store(engine: Engine, prompts: dict[str, list[int]]) -> None:
    engine.run_to_completion([engine.add(make_request(r, p)) for r, p in prompts.items()])


def test_a_slow_tier_is_recomputed_once_measured(
    engines: Any, sidecar: DevSidecar, tenant: str
) -> None:
    extra = settings(sidecar, tenant, load_mode="sync", layerwise=False)
    stored = {f"s{i}": prompt_of(3 * CT + 2, seed=100 + i) for i in range(6)}
    _store(engines(extra), stored)
    b = engines(extra)
    slow = SlowTier(b.worker_side._load_client, delay_s=0.5)
    b.worker_side._load_client.load = slow.load  # type: ignore[method-assign]
    # The engine's prefill rate: full prefills of prompts the store does not hold.
    for i in range(10):
        rid = f"cold{i}"
        b.run_to_completion([b.add(make_request(rid, prompt_of(4 * CT, seed=900 + i)))])
        assert first_scheduled(b, rid) == 4 * CT
    # The first three hits load (they are the tier's measurement) ...
    for i in range(3):
        b.run_to_completion([b.add(make_request(f"s{i}", stored[f"s{i}"]))])
        assert first_scheduled(b, f"s{i}") == 2, f"s{i} should have loaded 3 chunks"
    assert slow.loads == 3
    guard = b.sched_side._guard
    assert guard is not None
    load_rate, prefill_rate = guard.load_rate(), guard.prefill_rate()
    assert load_rate is not None and prefill_rate is not None and load_rate < prefill_rate
    # ... and from then on the stored prefix is recomputed: no load is started.
    for i in range(3, 6):
        b.run_to_completion([b.add(make_request(f"s{i}", stored[f"s{i}"]))])
        assert first_scheduled(b, f"s{i}") == len(stored[f"s{i}"]), f"s{i} loaded"
    assert slow.loads == 3


def test_a_fast_tier_keeps_loading(engines: Any, sidecar: DevSidecar, tenant: str) -> None:
    # The operator says the engine prefills 1 token/s: every load pays.
    extra = settings(sidecar, tenant, load_mode="sync", prefill_tokens_per_s=1.0)
    stored = {f"f{i}": prompt_of(3 * CT + 2, seed=200 + i) for i in range(6)}
    _store(engines(extra), stored)
    b = engines(extra)
    for rid, prompt in stored.items():
        b.run_to_completion([b.add(make_request(rid, prompt))])
        assert first_scheduled(b, rid) == 2, rid


def test_the_guard_can_be_turned_off(engines: Any, sidecar: DevSidecar, tenant: str) -> None:
    extra = settings(sidecar, tenant, load_mode="sync", recompute_guard=False, layerwise=False)
    stored = {f"o{i}": prompt_of(3 * CT + 2, seed=300 + i) for i in range(5)}
    _store(engines(extra), stored)
    b = engines(extra)
    assert b.sched_side._guard is None
    slow = SlowTier(b.worker_side._load_client, delay_s=0.2)
    b.worker_side._load_client.load = slow.load  # type: ignore[method-assign]
    for i in range(10):
        b.run_to_completion([b.add(make_request(f"c{i}", prompt_of(4 * CT, seed=700 + i)))])
    for rid, prompt in stored.items():
        b.run_to_completion([b.add(make_request(rid, prompt))])
        assert first_scheduled(b, rid) == 2, rid
    assert slow.loads == len(stored)
