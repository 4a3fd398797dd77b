"""The store: objects on disk (layout v1), an LMDB index, a per-tenant keyring.

Usable in-process (tests, CLI) and served by the sidecar. Thread-safe: the
server calls it from a thread pool.

Read rule: a chunk is returned only after every byte of its object has been
verified (structure, zero padding, every tag or checksum). Any failure —
missing file, torn or flipped bytes, another object's file, a purged key —
is a miss, and the index entry (and a corrupt file) is dropped.

Capacity rule: ``used + reserved <= capacity`` at all times. A write reserves
its object size first, evicting least-recently-used unpinned chunks if it
must; if it still cannot fit it fails with :class:`StoreFull`, never
exceeding the limit. Above the high watermark, eviction runs down to the low
watermark.

I/O: objects are written and read through the backend ``StoreConfig.io`` (or
``$KVOFFLOAD_IO``) selects at open (``sidecar/iobackend.py``; ``auto`` by
default, logged with its reason). ``put_many`` and ``get_many_into`` pipeline
a batch on a small thread pool: chunk n+1 is sealed while chunk n is
written, and read while chunk n is verified and decrypted.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ...layouts import (
    CorruptObject,
    LayoutError,
    UnknownLayoutVersion,
    create_root,
    read_layout,
    v1,
)
from .. import fileio
from ..errors import (
    LeaseInvalid,
    QuotaExceeded,
    StoreError,
    StoreFull,
    StoreIOError,
    StoreLocked,
)
from ..fileio import Durability, ScratchBuffers, read_prefix, syncfs
from ..index import ChunkRecord, Index
from ..iobackend import IOBackend, IOMode, IOPlan, select_backend
from ..keyring import Kek, Keyring, KeyringError, TenantKeys

log = logging.getLogger("kvoffload.store")

#: Objects larger than this are refused on read (a corrupt size must not OOM us).
MAX_OBJECT_BYTES = 4 << 30
#: NIST SP 800-38D: at most 2**32 random 96-bit nonces per key. Layer segments
#: count against it; we rotate the tenant's DEK well before.
DEFAULT_MAX_SEGMENTS_PER_EPOCH = 2**31
_SEAL_COUNT_BLOCK = 1 << 16


@dataclass
class StoreConfig:
    root: Path
    index_dir: Path | None = None  # node-local; default <root>/../<root name>.index
    capacity_bytes: int | None = None
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    durability: Durability = Durability.BATCH
    batch_interval_s: float = 1.0
    key_cache_ttl_s: float = 30.0
    tmp_max_age_s: float = 600.0
    probe_files_on_miss: bool = True
    max_segments_per_epoch: int = DEFAULT_MAX_SEGMENTS_PER_EPOCH
    #: I/O backend (auto | posix | posix-direct | posix-buffered | kvikio | cufile);
    #: None: $KVOFFLOAD_IO, else auto. See sidecar/iobackend.py.
    io: str | IOMode | None = None

    def resolved_index_dir(self) -> Path:
        if self.index_dir is not None:
            return Path(self.index_dir)
        root = Path(self.root)
        return root.parent / f"{root.name}.index"

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.durability = Durability(self.durability)
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ValueError("watermarks must satisfy 0 < low <= high <= 1")
        if self.capacity_bytes is not None and self.capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")


class Reservation:
    """Bytes held against the capacity for one in-flight write."""

    def __init__(self, store: Store, tenant: str, nbytes: int) -> None:
        self._store = store
        self.tenant = tenant
        self.nbytes = nbytes
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._store._unreserve(self.tenant, self.nbytes)

    def _commit_locked(self) -> None:
        # Caller holds the store's lock and has just added the bytes to `used`.
        if not self._released:
            self._released = True
            self._store._unreserve_locked(self.tenant, self.nbytes)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class FsckReport:
    objects_on_disk: int = 0
    index_records: int = 0
    ok: int = 0
    missing_files: list[str] = field(default_factory=list)  # index says present, no file
    unindexed_files: list[str] = field(default_factory=list)  # file, no index record
    corrupt_files: list[str] = field(default_factory=list)
    orphan_tmp_files: list[str] = field(default_factory=list)
    purged_tenant_files: list[str] = field(default_factory=list)
    mismatched_records: list[str] = field(default_factory=list)
    repaired: bool = False

    @property
    def clean(self) -> bool:
        return not (
            self.missing_files
            or self.unindexed_files
            or self.corrupt_files
            or self.orphan_tmp_files
            or self.purged_tenant_files
            or self.mismatched_records
        )

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items()}
        d["clean"] = self.clean
        return d


@dataclass
class Counters:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_exists: int = 0
    evictions: int = 0
    corrupt: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


@dataclass
class StoreLease:
    """A direct-path write in progress (docs/spec/layout-v1.md §4.1): the leased temp
    file, its reservation, and what the finished object must be."""

    tenant: str
    namespace: bytes
    chunk_key: bytes
    lengths: tuple[int, ...]
    size: int
    tmp: Path
    final: Path
    reservation: Reservation
    ttl_s: float | None

    @property
    def offsets(self) -> tuple[int, list[int]]:
        """(data_offset, layer offsets) of the object the worker must write."""
        return v1.plan_offsets(len(self.lengths), self.lengths, False)


@dataclass(frozen=True)
class ReadLease:
    """What a worker needs to read one verified-at-rest direct-path object itself."""

    path: Path
    size: int
    header: v1.ObjectHeader


@dataclass
class _PutJob:
    """One chunk between reservation and index insert (put / put_many)."""

    tenant: str
    namespace: bytes
    chunk_key: bytes
    layers: Sequence[memoryview | bytes | bytearray]
    lengths: list[int]
    size: int
    res: Reservation
    aead: AESGCM | None
    epoch: int
    ttl_s: float | None
    now: int


class Store:
    """See the module docstring. Open with :meth:`open`; close with :meth:`close`."""

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
        if create:
            self.layout = create_root(self.root)
        else:
            self.layout = read_layout(self.root)
        index_dir = config.resolved_index_dir()
        index_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(index_dir / "kvoffload.lock", os.O_RDWR | os.O_CREAT, 0o640)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(self._lock_fd)
            raise StoreLocked(
                f"the index at {index_dir} is in use by another process (a running sidecar?); "
                "use the sidecar's admin verbs or stop it first"
            ) from exc
        self._audit_hook = audit
        self._audit_path = index_dir / "audit.jsonl"
        self.keyring = Keyring(
            self.root / "keys", kek, cache_ttl_s=config.key_cache_ttl_s, audit=self._audit
        )
        tenants = self.keyring.tenants()
        if tenants:
            # A wrong KEK must stop us here: later, every object would look corrupt
            # and fsck --repair would delete them all.
            try:
                self.keyring.get(tenants[0])
            except KeyringError as exc:
                os.close(self._lock_fd)
                raise StoreError(f"the KEK does not open this store's keys: {exc}") from exc
        self.index = Index(index_dir / "lmdb")
        store_id = self.index.get_meta("store_id")
        if store_id is None:
            self.index.set_meta("store_id", self.layout.store_id.encode())
        elif store_id.decode() != self.layout.store_id:
            self.index.close()
            os.close(self._lock_fd)
            raise StoreError(
                f"index at {index_dir} belongs to store {store_id.decode()}, "
                f"not {self.layout.store_id}: point index_dir elsewhere or run fsck --repair"
            )
        self._mu = threading.Lock()
        self._used = self.index.usage().bytes
        self._reserved = 0
        self._tenant_reserved: dict[str, int] = {}
        self._pins: dict[tuple[str, bytes], int] = {}
        self._touch_pending: dict[tuple[str, bytes], int] = {}
        self._touch_flushed = time.time_ns()
        self._seal_budget: dict[tuple[str, int], int] = {}
        self._scratch = ScratchBuffers()
        self._scratch_alt = ScratchBuffers()  # the second buffer of put_many/get_many_into
        self._pipe: ThreadPoolExecutor | None = None
        try:
            sel = select_backend(config.io, self.root / "objects")
        except StoreError:
            self.index.close()
            os.close(self._lock_fd)
            raise
        self.io: IOBackend = sel.backend
        self.io_plan: IOPlan = sel.plan
        self.counters = Counters()
        self._closed = threading.Event()
        self._bg: list[threading.Thread] = []
        self._flusher: threading.Thread | None = None
        if config.durability is Durability.BATCH:
            self._flusher = threading.Thread(
                target=self._flush_loop, name="kvoffload-flush", daemon=True
            )
            self._flusher.start()

    # ------------------------------------------------------------------ life

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self.wait_background()
        if self._pipe is not None:
            self._pipe.shutdown(wait=True)
        self.io.close()
        self._flush_touches()
        if self._flusher is not None:
            self._flusher.join()
        if self.config.durability is not Durability.NONE:
            try:
                syncfs(self.root)
            except OSError as exc:
                log.warning("final syncfs failed: %s", exc)
        self.index.flush()
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

    def wait_background(self) -> None:
        """Wait for background work (purge file removal) to finish."""
        for t in list(self._bg):
            t.join()
        self._bg = [t for t in self._bg if t.is_alive()]

    def _audit(self, event: str, details: dict[str, Any]) -> None:
        entry = {"ts": time.time(), "event": event, **details}
        log.warning("audit: %s", entry)
        # Append-only, fsync'd: a purge or revocation must leave a trace even if we crash next.
        with open(self._audit_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self._audit_hook is not None:
            self._audit_hook(event, details)

    # -------------------------------------------------------------- tenants

    def tenant_salt(self, tenant: str) -> bytes:
        """The tenant's secret key salt (creates the tenant's keys on first use)."""
        return self.keyring.ensure_tenant(tenant).salt

    def tenants(self) -> list[str]:
        return self.keyring.tenants()

    # ------------------------------------------------------------- capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    @property
    def accounted_bytes(self) -> int:
        """used + reserved, read atomically: never above the capacity."""
        with self._mu:
            return self._used + self._reserved

    def _unreserve(self, tenant: str, n: int) -> None:
        with self._mu:
            self._unreserve_locked(tenant, n)

    def _unreserve_locked(self, tenant: str, n: int) -> None:
        self._reserved -= n
        self._drop_tenant_share_locked(tenant, n)

    def _drop_tenant_share_locked(self, tenant: str, n: int) -> None:
        left = self._tenant_reserved.get(tenant, 0) - n
        if left > 0:
            self._tenant_reserved[tenant] = left
        else:
            self._tenant_reserved.pop(tenant, None)

    def reserve(self, tenant: str, nbytes: int, *, quota: int | None = None) -> Reservation:
        """Hold ``nbytes`` of capacity, evicting LRU chunks if needed; else StoreFull.

        ``quota``: the tenant's byte limit (its policy's ``quota``). The tenant's
        stored plus reserved bytes stay at or below it: its own least recently
        used unpinned chunks are evicted to make room (down to the low
        watermark of the quota, so that eviction runs in batches), never
        another tenant's; if that cannot make room, :class:`QuotaExceeded`.
        """
        if quota is not None:
            self._hold_quota(tenant, nbytes, quota)
        else:
            with self._mu:
                self._tenant_reserved[tenant] = self._tenant_reserved.get(tenant, 0) + nbytes
        try:
            self._hold_capacity(nbytes)
        except BaseException:
            with self._mu:
                self._drop_tenant_share_locked(tenant, nbytes)
            raise
        return Reservation(self, tenant, nbytes)

    def tenant_accounted(self, tenant: str) -> int:
        """The tenant's stored + reserved bytes (what its quota bounds)."""
        with self._mu:
            return self.index.usage(tenant).bytes + self._tenant_reserved.get(tenant, 0)

    def _hold_quota(self, tenant: str, nbytes: int, quota: int) -> None:
        if nbytes > quota:
            raise QuotaExceeded(tenant, nbytes, quota, self.index.usage(tenant).bytes)
        evicted_nothing = False
        for _attempt in range(1000):
            with self._mu:
                # The index's usage is read under the lock that every insert
                # takes, so two writers cannot both fit into the same room.
                used = self.index.usage(tenant).bytes
                over = used + self._tenant_reserved.get(tenant, 0) + nbytes - quota
                if over <= 0:
                    self._tenant_reserved[tenant] = self._tenant_reserved.get(tenant, 0) + nbytes
                    return
            if evicted_nothing:
                # Checked again after finding nothing to evict: the rest of the
                # quota is pinned or reserved by the tenant's writes in flight.
                raise QuotaExceeded(tenant, nbytes, quota, used)
            slack = int(quota * (1 - self.config.low_watermark))
            # Freed nothing: another writer is evicting the same chunks (try
            # again), or nothing of the tenant's own is evictable (one more look
            # at the room, which that writer may have made, then give up).
            if self._evict_tenant(tenant, over + slack) == 0:
                evicted_nothing = not self._tenant_evictable(tenant)
        raise QuotaExceeded(tenant, nbytes, quota, self.index.usage(tenant).bytes)

    def _tenant_evictable(self, tenant: str) -> bool:
        for rec in self.index.records(tenant):
            with self._mu:
                if not self._pins.get((rec.tenant, rec.chunk_key)):
                    return True
        return False

    def _evict_tenant(self, tenant: str, nbytes: int) -> int:
        """Evict the tenant's own unpinned chunks, oldest access first."""
        self._flush_touches()
        freed = 0
        for rec in sorted(self.index.records(tenant), key=lambda r: r.last_access_ns):
            if freed >= nbytes:
                break
            with self._mu:
                if self._pins.get((rec.tenant, rec.chunk_key)):
                    continue
            if self._drop(rec.tenant, rec.chunk_key, reason="quota"):
                freed += rec.size
                self.counters.evictions += 1
        return freed

    def _hold_capacity(self, nbytes: int) -> None:
        cap = self.config.capacity_bytes
        if cap is not None:
            if nbytes > cap:
                raise StoreFull(nbytes, cap, self._used)
            for _attempt in range(1000):
                with self._mu:
                    over = self._used + self._reserved + nbytes - cap
                    if over <= 0:
                        self._reserved += nbytes
                        break
                # Freed nothing: either another writer is evicting the same
                # records (try again) or nothing is evictable (give up).
                if self._evict(over) == 0 and not self._has_evictable():
                    raise StoreFull(nbytes, cap, self._used)
            else:
                raise StoreFull(nbytes, cap, self._used)
        else:
            with self._mu:
                self._reserved += nbytes

    def _has_evictable(self) -> bool:
        for rec in self.index.lru():
            with self._mu:
                if not self._pins.get((rec.tenant, rec.chunk_key)):
                    return True
        return False

    def _evict(self, nbytes: int) -> int:
        """Evict unpinned chunks, oldest access first, until ``nbytes`` are freed."""
        self._flush_touches()
        freed = 0
        for rec in self.index.lru():
            if freed >= nbytes:
                break
            with self._mu:
                if self._pins.get((rec.tenant, rec.chunk_key)):
                    continue
            if self._drop(rec.tenant, rec.chunk_key, reason="evict"):
                freed += rec.size
                self.counters.evictions += 1
        return freed

    def _after_write(self) -> None:
        cap = self.config.capacity_bytes
        if cap is None:
            return
        if self._used + self._reserved > cap * self.config.high_watermark:
            target = int(cap * self.config.low_watermark)
            self._evict(self._used + self._reserved - target)

    def pin(self, tenant: str, keys: Sequence[bytes]) -> None:
        with self._mu:
            for k in keys:
                self._pins[(tenant, k)] = self._pins.get((tenant, k), 0) + 1

    def unpin(self, tenant: str, keys: Sequence[bytes]) -> None:
        with self._mu:
            for k in keys:
                n = self._pins.get((tenant, k), 0) - 1
                if n > 0:
                    self._pins[(tenant, k)] = n
                else:
                    self._pins.pop((tenant, k), None)

    # ----------------------------------------------------------------- write

    def _path(self, tenant: str, key: bytes) -> Path:
        return self.root / v1.object_relpath(tenant, key)

    def _nonce_budget(self, tenant: str, epoch: int, segments: int) -> int:
        """Count sealed segments per (tenant, epoch); rotate the DEK before the bound.

        The persisted count runs ahead of the real one by up to a block, so a
        crash can only over-count, never under-count.
        """
        limit = self.config.max_segments_per_epoch
        block = max(segments, min(_SEAL_COUNT_BLOCK, limit // 4))
        with self._mu:
            while True:
                left = self._seal_budget.get((tenant, epoch), 0)
                if left >= segments:
                    self._seal_budget[(tenant, epoch)] = left - segments
                    return epoch
                name = f"seal_count/{tenant}/{epoch}"
                raw = self.index.get_meta(name)
                done = int(raw.decode()) if raw else 0
                if done + block > limit:
                    epoch = self.keyring.rotate_dek(tenant)
                    log.info("tenant %s: nonce budget spent, DEK epoch now %d", tenant, epoch)
                    continue
                self.index.set_meta(name, str(done + block).encode())
                self._seal_budget[(tenant, epoch)] = left + block

    def put(
        self,
        tenant: str,
        namespace: bytes,
        chunk_key: bytes,
        layers: Sequence[memoryview | bytes | bytearray],
        *,
        encrypt: bool = True,
        ttl_s: float | None = None,
        reservation: Reservation | None = None,
    ) -> bool:
        """Store one chunk. True if written, False if it was already present."""
        job = self._begin_put(tenant, namespace, chunk_key, layers, encrypt, ttl_s, reservation)
        if job is None:
            return False
        try:
            buf = self._scratch.get(job.size)
            self._seal(job, buf)
        except BaseException:
            job.res.release()
            raise
        return self._write_sealed(job, buf)

    def put_many(
        self,
        tenant: str,
        namespace: bytes,
        chunks: Sequence[tuple[bytes, Sequence[memoryview | bytes | bytearray]]],
        *,
        encrypt: bool = True,
        ttl_s: float | None = None,
        reservations: Sequence[Reservation | None] | None = None,
    ) -> list[bool]:
        """Store several chunks ``(chunk_key, layers)``, sealing chunk n+1 while chunk n
        is written. Per chunk: True if written, False if already present.

        ``reservations[i]``, if given, is capacity already held for chunk i (the
        server reserves at prepare time); it is consumed or released.
        On an error (StoreFull, StoreIOError…) the chunks before the failing one
        are stored, nothing after it is, and the error is raised.
        """
        results = [False] * len(chunks)
        held = list(reservations) if reservations is not None else [None] * len(chunks)
        if len(held) != len(chunks):
            raise ValueError("one reservation (or None) per chunk")
        if len(chunks) < 2:
            for i, (key, layers) in enumerate(chunks):
                results[i] = self.put(
                    tenant, namespace, key, layers, encrypt=encrypt, ttl_s=ttl_s,
                    reservation=held[i],
                )  # fmt: skip
            return results
        pool = self._pipeline()
        scratch = (self._scratch, self._scratch_alt)
        turn = 0
        inflight: tuple[int, Future[bool]] | None = None
        try:
            for i, (key, layers) in enumerate(chunks):
                job = self._begin_put(tenant, namespace, key, layers, encrypt, ttl_s, held[i])
                if job is None:
                    continue
                try:
                    # The other buffer may still be being written: seal into this one.
                    buf = scratch[turn].get(job.size)
                    turn ^= 1
                    self._seal(job, buf)
                    if inflight is not None:
                        j, fut = inflight
                        inflight = None
                        results[j] = fut.result()
                except BaseException:
                    job.res.release()
                    raise
                inflight = (i, pool.submit(self._write_sealed, job, buf))
            if inflight is not None:
                j, fut = inflight
                inflight = None
                results[j] = fut.result()
        finally:
            if inflight is not None:  # an error while a write was in flight: let it finish
                try:
                    inflight[1].result()
                except Exception as exc:
                    log.warning("put_many: in-flight write failed too: %s", exc)
        return results

    def _pipeline(self) -> ThreadPoolExecutor:
        with self._mu:
            if self._pipe is None:
                self._pipe = ThreadPoolExecutor(
                    max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="kvoffload-pipe"
                )
            return self._pipe

    def _begin_put(
        self,
        tenant: str,
        namespace: bytes,
        chunk_key: bytes,
        layers: Sequence[memoryview | bytes | bytearray],
        encrypt: bool,
        ttl_s: float | None,
        reservation: Reservation | None,
    ) -> _PutJob | None:
        """Checks, capacity reservation and key for one chunk; None if already present."""
        if len(chunk_key) != v1.KEY_SIZE or len(namespace) != v1.KEY_SIZE:
            raise ValueError("chunk key and namespace must be 32 bytes")
        if self.index.get(tenant, chunk_key) is not None:
            self.counters.put_exists += 1
            if reservation is not None:
                reservation.release()
            return None
        lengths = [memoryview(x).nbytes for x in layers]
        size = v1.object_size(lengths, encrypt)
        res = reservation
        if res is None or res.released or res.nbytes < size:
            if res is not None:
                res.release()
            res = self.reserve(tenant, size)
        try:
            aead = None
            epoch = 0
            if encrypt:
                tk = self.keyring.ensure_tenant(tenant)
                epoch = self._nonce_budget(tenant, tk.current_epoch, len(layers))
                if epoch != tk.current_epoch:
                    tk = self.keyring.ensure_tenant(tenant)
                aead = tk.aead(epoch)
                if aead is None:
                    raise StoreError(f"tenant {tenant}: no data key for epoch {epoch}")
        except BaseException:
            res.release()
            raise
        return _PutJob(
            tenant, namespace, chunk_key, layers, lengths, size, res, aead, epoch, ttl_s,
            time.time_ns(),
        )  # fmt: skip

    @staticmethod
    def _seal(job: _PutJob, buf: memoryview) -> None:
        v1.seal_into(
            buf,
            tenant=job.tenant,
            namespace=job.namespace,
            chunk_key=job.chunk_key,
            layers=job.layers,
            aead=job.aead,
            key_epoch=job.epoch,
            created_ns=job.now,
        )

    def _write_sealed(self, job: _PutJob, buf: memoryview) -> bool:
        """Write a sealed object and index it; always releases the job's reservation."""
        res = job.res
        try:
            path = self._path(job.tenant, job.chunk_key)
            written = self.io.write_object(path, buf, self.config.durability)
            if not written:
                # Another writer (another node on a shared FS) got there first.
                self._adopt(job.tenant, job.chunk_key)
                self.counters.put_exists += 1
                return False
            now = job.now
            rec = ChunkRecord(
                tenant=job.tenant,
                chunk_key=job.chunk_key,
                namespace=job.namespace,
                key_epoch=job.epoch,
                size=job.size,
                payload=sum(job.lengths),
                num_layers=len(job.lengths),
                created_ns=now,
                last_access_ns=now,
                expires_ns=now + int(job.ttl_s * 1e9) if job.ttl_s else 0,
            )
            with self._mu:
                # Turn the reservation into usage in one step: used + reserved
                # neither dips (letting another writer in) nor double counts.
                inserted = self.index.put(rec)
                if inserted:
                    self._used += job.size
                    res._commit_locked()
            self.counters.puts += 1
            self.counters.bytes_in += rec.payload
        finally:
            res.release()
        self._after_write()
        return inserted

    # ------------------------------------------------------- direct path

    @property
    def durability(self) -> str:
        """The fsync setting, as the lease tells a direct-path writer (a write hint)."""
        return str(self.config.durability)

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
        """Reserve space and create the temp file a worker will fill (layout-v1.md §4.1).

        None if the chunk is already stored. ``gid``: the tenant's
        ``direct_group``, which gets the tenant's object tree shared with it.
        Raises StoreFull, or StoreIOError (a full disk: before any byte moves).
        """
        if len(chunk_key) != v1.KEY_SIZE or len(namespace) != v1.KEY_SIZE:
            raise ValueError("chunk key and namespace must be 32 bytes")
        if not 1 <= len(lengths) <= v1.MAX_LAYERS or any(n < 1 for n in lengths):
            raise ValueError(f"1..{v1.MAX_LAYERS} layers of at least one byte expected")
        if self.index.get(tenant, chunk_key) is not None:
            self.counters.put_exists += 1
            return None
        size = v1.object_size(lengths, False)
        res = self.reserve(tenant, size, quota=quota)
        final = self._path(tenant, chunk_key)
        try:
            tmp = fileio.create_lease_file(
                final,
                size,
                durable_dirs=self.config.durability is Durability.OBJECT,
                gid=gid,
                share_top=self.root / "objects" / tenant if gid is not None else None,
            )
        except BaseException:
            res.release()
            raise
        return StoreLease(
            tenant, namespace, chunk_key, tuple(lengths), size, tmp, final, res, ttl_s
        )  # fmt: skip

    def cancel_lease(self, lease: StoreLease) -> None:
        """Drop a lease: its temp file and its reservation (idempotent)."""
        with contextlib.suppress(FileNotFoundError):
            lease.tmp.unlink()
        lease.reservation.release()

    def publish_lease(self, lease: StoreLease) -> bool:
        """Check the worker's object and give it its name; True once stored.

        Raises :class:`LeaseInvalid` (the object failed a check: it is
        deleted, nothing is indexed) or StoreIOError. Always ends the lease.
        """
        try:
            try:
                fd = fileio.open_lease_file(lease.tmp, lease.size)
            except OSError as exc:
                raise LeaseInvalid(f"leased file unusable: {exc}") from exc
            try:
                buf = self._scratch.get(lease.size)
                n = fileio.read_fd(fd, buf, lease.size)
                h = v1.verify_plain(
                    buf[:n],
                    tenant=lease.tenant,
                    namespace=lease.namespace,
                    chunk_key=lease.chunk_key,
                )
                if tuple(le.length for le in h.layers) != lease.lengths:
                    raise CorruptObject("layer lengths differ from the lease")
            except (LayoutError, OSError) as exc:
                os.close(fd)
                self.counters.corrupt += 1
                raise LeaseInvalid(f"chunk {lease.chunk_key.hex()[:16]}: {exc}") from exc
            fileio.publish_lease_file(lease.tmp, fd, lease.final, self.config.durability)
            now = time.time_ns()
            rec = ChunkRecord(
                tenant=lease.tenant,
                chunk_key=lease.chunk_key,
                namespace=lease.namespace,
                key_epoch=0,
                size=lease.size,
                payload=h.payload_size,
                num_layers=len(h.layers),
                created_ns=h.created_ns,
                last_access_ns=now,
                expires_ns=now + int(lease.ttl_s * 1e9) if lease.ttl_s else 0,
            )
            with self._mu:
                inserted = self.index.put(rec)
                if inserted:
                    self._used += lease.size
                    lease.reservation._commit_locked()
            if inserted:
                self.counters.puts += 1
                self.counters.bytes_in += rec.payload
            else:
                self.counters.put_exists += 1  # another writer indexed it meanwhile
        finally:
            self.cancel_lease(lease)  # a no-op for the file once it has its name
        self._after_write()
        return True

    def lease_load(self, tenant: str, key: bytes) -> ReadLease | None:
        """Header-checked facts of a stored plaintext chunk for a worker to read itself.

        None (a miss, the entry dropped where the file is bad) if it is absent,
        expired, sealed, or its header, identity or size fail. The layer bytes
        are the reader's to verify against the header's checksums. The caller
        pins the key first.
        """
        rec = self._record(tenant, key)
        if rec is None:
            self.counters.misses += 1
            return None
        if rec.key_epoch:
            return None  # sealed: only the sidecar reads it
        path = self._path(tenant, key)
        try:
            size = os.stat(path).st_size
            head = read_prefix(path, v1.header_length(rec.num_layers))
            h = v1.decode_header(head)
            if h.chunk_key != key or h.tenant != tenant or h.namespace != rec.namespace:
                raise CorruptObject("object belongs to another chunk key, tenant or namespace")
            if h.sealed or size != h.total_size:
                raise CorruptObject(f"object is {size} bytes or sealed, header says otherwise")
        except (LayoutError, KeyringError, OSError) as exc:
            self._read_failed(tenant, key, exc)
            return None
        self._hit(tenant, key, h.payload_size)
        return ReadLease(path, size, h)

    def check_reported(self, tenant: str, key: bytes) -> bool:
        """A reader says the chunk failed its checksums: verify it fully here.

        True (and the chunk dropped) if it is corrupt; False if it verifies,
        so a confused or hostile reader cannot make the store delete good data.
        """
        rec = self._record(tenant, key)
        if rec is None or rec.key_epoch:
            return False  # sealed chunks are read by the sidecar only: nothing to re-check
        try:
            buf = self.io.read_object(self._path(tenant, key), self._scratch.get, MAX_OBJECT_BYTES)
            v1.verify_plain(buf, tenant=tenant, namespace=rec.namespace, chunk_key=key)
        except (LayoutError, OSError) as exc:
            self._read_failed(tenant, key, exc)
            return True
        return False

    # ------------------------------------------------------------------ read

    def _adopt(self, tenant: str, key: bytes) -> bool:
        """Index an object another writer (node) put on disk. False if absent/invalid."""
        path = self._path(tenant, key)
        try:
            st = path.stat()
            head = read_prefix(path, v1.ALIGN)
            h = v1.decode_header(head)
        except (OSError, LayoutError):
            return False
        if h.chunk_key != key or h.tenant != tenant or st.st_size != h.total_size:
            return False
        rec = self._record_from_header(h, st.st_size)
        with self._mu:
            if self.index.put(rec):
                self._used += rec.size
        return True

    @staticmethod
    def _record_from_header(h: v1.ObjectHeader, size: int) -> ChunkRecord:
        now = time.time_ns()
        return ChunkRecord(
            tenant=h.tenant,
            chunk_key=h.chunk_key,
            namespace=h.namespace,
            key_epoch=h.key_epoch,
            size=size,
            payload=h.payload_size,
            num_layers=len(h.layers),
            created_ns=h.created_ns,
            last_access_ns=now,
            expires_ns=0,
        )

    def _record(self, tenant: str, key: bytes) -> ChunkRecord | None:
        rec = self.index.get(tenant, key)
        if rec is None and self.config.probe_files_on_miss and self._adopt(tenant, key):
            rec = self.index.get(tenant, key)
        if rec is not None and rec.expires_ns and rec.expires_ns <= time.time_ns():
            self._drop(tenant, key, reason="expired")
            return None
        return rec

    def lookup(self, tenant: str, keys: Sequence[bytes]) -> int:
        """How many leading keys are present (per the index, plus files on a miss)."""
        now = time.time_ns()
        n = self.index.lookup(tenant, keys, now_ns=now)
        # The prefix ends at an absent or expired key; an absent one may be another
        # node's object (shared FS): adopt it and go on, which costs a stat per miss.
        while n < len(keys):
            rec = self.index.get(tenant, keys[n])
            if rec is not None:  # present but expired
                self._drop(tenant, keys[n], reason="expired")
                return n
            if not (self.config.probe_files_on_miss and self._adopt(tenant, keys[n])):
                return n
            n += self.index.lookup(tenant, keys[n:], now_ns=now)
        return n

    def lookup_cached(self, tenant: str, keys: Sequence[bytes]) -> int | None:
        """:meth:`lookup` from the index alone, or None where that needs the disk
        (a miss that may be another node's file, or an expired entry to drop)."""
        n = self.index.lookup(tenant, keys, now_ns=time.time_ns())
        if n == len(keys):
            return n
        if self.config.probe_files_on_miss or self.index.get(tenant, keys[n]) is not None:
            return None
        return n

    def contains(self, tenant: str, key: bytes) -> bool:
        return self.lookup(tenant, [key]) == 1

    def payload_info(self, tenant: str, key: bytes) -> ChunkRecord | None:
        """Index record of a chunk (sizes, layers), no data I/O."""
        return self._record(tenant, key)

    def get_into(self, tenant: str, key: bytes, out: memoryview) -> list[int] | None:
        """Verify the chunk and write its layers, packed, into ``out``.

        Returns the per-layer lengths, or None (a miss) if the chunk is absent
        or fails any check; then ``out`` holds garbage and the entry is dropped.
        """
        rec = self._record(tenant, key)
        if rec is None:
            self.counters.misses += 1
            return None
        try:
            buf = self.io.read_object(self._path(tenant, key), self._scratch.get, MAX_OBJECT_BYTES)
        except OSError as exc:
            self._unreadable(tenant, key, exc)
            return None
        return self._open_into(tenant, key, rec, buf, out)

    def get_many_into(
        self,
        tenant: str,
        keys: Sequence[bytes],
        outs: Sequence[memoryview],
        *,
        stop_at_miss: bool = True,
    ) -> list[list[int] | None]:
        """:meth:`get_into` for several chunks, reading chunk n+1 while chunk n is
        verified and decrypted. Per chunk: its layer lengths, or None (a miss).

        With ``stop_at_miss`` (the default: a prefix cache has no use for the
        chunks after a hole) nothing after the first miss is read; those are None.
        """
        if len(outs) != len(keys):
            raise ValueError("one output buffer per key")
        results: list[list[int] | None] = [None] * len(keys)
        if len(keys) < 2:
            for i, k in enumerate(keys):
                results[i] = self.get_into(tenant, k, outs[i])
            return results
        pool = self._pipeline()
        scratch = (self._scratch, self._scratch_alt)
        turn = 0

        def start(i: int) -> tuple[ChunkRecord | None, Future[memoryview] | None]:
            nonlocal turn
            rec = self._record(tenant, keys[i])
            if rec is None:
                return None, None
            # Size the buffer here, in the caller's thread (scratch buffers are per thread).
            buf = scratch[turn].get(v1.align_up(rec.size))
            turn ^= 1
            path = self._path(tenant, keys[i])
            return rec, pool.submit(self.io.read_object, path, _Prealloc(buf), MAX_OBJECT_BYTES)

        cur = start(0)
        nxt: tuple[ChunkRecord | None, Future[memoryview] | None] = (None, None)
        try:
            for i in range(len(keys)):
                rec, fut = cur
                cur = (None, None)
                if rec is None or fut is None:
                    self.counters.misses += 1
                    if stop_at_miss:
                        break
                    if i + 1 < len(keys):
                        cur = start(i + 1)
                    continue
                try:
                    buf = fut.result()
                except OSError as exc:
                    self._unreadable(tenant, keys[i], exc)
                    if stop_at_miss:
                        break
                    if i + 1 < len(keys):
                        cur = start(i + 1)
                    continue
                if i + 1 < len(keys):
                    nxt = start(i + 1)  # read the next chunk while this one decrypts
                results[i] = self._open_into(tenant, keys[i], rec, buf, outs[i])
                del buf
                cur, nxt = nxt, (None, None)
                if results[i] is None and stop_at_miss:
                    break
        finally:
            for _rec, f in (cur, nxt):
                if f is not None:  # a read we no longer want still owns a buffer: wait
                    with contextlib.suppress(Exception):
                        f.result()
        return results

    def _read_failed(self, tenant: str, key: bytes, exc: Exception) -> None:
        """A chunk that cannot be read or verified: a miss; its entry is dropped,
        and its file too where the file is corrupt (not for an unknown version,
        which a newer kvoffload may read)."""
        if isinstance(exc, UnknownLayoutVersion):
            log.warning("chunk %s: %s", key.hex()[:16], exc)
            self._miss(tenant, key, "unknown-version", remove_file=False)
        elif isinstance(exc, OSError):
            self._unreadable(tenant, key, exc)
        else:
            log.warning("chunk %s of %s failed verification: %s", key.hex()[:16], tenant, exc)
            self.counters.corrupt += 1
            self._miss(tenant, key, "corrupt", remove_file=True)

    def _hit(self, tenant: str, key: bytes, payload: int) -> None:
        self._touch_later(tenant, key)
        self.counters.hits += 1
        self.counters.bytes_out += payload

    def _unreadable(self, tenant: str, key: bytes, exc: OSError) -> None:
        # ENOENT (evicted/deleted elsewhere), ESTALE (NFS), EIO: all misses.
        log.info("chunk %s unreadable: %s", key.hex()[:16], exc)
        self._miss(tenant, key, errno.errorcode.get(exc.errno or 0, "oserror"), False)

    def _open_into(
        self, tenant: str, key: bytes, rec: ChunkRecord, buf: memoryview, out: memoryview
    ) -> list[int] | None:
        """Verify and decrypt a read object into ``out``; None (and the entry dropped) if bad."""
        try:
            tk = self.keyring.get(tenant) if rec.key_epoch else None
            h = v1.open_into(
                buf,
                out,
                tenant=tenant,
                namespace=rec.namespace,
                chunk_key=key,
                aead_for_epoch=_aead_lookup(tk),
            )
        except (LayoutError, KeyringError, OSError) as exc:
            self._read_failed(tenant, key, exc)
            return None
        self._hit(tenant, key, h.payload_size)
        return [le.length for le in h.layers]

    def get(self, tenant: str, key: bytes) -> list[bytes] | None:
        """Convenience: the verified layers as bytes, or None."""
        rec = self._record(tenant, key)
        if rec is None:
            self.counters.misses += 1
            return None
        out = bytearray(rec.payload)
        lengths = self.get_into(tenant, key, memoryview(out))
        if lengths is None:
            return None
        res, pos = [], 0
        for n in lengths:
            res.append(bytes(out[pos : pos + n]))
            pos += n
        return res

    def touch(self, tenant: str, keys: Sequence[bytes]) -> None:
        for k in keys:
            self._touch_later(tenant, k)  # the index ignores keys it does not hold

    def _touch_later(self, tenant: str, key: bytes) -> None:
        """Record an access; written to the index in batches (a write txn per get is
        most of a small get's cost). The LRU order is at most a batch stale."""
        now = time.time_ns()
        with self._mu:
            self._touch_pending[(tenant, key)] = now
            due = len(self._touch_pending) >= 512 or now - self._touch_flushed > 500_000_000
        if due:
            self._flush_touches()

    def _flush_touches(self) -> None:
        with self._mu:
            pending, self._touch_pending = self._touch_pending, {}
            self._touch_flushed = time.time_ns()
        # One write txn per tenant per batch: the batch shares one access time.
        by_tenant: dict[str, list[bytes]] = {}
        latest: dict[str, int] = {}
        for (tenant, key), ts in pending.items():
            by_tenant.setdefault(tenant, []).append(key)
            latest[tenant] = max(ts, latest.get(tenant, 0))
        for tenant, keys in by_tenant.items():
            self.index.touch(tenant, keys, latest[tenant])

    def _miss(self, tenant: str, key: bytes, reason: str, remove_file: bool) -> None:
        self.counters.misses += 1
        self._drop(tenant, key, reason=reason, remove_file=remove_file)

    # --------------------------------------------------------------- delete

    def _drop(self, tenant: str, key: bytes, *, reason: str, remove_file: bool = True) -> bool:
        # The file goes first and the accounting after: the other order lets a
        # concurrent writer spend the freed bytes while the old file still
        # occupies them, so the disk would briefly hold more than the limit.
        if remove_file:
            try:
                self._path(tenant, key).unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("removing %s (%s): %s", key.hex()[:16], reason, exc)
                return False
        rec = self.index.remove(tenant, key)
        if rec is not None:
            with self._mu:
                self._used -= rec.size
        return rec is not None

    def delete(self, tenant: str, key: bytes) -> bool:
        return self._drop(tenant, key, reason="delete")

    def expire(self) -> int:
        """Drop every chunk whose TTL has passed."""
        n = 0
        for rec in self.index.expired(time.time_ns()):
            n += self._drop(rec.tenant, rec.chunk_key, reason="expired")
        return n

    def purge_tenant(self, tenant: str, *, wait: bool = False) -> int:
        """Crypto-erase a tenant: destroy its wrapped keys first, then remove its data.

        After the key file is destroyed (overwritten, fsync'd, unlinked) no
        object of the tenant decrypts anywhere; files and index entries are
        removed in the background (``wait=True`` waits). Returns the number of
        index records scheduled for removal.
        """
        existed = self.keyring.destroy(tenant)
        recs = list(self.index.records(tenant=tenant))
        self._audit("purge_tenant", {"tenant": tenant, "had_keys": existed, "chunks": len(recs)})

        def work() -> None:
            shutil.rmtree(self.root / "objects" / tenant, ignore_errors=True)
            for rec in recs:
                self._drop(rec.tenant, rec.chunk_key, reason="purge", remove_file=False)

        t = threading.Thread(target=work, name=f"purge-{tenant}", daemon=True)
        t.start()
        self._bg.append(t)
        if wait:
            t.join()
        return len(recs)

    def purge_namespace(self, tenant: str, namespace: bytes) -> int:
        """Remove a namespace's chunks (file removal, not a crypto erase: keys are per tenant)."""
        recs = list(self.index.records(tenant=tenant, namespace=namespace))
        for rec in recs:
            self._drop(rec.tenant, rec.chunk_key, reason="purge-namespace")
        self._audit(
            "purge_namespace", {"tenant": tenant, "namespace": namespace.hex(), "chunks": len(recs)}
        )
        return len(recs)

    def purge_older_than(self, age_s: float, tenant: str | None = None) -> int:
        cutoff = time.time_ns() - int(age_s * 1e9)
        recs = [r for r in self.index.records(tenant=tenant) if r.created_ns < cutoff]
        for rec in recs:
            self._drop(rec.tenant, rec.chunk_key, reason="purge-age")
        return len(recs)

    def rotate_kek(self, new_kek: Kek) -> int:
        return self.keyring.rotate_kek(new_kek)  # the keyring writes the audit record

    # ----------------------------------------------------------------- fsck

    def _walk_objects(self) -> Iterator[Path]:
        objects = self.root / "objects"
        if not objects.is_dir():
            return
        for dirpath, _dirs, files in os.walk(objects):
            for name in files:
                yield Path(dirpath) / name

    def fsck(
        self,
        repair: bool = False,
        *,
        verify_data: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> FsckReport:
        """Compare the files with the index; ``repair`` rebuilds the index from files.

        ``verify_data`` also decrypts/checksums every layer (slower). Objects
        of tenants without keys (purged) and old temp files are removed on repair.
        """
        rep = FsckReport(repaired=repair)
        now = time.time()
        good: dict[tuple[str, bytes], ChunkRecord] = {}
        to_remove: list[Path] = []
        tenants_with_keys = set(self.keyring.tenants())
        corrupt_ids: set[tuple[str, bytes] | None] = set()
        for i, path in enumerate(self._walk_objects()):
            if progress is not None and i % 256 == 0:
                progress(i)
            rel = str(path.relative_to(self.root))
            if path.name.startswith(v1.TMP_PREFIX):
                try:
                    old = now - path.stat().st_mtime > self.config.tmp_max_age_s
                except FileNotFoundError:
                    continue
                if old:
                    rep.orphan_tmp_files.append(rel)
                    to_remove.append(path)
                continue
            rep.objects_on_disk += 1
            try:
                st = path.stat()
                h = v1.decode_header(read_prefix(path, v1.ALIGN * 64))
                if rel != v1.object_relpath(h.tenant, h.chunk_key):
                    raise CorruptObject("object is not at its own path")
                if st.st_size != h.total_size:
                    raise CorruptObject("size differs from header")
                if h.tenant not in tenants_with_keys and h.sealed:
                    rep.purged_tenant_files.append(rel)
                    to_remove.append(path)
                    continue
                if verify_data:
                    tk = self.keyring.get(h.tenant) if h.sealed else None
                    scratch = bytearray(h.payload_size)
                    v1.open_into(
                        self.io.read_object(path, self._scratch.get, MAX_OBJECT_BYTES),
                        memoryview(scratch),
                        tenant=h.tenant,
                        namespace=h.namespace,
                        chunk_key=h.chunk_key,
                        aead_for_epoch=_aead_lookup(tk),
                    )
            except (LayoutError, OSError, KeyringError) as exc:
                rep.corrupt_files.append(f"{rel}: {exc}")
                to_remove.append(path)
                corrupt_ids.add(_identity_from_path(rel))
                continue
            good[(h.tenant, h.chunk_key)] = self._record_from_header(h, st.st_size)
        indexed = {(r.tenant, r.chunk_key): r for r in self.index.records()}
        rep.index_records = len(indexed)
        for k, r in indexed.items():
            g = good.get(k)
            if g is None:
                if k not in corrupt_ids:
                    rep.missing_files.append(v1.object_relpath(*k))
            elif (g.size, g.namespace, g.key_epoch) != (r.size, r.namespace, r.key_epoch):
                rep.mismatched_records.append(v1.object_relpath(*k))
            else:
                rep.ok += 1
        for k in good:
            if k not in indexed:
                rep.unindexed_files.append(v1.object_relpath(*k))
        if repair:
            for p in to_remove:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            # Rebuild from the files alone, keeping access times the index still knows.
            merged: list[ChunkRecord] = []
            for k, g in good.items():
                prev = indexed.get(k)
                same = prev is not None and (prev.size, prev.namespace, prev.key_epoch) == (
                    g.size,
                    g.namespace,
                    g.key_epoch,
                )
                if prev is not None and same:
                    merged.append(prev)
                else:
                    merged.append(g)
            with self._mu:
                self.index.clear()
                self.index.put_many(merged)
                self._used = self.index.usage().bytes
            self.index.flush()
        return rep

    def maintain(self) -> dict[str, int]:
        """Periodic upkeep the server runs: TTL expiry and orphaned temp files."""
        self._flush_touches()
        return {"expired": self.expire(), "tmp_removed": self.collect_garbage()}

    def collect_garbage(self) -> int:
        """Remove temp files older than ``tmp_max_age_s`` (cancelled or crashed writers)."""
        n = 0
        now = time.time()
        for path in self._walk_objects():
            if path.name.startswith(v1.TMP_PREFIX):
                try:
                    if now - path.stat().st_mtime > self.config.tmp_max_age_s:
                        path.unlink()
                        n += 1
                except FileNotFoundError:
                    pass
        return n

    # ---------------------------------------------------------------- stats

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
        }


class _Prealloc:
    """An ``alloc`` for a read on another thread: the caller's buffer, sized beforehand
    from the index record; a fresh mapping if the file turns out larger."""

    def __init__(self, buf: memoryview) -> None:
        self._buf = buf

    def __call__(self, n: int) -> memoryview:
        if n <= len(self._buf):
            return self._buf[:n]
        return memoryview(mmap.mmap(-1, v1.align_up(max(n, 1))))[:n]


def _aead_lookup(tk: TenantKeys | None) -> Callable[[int], AESGCM | None]:
    def lookup(epoch: int) -> AESGCM | None:
        return tk.aead(epoch) if tk is not None else None

    return lookup


def _identity_from_path(rel: str) -> tuple[str, bytes] | None:
    """(tenant, chunk key) that a path under objects/ names, if it names one."""
    parts = rel.split("/")
    if len(parts) != 5 or parts[0] != "objects" or not parts[4].endswith(v1.OBJECT_SUFFIX):
        return None
    try:
        return parts[1], bytes.fromhex(parts[4][: -len(v1.OBJECT_SUFFIX)])
    except ValueError:
        return None


def open_store(config: StoreConfig, kek: Kek, *, create: bool = False) -> Store:
    try:
        return Store(config, kek, create=create)
    except OSError as exc:
        raise StoreIOError(f"cannot open store at {config.root}: {exc}", exc.errno) from exc
