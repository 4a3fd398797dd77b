"""Layer-wise sync loads in the vLLM tier: vLLM 0.33's real scheduler, the stand-in runner.

The stand-in runner (tests/vllm/engine.py: a fake forward over real KV-cache
tensors, standing in for vLLM's GPU model runner) calls
``wait_for_layer_load`` before it touches each layer, as vLLM's attention
layers do. Shown here, against a real sidecar process:

- the forward starts on layer 0 while a later layer is still loading (it
  would deadlock on a whole-chunk load: that case is caught by a timeout);
- the loaded KV is bit-identical to what a recompute writes, layer-wise or not;
- a chunk whose layer *k* is corrupt on disk: its layer *k* and later never
  reach the cache (nor any layer of a later chunk past the failure), the
  blocks of that chunk and every later one are reported to vLLM, which
  recomputes from that chunk, and the final KV is exact.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvoffload.client import SidecarClient
from kvoffload.integrations.vllm.common import ChunkRef
from kvoffload.integrations.vllm.worker import PagedCache
from kvoffload.keys import chunk_keys
from kvoffload.layouts import v1
from tests.vllm.scheduling import (
    CT,
    assert_kv,
    prompt_of,
    rewound_to,
    settings,
)

from ..sidecar_proc import DevSidecar
from .engine import LAYER_NAMES, Engine, make_request, make_vllm_config

pytestmark = pytest.mark.vllm


@pytest.fixture
def engines(tiny_model: Path) -> Iterator[Any]:
    made: list[Engine] = []

    def make(extra: dict[str, Any], **kw: Any) -> Engine:
        e = Engine(make_vllm_config(tiny_model, extra, **kw), num_blocks=128)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


class ScatterSpy:
    """Records every layer the worker writes into the cache: (first block id, layer)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[int, int]] = []
        self.hook: Any = None
        real = PagedCache.scatter_layer

        def spy(
            cache: PagedCache,
            chunk: ChunkRef,
            chunk_tokens: int,
            i: int,
            mv: memoryview,
            non_blocking: bool = False,
        ) -> None:
            if self.hook is not None:
                self.hook(i)
            real(cache, chunk, chunk_tokens, i, mv, non_blocking)
            self.calls.append((chunk.block_ids[0], i))

        monkeypatch.setattr(PagedCache, "scatter_layer", spy)


def saved_prefix(engines: Any, extra: dict[str, Any], shared: list[int]) -> Engine:
    a = engines(extra)
    a.run_to_completion([a.add(make_request("a", [*shared, 1, 2, 3]))])
    return a


def keys_of(engine: Engine, sidecar: DevSidecar, tenant: str, tokens: Sequence[int]) -> list[bytes]:
    with SidecarClient(sidecar.socket_path, tenant, staging_bytes=4096) as c:
        salt = c.salt
    assert salt is not None
    return chunk_keys(engine.connector.contracts.contract(None, 0), salt, list(tokens))


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole-chunk"])
def test_loaded_kv_is_exact_either_way(
    engines: Any,
    sidecar: DevSidecar,
    tenant: str,
    layerwise: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    extra = settings(sidecar, tenant, layerwise=layerwise)
    shared = prompt_of(4 * CT, seed=11)
    saved_prefix(engines, extra, shared)
    calls: list[int] = []
    real = SidecarClient.load_layerwise

    def count(self: SidecarClient, keys: Sequence[bytes], on_layer: Any) -> Any:
        calls.append(len(keys))
        return real(self, keys, on_layer)

    monkeypatch.setattr(SidecarClient, "load_layerwise", count)
    b = engines(extra)
    prompt = [*shared, *prompt_of(20, seed=12)]
    rb = b.add(make_request("b", prompt))
    so = b.step()
    assert so.has_sync_kv_loads
    assert b.schedules("b")[0] == (4 * CT, 20)  # the prefix came from the sidecar
    assert calls == ([4] if layerwise else [])
    assert not b.invalid_block_ids
    # Bit-identical to what a recompute writes, every layer, every position.
    assert_kv(b, "b", prompt, len(prompt))
    b.run_to_completion([rb])


def test_forward_computes_layer_0_while_layer_1_loads(
    engines: Any, sidecar: DevSidecar, tenant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = settings(sidecar, tenant)
    shared = prompt_of(3 * CT, seed=21)
    saved_prefix(engines, extra, shared)
    b = engines(extra)
    spy = ScatterSpy(monkeypatch)
    layer0_used = threading.Event()
    overlapped: list[bool] = []

    def hold_layer_1(i: int) -> None:
        # Layer 1 is written only once the forward got past layer 0: a load
        # that finishes before the forward starts cannot satisfy this.
        if i == 1 and not overlapped:
            overlapped.append(layer0_used.wait(timeout=20))

    spy.hook = hold_layer_1
    real_wait = b.worker.wait_for_layer_load

    def wait(layer_name: str) -> None:
        real_wait(layer_name)
        if layer_name == LAYER_NAMES[0]:
            layer0_used.set()

    monkeypatch.setattr(b.worker, "wait_for_layer_load", wait)
    prompt = [*shared, *prompt_of(8, seed=22)]
    rb = b.add(make_request("b", prompt))
    b.step()
    assert overlapped == [True]
    assert not b.invalid_block_ids
    assert_kv(b, "b", prompt, len(prompt))
    b.run_to_completion([rb])


def corrupt_layer(path: Path, layer: int) -> None:
    h = v1.decode_header(path.read_bytes())
    os.chmod(path, 0o600)
    with open(path, "r+b") as f:
        at = h.layers[layer].offset + 100
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("bad_layer", [0, 1])
def test_corrupt_layer_never_reaches_the_cache_and_is_recomputed(
    engines: Any,
    sidecar: DevSidecar,
    tenant: str,
    bad_layer: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    extra = settings(sidecar, tenant)
    shared = prompt_of(4 * CT, seed=31 + bad_layer)
    a = saved_prefix(engines, extra, shared)
    keys = keys_of(a, sidecar, tenant, shared)
    corrupt_layer(sidecar.object_path(tenant, keys[2]), bad_layer)

    b = engines(extra)
    spy = ScatterSpy(monkeypatch)
    prompt = [*shared, *prompt_of(40, seed=33)]
    rb = b.add(make_request("b", prompt))
    b.step()
    blocks = b.block_ids("b")
    # The bad chunk's layer `bad_layer` and everything after it in the load
    # order never reached the cache: nothing of chunks 2 and 3 from that layer on.
    late = {blocks[2 * 2], blocks[3 * 2]}
    assert not [(blk, i) for blk, i in spy.calls if blk in late and i >= bad_layer]
    # Chunks 0 and 1 were loaded whole.
    for first in (blocks[0], blocks[2]):
        assert sorted(i for blk, i in spy.calls if blk == first) == [0, 1]
    b.run_until(lambda: rewound_to(b.schedules("b")[1:], 2 * CT, len(prompt)))
    # Reported as vLLM expects: the blocks of chunk 2 and every later loaded chunk.
    assert b.invalid_block_ids == set(blocks[2 * 2 : 4 * 2])
    steps = b.schedules("b")
    assert steps[0] == (4 * CT, 40)
    assert rewound_to(steps[1:], 2 * CT, len(prompt))
    # After the recompute the KV is exactly a clean forward's.
    assert_kv(b, "b", prompt, len(prompt))
    b.run_to_completion([rb])
