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
    objs = sidecar.objects(tenant)
    assert len(objs) == 2  # a page_first page: its K run and its V run, one chunk each
    obj = objs[1]
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


# -- in place: the host pool in shared memory (extra_config "allocator": "shm") ------


def _moved(sc: DevSidecar) -> tuple[int, int]:
    st = sc.stats()["inplace"]
    return int(st.get("stored_chunks", 0)), int(st.get("loaded_chunks", 0))


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "page_head"])
def test_a_shared_memory_pool_moves_pages_in_place(
    sidecar: DevSidecar, tenant: str, layout: str
) -> None:
    """SGLang's ShmHostTensorAllocator puts the pool in a memfd: the backend hands it
    to the sidecar, which reads a backup from it and writes a prefetch into it (each
    page's K and V runs one chunk each); the controller's calls are unchanged."""
    pool = host_pool(layout, page_size=PAGE, allocator="shm")
    backend = _backend(sidecar, tenant, pool, extra={"allocator": "shm"})
    ctrl = controller_stand_in(backend, pool)
    tokens = _tokens(5, seed=11)
    hashes = _hashes(tokens)
    src = _fill(pool, 5, seed=11)
    want = _pages(pool, src)
    stored0, loaded0 = _moved(sidecar)
    op = StorageOperation(src, tokens, hash_value=hashes, prefix_keys=[])
    ctrl._page_backup(op)
    assert op.completed_tokens == 5 * PAGE
    pre = PrefetchOperation("req-ip", tokens, prefix_keys=[])
    assert ctrl._storage_hit_query(pre) == (hashes, 5 * PAGE)
    dst = pool.alloc(5 * PAGE)
    pre.hash_value, pre.host_indices = hashes, dst
    assert ctrl._page_transfer(pre) == 5
    assert all(torch.equal(a, b) for a, b in zip(_pages(pool, dst), want, strict=True))
    assert _moved(sidecar) == (stored0 + 10, loaded0 + 10)
    backend.close()


