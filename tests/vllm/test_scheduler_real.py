"""vLLM's real v1 scheduler driving kvoffload against a real sidecar process.

Two ``Engine`` instances (two vLLM schedulers with their own KV caches) share
one sidecar, as two engines on a node do. What is shown, in sync and async
load modes: the second engine gets the first one's prefix from the sidecar
(``num_computed_tokens`` jumps by the hit and vLLM schedules only the rest),
its blocks then hold exactly the KV the first engine computed, a miss costs
nothing, blocks of a finished request stay allocated until its async save is
done, and a chunk that fails to load is recomputed from there on (and saved
again).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from vllm.lora.request import LoRARequest
from vllm.v1.request import RequestStatus

from kvoffload.client import SidecarClient
from kvoffload.integrations.vllm.common import KVOffloadMetadata
from kvoffload.keys import chunk_keys
from kvoffload.layouts import v1
from tests.vllm.scheduling import CT, assert_kv, prompt_of, rewound_to, settings, stored_chunks

from ..sidecar_proc import DevSidecar
from .conftest import DIRECT_TENANT
from .engine import Engine, make_request, make_vllm_config

pytestmark = pytest.mark.vllm


@pytest.fixture
def engines(tiny_model: Path) -> Iterator[Any]:
    """Factory of engines, all closed at the end."""
    made: list[Engine] = []

    def make(extra: dict[str, Any], num_blocks: int = 128, **kw: Any) -> Engine:
        e = Engine(make_vllm_config(tiny_model, extra, **kw), num_blocks=num_blocks)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def first_scheduled(engine: Engine, req_id: str) -> int:
    """Tokens vLLM scheduled for the request the first time it computed anything."""
    return engine.schedules(req_id)[0][1]


def run_until_recomputed(
    engine: Engine, req_id: str, load_mode: str, start: int, upto: int
) -> None:
    """Step until vLLM recomputed the request from ``start`` after a failed load.

    A sync load's step runs the forward before the failure is known, so the
    recompute is a later step; an async load's failure is known before the
    request computes anything.
    """
    if load_mode == "sync":
        engine.run_until(lambda: rewound_to(engine.schedules(req_id)[1:], start, upto))
    else:
        engine.run_until(lambda: bool(engine.schedules(req_id)))


# vLLM 0.33 schedules asynchronously by default (AsyncScheduler, one batch in
# flight); the plain Scheduler is what it falls back to.
SCHEDULING = pytest.mark.parametrize(
    "async_scheduling", [True, False], ids=["async-sched", "sync-sched"]
)


@SCHEDULING
@pytest.mark.parametrize("load_mode", ["sync", "async"])
def test_second_engine_gets_prefix_from_sidecar(
    engines: Any, sidecar: DevSidecar, tenant: str, load_mode: str, async_scheduling: bool
) -> None:
    extra = settings(sidecar, tenant, load_mode=load_mode)
    prompt = prompt_of(5 * CT + 7)
    a = engines(extra, async_scheduling=async_scheduling)
    ra = a.add(make_request("a", prompt))
    a.run_to_completion([ra])
    assert first_scheduled(a, "a") == len(prompt)  # nothing to load: all computed
    assert stored_chunks(a, sidecar, tenant, prompt) == 5
    # vLLM's KV-connector stats (get_kv_connector_stats), merged over the workers.
    assert a.connector_total("chunks_saved") == 5 * len(a.workers)
    assert a.connector_total("chunks_loaded") == 0

    b = engines(extra, async_scheduling=async_scheduling)
    rb = b.add(make_request("b", prompt))
    so = b.step()
    meta = so.kv_connector_metadata
    assert isinstance(meta, KVOffloadMetadata)
    assert [c.index for c in meta.loads[0].chunks] == [0, 1, 2, 3, 4]
    if load_mode == "sync":
        # Loaded before this step's forward; vLLM computes only the last 7.
        assert so.has_sync_kv_loads
        assert so.num_scheduled_tokens["b"] == 7
        assert rb.num_computed_tokens == len(prompt)
    else:
        # The request waits for the load; other requests could run meanwhile.
        assert "b" not in so.num_scheduled_tokens
        assert rb.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert rb.num_computed_tokens == 5 * CT
        b.run_until(lambda: any("b" in o.num_scheduled_tokens for o in b.outputs))
        assert first_scheduled(b, "b") == 7
    # B never computed positions < 160, yet its blocks hold A's KV for them.
    assert_kv(b, "b", prompt, 5 * CT)
    assert not b.invalid_block_ids
    b.run_to_completion([rb])
    assert list(rb.output_token_ids) == list(ra.output_token_ids)
    assert b.connector_total("chunks_loaded") == 5 * len(b.workers)
    assert b.connector_total("chunks_load_failed") == 0


@pytest.mark.parametrize("load_mode", ["sync", "async"])
def test_direct_path_tenant_reuses_prefix_without_staging(
    engines: Any, sidecar: DevSidecar, load_mode: str
) -> None:
    """A tenant whose policy allows the direct path: the workers write and read
    the layout-v1 files themselves, and B still gets exactly A's KV."""
    tenant = DIRECT_TENANT
    extra = settings(sidecar, tenant, load_mode=load_mode, direct=True)
    seed = 101 if load_mode == "sync" else 202  # one tenant for the session: own prompts
    prompt = prompt_of(4 * CT + 5, seed=seed)
    a = engines(extra)
    ra = a.add(make_request("a", prompt))
    a.run_to_completion([ra])
    assert stored_chunks(a, sidecar, tenant, prompt) == 4
    with SidecarClient(sidecar.socket_path, tenant, staging_bytes=4096, direct=True) as c:
        assert c.uses_direct()
        salt = c.salt
        assert salt is not None
        keys = chunk_keys(a.connector.contracts.contract(None, 0), salt, prompt)[:4]
    for k in keys:
        # Published by the direct path: read-only, plaintext, verified by the sidecar.
        path = sidecar.object_path(tenant, k)
        assert path.stat().st_mode & 0o777 == 0o440
        assert not v1.decode_header(path.read_bytes()).sealed

    b = engines(extra)
    rb = b.add(make_request("b", prompt))
    b.run_until(lambda: any("b" in o.num_scheduled_tokens for o in b.outputs))
    assert first_scheduled(b, "b") == 5
    assert_kv(b, "b", prompt, 4 * CT)
    b.run_to_completion([rb])
    assert list(rb.output_token_ids) == list(ra.output_token_ids)


