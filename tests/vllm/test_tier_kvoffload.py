"""kvoffload as a secondary tier of vLLM's native offloading, on vLLM's real
``TieringOffloadingSpec`` and tiering manager with a real sidecar process.

The GPU side is a stand-in (tier_driver.gpu_stand_in_write); everything the
scheduler runs is vLLM's code.
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob

from kvoffload.client import call_tenantless
from kvoffload.errors import KVOffloadConfigError
from kvoffload.protocol import Purge

from ..sidecar_proc import DevSidecar, dev_sidecar, wait_until
from . import tier_driver as d

pytestmark = pytest.mark.vllm


def _stored_then_evicted(sidecar: DevSidecar, tenant: str, n: int = 2) -> tuple[object, list, list]:
    spec = d.make_spec([d.kvoffload_tier(str(sidecar.socket_path), tenant)], num_chunks=4)
    mgr = spec.get_manager()
    keys = d.offload_keys(f"prompt-{uuid.uuid4().hex}", n)
    ids = d.store(mgr, "writer", keys, "A")
    want = d.rows_of(mgr)[ids].copy()
    d.evict_primary(mgr, 4)
    ctx = ReqContext("probe")
    with mgr.lock:
        assert [mgr.primary_tier.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * n
    return mgr, keys, want


def test_store_evict_and_load_back_bit_exact(sidecar: DevSidecar, tenant: str) -> None:
    mgr, keys, want = _stored_then_evicted(sidecar, tenant)
    try:
        # Sealed objects of the tenant on disk: its 2 chunks and the 4 that evicted them.
        assert len(sidecar.objects(tenant)) == 6
        ctx = ReqContext("reader")
        with mgr.lock:
            mgr.on_new_request(ctx)
        # Promoted from kvoffload into the primary tier, then HIT there.
        assert d.resolve(mgr, ctx, keys) == [LookupResult.HIT] * 2
        got = d.primary_rows(mgr, ctx, keys)
        assert np.array_equal(got, want)
        stats = mgr.get_stats()
        assert stats is not None
        flat = stats.reduce()
        assert flat["vllm:kv_offload_kvoffload_stored_chunks"] == 6
        assert flat["vllm:kv_offload_kvoffload_loaded_chunks"] == 2
    finally:
        mgr.shutdown()


def test_objects_are_sealed_not_the_row_bytes(sidecar: DevSidecar, tenant: str) -> None:
    mgr, _keys, want = _stored_then_evicted(sidecar, tenant, n=1)
    try:
        objects = sidecar.objects(tenant)
        assert objects
        page = bytes(want[0][:4096])
        for obj in objects:  # AES-GCM: no plaintext page on disk
            assert page not in obj.read_bytes()
    finally:
        mgr.shutdown()


def test_another_tenant_or_model_misses(sidecar: DevSidecar, tenant: str) -> None:
    mgr, keys, _ = _stored_then_evicted(sidecar, tenant, n=1)
    mgr.shutdown()
    for t, extra in ((f"other-{tenant}", {}), (tenant, {"model_revision": "tiny-test@2"})):
        spec = d.make_spec([d.kvoffload_tier(str(sidecar.socket_path), t, **extra)])
        other = spec.get_manager()
        try:
            ctx = ReqContext("r")
            with other.lock:
                other.on_new_request(ctx)
            assert d.resolve(other, ctx, keys) == [LookupResult.MISS]
        finally:
            other.shutdown()


def test_purge_reaches_the_tier(sidecar: DevSidecar, tenant: str) -> None:
    mgr, keys, _ = _stored_then_evicted(sidecar, tenant)
    try:
        call_tenantless(sidecar.socket_path, [Purge(tenant)])
        ctx = ReqContext("after-purge")
        with mgr.lock:
            mgr.on_new_request(ctx)
        assert d.resolve(mgr, ctx, keys) == [LookupResult.MISS] * 2
    finally:
        mgr.shutdown()


def test_failed_load_after_purge_fails_the_job_and_misses_after(
    sidecar: DevSidecar, tenant: str
) -> None:
    """A lookup answered before the purge, a load after it: the job fails, nothing
    is HIT, and the key is then a miss (no livelock of doomed promotions)."""
    mgr, keys, _ = _stored_then_evicted(sidecar, tenant, n=1)
    try:
        t = d.tier(mgr)
        ctx = ReqContext("early")
        with mgr.lock:
            assert t.lookup(keys[0], ctx) is LookupResult.RETRY
        d.run_until(mgr, lambda: t.lookup(keys[0], ctx) is LookupResult.HIT, "tier says HIT")
        call_tenantless(sidecar.socket_path, [Purge(tenant)])
        job = TransferJob(999, [keys[0]], np.array([0], np.int32), True, ctx)
        before = d.rows_of(mgr)[0].copy()
        with mgr.lock:
            t.submit_load(job)
        results: list = []
        d.run_until(mgr, lambda: bool(results.extend(t.get_finished_jobs()) or results), "job done")
        assert [(r.job_id, r.success) for r in results] == [(999, False)]
        assert np.array_equal(d.rows_of(mgr)[0], before)  # staging path: slot untouched
        with mgr.lock:
            assert t.lookup(keys[0], ctx) is LookupResult.MISS
    finally:
        mgr.shutdown()


def test_wedged_then_killed_sidecar_never_stalls_the_scheduler(tenant: str) -> None:
    with dev_sidecar() as sc:
        mgr, keys, _ = _stored_then_evicted(sc, tenant)
        try:
            pid = sc.proc.pid
            os.kill(pid, signal.SIGSTOP)  # wedged: accepts nothing, answers nothing
            try:
                ctx = ReqContext("while-wedged")
                with mgr.lock:
                    mgr.on_new_request(ctx)
                # Each call returns although the sidecar cannot answer.
                assert d.lookup_all(mgr, ctx, keys) == [LookupResult.RETRY] * 2
                d.step(mgr)
                assert d.lookup_all(mgr, ctx, keys) == [LookupResult.RETRY] * 2
                new = d.offload_keys("during-outage", 1)
                wctx = ReqContext("store-while-wedged")
                with mgr.lock:
                    mgr.on_new_request(wctx)
                    out = mgr.prepare_store(new, wctx)
                    assert out is not None
                    mgr.complete_store(new, wctx)  # submit_store: returns, job queued
                    assert mgr.has_pending_work()
            finally:
                os.kill(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGCONT)
            # Dead: the queued store fails, the lookups resolve as misses.
            d.run_until(mgr, lambda: not mgr.has_pending_work(), "jobs failed")
            assert d.resolve(mgr, ctx, keys) == [LookupResult.MISS] * 2
            flat = mgr.get_stats()
            assert flat is not None
            assert flat.reduce()["vllm:kv_offload_kvoffload_failed_store_chunks"] == 1
        finally:
            mgr.shutdown()


def test_events_name_the_storage_medium(sidecar: DevSidecar, tenant: str) -> None:
    tier_cfg = d.kvoffload_tier(str(sidecar.socket_path), tenant, enable_kv_events=True)
    mgr = d.make_spec([tier_cfg], events=True).get_manager()
    try:
        keys = d.offload_keys(uuid.uuid4().hex, 2)
        d.store(mgr, "w", keys, "E")
        with mgr.lock:
            events = list(mgr.take_events())
        mine = [e for e in events if e.medium.name == "STORAGE"]
        assert [(list(e.keys), e.removed) for e in mine] == [(keys, False)]
    finally:
        mgr.shutdown()


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"chunk_tokens": 256}, "unknown option(s) chunk_tokens"),
        ({"io_threads": 0}, "io_threads"),
        ({"locality": "MARS"}, "locality"),
        ({"tenant": "bad tenant!"}, "tenant"),
    ],
)
def test_bad_options_one_clear_error(extra: dict, words: str) -> None:
    cfg = {**d.kvoffload_tier("/nonexistent.sock", "t1"), **extra}
    with pytest.raises(KVOffloadConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        d.make_spec([cfg]).get_manager()


def test_identity_needs_a_model_revision_without_vllm_config() -> None:
    cfg = d.kvoffload_tier("/nonexistent.sock", "t1")
    del cfg["model_revision"]
    with pytest.raises(KVOffloadConfigError, match="model_revision"):
        d.make_spec([cfg]).get_manager()


def test_sidecar_absent_at_start_lookups_miss(tenant: str, tmp_path: object) -> None:
    cfg = d.kvoffload_tier(f"/tmp/kvo-none-{uuid.uuid4().hex[:8]}.sock", tenant)
    mgr = d.make_spec([cfg]).get_manager()
    try:
        keys = d.offload_keys("x", 1)
        ctx = ReqContext("r")
        with mgr.lock:
            mgr.on_new_request(ctx)
        assert d.resolve(mgr, ctx, keys) == [LookupResult.MISS]
        d.store(mgr, "w", d.offload_keys("y", 1), "Y")  # its cascade fails, nothing hangs
        wait_until(lambda: not mgr.has_pending_work(), "no pending work")
    finally:
        mgr.shutdown()


def _policy(tenants: list[str]) -> str:
    names = ", ".join(f'"{t}"' for t in tenants)
    return f"version = 1\n[[grants]]\nuid = {os.getuid()}\ntenants = [{names}]\nadmin = true\n"


def test_revocation_reaches_the_tier(tmp_path: Path, tenant: str) -> None:
    pol = tmp_path / "policy.toml"
    pol.write_text(_policy([tenant]))
    pol.chmod(0o644)
    with dev_sidecar(env={"KVOFFLOAD_POLICY": str(pol)}) as sc:
        mgr, keys, _ = _stored_then_evicted(sc, tenant)
        try:
            gen = int(sc.stats()["policy"]["generation"])
            new = tmp_path / "policy.new"
            new.write_text(_policy(["someone-else"]))
            new.chmod(0o644)
            os.replace(new, pol)  # as an editor saves; the sidecar reloads on the change
            wait_until(lambda: int(sc.stats()["policy"]["generation"]) > gen, "policy reloaded")
            ctx = ReqContext("after-revocation")
            with mgr.lock:
                mgr.on_new_request(ctx)
            assert d.resolve(mgr, ctx, keys) == [LookupResult.MISS] * 2
        finally:
            mgr.shutdown()


def test_identity_from_the_current_vllm_config(tiny_model: Path) -> None:
    """Under vLLM's current config the tier derives the model identity with the
    connector's code, and refuses a non-cryptographic prefix-cache hash."""
    from vllm.config import set_current_vllm_config

    from kvoffload.integrations.vllm.common import model_revision

    from .engine import make_vllm_config

    cfg = d.kvoffload_tier("/nonexistent.sock", "t1")
    del cfg["model_revision"], cfg["tokenizer_hash"]
    cfg["attention_backend"] = "TORCH_SDPA"  # no platform backend on this CPU
    vc = make_vllm_config(tiny_model, {"tenant": "t1"})
    with set_current_vllm_config(vc):
        mgr = d.make_spec([cfg]).get_manager()
        try:
            contract = d.tier(mgr).contract
            assert contract.model_revision == model_revision(vc.model_config)
            assert contract.layer_layout.cache_layout.startswith("vllm-row-v1:")
        finally:
            mgr.shutdown()
        vc.cache_config.prefix_caching_hash_algo = "xxhash"
        with pytest.raises(KVOffloadConfigError, match="prefix_caching_hash_algo"):
            d.make_spec([cfg]).get_manager()


