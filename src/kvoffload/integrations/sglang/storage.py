"""``KvoffloadStorage``: SGLang's ``HiCacheStorage`` backed by the kvoffload sidecar.

SGLang loads it with ``--hicache-storage-backend dynamic`` (its
``StorageBackendFactory`` calls ``KvoffloadStorage(storage_config, kwargs)``),
registers the host pool, and with ``"interface_v1": 1`` in the extra config its
cache controller calls ``batch_exists`` / ``batch_get_v1`` / ``batch_set_v1``
over host-pool indices; the generic ``get``/``set``/``batch_get``/``batch_set``
and the v2 hybrid-pool calls work too.

Every answer comes from the sidecar, which verifies a chunk before it says
"loaded" and never shows a store that did not complete: a page is a hit only
if its bytes are whole and authentic, under this tenant, this namespace and
this pool. Sidecar down, restarting or refusing: misses and failed stores,
logged (rate-limited) by the client, never an exception into SGLang's threads.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)

from ...client import SidecarClient
from ...protocol import ALIGNMENT
from .identity import (
    Coordinates,
    KeyMapper,
    PoolShape,
    Settings,
    SettingsError,
    chunk_plan,
    make_contract,
)
from .inplace import PoolRegions, Span, adjacent_runs
from .pages import byte_view, page_regions

log = logging.getLogger("kvoffload.sglang")

KV_POOL = "kv"


@dataclass
class _Pool:
    """One registered host pool: its namespace, key mapper and page geometry, and
    its files where it is in shared memory (in-place transfers; None: staging)."""

    name: str
    host: Any
    shape: PoolShape
    keys: KeyMapper
    regions: PoolRegions | None = None

    @property
    def parts(self) -> int:
        return len(self.shape.plan)

    def runs(self, index: int) -> list[list[torch.Tensor]] | None:
        """The page at ``index`` as views of the pool, one list per chunk; None where
        it does not split as the plan says (the caller copies through a flat page)."""
        regions = page_regions(self.host, index)
        if regions is None:
            return None
        plan = self.shape.plan
        runs = [regions] if len(plan) == 1 else adjacent_runs(regions)
        sizes = [tuple(int(t.numel() * t.element_size()) for t in r) for r in runs]
        return runs if tuple(sizes) == plan else None


def _pool_shape(name: str, host: Any) -> PoolShape:
    page_size = int(getattr(host, "page_size", 1) or 1)
    flat = host.get_dummy_flat_data_page()
    page_bytes = int(flat.numel() * flat.element_size())
    regions = page_regions(host, 0)
    layer_bytes = (
        tuple(int(r.numel() * r.element_size()) for r in regions) if regions else (page_bytes,)
    )
    if sum(layer_bytes) != page_bytes:
        layer_bytes = (page_bytes,)
    runs = adjacent_runs(regions) if regions else []
    chunks = chunk_plan(
        [tuple(int(t.numel() * t.element_size()) for t in r) for r in runs]
        if sum(layer_bytes) == page_bytes and len(layer_bytes) > 1
        else []
    )
    head_dim = getattr(host, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim <= 0:
        rank = getattr(host, "kv_lora_rank", 0) or 0
        rope = getattr(host, "qk_rope_head_dim", 0) or 0
        head_dim = rank + rope if rank + rope > 0 else max(1, page_bytes // page_size)
    heads = getattr(host, "head_num", 1)
    layers = getattr(host, "layer_num", 1)
    return PoolShape(
        pool=name,
        kind=type(host).__name__,
        layout=str(getattr(host, "layout", "unknown")),
        dtype=str(getattr(host, "dtype", "unknown")).removeprefix("torch."),
        page_size=page_size,
        num_layers=layers if isinstance(layers, int) and layers > 0 else 1,
        num_heads=heads if isinstance(heads, int) and heads > 0 else 1,
        head_dim=head_dim,
        page_bytes=page_bytes,
        layer_bytes=layer_bytes,
        chunks=chunks,
    )


def _split(view: memoryview, sizes: tuple[int, ...]) -> list[memoryview]:
    out, at = [], 0
    for n in sizes:
        out.append(view[at : at + n])
        at += n
    return out


def _split_plan(view: memoryview, plan: tuple[tuple[int, ...], ...]) -> list[list[memoryview]]:
    """A flat page's bytes as the layers of each of its chunks."""
    out, at = [], 0
    for sizes in plan:
        n = sum(sizes)
        out.append(_split(view[at : at + n], sizes))
        at += n
    return out


