"""kvoffload as SGLang's HiCache L3: SGLang's real HiCacheStorage base, backend
factory, host pool and cache-controller methods, over a real sidecar process.

What cannot run without a GPU (the controller's device pool and process
groups) is the named stand-in of scripts/benchlib/sglang.py; everything that moves
a page is SGLang's code or kvoffload's.
"""

from __future__ import annotations

import os
import subprocess
from array import array
from typing import Any

import pytest

from kvoffload.testing import cli_argv

from ..sidecar_proc import DevSidecar, clean_env, dev_sidecar

try:
    from benchlib.sglang import (
        controller_stand_in,
        dynamic_extra,
        host_pool,
        import_sglang,
        storage_config,
    )

    import_sglang()
except ImportError as exc:  # the main venv: no SGLang
    pytest.skip(f"SGLang is not installed ({exc}); make pytest-sglang", allow_module_level=True)

import torch
from sglang.srt.managers.cache_controller import PrefetchOperation, StorageOperation
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

from kvoffload.integrations.sglang.identity import SettingsError
from kvoffload.integrations.sglang.storage import KvoffloadStorage

PAGE = 4


def _backend(sc: DevSidecar, tenant: str, pool: Any, **kw: Any) -> Any:
    extra = dynamic_extra(str(sc.socket_path), tenant, **kw.pop("extra", {}))
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra, **kw), pool)
    b.register_mem_pool_host(pool)
    return b


def _tokens(n_pages: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 32000 for i in range(n_pages * PAGE)]


def _hashes(tokens: list[int], **salt: str) -> list[str]:
    key: Any = RadixKey(array("l", tokens), **salt) if salt else tokens
    out = get_storage_hash_str(key, None, page_size=PAGE)
    assert isinstance(out, list)
    return out


def _fill(pool: Any, n_pages: int, seed: int) -> torch.Tensor:
    idx = pool.alloc(n_pages * PAGE)
    assert idx is not None
    g = torch.Generator().manual_seed(seed)
    for p in range(n_pages):
        i = int(idx[p * PAGE])
        page = pool.get_data_page(i, flat=True)
        pool.set_from_flat_data_page(i, torch.randn(page.shape, generator=g).to(page.dtype))
    return idx


def _pages(pool: Any, idx: torch.Tensor) -> list[torch.Tensor]:
    n = idx.numel() // PAGE
    return [pool.get_data_page(int(idx[p * PAGE]), flat=True).clone() for p in range(n)]