def test_drain_jobs_leaves_every_result_ready(sidecar: DevSidecar, tenant: str) -> None:
    """SecondaryTierManager.drain_jobs: on return, no job touches the primary
    region and each submitted job's result is in the next get_finished_jobs."""
    mgr = d.make_spec([d.kvoffload_tier(str(sidecar.socket_path), tenant)]).get_manager()
    try:
        t = d.tier(mgr)
        ctx = ReqContext("drain")
        keys = d.offload_keys(uuid.uuid4().hex, 4)
        with mgr.lock:
            for j, k in enumerate(keys):
                t.submit_store(TransferJob(100 + j, [k], np.array([j], np.int32), False, ctx))
            t.drain_jobs()
            done = sorted((r.job_id, r.success) for r in t.get_finished_jobs())
        assert done == [(100 + j, True) for j in range(4)]
        assert not t.has_pending_work()
    finally:
        mgr.shutdown()


# -- in place (protocol-v1 §5.34): the sidecar reads and writes the primary region ---------


def test_in_place_store_evict_and_load_back_bit_exact(sidecar: DevSidecar, tenant: str) -> None:
    mgr, keys, want = _stored_then_evicted(sidecar, tenant)
    try:
        t = d.tier(mgr)
        assert t._region is not None  # vLLM's primary region file was reachable
        ctx = ReqContext("reader")
        with mgr.lock:
            mgr.on_new_request(ctx)
        assert d.resolve(mgr, ctx, keys) == [LookupResult.HIT] * 2
        assert np.array_equal(d.primary_rows(mgr, ctx, keys), want)
        stats = mgr.get_stats()
        assert stats is not None
        flat = stats.reduce()
        # Every chunk of both ways moved in place: 6 stored, 2 loaded.
        assert flat["vllm:kv_offload_kvoffload_inplace_chunks"] == 8
        assert flat["vllm:kv_offload_kvoffload_loaded_chunks"] == 2
        # ... and no client's staging buffer ever held a byte of a row.
        for c in t._all_clients:
            assert c.staging is None or not any(c.staging.view)
        counts = t._all_clients[0].stats()["inplace"]
        assert counts["loaded_chunks"] >= 2 and counts["stored_chunks"] >= 6
    finally:
        mgr.shutdown()


