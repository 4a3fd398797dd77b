"""Never slower than recompute: the connector's recompute guard on vLLM's real
scheduler (CPU stand-in worker runner, as the other tests of this tier) and a
real sidecar; the slow tier is an injected delay in the worker's loads (a test
double of a throttled file system, named as such)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from tests.vllm.scheduling import CT, assert_kv, prompt_of, settings

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
    ``delay_s`` (plus ``per_chunk_s`` per chunk) before the real sidecar load runs."""

    def __init__(self, client: Any, delay_s: float, per_chunk_s: float = 0.0) -> None:
        self._client, self._delay_s, self._per_chunk_s = client, delay_s, per_chunk_s
        self._load, self._load_layerwise = client.load, client.load_layerwise
        self.loads = 0
        self.chunks: list[int] = []

    def _wait(self, keys: Sequence[bytes]) -> None:
        self.loads += 1
        self.chunks.append(len(keys))
        time.sleep(self._delay_s + self._per_chunk_s * len(keys))

    def load(self, keys: Sequence[bytes], *args: Any, **kw: Any) -> Any:
        self._wait(keys)
        return self._load(keys, *args, **kw)

    def load_layerwise(self, keys: Sequence[bytes], *args: Any, **kw: Any) -> Any:
        self._wait(keys)
        return self._load_layerwise(keys, *args, **kw)

    def install(self) -> SlowTier:
        self._client.load = self.load
        self._client.load_layerwise = self.load_layerwise
        return self


class GatedProbe:
    """Test double of a probe read on a stalled tier: the worker's probe connection,
    whose loads block until the test opens the gate (then run for real)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.gate = threading.Event()
        self.started = threading.Event()
        self.results: list[bool] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def load(self, keys: Sequence[bytes], *args: Any, **kw: Any) -> Any:
        self.started.set()
        assert self.gate.wait(30), "the test never opened the gate"
        out = self._client.load(keys, *args, **kw)
        self.results.extend(r.ok for r in out)
        return out


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
    slow = SlowTier(b.worker_side._load_client, delay_s=0.5).install()
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
    slow = SlowTier(b.worker_side._load_client, delay_s=0.2).install()
    for i in range(10):
        b.run_to_completion([b.add(make_request(f"c{i}", prompt_of(4 * CT, seed=700 + i)))])
    for rid, prompt in stored.items():
        b.run_to_completion([b.add(make_request(rid, prompt))])
        assert first_scheduled(b, rid) == 2, rid
    assert slow.loads == len(stored)


def test_no_request_waits_on_a_probe_of_a_slow_tier(
    engines: Any, sidecar: DevSidecar, tenant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = settings(sidecar, tenant, load_mode="sync", layerwise=False)
    stored = {f"p{i}": prompt_of(3 * CT + 2, seed=400 + i) for i in range(6)}
    _store(engines(extra), stored)
    b = engines(extra)
    slow = SlowTier(b.worker_side._load_client, delay_s=0.5).install()
    probe = b.worker_side._probe
    gated: list[GatedProbe] = []

    def make_gated(size: int, make: Any = probe._make_client) -> Any:
        gated.append(GatedProbe(make(size)))
        return gated[-1]

    monkeypatch.setattr(probe, "_make_client", make_gated)
    for i in range(10):
        b.run_to_completion([b.add(make_request(f"c{i}", prompt_of(4 * CT, seed=800 + i)))])
    for i in range(3):  # the tier's measurement: three slow loads
        b.run_to_completion([b.add(make_request(f"p{i}", stored[f"p{i}"]))])
    b.run_to_completion([b.add(make_request("p3", stored["p3"]))])
    assert first_scheduled(b, "p3") == len(stored["p3"])  # recomputed
    assert not gated, "a probe within the period after a load sample"
    # A probe is due (30 s later): the next hit still recomputes all of it, and
    # finishes while the probe's read of the tier is stalled in the background.
    guard = b.sched_side._guard
    assert guard is not None
    monkeypatch.setattr(guard, "_clock", lambda: time.monotonic() + 31.0)
    b.run_to_completion([b.add(make_request("p4", stored["p4"]))])
    assert first_scheduled(b, "p4") == len(stored["p4"]), "p4 waited on a probe chunk"
    assert slow.loads == 3  # no request loaded anything since the measurement
    assert len(gated) == 1 and gated[0].started.wait(10)
    assert not gated[0].results  # still stalled: p4 is done nonetheless
    gated[0].gate.set()
    probe.wait(30)
    assert gated[0].results == [True]  # the probe read a chunk the store holds
    # Its time is reported like a load's: the next step hands it to the guard.
    samples = len(guard._loads)
    b.run_to_completion([b.add(make_request("p5", stored["p5"]))])
    assert len(guard._loads) == samples + 1
    assert first_scheduled(b, "p5") == len(stored["p5"])


def test_an_overlapped_load_takes_the_leading_chunks_that_pay(
    engines: Any, sidecar: DevSidecar, tenant: str
) -> None:
    # The engine prefills 320 tokens/s (configured: a chunk of 32 in 0.1 s); the
    # tier reads a chunk in 0.11 s: loading all 12 chunks is slower than
    # recomputing them, but with the layer-wise load streaming while the step
    # computes the rest, loading about half and computing the other half beats both.
    extra = settings(sidecar, tenant, load_mode="sync", prefill_tokens_per_s=320.0)
    stored = {f"h{i}": prompt_of(12 * CT + 2, seed=500 + i) for i in range(5)}
    _store(engines(extra), stored)
    b = engines(extra)
    slow = SlowTier(b.worker_side._load_client, delay_s=0.0, per_chunk_s=0.11).install()
    for i in range(3):  # unmeasured: loaded whole (the tier's measurement)
        b.run_to_completion([b.add(make_request(f"h{i}", stored[f"h{i}"]))])
        assert first_scheduled(b, f"h{i}") == 2
    guard = b.sched_side._guard
    assert guard is not None
    load_rate = guard.load_rate()
    assert load_rate is not None and 200 < load_rate < 320  # slower than the engine
    for rid in ("h3", "h4"):
        req = b.add(make_request(rid, stored[rid]))
        b.run_until(lambda req=req: req.output_token_ids)
        loaded = len(stored[rid]) - first_scheduled(b, rid)
        assert 0 < loaded < 12 * CT and loaded % CT == 0, f"{rid}: loaded {loaded} tokens"
        assert 3 * CT <= loaded <= 8 * CT, f"{rid}: loaded {loaded} tokens"
        assert_kv(b, rid, stored[rid], len(stored[rid]))  # loaded and computed parts
        b.run_to_completion([req])
    assert slow.chunks[3:] == [c for c in slow.chunks[3:] if 3 <= c <= 8]
