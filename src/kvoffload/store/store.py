"""The :class:`Store`: it opens its parts in order (each on a shared
:class:`~.state.StoreState` and the parts before it), closes them in reverse,
and delegates every public method to the part that does the work.

Every public method leaves through the store boundary (:func:`~.state.boundary`):
index failures become :class:`StoreIOError`, keyring failures
:class:`StoreKeyError`; a chunk that cannot be read is a miss, never an exception.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import StoreIOError
from ..layouts import LayoutInfo, record_kek_id, v1
from . import opening
from .api import (
    ChunkRecord,
    EventsHook,
    FsckReport,
    LoadPlan,
    PurgeReport,
    ReadLease,
    Reservation,
    SealedLease,
    StoreLease,
    Usage,
)
from .capacity import Capacity
from .config import StoreConfig
from .files import Durability, syncfs
from .keys.keyring import Kek
from .layerwise import Layerwise, PlanFn, ReportFn
from .leases import Leases
from .maintenance import Maintenance
from .peers import Peers
from .purge import Purges
from .reads import Reads
from .removal import Removal
from .shared.root import check_unshared_open
from .state import RetentionProvider, boundary, log, mapped_errors
from .views import Views
from .writes import Layers, Writes

Guard = Callable[[int], None]
Keys = Sequence[bytes]
Outs = Sequence[memoryview]
Recs = Sequence[ChunkRecord]
Results = list[list[int] | None]
OnChunk = Callable[[int, list[int]], None] | None
Stop = Callable[[int], bool]


class Store:
    """See the package docstring. Open with :func:`open_store` (or the
    constructor); close with :meth:`close`."""

    def __init__(
        self, config: StoreConfig, kek: Kek, *, create: bool = False,
        audit: opening.AuditFn | None = None,
    ) -> None:  # fmt: skip
        self.config = config
        self.root = config.root
        index_dir = config.resolved_index_dir()
        layout = opening.load_layout(self.root, index_dir, kek, create)
        if not config.shared:
            check_unshared_open(self.root, index_dir)  # other nodes' journals: refused
        opening.tighten_modes(self.root)
        self._lock_fd = opening.lock_index_dir(index_dir)
        try:
            with mapped_errors("open"):
                st, rebuild = opening.open_state(config, index_dir, kek, layout, audit)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._state = st
        # Read by the CLI, the benchmarks and tests: never rebound.
        self.index, self.keyring, self.contracts = st.index, st.keyring, st.contracts
        self.io, self.io_plan, self.counters = st.io, st.io_plan, st.counters
        # The parts, each on those before it.
        self._capacity = Capacity(st)
        self._removal = Removal(st, self._capacity)
        self._capacity.evicts_with(self._removal.drop)
        self._maintenance = Maintenance(st, self._capacity, self._removal)
        self._writes = Writes(st, self._capacity, self._removal, self._maintenance)
        self._reads = Reads(st, self._removal, self._maintenance)
        self._leases = Leases(st, self._capacity, self._removal, self._reads, self._writes)
        self._layerwise = Layerwise(st, self._reads, self._removal)
        self._views = Views(st, self._capacity)
        self._purges = Purges(st, self._removal, self._writes, self._views)
        self._peers = Peers(
            st, self._capacity, self._removal, self._maintenance, self._writes, self._purges
        )
        self._closed = threading.Event()
        self._flusher: threading.Thread | None = None
        self._purges.finish_interrupted()  # the trees a crash left moved aside
        if rebuild is not None:
            try:
                self._maintenance.rebuild(rebuild)
            except BaseException:
                st.index.close()
                os.close(self._lock_fd)
                raise
        if config.durability is Durability.BATCH:
            self._flusher = threading.Thread(
                target=self._flush_loop, name="kvoffload-flush", daemon=True
            )
            self._flusher.start()
        with mapped_errors("open"):
            self._peers.start()

    def close(self) -> None:
        """Stop the parts in the reverse order of their start; release the index."""
        if self._closed.is_set():
            return
        self._closed.set()
        st = self._state
        self._peers.close()
        self._purges.wait_background()
        st.streams.close()
        st.io.close()
        if st.ram is not None:
            st.ram.close()
        with mapped_errors("close"):
            try:
                st.access.flush()
                if self._flusher is not None:
                    self._flusher.join()
                if self.config.durability is not Durability.NONE:
                    try:
                        syncfs(self.root)
                    except OSError as exc:
                        log.warning("final syncfs failed: %s", exc)
                st.index.flush()
            finally:
                if st.shared is not None:
                    st.shared.close()
                st.index.close()
                os.close(self._lock_fd)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _flush_loop(self) -> None:
        while not self._closed.wait(self.config.batch_interval_s):
            try:
                syncfs(self.root)
                self._state.index.flush()
            except OSError as exc:
                log.warning("batched syncfs failed: %s", exc)

    # ------------------------------------------------------------- settings
    @property
    def layout(self) -> LayoutInfo:
        return self._state.layout

    @property
    def events_hook(self) -> EventsHook | None:
        """The KV-event feed (kvoffload.sidecar.events), told of every chunk that leaves."""
        return self._state.events_hook

    @events_hook.setter
    def events_hook(self, hook: EventsHook | None) -> None:
        self._state.events_hook = hook

    @property
    def retention_policy(self) -> RetentionProvider | None:
        return self._state.retention_policy

    def set_retention(self, provider: RetentionProvider | None) -> None:
        """Enforce ``provider(tenant)``'s current limits on every read and in :meth:`expire`."""
        self._state.retention_policy = provider

    @property
    def io_streams(self) -> int:
        """Chunks of one batch sealed/read and written/verified at once."""
        return self._state.streams.streams

    @property
    def durability(self) -> str:
        """The fsync setting, as the lease tells a direct-path writer (a write hint)."""
        return str(self.config.durability)

    @property
    def alignment(self) -> int:
        """The alignment of an object's layers in its file (layout-v1.md §3)."""
        return v1.ALIGN

    def shape_ok(self, lengths: Sequence[int], encrypt: bool) -> bool:
        """Whether a chunk of these layer lengths can be stored (layout-v1.md §3.2)."""
        return v1.shape_ok(lengths, encrypt)

    @property
    def has_ram_tier(self) -> bool:
        return self._state.ram is not None

    def _path(self, tenant: str, key: bytes) -> Path:
        """The object file of a chunk."""
        return self._state.path(tenant, key)

    # ------------------------------------------------------------- capacity
    @property
    def used_bytes(self) -> int:
        return self._capacity.used_bytes

    @property
    def reserved_bytes(self) -> int:
        return self._capacity.reserved_bytes

    @property
    def accounted_bytes(self) -> int:
        return self._capacity.accounted_bytes

    @boundary
    def reserve(self, tenant: str, nbytes: int, *, quota: int | None = None) -> Reservation:
        return self._capacity.reserve(tenant, nbytes, quota=quota)

    @boundary
    def reserve_chunk(
        self, tenant: str, lengths: Sequence[int], *, encrypt: bool, quota: int | None = None
    ) -> Reservation:
        """:meth:`reserve` the object of one chunk of these layer lengths."""
        return self._capacity.reserve_chunk(tenant, lengths, encrypt=encrypt, quota=quota)

    @boundary
    def tenant_accounted(self, tenant: str) -> int:
        return self._capacity.tenant_accounted(tenant)

    def pin(self, tenant: str, keys: Keys) -> None:
        self._capacity.pin(tenant, keys)

    def unpin(self, tenant: str, keys: Keys) -> None:
        self._capacity.unpin(tenant, keys)

    # --------------------------------------------------------------- writes
    @boundary
    def put(
        self, tenant: str, namespace: bytes, chunk_key: bytes, layers: Layers, *,
        encrypt: bool = True, ttl_s: float | None = None, reservation: Reservation | None = None,
    ) -> bool:  # fmt: skip
        return self._writes.put(
            tenant, namespace, chunk_key, layers,
            encrypt=encrypt, ttl_s=ttl_s, reservation=reservation,
        )  # fmt: skip

    @boundary
    def put_many(
        self, tenant: str, namespace: bytes, chunks: Sequence[tuple[bytes, Layers]], *,
        encrypt: bool = True, ttl_s: float | None = None,
        reservations: Sequence[Reservation | None] | None = None,
    ) -> list[bool]:  # fmt: skip
        return self._writes.put_many(
            tenant, namespace, chunks, encrypt=encrypt, ttl_s=ttl_s, reservations=reservations
        )

    # ---------------------------------------------------------------- reads
    @boundary
    def lookup(self, tenant: str, keys: Keys) -> int:
        return self._reads.lookup(tenant, keys)

    @boundary
    def lookup_cached(self, tenant: str, keys: Keys) -> int | None:
        return self._reads.lookup_cached(tenant, keys)

    @boundary
    def contains(self, tenant: str, key: bytes) -> bool:
        return self._reads.contains(tenant, key)

    @boundary
    def payload_info(self, tenant: str, key: bytes) -> ChunkRecord | None:
        return self._reads.payload_info(tenant, key)

    @boundary
    def payload_info_cached(self, tenant: str, key: bytes) -> tuple[bool, ChunkRecord | None]:
        return self._reads.payload_info_cached(tenant, key)

    @boundary
    def touch(self, tenant: str, keys: Keys) -> None:
        self._reads.touch(tenant, keys)

    @boundary
    def get(self, tenant: str, key: bytes) -> list[bytes] | None:
        return self._reads.get(tenant, key)

    @boundary
    def get_into(self, tenant: str, key: bytes, out: memoryview) -> list[int] | None:
        return self._reads.get_into(tenant, key, out)

    @boundary
    def get_many_into(
        self, tenant: str, keys: Keys, outs: Outs, *, stop_at_miss: bool = True,
    ) -> Results:  # fmt: skip
        return self._reads.get_many_into(tenant, keys, outs, stop_at_miss=stop_at_miss)

    def load_guard(self, tenant: str) -> Guard:
        return self._reads.load_guard(tenant)

    @boundary
    def plan_load(self, tenant: str, keys: Keys) -> LoadPlan:
        return self._reads.plan_load(tenant, keys)

    @boundary
    def load(
        self, plan: LoadPlan, outs: Outs, *, on_chunk: OnChunk = None, inline: bool = False,
    ) -> Results:  # fmt: skip
        return self._reads.load(plan, outs, on_chunk=on_chunk, inline=inline)

    @boundary
    def load_planned(
        self, tenant: str, recs: Recs, outs: Outs, guard: Guard, on_chunk: OnChunk = None,
    ) -> Results:  # fmt: skip
        return self._reads.load_planned(tenant, recs, outs, guard, on_chunk)

    @boundary
    def load_planned_cached(self, tenant: str, recs: Recs, outs: Outs, guard: Guard) -> Results:
        return self._reads.load_planned_cached(tenant, recs, outs, guard)

    @boundary
    def get_layerwise_into(
        self, tenant: str, keys: Keys, outs: Outs, plan: PlanFn, report: ReportFn, cancelled: Stop,
    ) -> Results:  # fmt: skip
        return self._layerwise.get_into(tenant, keys, outs, plan, report, cancelled)

    @boundary
    def load_planned_layerwise(
        self, tenant: str, recs: Recs, outs: Outs, plan: PlanFn, report: ReportFn, cancelled: Stop,
        guard: Guard,
    ) -> Results:  # fmt: skip
        return self._layerwise.load_planned(tenant, recs, outs, plan, report, cancelled, guard)

    def cancel_loads(self, tenant: str) -> None:
        """Stop every load of ``tenant`` in flight before its next layer is copied
        (a revocation; purges do this themselves). Those chunks are misses, and
        the tenant's images leave the RAM tier."""
        self._removal.stop_tenant(tenant)

    def drop_cache(self) -> tuple[int, int]:
        """Empty the RAM tier (protocol-v1 §5.31): every chunk's next load reads
        its file. (images dropped, bytes the tier still maps as spare buffers)."""
        ram = self._state.ram
        return (0, 0) if ram is None else ram.clear()

    # ---------------------------------------------------------- direct path
    @boundary
    def lease_store(
        self, tenant: str, namespace: bytes, chunk_key: bytes, lengths: Sequence[int], *,
        ttl_s: float | None = None, gid: int | None = None, quota: int | None = None,
    ) -> StoreLease | None:  # fmt: skip
        return self._leases.lease_store(
            tenant, namespace, chunk_key, lengths, ttl_s=ttl_s, gid=gid, quota=quota
        )

    def cancel_lease(self, lease: StoreLease) -> None:
        self._leases.cancel_lease(lease)

    @boundary
    def publish_lease(self, lease: StoreLease) -> bool:
        return self._leases.publish_lease(lease)

    @boundary
    def lease_load(self, tenant: str, key: bytes) -> ReadLease | None:
        return self._leases.lease_load(tenant, key)

    @boundary
    def sealed_lease(self, tenant: str, key: bytes) -> SealedLease | None:
        return self._leases.sealed_lease(tenant, key)

    @boundary
    def check_reported(self, tenant: str, key: bytes) -> bool:
        return self._leases.check_reported(tenant, key)

    # ------------------------------------------------------ removal, purges
    @boundary
    def delete(self, tenant: str, key: bytes) -> bool:
        return self._removal.drop(tenant, key, reason="delete")

    @boundary
    def purge(self, tenant: str, namespace: bytes | None = None) -> PurgeReport:
        """Purge a whole tenant (``namespace`` None: a crypto-erase, waited for)
        or one namespace of it; the report of what was removed, tier by tier."""
        if namespace is None:
            return self._purges.tenant(tenant, wait=True)
        return self._purges.namespace(tenant, namespace)

    @boundary
    def purge_tenant(self, tenant: str, *, wait: bool = False) -> int:
        return self._purges.tenant(tenant, wait=wait).removed

    @boundary
    def expire_due(self, now_ns: int | None = None) -> int:
        return self._maintenance.expire_due(now_ns)

    @boundary
    def purge_namespace(self, tenant: str, namespace: bytes) -> int:
        return self._purges.namespace(tenant, namespace).removed

    @boundary
    def purge_older_than(self, age_s: float, tenant: str | None = None) -> int:
        return self._purges.older_than(age_s, tenant)

    @boundary
    def invalidate(
        self, selector: Mapping[str, str], *, tenant: str | None = None, dry_run: bool = False,
        actor: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        return self._purges.invalidate(selector, tenant=tenant, dry_run=dry_run, actor=actor)

    def wait_background(self) -> None:
        """Wait for background work (purge file removal) to finish."""
        self._purges.wait_background()

    # ---------------------------------------------------------- maintenance
    @boundary
    def fsck(
        self, repair: bool = False, *, verify_data: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> FsckReport:  # fmt: skip
        return self._maintenance.fsck(repair, verify_data=verify_data, progress=progress)

    @boundary
    def sweep(self) -> dict[str, int]:
        return self._maintenance.sweep()

    @boundary
    def collect_garbage(self) -> int:
        return self._maintenance.collect_garbage()

    @boundary
    def expire(self) -> int:
        return self._maintenance.expire()

    @boundary
    def maintain(self) -> dict[str, int]:
        return self._maintenance.maintain()

    # ----------------------------------------------------------- shared root
    @boundary
    def follow_journals(self) -> int:
        return self._peers.follow_journals()

    @boundary
    def evictor_tick(self) -> bool:
        return self._capacity.evictor_tick()

    @boundary
    def compact_journal(self, *, max_segments: int = 8) -> int | None:
        return self._peers.compact_journal(max_segments=max_segments)

    def shared_info(self) -> dict[str, Any] | None:
        return self._views.shared_info()

    # ------------------------------------------------------ tenants and keys
    @boundary
    def tenant_salt(self, tenant: str) -> bytes:
        """The tenant's secret key salt (creates the tenant's keys on first use)."""
        return self._state.keyring.ensure_tenant(tenant).salt

    @boundary
    def tenants(self) -> list[str]:
        return self._views.tenants()

    def key_problems(self) -> dict[str, str]:
        with mapped_errors("key_problems"):
            return self._views.key_problems()

    @boundary
    def rotate_kek(self, new_kek: Kek) -> int:
        """Re-wrap every key file under ``new_kek``; the root records the new id
        first (the old one still accepted), so a rotation killed half-way is
        finished by running it again, with either KEK."""
        st = self._state
        old = st.keyring.kek_id
        st.layout = record_kek_id(self.root, new_kek.key_id, previous=old)
        n = st.keyring.rotate_kek(new_kek)  # the keyring writes the audit record
        st.layout = record_kek_id(self.root, new_kek.key_id)
        opening.keep_layout_copy(self.root, self.config.resolved_index_dir())
        return n

    @boundary
    def record_contract(self, tenant: str, namespace: bytes, fields: Mapping[str, Any]) -> bool:
        """Keep a namespace's contract fields (ContractError unless they hash to it)."""
        return self._state.contracts.record(tenant, namespace, fields)

    @boundary
    def record_audit(self, event: str, details: dict[str, Any]) -> None:
        """Append one record, fsync'd, to the audit log (docs/spec/audit-v1.md):
        never keys, salts, tokens or data in ``details``."""
        self._state.audit(event, details)

    # ---------------------------------------------------------------- views
    def chunks(
        self, tenant: str | None = None, namespace: bytes | None = None
    ) -> Iterator[ChunkRecord]:
        with mapped_errors("chunks"):
            yield from self._views.chunks(tenant, namespace)

    @boundary
    def chunk_count(self) -> int:
        return self._views.chunk_count()

    @boundary
    def tenant_usage(self) -> dict[str, Usage]:
        return self._views.tenant_usage()

    @boundary
    def namespace_usage(self, tenant: str) -> dict[bytes, Usage]:
        return self._views.namespace_usage(tenant)

    @boundary
    def namespaces_report(
        self, tenant: str | None = None, *, ages: bool = True
    ) -> list[dict[str, Any]]:
        return self._views.namespaces_report(tenant, ages=ages)

    @boundary
    def stats(self) -> dict[str, Any]:
        return self._views.stats()


def open_store(config: StoreConfig, kek: Kek, *, create: bool = False) -> Store:
    try:
        return Store(config, kek, create=create)
    except OSError as exc:
        raise StoreIOError(f"cannot open store at {config.root}: {exc}", exc.errno) from exc
