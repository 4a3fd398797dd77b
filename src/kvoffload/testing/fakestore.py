"""An in-memory test double of the whole store port (:class:`~kvoffload.sidecar.ports.StoreAPI`).

:class:`FakeStore` pins down the daemon, not the engine: every call the daemon
makes on a store is answered from a dict, with the same contract where a test
can see it (capacity as :class:`~kvoffload.errors.StoreFull`, a miss ends a
prefix, pins counted, purges remove). It records who asked for what (tenants
seen, pins, touches, audit records) so tests can assert it. Test doubles with
special behaviour subclass it and override one call.

What it does not model, on purpose: the direct path (a lease is refused as an
I/O error, a lease load is a miss), the page-cache fast paths (``lookup_cached``
and ``payload_info_cached`` always defer to the pool, so tests control timing),
the RAM tier and shared roots. Imports the store's value types, so not for a
worker process (:mod:`kvoffload.testing` itself stays standard library only).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload.errors import StoreFull, StoreIOError

from ..layouts import v1
from ..sidecar.ports import StoreAPI
from ..store import (
    ChunkRecord,
    FsckReport,
    ReadLease,
    SealedLease,
    StoreConfig,
    StoreLease,
    Usage,
)
from ..store.api import TIER_INDEX, TIER_KEYS, TIER_OBJECTS, PurgeReport, RetentionSettings

ALIGN = 4096


@dataclass(frozen=True)
class FakeLayout:
    store_id: str = "fake-store"
    version: int = 1


#: (namespace, created_ns) of a chunk a test put into ``data`` itself.
_NO_META = (bytes(32), 0)


class FakeReservation:
    """Capacity held by a :class:`FakeStore` until released (once)."""

    def __init__(self, store: FakeStore, n: int) -> None:
        self.store = store
        self.n = n
        self.released = False

    def release(self) -> None:
        with self.store.mu:
            if not self.released:
                self.released = True
                self.store.reserved -= self.n


class FakeStore:
    """See the module docstring. ``capacity``: bytes of payload it holds at most."""

    def __init__(self, capacity: int | None = None) -> None:
        self.mu = threading.Lock()
        #: (tenant, key) → the chunk's layers; a test may fill it directly.
        self.data: dict[tuple[str, bytes], list[bytes]] = {}
        #: (tenant, key) → (namespace, created_ns) of what :meth:`put` stored.
        self.meta: dict[tuple[str, bytes], tuple[bytes, int]] = {}
        self.salts: dict[str, bytes] = {}
        self.capacity = capacity
        self.reserved = 0
        self.pins: Counter[tuple[str, bytes]] = Counter()
        self.touched: list[tuple[str, bytes]] = []
        self.tenants_seen: set[str] = set()
        self.audit: list[tuple[str, dict[str, Any]]] = []
        self.contracts: dict[tuple[str, bytes], dict[str, Any]] = {}
        self.retention: Callable[[str], RetentionSettings | None] | None = None
        self._layout = FakeLayout()
        self._config = StoreConfig(root=Path("/nonexistent/fake-store"), capacity_bytes=capacity)

    def _saw(self, tenant: str) -> None:
        self.tenants_seen.add(tenant)

    def _record(self, tenant: str, key: bytes, layers: list[bytes]) -> ChunkRecord:
        size = sum(len(x) for x in layers)
        ns, created = self.meta.get((tenant, key), _NO_META)
        return ChunkRecord(tenant, key, ns, 0, size, size, len(layers), created, created, 0)

    # -- facts ----------------------------------------------------------------------
    @property
    def layout(self) -> FakeLayout:
        return self._layout

    @property
    def config(self) -> StoreConfig:
        return self._config

    @property
    def durability(self) -> str:
        return "batch"

    @property
    def alignment(self) -> int:
        return ALIGN

    @property
    def used_bytes(self) -> int:
        return sum(len(b) for layers in self.data.values() for b in layers)

    @property
    def has_ram_tier(self) -> bool:
        return False

    def stats(self) -> dict[str, Any]:
        return {"store_id": self._layout.store_id, "chunks": len(self.data), "tenants": 7}

    def shared_info(self) -> dict[str, Any] | None:
        return None

    # -- tenants, retention, the audit log ----------------------------------------
    def tenant_salt(self, tenant: str) -> bytes:
        self._saw(tenant)
        return self.salts.setdefault(tenant, os.urandom(32))

    def tenants(self) -> list[str]:
        return sorted(self.salts)

    def key_problems(self) -> dict[str, str]:
        return {}

    def set_retention(self, provider: Callable[[str], RetentionSettings | None] | None) -> None:
        self.retention = provider

    def record_audit(self, event: str, details: dict[str, Any]) -> None:
        self.audit.append((event, dict(details)))

    # -- writes ---------------------------------------------------------------------
    def shape_ok(self, lengths: Sequence[int], encrypt: bool) -> bool:
        return v1.shape_ok(lengths, encrypt)

    def reserve(self, tenant: str, nbytes: int, *, quota: int | None = None) -> FakeReservation:
        self._saw(tenant)
        with self.mu:
            used = self.used_bytes
            if self.capacity is not None and used + self.reserved + nbytes > self.capacity:
                raise StoreFull(nbytes, self.capacity, used)
            self.reserved += nbytes
        return FakeReservation(self, nbytes)

    def reserve_chunk(
        self, tenant: str, lengths: Sequence[int], *, encrypt: bool, quota: int | None = None
    ) -> Any:
        # What a real object of these layers costs on disk (layout-v1.md §3).
        return self.reserve(tenant, v1.object_size(lengths, encrypt), quota=quota)

    def put(
        self,
        tenant: str,
        namespace: bytes,
        chunk_key: bytes,
        layers: Sequence[memoryview],
        *,
        encrypt: bool = True,
        ttl_s: float | None = None,
        reservation: Any = None,
    ) -> bool:
        self._saw(tenant)
        if reservation is not None:
            reservation.release()
        if (tenant, chunk_key) in self.data:
            return False
        self.data[(tenant, chunk_key)] = [bytes(x) for x in layers]
        self.meta[(tenant, chunk_key)] = (namespace, time.time_ns())
        return True

    def put_many(
        self,
        tenant: str,
        namespace: bytes,
        chunks: Sequence[tuple[bytes, Sequence[memoryview]]],
        *,
        encrypt: bool = True,
        ttl_s: float | None = None,
        reservations: Sequence[Any] | None = None,
    ) -> list[bool]:
        res = list(reservations) if reservations is not None else [None] * len(chunks)
        return [
            self.put(tenant, namespace, k, layers, encrypt=encrypt, ttl_s=ttl_s, reservation=r)
            for (k, layers), r in zip(chunks, res, strict=True)
        ]

    def record_contract(self, tenant: str, namespace: bytes, fields: Mapping[str, Any]) -> bool:
        new = (tenant, namespace) not in self.contracts
        self.contracts[(tenant, namespace)] = dict(fields)
        return new

    # -- reads ----------------------------------------------------------------------
    def lookup(self, tenant: str, keys: Sequence[bytes]) -> int:
        self._saw(tenant)
        n = 0
        while n < len(keys) and (tenant, keys[n]) in self.data:
            n += 1
        return n

    def lookup_cached(self, tenant: str, keys: Sequence[bytes]) -> int | None:
        return None  # always the pool path: tests control lookups' timing

    def payload_info(self, tenant: str, chunk_key: bytes) -> ChunkRecord | None:
        self._saw(tenant)
        layers = self.data.get((tenant, chunk_key))
        return None if layers is None else self._record(tenant, chunk_key, layers)

    def payload_info_cached(self, tenant: str, key: bytes) -> tuple[bool, ChunkRecord | None]:
        return False, None  # always the pool path

    def pin(self, tenant: str, keys: Sequence[bytes]) -> None:
        with self.mu:
            self.pins.update((tenant, k) for k in keys)

    def unpin(self, tenant: str, keys: Sequence[bytes]) -> None:
        with self.mu:
            self.pins.subtract((tenant, k) for k in keys)
            self.pins = +self.pins

    def touch(self, tenant: str, keys: Sequence[bytes]) -> None:
        self._saw(tenant)
        self.touched += [(tenant, k) for k in keys]

    def delete(self, tenant: str, key: bytes) -> bool:
        self._saw(tenant)
        return self.data.pop((tenant, key), None) is not None

    def load_guard(self, tenant: str) -> Callable[[int], None]:
        return lambda _i: None

    def get_into(self, tenant: str, chunk_key: bytes, out: memoryview) -> list[int] | None:
        self._saw(tenant)
        layers = self.data.get((tenant, chunk_key))
        if layers is None:
            return None
        pos = 0
        for x in layers:
            out[pos : pos + len(x)] = x
            pos += len(x)
        return [len(x) for x in layers]

    def load_planned(
        self,
        tenant: str,
        recs: Sequence[ChunkRecord],
        outs: Sequence[memoryview],
        guard: Callable[[int], None],
        on_chunk: Callable[[int, list[int]], None] | None = None,
    ) -> list[list[int] | None]:
        results: list[list[int] | None] = []
        for i, (rec, out) in enumerate(zip(recs, outs, strict=True)):
            got = self.get_into(tenant, rec.chunk_key, out)
            results.append(got)
            if got is None:  # a miss ends the prefix
                return results + [None] * (len(recs) - len(results))
            if on_chunk is not None:
                on_chunk(i, got)
        return results

    def load_planned_cached(
        self,
        tenant: str,
        recs: Sequence[ChunkRecord],
        outs: Sequence[memoryview],
        guard: Callable[[int], None],
    ) -> list[list[int] | None]:
        return []  # every chunk "would wait": the pool reads it

    def load_planned_layerwise(
        self,
        tenant: str,
        recs: Sequence[ChunkRecord],
        outs: Sequence[memoryview],
        plan: Callable[[list[tuple[int, ...]]], None],
        report: Callable[[int, int], None],
        cancelled: Callable[[int], bool],
        guard: Callable[[int], None],
    ) -> list[list[int] | None]:
        chunks = [self.data.get((tenant, r.chunk_key)) for r in recs]
        n = next((i for i, c in enumerate(chunks) if c is None), len(chunks))
        found = [c for c in chunks[:n] if c is not None]
        plan([tuple(len(x) for x in c) for c in found])
        pos = [0] * len(found)
        for layer in range(max((len(c) for c in found), default=0)):
            if cancelled(layer):
                return [None] * len(recs)
            for j, c in enumerate(found):
                if layer < len(c):
                    outs[j][pos[j] : pos[j] + len(c[layer])] = c[layer]
                    pos[j] += len(c[layer])
            report(layer + 1, len(found))
        got: list[list[int] | None] = [[len(x) for x in c] for c in found]
        return got + [None] * (len(recs) - len(found))

    def cancel_loads(self, tenant: str) -> None:
        pass

    def drop_cache(self) -> tuple[int, int]:
        return 0, 0

    # -- the direct path: not modelled ------------------------------------------------
    def lease_store(
        self,
        tenant: str,
        namespace: bytes,
        chunk_key: bytes,
        lengths: Sequence[int],
        *,
        ttl_s: float | None = None,
        gid: int | None = None,
        quota: int | None = None,
    ) -> StoreLease | None:
        raise StoreIOError("the fake store has no direct path", errno.EOPNOTSUPP)

    def publish_lease(self, lease: StoreLease) -> bool:
        return False

    def cancel_lease(self, lease: StoreLease) -> None:
        pass

    def lease_load(self, tenant: str, key: bytes) -> ReadLease | None:
        return None

    def sealed_lease(self, tenant: str, key: bytes) -> SealedLease | None:
        return None

    def check_reported(self, tenant: str, key: bytes) -> bool:
        return False

    # -- admin: views, purges, fsck, contracts ----------------------------------------
    def chunks(
        self, tenant: str | None = None, namespace: bytes | None = None
    ) -> Iterator[ChunkRecord]:
        for (t, k), layers in sorted(self.data.items()):
            rec = self._record(t, k, layers)
            if (tenant is None or t == tenant) and (
                namespace is None or rec.namespace == namespace
            ):
                yield rec

    def chunk_count(self) -> int:
        return len(self.data)

    def tenant_usage(self) -> dict[str, Usage]:
        out: dict[str, Usage] = {}
        for rec in self.chunks():
            u = out.get(rec.tenant, Usage(0, 0))
            out[rec.tenant] = Usage(u.bytes + rec.size, u.count + 1)
        return out

    def namespace_usage(self, tenant: str) -> dict[bytes, Usage]:
        out: dict[bytes, Usage] = {}
        for rec in self.chunks(tenant):
            u = out.get(rec.namespace, Usage(0, 0))
            out[rec.namespace] = Usage(u.bytes + rec.size, u.count + 1)
        return out

    def _remove(self, hit: Callable[[ChunkRecord], bool]) -> int:
        gone = [(r.tenant, r.chunk_key) for r in self.chunks() if hit(r)]
        for k in gone:
            del self.data[k]
            self.meta.pop(k, None)
        return len(gone)

    def purge(self, tenant: str, namespace: bytes | None = None) -> PurgeReport:
        """What the real store's purge reports, of what this double holds: the key
        (a whole-tenant purge, if it had one), then the chunks' objects and records."""
        report = PurgeReport(tenant, namespace)
        if namespace is None:
            report.reach(TIER_KEYS, int(tenant in self.salts))
            report.removed = self.purge_tenant(tenant, wait=True)
        else:
            report.removed = self.purge_namespace(tenant, namespace)
        report.reach(TIER_OBJECTS, report.removed)
        report.reach(TIER_INDEX, report.removed)
        return report

    def purge_tenant(self, tenant: str, *, wait: bool = False) -> int:
        self.salts.pop(tenant, None)
        return self._remove(lambda r: r.tenant == tenant)

    def purge_namespace(self, tenant: str, namespace: bytes) -> int:
        return self._remove(lambda r: r.tenant == tenant and r.namespace == namespace)

    def purge_older_than(self, age_s: float, tenant: str | None = None) -> int:
        cut = time.time_ns() - int(min(age_s, 1e10) * 1e9)
        return self._remove(lambda r: (tenant is None or r.tenant == tenant) and r.created_ns < cut)

    def fsck(
        self,
        repair: bool = False,
        *,
        verify_data: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> FsckReport:
        n = len(self.data)
        return FsckReport(objects_on_disk=n, index_records=n, ok=n, repaired=repair)

    def maintain(self) -> dict[str, int]:
        return {"expired": 0, "tmp_removed": 0}

    def namespaces_report(
        self, tenant: str | None = None, *, ages: bool = False
    ) -> list[dict[str, Any]]:
        return [
            {
                "tenant": t,
                "namespace": ns.hex(),
                "contract": dict(fields),
                "chunks": u.count,
                "bytes": u.bytes,
            }
            for (t, ns), fields in sorted(self.contracts.items())
            if tenant is None or t == tenant
            for u in [self.namespace_usage(t).get(ns, Usage(0, 0))]
        ]

    def invalidate(
        self,
        selector: Mapping[str, str],
        *,
        tenant: str | None = None,
        dry_run: bool = False,
        actor: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        matched = [
            row
            for row in self.namespaces_report(tenant)
            if all(str(row["contract"].get(k)) == v for k, v in selector.items())
        ]
        removed = 0
        if not dry_run:
            for row in matched:
                removed += self.purge_namespace(row["tenant"], bytes.fromhex(row["namespace"]))
        return {
            "dry_run": dry_run,
            "selector": dict(selector),
            "tenant": tenant,
            "namespaces": matched,
            "removed_namespaces": len(matched),
            "removed_chunks": removed,
            "removed_bytes": sum(row["bytes"] for row in matched),
            "unknown_contract": [],
            "shared_root": False,
        }


__all__ = ["FakeLayout", "FakeReservation", "FakeStore"]


def _conforms(store: FakeStore) -> StoreAPI:
    """Checked by mypy: the double implements the whole port."""
    return store