def test_in_place_off_uses_staging_and_loads_the_same(sidecar: DevSidecar, tenant: str) -> None:
    spec = d.make_spec(
        [d.kvoffload_tier(str(sidecar.socket_path), tenant, inplace="off")], num_chunks=4
    )
    mgr = spec.get_manager()
    try:
        keys = d.offload_keys(f"prompt-{uuid.uuid4().hex}", 2)
        ids = d.store(mgr, "writer", keys, "A")
        want = d.rows_of(mgr)[ids].copy()
        d.evict_primary(mgr, 4)
        ctx = ReqContext("reader")
        with mgr.lock:
            mgr.on_new_request(ctx)
        assert d.resolve(mgr, ctx, keys) == [LookupResult.HIT] * 2
        assert np.array_equal(d.primary_rows(mgr, ctx, keys), want)
        stats = mgr.get_stats()
        assert stats is not None
        assert "vllm:kv_offload_kvoffload_inplace_chunks" not in stats.reduce()
        assert d.tier(mgr)._region is None
    finally:
        mgr.shutdown()


def test_in_place_bad_setting_one_clear_error(sidecar: DevSidecar, tenant: str) -> None:
    with pytest.raises(KVOffloadConfigError, match="inplace must be one of auto, off"):
        d.make_spec(
            [d.kvoffload_tier(str(sidecar.socket_path), tenant, inplace="yes")], num_chunks=4
        ).get_manager()
