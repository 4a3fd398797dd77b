"""Sealed direct reads in the vLLM connector's worker (``sealed_direct``): vLLM
0.33's real scheduler, the CPU stand-in runner (tests/vllm/engine.py, standing in
for vLLM's GPU model runner) and a real sidecar process, which hands the worker
each object's descriptor and key (protocol-v1.md §5.33).

Shown here: whole-chunk loads (sync and async) take the sealed path, no chunk
through staging, and the loaded KV is bit-identical to a recompute's; a flipped
object read this way is a miss from that chunk on (vLLM recomputes it and the
KV ends exact); a sidecar without ``sealed_load`` (a test double of revision 15:
the real sidecar's hello with the flag taken out) is loaded through staging.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

pytest.importorskip("vllm")

from kvoffload.client import SidecarClient
from kvoffload.client.sealed import SealedPath
from kvoffload.client.staged import StagedPath
from kvoffload.keys import chunk_keys
from kvoffload.layouts import v1
from kvoffload.protocol import region_size
from tests.vllm.scheduling import CT, assert_kv, prompt_of, rewound_to, settings

from ..sidecar_proc import DevSidecar
from .engine import Engine, make_request, make_vllm_config

pytestmark = pytest.mark.vllm


@pytest.fixture
def engines(tiny_model: Path) -> Iterator[Any]:
    made: list[Engine] = []

    def make(extra: dict[str, Any]) -> Engine:
        e = Engine(make_vllm_config(tiny_model, extra), num_blocks=128)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


class PathSpy:
    """Counts the chunks each load path moved: sealed (handed objects opened in
    the worker) and staged (the sidecar's pass into staging); and which client
    call the worker made: ``load_to`` (into its scratch) or ``load`` (a callback)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sealed: list[int] = []
        self.staged: list[int] = []
        self.calls: list[str] = []
        real_open, real_staged = SealedPath._open_batch, StagedPath.load
        real_load, real_load_to = SidecarClient.load, SidecarClient.load_to

        def load(client: SidecarClient, *a: Any) -> Any:
            self.calls.append("load")
            return real_load(client, *a)

        def load_to(client: SidecarClient, *a: Any) -> Any:
            self.calls.append("load_to")
            return real_load_to(client, *a)

        monkeypatch.setattr(SidecarClient, "load", load)
        monkeypatch.setattr(SidecarClient, "load_to", load_to)

        def open_batch(path: Any, s: Any, keys: Any, pos: int, prep: Any, *a: Any) -> Any:
            self.sealed.append(prep.found)
            return real_open(path, s, keys, pos, prep, *a)

        def staged(path: Any, s: Any, keys: Sequence[bytes], *a: Any) -> Any:
            self.staged.append(len(keys))
            return real_staged(path, s, keys, *a)

        monkeypatch.setattr(SealedPath, "_open_batch", open_batch)
        monkeypatch.setattr(StagedPath, "load", staged)


def _store(engines: Any, extra: dict[str, Any], shared: list[int]) -> Engine:
    a = engines(extra)
    a.run_to_completion([a.add(make_request("a", [*shared, 1, 2, 3]))])
    return a


def _flip(path: Path) -> None:
    """One bit of layer 1's data, past the header: the object no longer verifies."""
    h = v1.decode_header(path.read_bytes())
    os.chmod(path, 0o600)
    with open(path, "r+b") as f:
        at = h.layers[1].offset + 100
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("load_mode", ["sync", "async", "async-2-per-batch"])
def test_whole_chunk_loads_are_sealed_direct_reads_and_exact(
    engines: Any, sidecar: DevSidecar, tenant: str, load_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    mode, _, small = load_mode.partition("-")
    extra = settings(sidecar, tenant, load_mode=mode, layerwise=False, sealed_direct=True)
    if small:  # a scratch (staging's size) of two chunks: the load runs in two batches
        layer = CT * 2 * 2 * 16 * 4  # tokens x heads x K|V x head dim x fp32 bytes
        extra["staging_bytes"] = 2 * region_size([layer, layer]) + 1024
    shared = prompt_of(4 * CT, seed=61)
    _store(engines, extra, shared)
    b = engines(extra)
    spy = PathSpy(monkeypatch)
    prompt = [*shared, *prompt_of(20, seed=62)]
    rb = b.add(make_request("b", prompt))
    b.run_until(lambda: rb.output_token_ids)
    assert b.schedules("b")[0] == (4 * CT, 20)  # the prefix came from the store
    assert b.worker_side._load_client.uses_sealed_direct()
    assert sum(spy.sealed) == 4 and spy.staged == []  # no chunk through staging
    # Decrypted into the worker's own scratch, a batch at a time.
    assert spy.calls == ["load_to"] * (2 if small else 1)
    assert not b.invalid_block_ids
    assert_kv(b, "b", prompt, len(prompt))  # bit-identical to a recompute's KV
    b.run_to_completion([rb])


def test_a_flipped_object_read_sealed_is_a_miss_from_that_chunk_on(
    engines: Any, sidecar: DevSidecar, tenant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = settings(sidecar, tenant, load_mode="sync", layerwise=False, sealed_direct=True)
    shared = prompt_of(4 * CT, seed=71)
    a = _store(engines, extra, shared)
    with SidecarClient(sidecar.socket_path, tenant, staging_bytes=4096) as c:
        salt = c.salt
    assert salt is not None
    keys = chunk_keys(a.connector.contracts.contract(None, 0), salt, shared)
    _flip(sidecar.object_path(tenant, keys[2]))

    b = engines(extra)
    spy = PathSpy(monkeypatch)
    prompt = [*shared, *prompt_of(40, seed=72)]
    rb = b.add(make_request("b", prompt))
    b.step()
    blocks = b.block_ids("b")
    assert spy.staged == []
    # Chunks 0 and 1 loaded; the flipped chunk 2 and chunk 3 after it are reported.
    assert b.invalid_block_ids == set(blocks[2 * 2 : 4 * 2])
    b.run_until(lambda: rewound_to(b.schedules("b")[1:], 2 * CT, len(prompt)))
    assert b.schedules("b")[0] == (4 * CT, 40)
    assert_kv(b, "b", prompt, len(prompt))  # after the recompute: exact
    b.run_to_completion([rb])


def test_a_sidecar_without_sealed_loads_is_loaded_through_staging(
    engines: Any, sidecar: DevSidecar, tenant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = settings(sidecar, tenant, load_mode="async", layerwise=False, sealed_direct=True)
    shared = prompt_of(4 * CT, seed=81)
    _store(engines, extra, shared)
    real = SidecarClient._choose_path

    def revision_15(client: SidecarClient, s: Any) -> Any:
        # Test double of an older sidecar: its hello does not announce sealed_load.
        s.hello = msgspec.structs.replace(s.hello, sealed_load=False)
        return real(client, s)

    monkeypatch.setattr(SidecarClient, "_choose_path", revision_15)
    b = engines(extra)
    spy = PathSpy(monkeypatch)
    prompt = [*shared, *prompt_of(20, seed=82)]
    rb = b.add(make_request("b", prompt))
    b.run_until(lambda: rb.output_token_ids)
    assert not b.worker_side._load_client.uses_sealed_direct()
    assert b.schedules("b")[0] == (4 * CT, 20)
    assert spy.sealed == [] and sum(spy.staged) == 4
    assert spy.calls == ["load"]  # scattered straight from staging, no extra copy
    assert_kv(b, "b", prompt, len(prompt))
    b.run_to_completion([rb])
