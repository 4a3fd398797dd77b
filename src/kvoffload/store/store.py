"""The :class:`Store` facade: opening and closing, tenants, deletes and purges,
stats, and the read-only views the CLI uses (``chunks``, ``tenant_usage``…).

Every public method leaves through the store boundary
(:func:`~.base.mapped_errors`): index failures (:class:`IndexFailure`,
``lmdb.Error``) become :class:`StoreIOError`, keyring failures
(:class:`KeyringError`) :class:`StoreKeyError`; a chunk that cannot be read
is still a miss, never an exception.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import lmdb

from ..errors import StoreError, StoreIOError, StoreLocked
from ..layouts import (
    LAYOUT_FILE,
    LayoutError,
    LayoutInfo,
    UnknownLayoutVersion,
    create_root,
    read_layout,
    record_kek_id,
    v1,
)
from ..layouts.store_root import ROOT_DIR_MODES
from ..posix import atomic_create
from ..units import age_cutoff_ns
from .audit import AuditLog
from .base import (
    SEAL_COUNTS_LOST,
    Counters,
    RetentionProvider,
    StoreConfig,
    boundary,
    log,
    mapped_errors,
)
from .cancel import LoadGenerations, TenantWrites, TransferCancelled
from .capacity import Reservation, _Scope
from .contracts import ContractRegistry, check_selector, contract_fields, contract_matches
from .files import Durability, ScratchBuffers, syncfs
from .index import ChunkRecord, Index, IndexCorrupt, IndexFailure, Usage, probe_in_child
from .iobackend import DIRECT_WRITE_MIN, IOPlan, select_backend
from .keys.keyring import Kek, Keyring
from .layerwise import PlanFn, ReportFn, get_layerwise_into, load_layerwise
from .purges import Purges
from .ramtier import RamTier, auto_capacity
from .retention import RetentionJournal
from .shared.journal import JournalRecord, Op
from .shared.root import POSITIONS_META, SharedRoot, check_unshared_open


class Store(Purges):
    """See the package docstring. Open with :meth:`open`; close with :meth:`close`."""

    def __init__(
        self,
        config: StoreConfig,
        kek: Kek,
        *,
        create: bool = False,
        audit: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        self.config = config
        self.root = config.root
        index_dir = config.resolved_index_dir()
        self.layout = _load_layout(self.root, index_dir, kek, create)
        if not config.shared:
            check_unshared_open(self.root, index_dir)  # other nodes' journals: refused
        self.contracts = ContractRegistry(self.root)
        _tighten_modes(self.root)
        index_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock_fd = os.open(index_dir / "kvoffload.lock", os.O_RDWR | os.O_CREAT, 0o640)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(self._lock_fd)
            raise StoreLocked(
                f"the index at {index_dir} is in use by another process (a running sidecar?); "
                "use the sidecar's admin verbs or stop it first"
            ) from exc
        try:
            with mapped_errors("open"):
                self._open_parts(index_dir, kek, audit)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self.counters = Counters()
        self._closed = threading.Event()
        self._bg: list[threading.Thread] = []
        self._flusher: threading.Thread | None = None
        self._finish_interrupted_purges()
        if self._rebuild_reason is not None:
            try:
                self._rebuild(self._rebuild_reason)
            except BaseException:
                self.index.close()
                os.close(self._lock_fd)
                raise
        if config.durability is Durability.BATCH:
            self._flusher = threading.Thread(
                target=self._flush_loop, name="kvoffload-flush", daemon=True
            )
            self._flusher.start()
        self._journal_thread: threading.Thread | None = None
        if self._shared is not None:
            with mapped_errors("open"):
                self._settle_crashed_writes()
                self.follow_journals()
                self.evictor_tick()  # a lone node holds the role and its grant at once
            self._journal_thread = threading.Thread(
                target=self._journal_loop, name="kvoffload-journal", daemon=True
            )
            self._journal_thread.start()

    def _open_parts(
        self, index_dir: Path, kek: Kek, audit: Callable[[str, dict[str, Any]], None] | None
    ) -> None:
        """Keyring, index and I/O backend; on failure, what was opened is closed
        (the caller closes the lock file)."""
        config = self.config
        self._audit = AuditLog(
            index_dir / "audit.jsonl",
            audit,
            max_bytes=config.audit_max_bytes,
            keep=config.audit_keep,
        )
        self.keyring = Keyring(
            self.root / "keys", kek, cache_ttl_s=config.key_cache_ttl_s, audit=self._audit
        )
        self._check_kek(kek)
        _keep_layout_copy(self.root, index_dir)
        self._rebuild_reason: str | None = None
        self.index = self._open_index(index_dir)
        try:
            store_id = self.index.get_meta("store_id")
            if store_id is None:
                self.index.set_meta("store_id", self.layout.store_id.encode())
                if self._rebuild_reason is None and not config.shared and any(self._walk_objects()):
                    # A lost or deleted index of a store with objects: rebuilt
                    # from the files, so nothing stored is forgotten. Not on a
                    # shared root: a new node catches up from the journals and
                    # finds the rest by name, never by walking the object tree.
                    self._rebuild_reason = "the index is new but the store holds objects"
            elif store_id.decode() != self.layout.store_id:
                raise StoreError(
                    f"index at {index_dir} belongs to store {store_id.decode()}, "
                    f"not {self.layout.store_id}: point index_dir elsewhere or run fsck --repair"
                )
            self._mu = threading.Lock()
            self._used = self.index.usage().bytes
            self._reserved = 0
            self._tenant_reserved = {}
            self._pins = {}
            self._touch_pending = {}
            self._touch_flushed = time.time_ns()
            self._seal_budget = {}
            self._key_rereads = {}
            self._load_gens = LoadGenerations()
            self._writes = TenantWrites(self._load_gens)
            self._scratch = ScratchBuffers()
            node = self.index.get_meta("node_id")
            if node is None:
                node = os.urandom(8).hex().encode()
                self.index.set_meta("node_id", node)
            self._retention = RetentionJournal(self.root, node.decode())
            self._pipe = None
            self._leaves_ready = set()
            sel = select_backend(
                config.io, self.root / "objects", direct_read_min=config.direct_read_min
            )
            self._shared = None
            if config.shared:
                self._shared = SharedRoot(
                    self.root,
                    index_dir,
                    durable=config.durability is not Durability.NONE,
                    lease_ttl_s=config.evictor_lease_s,
                    segment_bytes=config.journal_segment_bytes,
                    index=self.index,
                )
                self._shared.restore_positions(self.index.get_meta(POSITIONS_META))
        except BaseException:
            self.index.close()
            raise
        self.io = sel.backend
        self.io_plan = sel.plan
        self._ram = _ram_tier(config, sel.plan)

    def _open_index(self, index_dir: Path) -> Index:
        """Open the index; a corrupt one (garbage ``data.mdb``, undecodable records,
        an unknown schema) is moved aside to ``lmdb.corrupt-<time>`` (kept for
        forensics) and a new one rebuilt from the files (layout-v1.md §1), when
        ``rebuild_corrupt_index`` (the default); else the error stands."""
        path = index_dir / "lmdb"
        index: Index | None = None
        try:
            if self.config.rebuild_corrupt_index:
                why = probe_in_child(path)
                if why is not None:
                    raise IndexCorrupt(f"LMDB index is corrupt: {why}")
            index = Index(path)
            for _rec in index.records():  # every record decodes, every page is reachable
                pass
            index.usage()
            return index
        except IndexFailure as exc:
            if index is not None:
                index.close()
            if not self.config.rebuild_corrupt_index or _environmental(exc):
                raise
            aside = index_dir / f"lmdb.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
            os.rename(path, aside)
            log.error(
                "the index at %s is unusable (%s): moved aside to %s; rebuilding it from the files",
                path, exc, aside.name,
            )  # fmt: skip
            self._rebuild_reason = f"the index was unusable ({exc})"
            return Index(path)

    def _rebuild(self, reason: str) -> None:
        log.warning("rebuilding the index from the files: %s", reason)
        # What only the index knew is gone: the count of nonces drawn per DEK epoch
        # (a fresh epoch per tenant bounds it again, base.SEAL_COUNT_BLOCK).
        self.index.set_meta(SEAL_COUNTS_LOST, b"1")
        rep = self.fsck(repair=True)
        indexed = len(rep.unindexed_files) + rep.ok
        log.warning("index rebuilt: %d objects, %d corrupt", indexed, len(rep.corrupt_files))

    def _check_kek(self, kek: Kek) -> None:
        """A wrong KEK stops us here (layout-v1.md §2): later, every object would
        look corrupt. Checked against the KEK id the root records, never against
        a key file, so one corrupt key file is its tenant's problem only. A root
        without one (older stores) learns it now, from the ids the key files
        name, refusing a KEK that none of them names."""
        layout = self.layout
        ours = kek.key_id
        self.keyring.check_store_kek(layout, self.root)
        if layout.kek_id is None:
            self.layout = record_kek_id(self.root, ours)
            log.info("store %s: KEK id %s recorded in layout.json", layout.store_id, ours)
        elif ours != layout.kek_id:
            log.warning(
                "store %s: a KEK rotation to id %s is unfinished; opened with the previous "
                "KEK %s: run `kvoffload keys rotate-kek` again to finish it",
                layout.store_id, layout.kek_id, ours,
            )  # fmt: skip

    # ------------------------------------------------------------------ life

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._journal_thread is not None:
            self._journal_thread.join()
        self.wait_background()
        if self._pipe is not None:
            self._pipe.shutdown(wait=True)
        if self._parts is not None:
            self._parts.close()
        self.io.close()
        if self._ram is not None:
            self._ram.close()
        with mapped_errors("close"):
            try:
                self._flush_touches()
                if self._flusher is not None:
                    self._flusher.join()
                if self.config.durability is not Durability.NONE:
                    try:
                        syncfs(self.root)
                    except OSError as exc:
                        log.warning("final syncfs failed: %s", exc)
                self.index.flush()
            finally:
                if self._shared is not None:
                    self._shared.close()
                self.index.close()
                os.close(self._lock_fd)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _flush_loop(self) -> None:
        while not self._closed.wait(self.config.batch_interval_s):
            try:
                syncfs(self.root)
                self.index.flush()
            except OSError as exc:
                log.warning("batched syncfs failed: %s", exc)

    # ---------------------------------------------------------- shared root

    def _journal_loop(self) -> None:
        """Follow the other nodes' journals and keep the evictor lease, until closed."""
        rounds = 0
        while not self._closed.wait(self.config.journal_poll_s):
            try:
                self.follow_journals()
                self.evictor_tick()
                rounds += 1
                if rounds % 120 == 0:
                    self.compact_journal()
            except Exception as exc:  # never let the follower die
                log.warning("following the shared root's journals: %s", exc)

    @boundary
    def follow_journals(self) -> int:
        """Apply what the other nodes journaled since the last call; records applied."""
        sh = self._shared
        if sh is None:
            return 0
        followed = sh.follower.poll()
        now = time.time_ns()
        for node, r in followed:
            if r.op is Op.STORE:
                with self._mu:
                    sh.saw_store_locked(node, r.grant_epoch, r.size)
                if r.expires_ns and r.expires_ns <= now:
                    continue
                rec = ChunkRecord(
                    tenant=r.tenant,
                    chunk_key=r.key,
                    namespace=r.namespace,
                    key_epoch=r.key_epoch,
                    size=r.size,
                    payload=r.payload,
                    num_layers=r.num_layers,
                    created_ns=r.time_ns,
                    last_access_ns=r.time_ns,
                    expires_ns=r.expires_ns,
                )
                with self._mu:
                    if self.index.put(rec):
                        self._used += rec.size
                        sh.stats.adopted += 1
            elif r.op is Op.TOUCH:
                self.index.touch(r.tenant, [r.key], r.time_ns)
            elif r.op is Op.REMOVE:
                sh.stats.dropped += self._drop(r.tenant, r.key, reason="journal", remove_file=False)
            elif r.op is Op.PURGE_TENANT:
                self._follow_purge(r.tenant)
                sh.stats.tenant_purges += 1
            elif r.op is Op.PURGE_NAMESPACE:
                self._load_gens.cancel(r.tenant)
                for old in list(self.index.records(tenant=r.tenant, namespace=r.namespace)):
                    self._drop(old.tenant, old.chunk_key, reason="journal", remove_file=False)
        if followed:
            sh.stats.followed += len(followed)
            self.index.set_meta(POSITIONS_META, sh.positions_blob())
        return len(followed)

    @boundary
    def evictor_tick(self) -> bool:
        """Renew or take the evictor lease; as holder, evict the root down to its
        low watermark. Whether this node holds the role."""
        sh = self._shared
        if sh is None:
            return False
        held = sh.lease.tick()
        cap = self.config.capacity_bytes
        to_free = 0
        with self._mu:
            before = dict(sh.lease.grants)
            if held and cap is not None:
                to_free = sh.issue_locked(
                    self._used,
                    cap,
                    self.config.high_watermark,
                    self.config.low_watermark,
                    now=time.monotonic(),
                    reserved=self._reserved,
                )
            else:
                sh.refresh_view_locked()
        if held and sh.lease.grants != before:
            sh.lease.publish()  # the new grants, on file before they are used
            held = sh.lease.held is not None
            with self._mu:
                sh.refresh_view_locked()
        if to_free and cap is not None:
            self._evict(_Scope(self, cap), to_free)  # each removal fenced
        return held

    @boundary
    def compact_journal(self, *, max_segments: int = 8) -> int | None:
        """Compact this node's journal when it has grown past ``max_segments``."""
        sh = self._shared
        if sh is None:
            return None
        kept = sh.maybe_compact(
            lambda t, k: self.index.get(t, k) is not None, max_segments=max_segments
        )
        if kept is not None:
            log.info("journal compacted: %d chunks of this node still present", kept)
        return kept

    def shared_info(self) -> dict[str, Any] | None:
        """This node's view of the shared root (None when the root is not shared)."""
        return None if self._shared is None else self._shared.describe()

    def wait_background(self) -> None:
        """Wait for background work (purge file removal) to finish."""
        for t in list(self._bg):
            t.join()
        self._bg = [t for t in self._bg if t.is_alive()]

    # -------------------------------------------------------------- tenants

    @boundary
    def get_layerwise_into(
        self,
        tenant: str,
        keys: Sequence[bytes],
        outs: Sequence[memoryview],
        plan: PlanFn,
        report: ReportFn,
        cancelled: Callable[[int], bool],
    ) -> list[list[int] | None]:
        """:meth:`get_many_into` layer by layer, reporting each layer (protocol §5.26).

        ``cancelled(layer)`` is asked before each layer; a purge or revocation
        of ``tenant`` from the start of this call on stops the load there too
        (the same load generation as :meth:`get_many_into`'s, store/cancel.py).
        """
        stop = _stop_check(cancelled, self._load_gens.guard(tenant))
        return get_layerwise_into(self, tenant, keys, outs, plan, report, stop)

    @boundary
    def load_planned_layerwise(
        self,
        tenant: str,
        recs: Sequence[ChunkRecord],
        outs: Sequence[memoryview],
        plan: PlanFn,
        report: ReportFn,
        cancelled: Callable[[int], bool],
        guard: Callable[[int], None],
    ) -> list[list[int] | None]:
        """:meth:`get_layerwise_into` of chunks whose records the caller looked up
        after taking ``guard`` (:meth:`load_guard`): no second lookup per chunk."""
        return load_layerwise(self, tenant, recs, outs, plan, report, _stop_check(cancelled, guard))

    @boundary
    def record_audit(self, event: str, details: dict[str, Any]) -> None:
        """Append one record to the store's audit log (``audit.jsonl`` beside the index).

        The one entry point for every part that must leave an audit trace
        (purges, revocations, reloads, admin verbs, refused access): the
        record is fsync'd before this returns. Never pass keys, salts, tokens
        or data in ``details``.
        """
        self._audit(event, details)

    def cancel_loads(self, tenant: str) -> None:
        """Stop every load of ``tenant`` in flight before its next layer is copied
        (a revocation; purges do this themselves). Those chunks are misses, and
        the tenant's images leave the RAM tier."""
        self._stop_tenant(tenant)

    @property
    def durability(self) -> str:
        """The durability setting's name: ``object``, ``batch`` or ``none``."""
        return self.config.durability.value

    @property
    def alignment(self) -> int:
        """The alignment of an object's layers in its file (layout-v1.md §3)."""
        return v1.ALIGN

    def shape_ok(self, lengths: Sequence[int], encrypt: bool) -> bool:
        """Whether a chunk of these layer lengths can be stored (layout-v1.md §3.2)."""
        return v1.shape_ok(lengths, encrypt)

    def reserve_chunk(
        self, tenant: str, lengths: Sequence[int], *, encrypt: bool, quota: int | None = None
    ) -> Reservation:
        """:meth:`reserve` the object of one chunk of these layer lengths: the store,
        not its caller, knows what an object of them costs on disk."""
        return self.reserve(tenant, v1.object_size(lengths, encrypt), quota=quota)

    @property
    def has_ram_tier(self) -> bool:
        return self._ram is not None

    def drop_cache(self) -> tuple[int, int]:
        """Empty the RAM tier (protocol-v1 §5.31): every chunk's next load reads
        its file. (images dropped, bytes the tier still maps as spare buffers)."""
        return (0, 0) if self._ram is None else self._ram.clear()

    @boundary
    def tenant_salt(self, tenant: str) -> bytes:
        """The tenant's secret key salt (creates the tenant's keys on first use)."""
        return self.keyring.ensure_tenant(tenant).salt

    @boundary
    def tenants(self) -> list[str]:
        """Tenants with keys."""
        return self.keyring.tenants()

    # ---------------------------------------------------------------- views

    def chunks(
        self, tenant: str | None = None, namespace: bytes | None = None
    ) -> Iterator[ChunkRecord]:
        """Index records (no data I/O), of one tenant and/or namespace, in key order."""
        with mapped_errors("chunks"):
            yield from self.index.records(tenant=tenant, namespace=namespace)

    @boundary
    def chunk_count(self) -> int:
        """How many chunks the index holds."""
        return self.index.count()

    @boundary
    def tenant_usage(self) -> dict[str, Usage]:
        """Stored chunks and bytes per tenant that has at least one chunk."""
        return self.index.tenants()

    @boundary
    def namespace_usage(self, tenant: str) -> dict[bytes, Usage]:
        """Stored chunks and bytes per namespace of ``tenant``."""
        return self.index.namespaces(tenant)

    # --------------------------------------------------------------- delete

    @boundary
    def delete(self, tenant: str, key: bytes) -> bool:
        return self._drop(tenant, key, reason="delete")

    def set_retention(self, provider: RetentionProvider | None) -> None:
        """Enforce ``provider(tenant)``'s limits (ttl, max_age, idle_ttl: the
        sidecar's *current* policy) on every read and in :meth:`expire`."""
        self.retention_policy = provider

    @boundary
    def expire(self) -> int:
        """Drop every chunk past its stamped expiry, or past its tenant's current
        ttl, max_age or idle_ttl (those scan the tenants that have one)."""
        now = time.time_ns()
        n = self.expire_due(now)
        if self.retention_policy is None:
            return n
        for tenant in list(self.index.tenants()):
            if self._cutoffs(tenant, now) == (0, 0):
                continue
            stale = [r for r in self.index.records(tenant=tenant) if self._is_expired(r, now)]
            for rec in stale:
                n += self._drop(rec.tenant, rec.chunk_key, reason="expired")
        return n

    @boundary
    def expire_due(self, now_ns: int | None = None) -> int:
        """Drop every chunk past its stamped expiry: a walk of the expiry table up
        to now, as cheap as the chunks it finds (the KV-event feed runs it often)."""
        n = 0
        for rec in self.index.expired(time.time_ns() if now_ns is None else now_ns):
            n += self._drop(rec.tenant, rec.chunk_key, reason="expired")
        return n

    @boundary
    def purge_namespace(self, tenant: str, namespace: bytes) -> int:
        """Remove a namespace's chunks (file removal, not a crypto erase: keys are per tenant)."""
        # Loads in flight of the tenant stop before their next layer (those of
        # its other namespaces too: a miss is safe, and purges are rare).
        self._load_gens.cancel(tenant)
        recs = list(self.index.records(tenant=tenant, namespace=namespace))
        if self._shared is not None:
            self._shared.journal([JournalRecord.purge_namespace(tenant, namespace)])
        for rec in recs:
            self._drop(rec.tenant, rec.chunk_key, reason="purge-namespace")
        self._audit(
            "purge_namespace", {"tenant": tenant, "namespace": namespace.hex(), "chunks": len(recs)}
        )
        return len(recs)

    # ------------------------------------------------ contracts (layout-v1 §2.1)

    @boundary
    def record_contract(self, tenant: str, namespace: bytes, fields: Mapping[str, Any]) -> bool:
        """Keep a namespace's contract fields once they hash to it (ContractError if
        not); True when this call recorded them."""
        return self.contracts.record(tenant, namespace, fields)

    @boundary
    def namespaces_report(
        self, tenant: str | None = None, *, ages: bool = True
    ) -> list[dict[str, Any]]:
        """Every namespace with chunks (of one tenant or all), in tenant and
        fingerprint order: its contract fields (None: unknown, never registered),
        chunks, bytes and — with ``ages``, which reads every record of the
        tenants — the ages of its oldest and newest chunk in seconds."""
        now = time.time_ns()
        tenants = [tenant] if tenant is not None else sorted(self.index.tenants())
        rows: list[dict[str, Any]] = []
        for t in tenants:
            spans: dict[bytes, list[int]] = {}
            if ages:
                for rec in self.index.records(tenant=t):
                    span = spans.setdefault(rec.namespace, [rec.created_ns, rec.created_ns])
                    span[0] = min(span[0], rec.created_ns)
                    span[1] = max(span[1], rec.created_ns)
            for ns, usage in sorted(self.index.namespaces(t).items()):
                if not usage.count:
                    continue
                c = self.contracts.get(t, ns)
                row: dict[str, Any] = {
                    "tenant": t,
                    "namespace": ns.hex(),
                    "chunks": usage.count,
                    "bytes": usage.bytes,
                }
                if ages:
                    oldest, newest = spans.get(ns, [now, now])
                    row["oldest_age_s"] = round(max(0, now - oldest) / 1e9, 3)
                    row["newest_age_s"] = round(max(0, now - newest) / 1e9, 3)
                row["contract"] = None if c is None else contract_fields(c)
                rows.append(row)
        return rows

    @boundary
    def invalidate(
        self,
        selector: Mapping[str, str],
        *,
        tenant: str | None = None,
        dry_run: bool = False,
        actor: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Purge every namespace whose registered contract matches ``selector``
        (:func:`contract_matches`), on every node of a shared root (a namespace
        purge is journaled). Namespaces without registered fields are reported
        as ``unknown_contract`` and left. One audit record "invalidate"."""
        check_selector(selector)
        matched: list[dict[str, Any]] = []
        unknown: list[dict[str, Any]] = []
        for row in self.namespaces_report(tenant, ages=False):
            contract = row["contract"]
            if contract is None:
                unknown.append({k: row[k] for k in ("tenant", "namespace", "chunks", "bytes")})
            elif contract_matches(contract, selector):
                matched.append(row)
        removed_chunks = removed_bytes = 0
        for row in matched:
            if dry_run:
                removed_chunks += row["chunks"]
            else:
                row["removed"] = self.purge_namespace(
                    row["tenant"], bytes.fromhex(row["namespace"])
                )
                removed_chunks += row["removed"]
            removed_bytes += row["bytes"]
        report: dict[str, Any] = {
            "dry_run": dry_run,
            "selector": dict(selector),
            "tenant": tenant,
            "namespaces": matched,
            "removed_namespaces": len(matched),
            "removed_chunks": removed_chunks,
            "removed_bytes": removed_bytes,
            "unknown_contract": unknown,
            "shared_root": self._shared is not None,
        }
        self._audit(
            "invalidate",
            {
                **dict(actor or {}),
                "selector": dict(selector),
                "tenant": tenant,
                "dry_run": dry_run,
                "result": "ok",
                "namespaces": [f"{r['tenant']}/{r['namespace']}" for r in matched],
                "chunks": removed_chunks,
                "bytes": removed_bytes,
                "unknown_contract": len(unknown),
            },
        )
        return report

    @boundary
    def purge_older_than(self, age_s: float, tenant: str | None = None) -> int:
        cutoff = age_cutoff_ns(time.time_ns(), age_s)  # 1e300 s: nothing is older
        recs = [r for r in self.index.records(tenant=tenant) if r.created_ns < cutoff]
        for rec in recs:
            self._drop(rec.tenant, rec.chunk_key, reason="purge-age")
        return len(recs)

    @boundary
    def rotate_kek(self, new_kek: Kek) -> int:
        """Re-wrap every key file under ``new_kek``. The root records the new id
        (keeping the old one accepted) before the first file is re-wrapped, and
        drops the old one once every file is: a rotation killed half-way is
        finished by running it again, with either KEK."""
        old = self.keyring.kek_id
        self.layout = record_kek_id(self.root, new_kek.key_id, previous=old)
        n = self.keyring.rotate_kek(new_kek)  # the keyring writes the audit record
        self.layout = record_kek_id(self.root, new_kek.key_id)
        _keep_layout_copy(self.root, self.config.resolved_index_dir())
        return n

    def key_problems(self) -> dict[str, str]:
        """Tenants whose key file cannot be read, with why: their chunks miss."""
        with mapped_errors("key_problems"):
            return self.keyring.problems()

    @boundary
    def maintain(self) -> dict[str, int]:
        """Periodic upkeep the server runs: TTL expiry, orphaned temp files and
        unindexed objects (:meth:`sweep`)."""
        self._flush_touches()
        return {"expired": self.expire(), **self.sweep()}

    # ---------------------------------------------------------------- stats

    @boundary
    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "store_id": self.layout.store_id,
            "layout_version": self.layout.version,
            "capacity_bytes": self.config.capacity_bytes,
            "used_bytes": self._used,
            "reserved_bytes": self._reserved,
            "chunks": self.index.count(),
            "tenants": len(self.keyring.tenants()),
            "hits": c.hits,
            "misses": c.misses,
            "puts": c.puts,
            "put_exists": c.put_exists,
            "evictions": c.evictions,
            "corrupt": c.corrupt,
            "bytes_in": c.bytes_in,
            "bytes_out": c.bytes_out,
            "durability": str(self.config.durability),
            "io": self.io.describe(),
            "shared": self.shared_info(),
            "ram_tier": None if self._ram is None else self._ram.stats(),
        }


def _ram_tier(config: StoreConfig, plan: IOPlan) -> RamTier | None:
    """The RAM tier this store's settings and I/O plan call for: objects the
    backend writes or reads around the page cache (posix: those of at least
    direct_read_min, 16 MiB), sized by ``ram_cache``. None where it is 0, or
    where the page cache already keeps every object (posix-buffered)."""
    capacity = auto_capacity() if config.ram_cache is None else config.ram_cache
    if not capacity or not (plan.direct_write or plan.direct_read or plan.direct_read_min):
        return None
    min_size = plan.direct_read_min or plan.direct_write_min or DIRECT_WRITE_MIN
    return RamTier(capacity, min_size)


def _stop_check(
    cancelled: Callable[[int], bool], guard: Callable[[int], None]
) -> Callable[[int], bool]:
    """A layer-wise load's check before each layer: the caller's, then the load
    generation of its tenant (a purge or revocation since ``guard`` was taken)."""

    def stop(layer: int) -> bool:
        if cancelled(layer):
            return True
        try:
            guard(layer)
        except TransferCancelled:
            return True
        return False

    return stop


def _load_layout(root: Path, index_dir: Path, kek: Kek, create: bool) -> LayoutInfo:
    """The root's ``layout.json``; a damaged one (unparseable, invalid, or failing its
    checksum: layout-v1.md §2) is restored from the copy this node keeps in its
    index directory, when that copy is intact and names this KEK; the damaged
    file is kept beside it. Without such a copy the error stands (one line)."""
    try:
        return create_root(root, kek_id=kek.key_id) if create else read_layout(root)
    except UnknownLayoutVersion:
        raise
    except LayoutError as exc:
        path = root / LAYOUT_FILE
        if not path.exists() or not (index_dir / LAYOUT_FILE).exists():
            raise
        try:
            copy = read_layout(index_dir)
        except LayoutError:
            raise exc from None
        if kek.key_id not in (copy.kek_id, copy.kek_id_previous):
            raise
        aside = root / f"{LAYOUT_FILE}.damaged-{time.strftime('%Y%m%dT%H%M%S')}"
        os.replace(path, aside)
        atomic_create(path, (index_dir / LAYOUT_FILE).read_bytes(), mode=0o644)
        log.error(
            "%s (%s); restored from %s, the damaged file kept as %s",
            path, exc, index_dir / LAYOUT_FILE, aside.name,
        )  # fmt: skip
        return read_layout(root)


def _keep_layout_copy(root: Path, index_dir: Path) -> None:
    """This node's copy of a verified ``layout.json``, to restore a damaged one."""
    data = (root / LAYOUT_FILE).read_bytes()
    copy = index_dir / LAYOUT_FILE
    try:
        if copy.read_bytes() == data:
            return
    except FileNotFoundError:
        pass
    try:
        atomic_create(copy, data, mode=0o600, replace=True)
    except OSError as exc:
        log.warning("keeping a copy of %s failed: %s", LAYOUT_FILE, exc)