def _purge(sc: DevSidecar, tenant: str) -> None:
    r = subprocess.run(
        cli_argv("--dev", "purge", "--tenant", tenant, "--yes"),
        cwd=sc.workdir,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
def test_controller_backs_up_and_prefetches_through_the_sidecar(
    sidecar: DevSidecar, tenant: str, layout: str
) -> None:
    pool = host_pool(layout, page_size=PAGE)
    backend = _backend(sidecar, tenant, pool)
    assert isinstance(backend, KvoffloadStorage)
    ctrl = controller_stand_in(backend, pool)
    tokens = _tokens(5)
    hashes = _hashes(tokens)
    src = _fill(pool, 5, seed=1)
    want = _pages(pool, src)

    # The controller's backup thread: batch_set_v1 over the host indices.
    op = StorageOperation(src, tokens, hash_value=hashes, prefix_keys=[])
    ctrl._page_backup(op)
    assert op.completed_tokens == 5 * PAGE

    # Its prefetch thread: the hit query, then the transfer into fresh host pages.
    pre = PrefetchOperation("req-1", tokens, prefix_keys=[])
    found, hit_tokens = ctrl._storage_hit_query(pre)
    assert (found, hit_tokens) == (hashes, 5 * PAGE)
    dst = pool.alloc(5 * PAGE)
    pre.hash_value, pre.host_indices = found, dst
    assert ctrl._page_transfer(pre) == 5
    assert all(torch.equal(a, b) for a, b in zip(_pages(pool, dst), want, strict=True))
    backend.close()


def test_hits_are_a_leading_run_and_loads_stop_at_the_first_miss(
    sidecar: DevSidecar, tenant: str
) -> None:
    pool = host_pool(page_size=PAGE)
    b = _backend(sidecar, tenant, pool)
    hashes = _hashes(_tokens(4, seed=2))
    src = _fill(pool, 4, seed=2)
    keep = [0, 1, 3]
    sel = torch.cat([src[p * PAGE : (p + 1) * PAGE] for p in keep])
    assert b.batch_set_v1([hashes[p] for p in keep], sel) == [True] * 3
    assert b.batch_exists(hashes) == 2
    assert b.exists(hashes[3]) and not b.exists(hashes[2])
    dst = pool.alloc(4 * PAGE)
    assert b.batch_get_v1(hashes, dst) == [True, True, False, False]
    # A host-index count that is not pages x page size: all False, never None.
    assert b.batch_get_v1(hashes, dst[:-1]) == [False] * 4
    assert b.batch_set_v1(hashes, dst[:-1]) == [False] * 4
    b.close()


def test_generic_get_set_interoperate_with_v1(sidecar: DevSidecar, tenant: str) -> None:
    pool = host_pool(page_size=PAGE)
    b = _backend(sidecar, tenant, pool)
    hashes = _hashes(_tokens(2, seed=3))
    src = _fill(pool, 2, seed=3)
    pages = _pages(pool, src)
    assert b.batch_set(hashes, pages) is True
    got = b.batch_get(hashes, [pool.get_dummy_flat_data_page() for _ in hashes])
    assert all(g is not None and torch.equal(g, p) for g, p in zip(got, pages, strict=True))
    dst = pool.alloc(2 * PAGE)
    assert b.batch_get_v1(hashes, dst) == [True, True]
    assert all(torch.equal(a, p) for a, p in zip(_pages(pool, dst), pages, strict=True))
    assert b.get("f" * 64, pool.get_dummy_flat_data_page()) is None
    b.close()


def test_another_tenant_or_salt_never_hits_and_a_purge_is_misses(
    sidecar: DevSidecar, tenant: str
) -> None:
    pool = host_pool(page_size=PAGE)
    mine = _backend(sidecar, tenant, pool)
    other = _backend(sidecar, tenant + "-other", pool)
    tokens = _tokens(3, seed=4)
    hashes = _hashes(tokens, cache_salt="alice")
    src = _fill(pool, 3, seed=4)
    assert mine.batch_set_v1(hashes, src) == [True] * 3
    assert mine.batch_exists(hashes) == 3
    dst = pool.alloc(3 * PAGE)
    # The same SGLang keys under another tenant: its own salt, so other chunk keys.
    assert other.batch_exists(hashes) == 0
    assert other.batch_get_v1(hashes, dst) == [False] * 3
    # The same tokens under another cache_salt (SGLang seeds its key chain with it).
    assert mine.batch_exists(_hashes(tokens, cache_salt="mallory")) == 0
    assert mine.batch_exists(_hashes(tokens)) == 0
    _purge(sidecar, tenant)
    assert mine.batch_exists(hashes) == 0
    assert mine.batch_get_v1(hashes, dst) == [False] * 3
    mine.close()
    other.close()


def test_a_damaged_page_is_a_miss(sidecar: DevSidecar, tenant: str) -> None:
    pool = host_pool(page_size=PAGE)
    b = _backend(sidecar, tenant, pool)
    hashes = _hashes(_tokens(1, seed=5))
    src = _fill(pool, 1, seed=5)
    assert b.batch_set_v1(hashes, src) == [True]
    (obj,) = sidecar.objects(tenant)
    raw = bytearray(obj.read_bytes())
    raw[-100] ^= 0xFF
    obj.write_bytes(bytes(raw))
    assert b.batch_get_v1(hashes, pool.alloc(PAGE)) == [False]
    b.close()


def test_tp_shards_are_apart_and_mla_has_one_writer(sidecar: DevSidecar, tenant: str) -> None:
    pool = host_pool(page_size=PAGE)
    hashes = _hashes(_tokens(2, seed=6))
    src = _fill(pool, 2, seed=6)
    r0 = _backend(sidecar, tenant, pool, tp_rank=0, tp_size=2)
    r1 = _backend(sidecar, tenant, pool, tp_rank=1, tp_size=2)
    assert r0.batch_set_v1(hashes, src) == [True, True]
    assert r1.batch_exists(hashes) == 0  # MHA: rank 1 holds other heads
    m1 = _backend(sidecar, tenant, pool, tp_rank=1, tp_size=2, is_mla_model=True)
    assert not m1.is_writer
    assert m1.batch_set_v1(hashes, src) == [True, True]  # the writer's job
    assert m1.batch_exists(hashes) == 0
    m0 = _backend(sidecar, tenant, pool, tp_rank=0, tp_size=2, is_mla_model=True)
    assert m0.batch_set_v1(hashes, src) == [True, True]
    assert m1.batch_exists(hashes) == 2  # every MLA rank reads the writer's pages
    for b in (r0, r1, m0, m1):
        b.close()


def test_v2_pools_have_their_own_pages(sidecar: DevSidecar, tenant: str) -> None:
    kv = host_pool(page_size=PAGE)
    state = host_pool(page_size=PAGE, layers=1, heads=1)
    b = _backend(sidecar, tenant, kv)
    b.register_mem_host_pool_v2(state, "mamba")
    hashes = _hashes(_tokens(3, seed=7))
    kv_src = _fill(kv, 3, seed=7)
    st_src = _fill(state, 3, seed=8)
    assert b.batch_set_v1(hashes, kv_src) == [True] * 3
    # Only the last page's state is stored (a trailing-window pool).
    last = PoolTransfer(name="mamba", host_indices=st_src[2 * PAGE :], keys=hashes[2:])
    assert b.batch_set_v2([last]) == {"mamba": [True]}
    trailing = PoolTransfer(name="mamba", keys=hashes[2:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    res = b.batch_exists_v2(hashes, [trailing])
    assert res.kv_hit_pages == 3 and res.restorable_prefix_pages == [3]
    every = PoolTransfer(name="mamba", keys=hashes, hit_policy=PoolHitPolicy.ALL_PAGES)
    assert b.batch_exists_v2(hashes, [every]).kv_hit_pages == 0
    dst = state.alloc(PAGE)
    got = b.batch_get_v2([PoolTransfer(name="mamba", host_indices=dst, keys=hashes[2:])])
    assert got == {"mamba": [True]}
    assert torch.equal(
        state.get_data_page(int(dst[0]), flat=True),
        state.get_data_page(int(st_src[2 * PAGE]), flat=True),
    )
    b.close()


def test_no_sidecar_is_misses_and_failed_stores(tmp_path: Any, tenant: str) -> None:
    pool = host_pool(page_size=PAGE)
    extra = dynamic_extra(str(tmp_path / "absent.sock"), tenant, timeout_s=1)
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool)
    b.register_mem_pool_host(pool)
    hashes = _hashes(_tokens(2, seed=9))
    src = _fill(pool, 2, seed=9)
    assert b.batch_exists(hashes) == 0
    assert b.batch_set_v1(hashes, src) == [False, False]
    assert b.batch_get_v1(hashes, src) == [False, False]
    b.close()


def test_a_typo_in_extra_config_is_one_clear_error(tmp_path: Any) -> None:
    pool = host_pool(page_size=PAGE)
    extra = dynamic_extra(str(tmp_path / "s.sock"), "t", tenat="x")
    with pytest.raises(SettingsError, match=r"unknown key.*'tenat'"):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool)


def test_a_tenant_over_its_quota_stores_nothing_and_hits_nothing(tmp_path: Any) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text(
        'version = 1\n[tenants.full]\nquota = "0B"\n'
        f'[[grants]]\nuid = {os.getuid()}\ntenants = ["*"]\nadmin = true\n'
    )
    policy.chmod(0o644)
    pool = host_pool(page_size=PAGE)
    hashes = _hashes(_tokens(2, seed=10))
    src = _fill(pool, 2, seed=10)
    with dev_sidecar(env={"KVOFFLOAD_POLICY": str(policy)}) as sc:
        b = _backend(sc, "full", pool)
        assert b.batch_set_v1(hashes, src) == [False, False]
        assert b.batch_exists(hashes) == 0
        assert b.batch_get_v1(hashes, pool.alloc(2 * PAGE)) == [False, False]
        assert sc.objects("full") == [] and sc.tmp_files() == []
        b.close()