def test_pages_in_place_and_through_staging_are_the_same_chunks(
    sidecar: DevSidecar, tenant: str
) -> None:
    """A page backed up through staging (a pool not in shared memory) loads in place
    into a shared-memory pool, and the other way round: one identity, two paths."""
    plain = host_pool(page_size=PAGE)
    shm = host_pool(page_size=PAGE, allocator="shm")
    staged, inplace = _backend(sidecar, tenant, plain), _backend(sidecar, tenant, shm)
    h1, h2 = _hashes(_tokens(2, seed=12)), _hashes(_tokens(2, seed=13))
    s1, s2 = _fill(plain, 2, seed=12), _fill(shm, 2, seed=13)
    assert staged.batch_set_v1(h1, s1) == [True, True]
    assert inplace.batch_set_v1(h2, s2) == [True, True]
    d1, d2 = shm.alloc(2 * PAGE), plain.alloc(2 * PAGE)
    stored0, loaded0 = _moved(sidecar)
    assert inplace.batch_get_v1(h1, d1) == [True, True]
    assert staged.batch_get_v1(h2, d2) == [True, True]
    assert all(torch.equal(a, b) for a, b in zip(_pages(shm, d1), _pages(plain, s1), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(_pages(plain, d2), _pages(shm, s2), strict=True))
    assert _moved(sidecar) == (stored0, loaded0 + 4)  # only the shared pool's load
    staged.close()
    inplace.close()


def test_in_place_another_tenant_or_salt_never_hits_and_a_purge_is_misses(
    sidecar: DevSidecar, tenant: str
) -> None:
    """Isolation holds on the in-place path: a miss writes nothing into the pool."""
    pool = host_pool(page_size=PAGE, allocator="shm")
    mine = _backend(sidecar, tenant, pool)
    other = _backend(sidecar, tenant + "-other", pool)
    tokens = _tokens(3, seed=14)
    hashes = _hashes(tokens, cache_salt="alice")
    src = _fill(pool, 3, seed=14)
    stored0, _ = _moved(sidecar)
    assert mine.batch_set_v1(hashes, src) == [True] * 3
    assert _moved(sidecar)[0] == stored0 + 6  # in place: the path under test
    assert mine.batch_exists(hashes) == 3
    dst = _fill(pool, 3, seed=15)
    before = _pages(pool, dst)
    assert other.batch_exists(hashes) == 0
    assert other.batch_get_v1(hashes, dst) == [False] * 3
    assert mine.batch_get_v1(_hashes(tokens, cache_salt="mallory"), dst) == [False] * 3
    assert mine.batch_get_v1(_hashes(tokens), dst) == [False] * 3
    _purge(sidecar, tenant)
    assert mine.batch_exists(hashes) == 0
    assert mine.batch_get_v1(hashes, dst) == [False] * 3
    assert all(torch.equal(a, b) for a, b in zip(_pages(pool, dst), before, strict=True))
    mine.close()
    other.close()


def test_in_place_a_damaged_page_is_a_miss_and_leaves_the_pool_as_it_was(
    sidecar: DevSidecar, tenant: str
) -> None:
    pool = host_pool(page_size=PAGE, allocator="shm")
    b = _backend(sidecar, tenant, pool)
    hashes = _hashes(_tokens(1, seed=16))
    stored0, _ = _moved(sidecar)
    assert b.batch_set_v1(hashes, _fill(pool, 1, seed=16)) == [True]
    assert _moved(sidecar)[0] == stored0 + 2
    for obj in sidecar.objects(tenant):
        raw = bytearray(obj.read_bytes())
        raw[-100] ^= 0xFF
        obj.write_bytes(bytes(raw))
    dst = _fill(pool, 1, seed=17)
    before = _pages(pool, dst)
    assert b.batch_get_v1(hashes, dst) == [False]
    assert torch.equal(_pages(pool, dst)[0], before[0])
    b.close()


def test_layer_first_and_inplace_off_stage_even_in_shared_memory(
    sidecar: DevSidecar, tenant: str
) -> None:
    """A layer_first page is dozens of runs (one chunk through staging), and
    ``"inplace": "off"`` stages whatever the pool: right bytes, nothing moved in place."""
    for layout, extra in (("layer_first", {}), ("page_first", {"inplace": "off"})):
        pool = host_pool(layout, page_size=PAGE, allocator="shm")
        b = _backend(sidecar, tenant, pool, extra=extra)
        hashes = _hashes(_tokens(2, seed=18), cache_salt=layout)
        src = _fill(pool, 2, seed=18)
        moved = _moved(sidecar)
        assert b.batch_set_v1(hashes, src) == [True, True]
        dst = pool.alloc(2 * PAGE)
        assert b.batch_get_v1(hashes, dst) == [True, True]
        assert all(
            torch.equal(x, y) for x, y in zip(_pages(pool, dst), _pages(pool, src), strict=True)
        )
        assert _moved(sidecar) == moved
        b.close()
    with pytest.raises(SettingsError, match="'inplace' must be one of auto, off"):
        _backend(sidecar, tenant, host_pool(page_size=PAGE), extra={"inplace": "yes"})


def test_a_sidecar_before_revision_17_gets_the_pages_through_staging(
    sock_dir: Any, store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that announces no ``max_region`` (older than revision 17): the
    shared-memory pool's pages go through staging, whole, and nothing in place."""
    from kvoffload.sidecar import session as session_mod
    from tests.sidecar.inthread import ServerThread, grants

    monkeypatch.setattr(session_mod, "MAX_REGION_BYTES", 0)
    st = ServerThread(sock_dir, store, grants("old-sidecar"))
    try:
        pool = host_pool(page_size=PAGE, allocator="shm")
        extra = dynamic_extra(str(st.path), "old-sidecar")
        b = StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool)
        b.register_mem_pool_host(pool)
        hashes = _hashes(_tokens(2, seed=19))
        src = _fill(pool, 2, seed=19)
        assert b.batch_set_v1(hashes, src) == [True, True]
        dst = pool.alloc(2 * PAGE)
        assert b.batch_get_v1(hashes, dst) == [True, True]
        assert all(
            torch.equal(x, y) for x, y in zip(_pages(pool, dst), _pages(pool, src), strict=True)
        )
        assert st.server.service.inplace.snapshot() == {}
        b.close()
    finally:
        st.stop()