def test_never_the_last_prompt_token(engines: Any, sidecar: DevSidecar, tenant: str) -> None:
    """A prompt of exactly 4 chunks loads 3: vLLM must compute one token to sample."""
    extra = settings(sidecar, tenant)
    prompt = prompt_of(4 * CT, seed=1)
    a = engines(extra)
    a.run_to_completion([a.add(make_request("a", prompt))])
    assert stored_chunks(a, sidecar, tenant, prompt) == 4

    b = engines(extra)
    rb = b.add(make_request("b", prompt))
    b.step()
    assert first_scheduled(b, "b") == CT
    b.run_to_completion([rb])


@pytest.mark.parametrize("load_mode", ["sync", "async"])
def test_lookup_miss_costs_nothing(
    engines: Any, sidecar: DevSidecar, tenant: str, load_mode: str
) -> None:
    extra = settings(sidecar, tenant, load_mode=load_mode)
    a = engines(extra)
    a.run_to_completion([a.add(make_request("a", prompt_of(3 * CT + 1, seed=2)))])

    b = engines(extra)
    other = prompt_of(3 * CT + 1, seed=3)
    rb = b.add(make_request("b", other))
    so = b.step()
    meta = so.kv_connector_metadata
    assert isinstance(meta, KVOffloadMetadata)
    # No load job, no waiting state, no sync-load barrier: scheduled whole, at once.
    assert meta.loads == []
    assert not so.has_sync_kv_loads
    assert so.num_scheduled_tokens["b"] == len(other)
    assert rb.status == RequestStatus.RUNNING
    b.run_to_completion([rb])


