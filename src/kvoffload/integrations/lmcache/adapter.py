"""LMCache's L2 adapter interface over the kvoffload sidecar: the plugin class.

Loaded by LMCache 0.5.6's multi-process server with::

    --l2-adapter '{"type": "plugin",
                   "module_path": "kvoffload.integrations.lmcache.adapter",
                   "class_name": "KVOffloadL2Adapter",
                   "adapter_params": {"socket": "/run/kvoffload/kvoffload.sock"}}'

LMCache finds :class:`KVOffloadL2AdapterConfig` by its name (the class name +
``Config``) and builds it from ``adapter_params`` (docs/lmcache.md). Each
``ObjectKey`` becomes a kvoffload chunk of the tenant its ``cache_salt`` maps to
(:mod:`.policy`); the object's bytes go to the sidecar as one layer, which
seals them with the tenant's key, so no LMCache serde is stacked on top. What
the sidecar guarantees holds as for any client: a load is verified before a
single byte is handed out, a failed or partial store is never visible, quotas,
purges and revocations apply, events are published, a shared root is shared.

Every call LMCache makes returns at once: stores run on one worker thread,
lookups and loads on another, each with its own sidecar connections (one per
tenant), and completion is signalled on the three event fds LMCache polls. A
sidecar that is down, restarting or refusing the tenant gives misses and failed
stores, never an exception into LMCache.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import MappingProxyType
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import EncodedObjectKey, KeyEntry, KeyListPage, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

from ...client import ChunkTooLarge, SidecarClient, fetch_stats
from ...contract import CompatContract
from ...errors import ConnectorConfigError
from ...protocol import EngineBlocks
from .policy import Settings, announces, object_chunk_key

log = logging.getLogger("kvoffload.lmcache")

_STORE, _LOAD = "store", "load"


class KVOffloadL2AdapterConfig(L2AdapterConfigBase):  # type: ignore[misc]
    """The plugin's config: ``adapter_params`` checked into :class:`.policy.Settings`."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVOffloadL2AdapterConfig:
        try:
            return cls(Settings.from_dict(d))
        except ConnectorConfigError as exc:
            raise ValueError(str(exc)) from None

    @classmethod
    def help(cls) -> str:
        return (
            "kvoffload L2 adapter (adapter_params; docs/lmcache.md):\n"
            "- socket (str): the sidecar's socket (default /run/kvoffload/kvoffload.sock)\n"
            "- tenants (object): cache_salt -> kvoffload tenant\n"
            "- default_tenant (str|null): tenant of other salts (default 'default'; null: "
            "not cached)\n"
            "- salt_as_tenant (bool): an unmapped salt that is a tenant id is its own tenant\n"
            "- max_capacity_bytes (int): pool size reported to LMCache (0: the sidecar's)\n"
            "- staging_bytes (int), timeout_s (float), usage_refresh_s (float)\n"
            "- contract (object): model_revision, tokenizer_hash, kv_dtype, ... of the chunks"
        )