_ENVIRONMENTAL = (
    lmdb.ReadonlyError,
    lmdb.DiskError,
    lmdb.MapFullError,
    lmdb.LockError,
    lmdb.ReadersFullError,
    lmdb.TlsFullError,
    lmdb.MemoryError,
)
_ENVIRONMENTAL_TEXT = (
    "Permission denied",
    "No space left",
    "Read-only file system",
    "Too many open files",
    "Cannot allocate memory",
    "Disk quota",
    "is closed",
)


def _environmental(exc: IndexFailure) -> bool:
    """An index failure of the machine (permissions, space, limits), not of the
    index's bytes: moving the index aside would not help and loses nothing less."""
    cause = exc.__cause__
    if isinstance(cause, (*_ENVIRONMENTAL, OSError)):
        return True
    return any(t in str(exc) for t in _ENVIRONMENTAL_TEXT)


def _tighten_modes(root: Path) -> None:
    """Set the modes of the root's directories (layout-v1.md §2), whatever the umask
    they were made under; a directory that is not ours is left as it is."""
    for sub, mode in ROOT_DIR_MODES.items():
        d = root / sub
        try:
            if d.stat().st_mode & 0o7777 != mode:
                d.chmod(mode)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("cannot set mode %04o on %s: %s", mode, d, exc)


def open_store(config: StoreConfig, kek: Kek, *, create: bool = False) -> Store:
    try:
        return Store(config, kek, create=create)
    except OSError as exc:
        raise StoreIOError(f"cannot open store at {config.root}: {exc}", exc.errno) from exc