def _prefix(ok: list[bool]) -> list[bool]:
    """Hits count only as a leading run (a load after a miss is not used)."""
    n = ok.index(False) if False in ok else len(ok)
    return [True] * n + [False] * (len(ok) - n)


def _pages_ok(ok: list[bool], parts: int) -> list[bool]:
    """Per page: every one of its ``parts`` chunks ok, as a leading run of pages."""
    return _prefix([all(ok[p * parts : (p + 1) * parts]) for p in range(len(ok) // parts)])


class KvoffloadStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang: untyped
    """A HiCache L3 backend whose pages live in the node's kvoffload sidecar."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.settings = Settings.from_extra_config(storage_config.extra_config)
        self.config = storage_config
        self.coords = Coordinates(
            model_name=storage_config.model_name,
            tp_rank=storage_config.tp_rank,
            tp_size=storage_config.tp_size,
            pp_rank=storage_config.pp_rank,
            pp_size=storage_config.pp_size,
            cp_rank=storage_config.attn_cp_rank,
            cp_size=storage_config.attn_cp_size,
            dcp_rank=storage_config.dcp_rank,
            dcp_size=storage_config.dcp_size,
            is_mla=storage_config.is_mla_model,
            split_heads=storage_config.should_split_heads,
        )
        #: MLA: one rank writes, every rank reads (``is_storage_writer``).
        self.is_writer = bool(storage_config.is_storage_writer)
        c = self.coords
        self.client = SidecarClient(
            self.settings.socket_path,
            self.settings.tenant,
            staging_bytes=self.settings.staging_bytes,
            timeout_s=self.settings.timeout_s,
            name=(
                f"sglang pid={os.getpid()} tp={c.tp_rank}/{c.tp_size} pp={c.pp_rank}/{c.pp_size}"
                f" dp={storage_config.dp_rank} cp={c.cp_rank}/{c.cp_size}"
            ),
        )
        self._pools: dict[str, _Pool] = {}
        self._lock = threading.Lock()

    # -- registration ----------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._register(KV_POOL, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._register(str(host_pool_name), host_pool)

    def _register(self, name: str, host: Any) -> None:
        shape = _pool_shape(name, host)
        need = shape.page_bytes + ALIGNMENT * len(shape.layer_bytes)
        if need > self.client.staging_bytes:
            raise SettingsError(
                f"kvoffload: a {name!r} page needs {need} bytes of staging; raise "
                f"'staging_bytes' in extra_config above {self.client.staging_bytes}"
            )
        contract = make_contract(self.settings, self.coords, shape)
        self.client.register_contract(contract)
        pool = _Pool(name, host, shape, KeyMapper(contract, name, len(shape.plan)))
        if self.settings.inplace == "auto":
            pool.regions = PoolRegions.of(self.client, host)
            why = 'the pool is not in shared memory: extra_config "allocator": "shm"'
            if pool.regions is not None and self._spans(pool, [0]) is None:
                pool.regions, why = None, "a page of this layout is not one or two runs"
            log.info(
                "kvoffload: %s pool %r: pages move %s",
                shape.layout,
                name,
                "in place (the sidecar reads and writes its shared-memory file)"
                if pool.regions is not None
                else f"through staging ({why})",
            )
        with self._lock:
            self._pools[name] = pool

    def _pool(self, name: str) -> _Pool | None:
        with self._lock:
            return self._pools.get(name)

    def _chunk_keys(self, pool: _Pool, keys: list[str]) -> list[bytes] | None:
        """The chunk keys of ``keys``' pages, ``pool.parts`` per page, page by page."""
        salt = self.client.salt
        return pool.keys.keys(salt, keys) if salt is not None else None

    # -- lookups ---------------------------------------------------------------

    def _leading(self, pool_name: str, keys: list[str]) -> int:
        pool = self._pool(pool_name)
        if pool is None or not keys:
            return 0
        ck = self._chunk_keys(pool, list(keys))
        return self.client.lookup(ck) // pool.parts if ck else 0

    def exists(self, key: str) -> bool:
        return self._leading(KV_POOL, [key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading ``keys`` the sidecar holds (SGLang's hit query)."""
        return self._leading(KV_POOL, list(keys))

    # -- v1: pages by host-pool index ----------------------------------------

    def _indices(self, pool: _Pool, n: int, host_indices: torch.Tensor | None) -> list[int] | None:
        ps = pool.shape.page_size
        if host_indices is None or host_indices.numel() != n * ps:
            log.error(
                "kvoffload: %s pages but %s host indices for pool %s (page size %s)",
                n,
                0 if host_indices is None else host_indices.numel(),
                pool.name,
                ps,
            )
            return None
        flat = host_indices.reshape(-1)
        return [int(flat[i * ps].item()) for i in range(n)]

    def _spans(self, pool: _Pool, idx: list[int]) -> list[Span] | None:
        """Every chunk of the pages at ``idx`` as a span of the pool's files, or None
        where one is not (then the whole batch stages)."""
        if pool.regions is None:
            return None
        spans: list[Span] = []
        for i in idx:
            runs = pool.runs(i)
            if runs is None:
                return None
            for run in runs:
                sp = pool.regions.span(run)
                if sp is None:
                    return None
                spans.append(sp)
        return spans

    def _get_pages(self, pool_name: str, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        n = len(keys)
        pool = self._pool(pool_name)
        idx = self._indices(pool, n, host_indices) if pool is not None else None
        if pool is None or idx is None or n == 0:
            return [False] * n
        ck = self._chunk_keys(pool, list(keys))
        if not ck:
            return [False] * n
        spans = self._spans(pool, idx)
        if spans is not None:
            # Verified by the sidecar, then written into the pool's file (§5.34);
            # a chunk of other layer sizes is a miss and no byte of it lands.
            done = self.client.load_in_place(ck, spans)
            if done is not None:
                return _pages_ok(done, pool.parts)
        return self._get_staged(pool, ck, idx)

    def _get_staged(self, pool: _Pool, ck: list[bytes], idx: list[int]) -> list[bool]:
        parts, plan = pool.parts, pool.shape.plan
        scratch: dict[int, torch.Tensor] = {}
        bad: set[int] = set()

        def dest_for(i: int, _key: bytes, sizes: Any) -> list[Any]:
            page, part = divmod(i, parts)
            if tuple(sizes) != plan[part]:
                # Not a chunk of this geometry: never copied into the pool.
                bad.add(page)
                return [bytearray(s) for s in sizes]
            runs = pool.runs(idx[page])
            if runs is not None:
                return [byte_view(r) for r in runs[part]]
            if page not in scratch:
                scratch[page] = pool.host.get_dummy_flat_data_page()
            return _split_plan(byte_view(scratch[page]), plan)[part]

        ok = _pages_ok(self.client.load_to(ck, dest_for), parts)
        ok = _prefix([o and p not in bad for p, o in enumerate(ok)])
        for p, t in scratch.items():
            if ok[p]:
                pool.host.set_from_flat_data_page(idx[p], t)
        return ok

    def _set_pages(self, pool_name: str, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        n = len(keys)
        pool = self._pool(pool_name)
        idx = self._indices(pool, n, host_indices) if pool is not None else None
        if pool is None or idx is None or n == 0:
            return [False] * n
        if not self.is_writer:
            # MLA: another rank writes these pages (SGLang skips this rank's backups).
            return [True] * n
        ck = self._chunk_keys(pool, list(keys))
        if not ck:
            return [False] * n
        spans = self._spans(pool, idx)
        if spans is not None:
            done = self._save(pool, ck, spans, in_place=True)
            if done is not None:
                return done
        chunks: list[list[memoryview]] = []
        for i in idx:
            runs = pool.runs(i)
            if runs is None:
                flat = pool.host.get_data_page(i, flat=True).contiguous().cpu()
                chunks.extend(_split_plan(byte_view(flat), pool.shape.plan))
            else:
                chunks.extend([byte_view(t) for t in r] for r in runs)
        got = self._save(pool, ck, chunks, in_place=False)
        assert got is not None
        return got

    def _save(
        self, pool: _Pool, ck: list[bytes], what: list[Any], *, in_place: bool
    ) -> list[bool] | None:
        """Store each chunk once (a page named twice in a batch is one chunk); per page,
        all of its chunks stored. ``what``: spans (in place) or layers (staged);
        None: the sidecar does not serve in-place stores (the caller stages)."""
        uniq: dict[bytes, int] = {}
        for i, k in enumerate(ck):
            uniq.setdefault(k, i)
        firsts = list(uniq.values())
        batch = [(ck[i], what[i]) for i in firsts]
        ttl = self.settings.ttl_s
        if in_place:
            stored = self.client.save_in_place(pool.keys.namespace, batch, ttl_s=ttl)
            if stored is None:
                return None
        else:
            stored = self.client.save(pool.keys.namespace, batch, ttl_s=ttl)
        by_key = {ck[i]: ok for i, ok in zip(firsts, stored, strict=True)}
        parts = pool.parts
        return [
            all(by_key[k] for k in ck[p * parts : (p + 1) * parts]) for p in range(len(ck) // parts)
        ]

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        return self._get_pages(KV_POOL, list(keys), host_indices)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        return self._set_pages(KV_POOL, list(keys), host_indices)

    # -- generic: flat page tensors ------------------------------------------

    def get(
        self,
        key: str,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        keys = list(keys)
        pool = self._pool(KV_POOL)
        if pool is None or not keys:
            return [None] * len(keys)
        targets = list(target_locations or [None] * len(keys))
        targets = [t if t is not None else pool.host.get_dummy_flat_data_page() for t in targets]
        ck = self._chunk_keys(pool, keys)
        if not ck:
            return [None] * len(keys)
        parts, plan = pool.parts, pool.shape.plan
        page_bytes = sum(pool.shape.layer_bytes)

        def dest_for(i: int, _key: bytes, got: Any) -> list[Any]:
            page, part = divmod(i, parts)
            t = targets[page]
            if t is None or tuple(got) != plan[part] or t.numel() * t.element_size() != page_bytes:
                targets[page] = None
                return [bytearray(s) for s in got]
            return _split_plan(byte_view(t), plan)[part]

        ok = _pages_ok(self.client.load_to(ck, dest_for), parts)
        return [t if o else None for t, o in zip(targets, ok, strict=True)]

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        keys = list(keys)
        pool = self._pool(KV_POOL)
        vals = list(values or [])
        if pool is None or len(vals) != len(keys):
            return False
        if not keys or not self.is_writer:
            return True
        page_bytes = sum(pool.shape.layer_bytes)
        chunks: list[list[memoryview]] = []
        for v in vals:
            t = v.contiguous().cpu()
            if t.numel() * t.element_size() != page_bytes:
                log.error("kvoffload: a page of %s bytes, expected %s", t.nbytes, page_bytes)
                return False
            chunks.extend(_split_plan(byte_view(t), pool.shape.plan))
        ck = self._chunk_keys(pool, keys)
        return ck is not None and all(self._save(pool, ck, chunks, in_place=False) or [False])

    # -- v2: hybrid pools ------------------------------------------------------

    def _each_present(self, pool_name: str, keys: list[str]) -> list[bool]:
        pool = self._pool(pool_name)
        if pool is None:
            return [False] * len(keys)
        ck = self._chunk_keys(pool, keys)
        if not ck:
            return [False] * len(keys)
        n = pool.parts
        return [self.client.lookup(ck[p * n : (p + 1) * n]) == n for p in range(len(keys))]

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        keys = list(keys)
        kv = self._leading(KV_POOL, keys)
        hits: dict[str, int] = {KV_POOL: kv} if kv else {}
        restorable = list(range(1, kv + 1))
        for t in pool_transfers or []:
            if not restorable:
                break
            name = str(t.name)
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = self._leading(name, keys[:kv])
                ok = set(range(1, boundary + 1))
            elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                have = self._each_present(name, keys[:kv])
                window = max(1, len(t.keys) if t.keys else 1)
                ok = {n for n in range(1, kv + 1) if all(have[max(0, n - window) : n])}
                boundary = max(ok, default=0)
            else:
                # BLOCK_GROUPS (compressed pools) is not supported: a miss, never a guess.
                ok, boundary = set(), 0
            if boundary:
                hits[name] = boundary
            restorable = [p for p in restorable if p in ok]
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        return {
            str(t.name): self._get_pages(str(t.name), list(t.keys or []), t.host_indices)
            for t in transfers
        }

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        return {
            str(t.name): self._set_pages(str(t.name), list(t.keys or []), t.host_indices)
            for t in transfers
        }

    # -- the rest ----------------------------------------------------------------

    def clear(self) -> None:
        """SGLang's ``flush_cache`` clears L3 too; a node's store is shared by every
        engine and node on it, so it is purged by its operator (``kvoffload purge``)."""
        log.warning(
            "kvoffload: not clearing tenant %r from the engine; run "
            "`kvoffload purge --tenant %s` to remove its pages",
            self.settings.tenant,
            self.settings.tenant,
        )

    def get_stats(self) -> None:
        return None

    def close(self) -> None:
        self.client.close()