class _Namespaces:
    """Contracts and fingerprints per (tenant, model, kv_rank), computed once."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._cache: dict[tuple[str, str, int], tuple[CompatContract, bytes]] = {}
        self._lock = threading.Lock()

    def get(self, tenant: str, model: str, kv_rank: int) -> tuple[CompatContract, bytes]:
        k = (tenant, model, kv_rank)
        with self._lock:
            hit = self._cache.get(k)
            if hit is None:
                c = self._settings.contract_for(tenant, model, kv_rank)
                hit = self._cache[k] = (c, c.fingerprint())
            return hit


class KVOffloadL2Adapter(L2AdapterInterface):  # type: ignore[misc]
    """LMCache ``L2AdapterInterface`` backed by the kvoffload sidecar (module docstring)."""

    def __init__(
        self,
        config: KVOffloadL2AdapterConfig | Mapping[str, Any],
        l1_memory_desc: Any = None,
        *,
        connect: Callable[[str, str], SidecarClient] | None = None,
    ) -> None:
        if not isinstance(config, KVOffloadL2AdapterConfig):
            config = KVOffloadL2AdapterConfig.from_dict(dict(config))
        s = self._settings = config.settings
        self._stats_at = float("-inf")
        self._stats: dict[str, Any] | None = None
        self._stats_lock = threading.Lock()
        cap = s.max_capacity_bytes or int((self._sidecar_stats() or {}).get("capacity_bytes") or 0)
        super().__init__(max_capacity_bytes=cap)
        self._connect = connect or self._new_client
        self._ns = _Namespaces(s)
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._lock = threading.Lock()
        self._next_id = 0
        self._done_store: dict[int, Any] = {}
        self._done_lookup: dict[int, Any] = {}
        self._done_load: dict[int, Any] = {}
        self._clients: dict[tuple[str, str], SidecarClient] = {}
        #: Objects this server stored or loaded, with their sizes (list_l2_keys, delete).
        self._known: dict[ObjectKey, int] = {}
        self._unmapped_warned: set[str] = set()
        self._old_sidecar_warned: set[str] = set()
        self._pools = {
            _STORE: ThreadPoolExecutor(1, thread_name_prefix="kvoffload-l2-store"),
            _LOAD: ThreadPoolExecutor(1, thread_name_prefix="kvoffload-l2-load"),
        }
        self._closed = False
        log.info(
            "kvoffload L2 adapter on %s (capacity reported: %s bytes)",
            s.socket,
            cap if cap else "unbounded",
        )

    # -- event fds -----------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return int(self._store_efd.fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._lookup_efd.fileno())

    def get_load_event_fd(self) -> int:
        return int(self._load_efd.fileno())

    # -- tasks ---------------------------------------------------------------------

    def _task_id(self) -> int:
        with self._lock:
            self._next_id += 1
            return self._next_id

    def submit_store_task(self, keys: list[ObjectKey], objects: list[Any]) -> int:
        tid = self._task_id()
        self._pools[_STORE].submit(self._run_store, tid, list(keys), list(objects))
        return tid

    def pop_completed_store_tasks(self) -> dict[int, Any]:
        with self._lock:
            done, self._done_store = self._done_store, {}
        return done

    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, Any]
    ) -> int:
        tid = self._task_id()
        self._pools[_LOAD].submit(self._run_lookup, tid, list(keys))
        return tid

    def query_lookup_and_lock_result(self, task_id: int) -> Any:
        with self._lock:
            return self._done_lookup.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        """Nothing to release: the sidecar verifies at load, so a chunk evicted or
        purged between lookup and load loads as a miss, never as other bytes."""

    def submit_load_task(self, keys: list[ObjectKey], objects: list[Any]) -> int:
        tid = self._task_id()
        self._pools[_LOAD].submit(self._run_load, tid, list(keys), list(objects))
        return tid

    def query_load_result(self, task_id: int) -> Any:
        with self._lock:
            return self._done_load.pop(task_id, None)

    # -- sidecar connections and identities ----------------------------------------

    def _new_client(self, role: str, tenant: str) -> SidecarClient:
        s = self._settings
        return SidecarClient(
            s.socket,
            tenant,
            staging_bytes=s.staging_bytes,
            timeout_s=s.timeout_s,
            name=f"lmcache-l2 {role}",
        )

    def _client(self, role: str, tenant: str) -> SidecarClient:
        with self._lock:
            c = self._clients.get((role, tenant))
            if c is None:
                c = self._clients[(role, tenant)] = self._connect(role, tenant)
            return c

    def _tenant(self, key: ObjectKey) -> str | None:
        t = self._settings.tenant_of(key.cache_salt)
        if t is None and key.cache_salt not in self._unmapped_warned:
            self._unmapped_warned.add(key.cache_salt)
            log.warning(
                "cache_salt %r maps to no kvoffload tenant (adapter_params.tenants, "
                "default_tenant): its objects are not cached",
                key.cache_salt,
            )
        return t

    def _groups(
        self, role: str, keys: Sequence[ObjectKey]
    ) -> tuple[dict[str, list[tuple[int, bytes, bytes, CompatContract]]], list[int]]:
        """Per tenant: (index, chunk key, namespace, contract) of each key, in order; and
        the indices of keys that map to no tenant or whose sidecar is unavailable."""
        groups: dict[str, list[tuple[int, bytes, bytes, CompatContract]]] = {}
        lost: list[int] = []
        salts: dict[str, bytes | None] = {}
        for i, k in enumerate(keys):
            tenant = self._tenant(k)
            if tenant is None:
                lost.append(i)
                continue
            if tenant not in salts:
                salts[tenant] = self._client(role, tenant).salt
            salt = salts[tenant]
            if salt is None:
                lost.append(i)
                continue
            contract, ns = self._ns.get(tenant, k.model_name, k.kv_rank)
            ck = object_chunk_key(
                ns, salt, k.chunk_hash, k.kv_rank, k.object_group_id, k.cache_salt
            )
            groups.setdefault(tenant, []).append((i, ck, ns, contract))
        return groups, lost

    # -- workers -------------------------------------------------------------------

    def _run_store(self, tid: int, keys: list[ObjectKey], objects: list[Any]) -> None:
        ok = True
        stored: list[ObjectKey] = []
        sizes: list[int] = []
        try:
            groups, lost = self._groups(_STORE, keys)
            ok = not lost
            for tenant, items in groups.items():
                ok = self._store_tenant(tenant, keys, objects, items, stored, sizes) and ok
        except Exception:
            log.exception("kvoffload L2 store task %d failed", tid)
            ok = False
        if stored:
            with self._lock:
                self._known.update(zip(stored, sizes, strict=True))
            self._notify_keys_stored(stored, sizes)
        with self._lock:
            self._done_store[tid] = L2StoreResult(ok, sum(sizes))
        self._store_efd.notify()

    def _store_tenant(
        self,
        tenant: str,
        keys: list[ObjectKey],
        objects: list[Any],
        items: list[tuple[int, bytes, bytes, CompatContract]],
        stored: list[ObjectKey],
        sizes: list[int],
    ) -> bool:
        client = self._client(_STORE, tenant)
        by_ns: dict[bytes, list[tuple[int, bytes]]] = {}
        seen: set[bytes] = set()
        for i, ck, ns, contract in items:
            if ck in seen:  # the same object twice in one task: store it once
                continue
            seen.add(ck)
            client.register_contract(contract)
            by_ns.setdefault(ns, []).append((i, ck))
        ok = True
        for ns, batch in by_ns.items():
            views = [objects[i].byte_array for i, _ in batch]
            blocks = [self._blocks(keys[i]) for i, _ in batch]
            try:
                res = client.save(
                    ns,
                    [(ck, [v]) for (_, ck), v in zip(batch, views, strict=True)],
                    blocks=blocks,
                )
            except ChunkTooLarge as exc:
                log.warning("kvoffload L2 store: %s (adapter_params.staging_bytes)", exc)
                res = [False] * len(batch)
            for (i, _), v, r in zip(batch, views, res, strict=True):
                if r:
                    stored.append(keys[i])
                    sizes.append(len(v))
                else:
                    ok = False
        return ok

    def _blocks(self, key: ObjectKey) -> EngineBlocks | None:
        """The object in LMCache's own event terms (its vLLM connector announces the
        same ``chunk_hash`` for the chunk in CPU memory): published by the sidecar on
        its KV-event feed with ``medium`` STORAGE. One writer per chunk hash (rank
        0, group 0), so that another rank's copy going does not retract it."""
        h = bytes(key.chunk_hash)
        if not announces(key.kv_rank, key.object_group_id) or not 1 <= len(h) <= 64:
            return None
        return EngineBlocks(hashes=(h,), block_size=self._settings.chunk_tokens)

    def _run_lookup(self, tid: int, keys: list[ObjectKey]) -> None:
        bitmap = Bitmap(len(keys))
        try:
            groups, _ = self._groups(_LOAD, keys)
            for tenant, items in groups.items():
                found = self._client(_LOAD, tenant).lookup([ck for _, ck, _, _ in items])
                for i, _, _, _ in items[:found]:
                    bitmap.set(i)
        except Exception:
            log.exception("kvoffload L2 lookup task %d failed", tid)
            bitmap = Bitmap(len(keys))
        with self._lock:
            self._done_lookup[tid] = bitmap
        self._lookup_efd.notify()

    def _run_load(self, tid: int, keys: list[ObjectKey], objects: list[Any]) -> None:
        bitmap = Bitmap(len(keys))
        loaded: list[ObjectKey] = []
        try:
            groups, _ = self._groups(_LOAD, keys)
            for tenant, items in groups.items():
                for i in self._load_tenant(tenant, objects, items):
                    bitmap.set(i)
                    loaded.append(keys[i])
        except Exception:
            log.exception("kvoffload L2 load task %d failed", tid)
            bitmap, loaded = Bitmap(len(keys)), []
        if loaded:
            with self._lock:
                for k in loaded:
                    self._known.setdefault(k, 0)
            self._notify_keys_accessed(loaded)
        with self._lock:
            self._done_load[tid] = bitmap
        self._load_efd.notify()

    def _load_tenant(
        self, tenant: str, objects: list[Any], items: list[tuple[int, bytes, bytes, CompatContract]]
    ) -> list[int]:
        """Load one tenant's objects into LMCache's buffers; the indices that loaded.

        A stored chunk whose size is not the buffer's (another layout or dtype under
        the same key) is a miss: its bytes go to a scratch buffer, never LMCache's."""
        wrong: set[int] = set()
        dests = [objects[i].byte_array for i, _, _, _ in items]

        def dest_for(idx: int, _key: bytes, layer_sizes: Sequence[int]) -> Sequence[Any]:
            if list(layer_sizes) == [len(dests[idx])]:
                return [dests[idx]]
            wrong.add(idx)
            return [bytearray(n) for n in layer_sizes]

        oks = self._client(_LOAD, tenant).load_to([ck for _, ck, _, _ in items], dest_for)
        if wrong:
            log.warning(
                "kvoffload L2 load: %d chunk(s) of tenant %s have another size than "
                "LMCache's buffer: served as misses",
                len(wrong),
                tenant,
            )
        return [items[j][0] for j, ok in enumerate(oks) if ok and j not in wrong]

    # -- eviction, listing, usage --------------------------------------------------

    def delete(self, keys: list[ObjectKey]) -> None:
        """LMCache's eviction controller discards ``keys``: each is removed from the
        sidecar (protocol-v1 §5.35, under the tenant its salt maps to, so no other
        salt's or tenant's chunk is reached), and listeners hear of the ones that
        were there. Waits for the store worker, so a store submitted before this
        call is removed too, and a lookup after it misses.

        Against a sidecar older than revision 18 the keys only leave this
        adapter's accounting and listing, and the sidecar's own eviction
        reclaims the bytes (a hit until then is still the verified chunk)."""
        keys = list(keys)
        if not keys or self._closed:
            return
        try:
            removed = self._pools[_STORE].submit(self._delete, keys).result()
        except Exception:
            log.exception("kvoffload L2 delete of %d object(s) failed", len(keys))
            removed = [False] * len(keys)
        gone: list[ObjectKey] = []
        sizes: list[int] = []
        with self._lock:
            for k, held in zip(keys, removed, strict=True):
                n = self._known.pop(k, None)
                if held or n is not None:
                    gone.append(k)
                    sizes.append(n or 0)
        if gone:
            self._notify_keys_deleted(gone, sizes)

    def _delete(self, keys: list[ObjectKey]) -> list[bool]:
        """Per key, whether the sidecar held it and removed it."""
        out = [False] * len(keys)
        groups, _ = self._groups(_STORE, keys)
        for tenant, items in groups.items():
            got = self._client(_STORE, tenant).delete([ck for _, ck, _, _ in items])
            if got is None:
                if tenant not in self._old_sidecar_warned:
                    self._old_sidecar_warned.add(tenant)
                    log.warning(
                        "kvoffload sidecar has no delete (older than protocol revision 18): "
                        "objects LMCache evicts stay until the sidecar evicts them"
                    )
                continue
            for (i, _, _, _), held in zip(items, got, strict=True):
                out[i] = out[i] or held
        return out

    def list_l2_keys(
        self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None
    ) -> KeyListPage:
        """Objects this server stored or loaded since it started that the sidecar
        still holds (kvoffload's chunk keys are one-way: the sidecar cannot name
        LMCache's keys). ``cursor``: the offset of the next entry, as a string."""
        if page_size <= 0:
            raise ValueError(f"page_size must be positive (got {page_size})")
        try:
            start = int(cursor) if cursor else 0
        except ValueError:
            raise ValueError(f"malformed cursor {cursor!r}") from None
        if start < 0:
            raise ValueError(f"malformed cursor {cursor!r}")
        with self._lock:
            known = sorted(
                ((k, n) for k, n in self._known.items() if model_name in (None, k.model_name)),
                key=lambda kn: (kn[0].model_name, kn[0].cache_salt, kn[0].chunk_hash),
            )
        page = known[start : start + page_size]
        entries = []
        for k, n in page:
            groups, _ = self._groups(_LOAD, [k])
            for tenant, items in groups.items():
                if self._client(_LOAD, tenant).lookup([items[0][1]]) == 1:
                    entries.append(KeyEntry(key=_encoded(k), size_bytes=n))
        nxt = start + page_size
        return KeyListPage(
            entries=tuple(entries), next_page_token=str(nxt) if nxt < len(known) else None
        )

    def _sidecar_stats(self) -> dict[str, Any] | None:
        with self._stats_lock:
            now = time.monotonic()
            if now - self._stats_at >= self._settings.usage_refresh_s:
                self._stats_at = now
                try:
                    self._stats = fetch_stats(self._settings.socket, timeout_s=5.0)
                except Exception as exc:
                    log.debug("kvoffload L2 usage: sidecar stats unavailable: %s", exc)
                    self._stats = None
            return self._stats

    def get_usage(self) -> AdapterUsage:
        """The sidecar's bytes, not this process's tally: right after a restart and with
        other writers on the node or a shared root. Per cache salt: the tenant's bytes
        where the salt is its tenant's only mapped salt; this server's tally otherwise."""
        base = super().get_usage()
        st = self._sidecar_stats()
        if st is None:
            return base
        tu = st.get("tenant_usage") or {}

        def used(tenant: str) -> int:
            return int((tu.get(tenant) or {}).get("bytes", 0))

        per = dict(base.bytes_by_cache_salt)
        for salt, tenant in self._settings.salts_alone().items():
            if used(tenant) > 0:
                per[salt] = used(tenant)
            else:
                per.pop(salt, None)
        if self._settings.max_capacity_bytes:
            tenants = {t for t in (self._settings.tenant_of(s) for s in per) if t}
            tenants |= set(self._settings.tenants.values())
            total = sum(used(t) for t in tenants)
        else:
            total = int(st.get("used_bytes") or 0)
        return AdapterUsage(
            total_bytes_used=total,
            total_capacity_bytes=self._max_capacity_bytes,
            bytes_by_cache_salt=MappingProxyType(per),
        )

    def report_status(self) -> dict[str, Any]:
        st = self._sidecar_stats()
        usage = self.get_usage()
        return {
            "is_healthy": st is not None and not self._closed,
            "type": "KVOffloadL2Adapter",
            "socket": self._settings.socket,
            "store_id": (st or {}).get("store_id"),
            "current_size_bytes": usage.total_bytes_used,
            "max_capacity_bytes": usage.total_capacity_bytes,
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for pool in self._pools.values():
            pool.shutdown(wait=True, cancel_futures=False)
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()
        for efd in (self._store_efd, self._lookup_efd, self._load_efd):
            efd.close()


def _encoded(k: ObjectKey) -> EncodedObjectKey:
    return k.to_encoded_object_key()