@SCHEDULING
def test_async_save_holds_blocks_until_saved(
    engines: Any,
    sidecar: DevSidecar,
    tenant: str,
    monkeypatch: pytest.MonkeyPatch,
    async_scheduling: bool,
) -> None:
    a = engines(settings(sidecar, tenant, save_mode="async"), async_scheduling=async_scheduling)
    total_free = a.free_blocks()
    gate = threading.Event()
    client = a.worker_side._save_client
    real_save = client.save

    def gated_save(*args: Any, **kwargs: Any) -> list[bool]:
        gate.wait(60)  # a slow store
        stored: list[bool] = real_save(*args, **kwargs)
        return stored

    monkeypatch.setattr(client, "save", gated_save)
    prompt = prompt_of(3 * CT + 5, seed=4)
    ra = a.add(make_request("a", prompt, max_tokens=2))
    a.run_until(ra.is_finished)
    # vLLM finished the request, kvoffload keeps its blocks: the save still runs.
    assert "a" in a.scheduler.requests
    held = a.free_blocks()
    assert held < total_free
    for _ in range(3):
        a.step()
    assert "a" in a.scheduler.requests
    assert a.free_blocks() == held
    assert a.sched_side.has_held_requests()

    gate.set()
    a.run_until(lambda: "a" not in a.scheduler.requests)
    assert a.free_blocks() == total_free
    assert not a.sched_side.has_held_requests()
    assert stored_chunks(a, sidecar, tenant, prompt) == 3


def test_sync_save_frees_at_once(engines: Any, sidecar: DevSidecar, tenant: str) -> None:
    """In sync save mode the last chunk is saved one step after the finish, then freed."""
    a = engines(settings(sidecar, tenant, save_mode="sync"))
    prompt = prompt_of(2 * CT + 3, seed=5)
    ra = a.add(make_request("a", prompt, max_tokens=1))
    a.run_to_completion([ra], max_steps=10)
    assert stored_chunks(a, sidecar, tenant, prompt) == 2


@SCHEDULING
@pytest.mark.parametrize("load_mode", ["sync", "async"])
def test_failed_chunk_and_later_ones_are_recomputed(
    engines: Any, sidecar: DevSidecar, tenant: str, load_mode: str, async_scheduling: bool
) -> None:
    extra = settings(sidecar, tenant, load_mode=load_mode)
    shared = prompt_of(4 * CT, seed=6)
    a = engines(extra, async_scheduling=async_scheduling)
    a.run_to_completion([a.add(make_request("a", [*shared, 1, 2, 3]))])
    with SidecarClient(sidecar.socket_path, tenant, staging_bytes=4096) as c:
        salt = c.salt
    assert salt is not None
    keys = chunk_keys(a.connector.contracts.contract(None, 0), salt, shared)
    # The index still lists chunk 2, its object is gone (evicted behind our back).
    sidecar.object_path(tenant, keys[2]).unlink()

    b = engines(extra, async_scheduling=async_scheduling)
    # 4 stored chunks, then 40 new tokens: with a sync load, the load step's
    # forward computes chunk 4 on top of the bad chunk 2 before vLLM hears of it.
    prompt = [*shared, *prompt_of(40, seed=60)]
    rb = b.add(make_request("b", prompt))
    run_until_recomputed(b, "b", load_mode, 2 * CT, len(prompt))
    blocks = b.block_ids("b")
    # Exactly the blocks of chunk 2 and every later loaded chunk were reported ...
    assert b.invalid_block_ids == set(blocks[2 * 2 : 4 * 2])
    # ... so vLLM computed from chunk 2 on, keeping chunks 0 and 1. (A sync
    # load's step already ran the forward over the tail on the bad blocks;
    # vLLM discards that and rewinds.)
    steps = b.schedules("b")
    if load_mode == "sync":
        assert steps[0] == (4 * CT, 40)
        assert rewound_to(steps[1:], 2 * CT, len(prompt))
    else:
        assert steps[0] == (2 * CT, len(prompt) - 2 * CT)
    assert_kv(b, "b", prompt, len(prompt))
    b.run_to_completion([rb])

    # The recomputed chunks were saved again, and chunk 4 as computed after the
    # rewind, not on top of the bad load: a third engine loads all 5 intact.
    c3 = engines(extra, async_scheduling=async_scheduling)
    rc = c3.add(make_request("c", prompt))
    c3.run_until(lambda: rc.output_token_ids)
    assert c3.schedules("c")[0] == (5 * CT, len(prompt) - 5 * CT)
    assert_kv(c3, "c", prompt, 5 * CT)
    assert not c3.invalid_block_ids


def test_partial_local_hit_loads_only_missing_blocks(
    engines: Any, sidecar: DevSidecar, tenant: str
) -> None:
    """vLLM's own prefix cache covers 3 blocks; kvoffload fills only the blocks after."""
    extra = settings(sidecar, tenant)
    prompt = prompt_of(5 * CT + 3, seed=7)
    a = engines(extra)
    a.run_to_completion([a.add(make_request("a", prompt))])

    b = engines(extra)
    # Warm B's local prefix cache with the first 3 whole blocks (48 tokens).
    b.run_to_completion([b.add(make_request("warm", prompt[:50], max_tokens=1))])
    rb = b.add(make_request("b", prompt))
    so = b.step()
    meta = so.kv_connector_metadata
    assert isinstance(meta, KVOffloadMetadata)
    (job,) = meta.loads
    # Chunk 1 is half local: only its second block is loaded.
    assert [(c.index, c.first_block, len(c.block_ids)) for c in job.chunks] == [
        (1, 1, 1),
        (2, 0, 2),
        (3, 0, 2),
        (4, 0, 2),
    ]
    assert job.chunks[0].block_ids[0] == b.block_ids("b")[3]
    assert so.num_scheduled_tokens["b"] == 3
    assert_kv(b, "b", prompt, 5 * CT)
    b.run_to_completion([rb])


def test_cache_salt_and_lora_separate_caches(
    engines: Any, sidecar: DevSidecar, tenant: str
) -> None:
    extra = settings(sidecar, tenant)
    prompt = prompt_of(3 * CT + 2, seed=8)
    lora = LoRARequest(lora_name="adapter-a", lora_int_id=1, lora_path="/nonexistent")
    a = engines(extra)
    a.run_to_completion(
        [
            a.add(make_request("salted", prompt, cache_salt="user-1")),
            a.add(make_request("lora", prompt, lora_request=lora)),
        ]
    )
    b = engines(extra)
    cases = [
        ("plain", {}, 0),
        ("other-salt", {"cache_salt": "user-2"}, 0),
        ("same-salt", {"cache_salt": "user-1"}, 3),
        ("same-lora", {"lora_request": lora}, 3),
        ("lora-same-id-other-name", {"lora_request": LoRARequest("adapter-b", 1, "/x")}, 0),
    ]
    for rid, kw, hit in cases:
        r = b.add(make_request(rid, prompt, **kw))
        b.run_to_completion([r])
        assert first_scheduled(b, rid) == len(prompt) - hit * CT, rid
        b.scheduler.reset_prefix_cache()  # no local hits between cases


def test_decode_chunks_are_saved_for_the_next_turn(
    engines: Any, sidecar: DevSidecar, tenant: str
) -> None:
    extra = settings(sidecar, tenant)
    a = engines(extra)
    ra = a.add(make_request("turn1", prompt_of(40, seed=9), max_tokens=60))
    a.run_to_completion([ra])
    history = list(ra.all_token_ids)  # 100 tokens, 99 with KV: 3 whole chunks

    b = engines(extra)
    rb = b.add(make_request("turn2", [*history, 11, 12, 13]))
    b.step()
    assert first_scheduled(b, "turn2") == len(history) + 3 - 3 * CT
    assert_kv(b, "turn2", history, 3 * CT)
    b.run_to_completion([rb])


def test_sidecar_down_is_a_plain_engine(engines: Any, tmp_path: Path, tenant: str) -> None:
    extra = {
        "tenant": tenant,
        "socket_path": str(tmp_path / "absent.sock"),
        "chunk_tokens": CT,
        "attention_backend": "FLASH_ATTN",
        "timeout_s": 0.5,
    }
    a = engines(extra)
    total_free = a.free_blocks()
    reqs = [a.add(make_request(f"r{i}", prompt_of(2 * CT + 9, seed=10))) for i in range(2)]
    a.run_to_completion(reqs, max_steps=20)
    assert first_scheduled(a, "r0") == 2 * CT + 9
    assert all(len(r.output_token_ids) == 3 for r in reqs)
    assert a.free_blocks() == total_free


def test_preemption_waits_for_saves_and_resumes_from_sidecar(
    engines: Any, sidecar: DevSidecar, tenant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A preempted request's blocks go back to the pool at once; saves still reading
    them finish before the step's forward can overwrite them, and the request
    comes back with its prefix loaded from the sidecar."""
    a = engines(settings(sidecar, tenant), num_blocks=13)  # 12 usable blocks
    worker = a.worker_side
    gate = threading.Event()
    real_save = worker._save_client.save

    def gated_save(*args: Any, **kwargs: Any) -> list[bool]:
        gate.wait(60)
        stored: list[bool] = real_save(*args, **kwargs)
        return stored

    waited: list[tuple[set[str], float, bool]] = []
    real_handle = worker.handle_preemptions

    def handle(meta: KVOffloadMetadata) -> None:
        if not meta.preempted_req_ids:
            real_handle(meta)
            return
        timer = threading.Timer(0.3, gate.set)
        timer.start()
        t0 = time.monotonic()
        real_handle(meta)
        drained = not any(r in worker._req_saves for r in meta.preempted_req_ids)
        waited.append((set(meta.preempted_req_ids), time.monotonic() - t0, drained))

    monkeypatch.setattr(worker._save_client, "save", gated_save)
    monkeypatch.setattr(worker, "handle_preemptions", handle)
    p1, p2 = prompt_of(100, seed=11), prompt_of(70, seed=12)
    r1 = a.add(make_request("r1", p1, max_tokens=40))
    r2 = a.add(make_request("r2", p2, max_tokens=40))
    a.run_to_completion([r1, r2], max_steps=400)

    assert waited, "the scenario did not preempt"
    preempted, seconds, drained = waited[0]
    assert preempted == {"r2"}
    assert seconds >= 0.25 and drained  # blocked until r2's saves were done
    resumed = [s for s in a.schedules("r2") if s[0] > 0]
    assert resumed, "r2 never resumed"
    # It resumed past its first whole chunks without recomputing them ...
    assert resumed[0][0] >= 2 * CT
    # ... and every request's KV is what a clean run computes.
    for r, p in ((r1, p1), (r2, p2)):
        assert len(r.output_token_ids) == 40
        tokens = [*p, *r.output_token_ids]
        b = engines(settings(sidecar, tenant))
        rb = b.add(make_request("check", tokens[:-1], max_tokens=5))
        b.run_until(lambda rb=rb: rb.output_token_ids)
        hit = (len(tokens) - 2) // CT * CT
        assert b.schedules("check")[0][0] == hit  # loaded, not computed, by b
        assert_kv(b, "check", tokens, hit)


@pytest.mark.parametrize("load_mode", ["sync", "async"])
def test_tensor_parallel_shards(
    engines: Any, sidecar: DevSidecar, tenant: str, load_mode: str
) -> None:
    """TP=2: each worker saves and loads its own heads under its shard's keys; a
    chunk missing on one shard rewinds the request on every rank."""
    extra = settings(sidecar, tenant, load_mode=load_mode)
    prompt = prompt_of(4 * CT + 5, seed=13)
    a = engines(extra, tp=2)
    a.run_to_completion([a.add(make_request("a", prompt))])
    assert [stored_chunks(a, sidecar, tenant, prompt, shard) for shard in (0, 1)] == [4, 4]

    b = engines(extra, tp=2)
    rb = b.add(make_request("b", prompt))
    b.run_until(lambda: rb.output_token_ids)
    assert b.schedules("b")[0] == (4 * CT, 5)
    for rank in (0, 1):
        assert_kv(b, "b", prompt, len(prompt), rank)
    b.run_to_completion([rb])

    # Rank 1's chunk 2 disappears; rank 0 still has all four.
    with SidecarClient(sidecar.socket_path, tenant, staging_bytes=4096) as c:
        salt = c.salt
    assert salt is not None
    keys = chunk_keys(a.connector.contracts.contract(None, 1), salt, prompt)
    sidecar.object_path(tenant, keys[2]).unlink()
    c3 = engines(extra, tp=2)
    rc = c3.add(make_request("c", prompt))
    run_until_recomputed(c3, "c", load_mode, 2 * CT, len(prompt))
    assert c3.invalid_block_ids == set(c3.block_ids("c")[4:8])
    steps = c3.schedules("c")
    assert rewound_to(steps[1:] if load_mode == "sync" else steps, 2 * CT, len(prompt))
    for rank in (0, 1):
        assert_kv(c3, "c", prompt, len(prompt), rank)
    c3.run_to_completion([rc])
    assert [stored_chunks(a, sidecar, tenant, prompt, shard) for shard in (0, 1)] == [4, 4]
