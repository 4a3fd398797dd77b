"""What every part of the store shares: its configuration, its state, its chunk
bookkeeping (paths, dropping a chunk, batched access times, a failed read as a
miss) and the boundary that maps lower-layer errors to :class:`StoreError`.

The store is built as a stack, each layer using only those below it::

    StoreBase (here) → Capacity → Maintenance (fsck) → Pipeline → Leases → Purges → Store
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, Protocol, TypeVar

import lmdb
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvoffload.errors import IndexFailure, StoreKeyError

from ..errors import StoreIOError
from ..layouts import LayoutInfo, UnknownKeyEpoch, UnknownLayoutVersion, v1
from .api import RetentionSettings
from .audit import AuditLog
from .cancel import LoadGenerations, TenantWrites
from .files import Durability, PartReader, ScratchBuffers
from .index import ChunkRecord, Index
from .iobackend import IOBackend, IOMode, IOPlan
from .keys.keyring import Keyring, KeyringError, TenantKeys
from .ramtier import RamTier
from .retention import RetentionJournal
from .shared.journal import JournalRecord, Reason
from .shared.root import REMOVE_REASONS, SharedRoot

log = logging.getLogger("kvoffload.store")

#: Objects larger than this are refused on read (a corrupt size must not OOM us).
MAX_OBJECT_BYTES = 4 << 30
#: NIST SP 800-38D: at most 2**32 random 96-bit nonces per key. Layer segments
#: count against it; we rotate the tenant's DEK well before.
DEFAULT_MAX_SEGMENTS_PER_EPOCH = 2**31
SEAL_COUNT_BLOCK = 1 << 16
#: Index meta set when the index was rebuilt from the files: the persisted seal
#: counts are gone, so each tenant's next seal starts a fresh DEK epoch.
SEAL_COUNTS_LOST = "seal_counts_lost"
#: Objects that failed verification go here (below the store root), not away:
#: the newest QUARANTINE_KEEP are kept for forensics.
QUARANTINE_DIR = "quarantine"
QUARANTINE_KEEP = 64

_P = ParamSpec("_P")
_R = TypeVar("_R")


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
    #: None: $KVOFFLOAD_IO, else auto. See store/iobackend.py.
    io: str | IOMode | None = None
    #: The root is shared by several nodes (shared-root-v1.md): journal this
    #: node's stores and removals, follow the others', evict only under the lease.
    shared: bool = False
    journal_poll_s: float = 0.5
    evictor_lease_s: float = 15.0
    journal_segment_bytes: int = 8 << 20
    #: Chunks of one batch sealed/written or read/verified at once (a pool of I/O
    #: threads, shared by all requests); 0: :func:`default_io_streams`.
    io_streams: int = 0
    #: Objects at least this big, mostly not in the page cache, are read with
    #: O_DIRECT (posix backend; 0: never); None: iobackend.DIRECT_READ_MIN.
    direct_read_min: int | None = None
    #: The RAM tier's size in bytes (ramtier.py: sealed images of the large
    #: objects the page cache does not keep); 0: none; None: ramtier.auto_capacity().
    ram_cache: int | None = None
    #: At open, move a corrupt index aside and rebuild it from the files (the
    #: index is a cache of them); False: refuse to open (StoreIOError).
    rebuild_corrupt_index: bool = True
    #: The audit log (docs/spec/audit-v1.md): rotate past this size, keep this many files.
    audit_max_bytes: int = 16 << 20
    audit_keep: int = 8

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
        if self.io_streams < 0:
            raise ValueError("io_streams must be >= 0 (0: one per core, at least 4)")
        if self.direct_read_min is not None and self.direct_read_min < 0:
            raise ValueError("direct_read_min must be >= 0 (0: never)")
        if self.ram_cache is not None and self.ram_cache < 0:
            raise ValueError("ram_cache must be >= 0 (0: no RAM tier)")


#: The most I/O streams the default picks (more rarely helps one NVMe device).
MAX_DEFAULT_IO_STREAMS = 16


def default_io_streams() -> int:
    """One I/O stream per core, at least 4 (a read or write in flight while a
    core seals or verifies another chunk), at most :data:`MAX_DEFAULT_IO_STREAMS`."""
    return min(MAX_DEFAULT_IO_STREAMS, max(4, os.cpu_count() or 1))


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


@contextlib.contextmanager
def mapped_errors(what: str) -> Iterator[None]:
    """The store boundary: index and keyring failures leave as :class:`StoreError`."""
    try:
        yield
    except (IndexFailure, lmdb.Error) as exc:
        raise StoreIOError(f"{what}: the index failed: {exc}") from exc
    except KeyringError as exc:
        raise StoreKeyError(f"{what}: {exc}") from exc


def boundary(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Decorate a public Store method with the mapping of :func:`mapped_errors`
    (a bare ``try``: this wraps the hot paths, get_into and lookup included)."""
    what = fn.__name__

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(*args, **kwargs)
        except (IndexFailure, lmdb.Error) as exc:
            raise StoreIOError(f"{what}: the index failed: {exc}") from exc
        except KeyringError as exc:
            raise StoreKeyError(f"{what}: {exc}") from exc

    return wrapper


class EventsHook(Protocol):
    """What the store tells the KV-event feed (kvoffload.sidecar.events.SidecarEvents)."""

    @property
    def lock(self) -> AbstractContextManager[Any]: ...

    def removed(self, tenant: str, blob: bytes, reason: str) -> None: ...


#: tenant -> its current retention limits (None: no limits beyond the stamped ttl).
RetentionProvider = Callable[[str], "RetentionSettings | None"]


class StoreBase:
    """The state every layer reads; :class:`~.facade.Store` sets it up."""

    config: StoreConfig
    root: Path
    layout: LayoutInfo
    index: Index
    keyring: Keyring
    io: IOBackend
    io_plan: IOPlan
    counters: Counters
    _audit: AuditLog
    _mu: threading.Lock
    _used: int
    _reserved: int
    _tenant_reserved: dict[str, int]
    _pins: dict[tuple[str, bytes], int]
    _touch_pending: dict[tuple[str, bytes], int]
    _touch_flushed: int
    _seal_budget: dict[tuple[str, int], int]
    _scratch: ScratchBuffers
    _retention: RetentionJournal
    _pipe: ThreadPoolExecutor | None
    #: Part reads of large O_DIRECT loads (fileio.PartReader); None until one.
    _parts: PartReader | None = None
    #: Tenants whose fan-out directories this process has made sure of.
    _leaves_ready: set[str]
    _shared: SharedRoot | None = None
    #: The RAM tier (ramtier.py); None: off.
    _ram: RamTier | None = None
    _key_rereads: dict[str, float]
    #: Per-tenant load generations: a purge or revocation cancels loads in flight.
    _load_gens: LoadGenerations
    #: Writes in flight per tenant, closed while a whole-tenant purge runs (purges.py).
    _writes: TenantWrites
    #: The KV-event feed (kvoffload.sidecar.events), told of every chunk that leaves.
    events_hook: EventsHook | None = None
    #: The tenants' current retention limits (the sidecar's policy), enforced on
    #: every read and by the sweep; None: only each chunk's stamped expiry.
    retention_policy: RetentionProvider | None = None

    def _cutoffs(self, tenant: str, now_ns: int) -> tuple[int, int]:
        """(created_after_ns, accessed_after_ns) of ``tenant`` at ``now_ns``: a chunk
        created or last accessed at or before them has expired; 0 = no limit."""
        provider = self.retention_policy
        if provider is None:
            return 0, 0
        try:
            limits = provider(tenant)
        except ValueError:  # not a valid tenant id: nothing of it is stored
            return 0, 0
        if limits is None:
            return 0, 0
        age, idle = limits.age_limit_s(), limits.idle_ttl_s
        return (
            max(1, now_ns - int(age * 1e9)) if age is not None else 0,
            max(1, now_ns - int(idle * 1e9)) if idle is not None else 0,
        )

    def _is_expired(self, rec: ChunkRecord, now_ns: int) -> bool:
        """Past its stamped expiry, or its tenant's current ttl, max_age or idle_ttl."""
        if rec.expires_ns and rec.expires_ns <= now_ns:
            return True
        created_after, accessed_after = self._cutoffs(rec.tenant, now_ns)
        return (created_after > 0 and rec.created_ns <= created_after) or (
            accessed_after > 0 and rec.last_access_ns <= accessed_after
        )

    def _path(self, tenant: str, key: bytes) -> Path:
        return Path(self._path_str(tenant, key))

    def _path_str(self, tenant: str, key: bytes) -> str:
        """:meth:`_path` as a string, for the read paths: building a Path costs
        more than the open(2) it is for."""
        return f"{self.root}/{v1.object_relpath(tenant, key, self.layout.fanout)}"

    # ------------------------------------------------------------- dropping

    def _stop_tenant(self, tenant: str) -> None:
        """A purge or revocation of ``tenant``: its loads in flight stop before
        their next layer (cancel.py), then its RAM images go; in that order, no
        load of it keeps an image again (ramtier.py, ``still``). The bump is
        under the store's lock, where a write's index insert compares it."""
        with self._mu:
            self._load_gens.cancel(tenant)
        if self._ram is not None:
            self._ram.drop_tenant(tenant)

    def _drop(
        self,
        tenant: str,
        key: bytes,
        *,
        reason: str,
        remove_file: bool = True,
        lease_epoch: int = 0,
    ) -> bool:
        """Remove a chunk: its file (unless ``remove_file`` is false), its index
        entry and its bytes from the accounting; journaled on a shared root.
        ``lease_epoch``: for an eviction, the evictor lease epoch its fence
        allowed it under (the record names it even if the lease lapsed since)."""
        # The file goes first and the accounting after: the other order lets a
        # concurrent writer spend the freed bytes while the old file still
        # occupies them, so the disk would briefly hold more than the limit.
        # Its RAM image goes before either: no load is served it from here on.
        if self._ram is not None:
            self._ram.discard(tenant, key)
        if remove_file:
            try:
                self._path(tenant, key).unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("removing %s (%s): %s", key.hex()[:16], reason, exc)
                return False
        hook = self.events_hook
        if hook is None:
            rec = self.index.remove(tenant, key)
        else:
            # Under the feed's lock: a snapshot sees the chunk and its hashes
            # either with their BlockStored or gone with their BlockRemoved.
            with hook.lock:
                blob = self.index.get_blocks(tenant, key)
                rec = self.index.remove(tenant, key)
                if rec is not None and blob is not None:
                    hook.removed(tenant, blob, reason)
        if rec is not None:
            with self._mu:
                self._used -= rec.size
            if remove_file and self._shared is not None:
                jr = REMOVE_REASONS.get(reason)
                if jr is not None:
                    epoch = 0
                    if jr is Reason.EVICTED:
                        held = self._shared.lease.held
                        epoch = lease_epoch or (held.epoch if held is not None else 0)
                    self._shared.journal([JournalRecord.remove(tenant, key, jr, lease_epoch=epoch)])
        return rec is not None

    def _journal_stored(self, rec: ChunkRecord, grant_epoch: int | None = None) -> None:
        """Tell the other nodes of a shared root about a chunk this node published
        (under the grant epoch it knows now, unless told which)."""
        if self._shared is not None:
            self._shared.journal(
                [
                    JournalRecord.store(
                        rec.tenant,
                        rec.chunk_key,
                        rec.namespace,
                        rec.size,
                        payload=rec.payload,
                        key_epoch=rec.key_epoch,
                        num_layers=rec.num_layers,
                        expires_ns=rec.expires_ns,
                        time_ns=rec.created_ns,
                        grant_epoch=(
                            self._shared.view_epoch if grant_epoch is None else grant_epoch
                        ),
                    )
                ]
            )

    def _retain(self, tenant: str, key: bytes, created_ns: int, expires_ns: int) -> None:
        """Record a chunk's expiry where an index rebuild finds it (layout-v1.md
        §4.2), before its object is written."""
        try:
            self._retention.record(
                tenant, key, created_ns, expires_ns,
                durable=self.config.durability is Durability.OBJECT,
            )  # fmt: skip
        except OSError as exc:
            raise StoreIOError(
                f"recording the retention of a chunk failed: {exc}", exc.errno
            ) from exc

    def _aead_for(self, tenant: str, tk: TenantKeys | None) -> Callable[[int], AESGCM | None]:
        """The tenant's data key per epoch, from ``tk`` (the cached keys); an epoch
        newer than those (another process or node rotated the DEK since they were
        read) re-reads the key file, at most once a second per tenant, rather than
        make a valid object look corrupt."""

        def lookup(epoch: int) -> AESGCM | None:
            if tk is None:
                return None
            aead = tk.aead(epoch)
            if aead is not None or epoch <= tk.current_epoch:
                return aead
            now = time.monotonic()
            with self._mu:
                last = self._key_rereads.get(tenant, float("-inf"))
                reread = now - last >= KEY_REREAD_INTERVAL_S
                if reread:
                    self._key_rereads[tenant] = now
            if reread:
                self.keyring.forget(tenant)
            fresh = self.keyring.get(tenant)  # re-read, or what another thread just read
            return fresh.aead(epoch) if fresh is not None else None

        return lookup

    # -------------------------------------------------------- access times

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
            try:
                self.index.touch(tenant, keys, latest[tenant])
            except Exception as exc:
                # Access times steer eviction only: a full disk or a failing
                # index must never fail the read that recorded them.
                log.warning("recording access times of %d chunks failed: %s", len(keys), exc)

    # ------------------------------------------------- hits and misses

    def _hit(self, tenant: str, key: bytes, payload: int) -> None:
        self._touch_later(tenant, key)
        self.counters.hits += 1
        self.counters.bytes_out += payload

    def _miss(self, tenant: str, key: bytes, reason: str, remove_file: bool) -> None:
        self.counters.misses += 1
        try:
            if remove_file:
                self._quarantine(tenant, key, reason)
            self._drop(tenant, key, reason=reason, remove_file=False)
        except Exception as exc:  # a full or failing index: still only a miss
            log.warning("chunk %s (%s): dropping its entry failed: %s", key.hex()[:16], reason, exc)

    def _unreadable(self, tenant: str, key: bytes, exc: OSError) -> None:
        # ENOENT (evicted/deleted elsewhere), ESTALE (NFS), EIO: all misses.
        log.info("chunk %s unreadable: %s", key.hex()[:16], exc)
        self._miss(tenant, key, errno.errorcode.get(exc.errno or 0, "oserror"), False)

    def _read_failed(self, tenant: str, key: bytes, exc: BaseException) -> None:
        """A chunk that cannot be read or verified: a miss (layout-v1.md §5).

        Its index entry is dropped and, where the file itself failed
        verification, the file leaves its name (quarantined) so that a re-save
        can replace it. Not for an unknown version whose header checksum holds
        (a newer kvoffload's object: left in place), nor for a key file that
        cannot be read (the tenant's problem, not the object's: nothing dropped).
        Every exception a damaged file can raise comes here; none escapes.
        """
        if isinstance(exc, KeyringError | StoreKeyError):
            log.warning("chunk %s of %s: the tenant's keys: %s", key.hex()[:16], tenant, exc)
            self.counters.misses += 1
        elif isinstance(exc, UnknownLayoutVersion):
            log.warning("chunk %s: %s", key.hex()[:16], exc)
            self._miss(tenant, key, "unknown-version", remove_file=False)
        elif isinstance(exc, UnknownKeyEpoch):
            # Maybe only newer than the key file this node can see yet (a shared
            # root's client caches): never quarantine a possibly valid object.
            log.info("chunk %s of %s: %s", key.hex()[:16], tenant, exc)
            self._miss(tenant, key, "unknown-key-epoch", remove_file=False)
        elif isinstance(exc, OSError):
            self._unreadable(tenant, key, exc)
        else:
            log.warning("chunk %s of %s failed verification: %s", key.hex()[:16], tenant, exc)
            self.counters.corrupt += 1
            self._miss(tenant, key, "corrupt", remove_file=True)

    def _quarantine(self, tenant: str, key: bytes, reason: str) -> None:
        """Move an object that failed verification out of its name, into
        ``<root>/quarantine/`` (kept for forensics, the newest
        :data:`QUARANTINE_KEEP`), or delete it where it cannot be moved."""
        path = self._path(tenant, key)
        qdir = self.root / QUARANTINE_DIR
        dest = qdir / f"{tenant}.{key.hex()}.{time.time_ns()}.{reason}{v1.OBJECT_SUFFIX}"
        try:
            qdir.mkdir(mode=0o700, exist_ok=True)
            os.rename(path, dest)
        except FileNotFoundError:
            if path.exists():  # the quarantine itself is missing: delete instead
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            return
        except OSError as exc:
            log.warning("quarantining %s failed (%s); deleting it", path, exc)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            return
        log.warning("chunk %s of %s quarantined as %s", key.hex()[:16], tenant, dest.name)
        try:
            kept = sorted(qdir.iterdir(), key=lambda p: p.name.rsplit(".", 3)[-3])
        except OSError:
            return
        for old in kept[:-QUARANTINE_KEEP]:
            with contextlib.suppress(OSError):
                old.unlink()

    def _purge_quarantine(self, tenant: str) -> None:
        """A purged tenant's quarantined objects go with the rest (a plaintext
        tenant's hold its KV in the clear)."""
        with contextlib.suppress(FileNotFoundError):
            for p in (self.root / QUARANTINE_DIR).iterdir():
                parts = p.name.rsplit(".", 4)
                if len(parts) == 5 and parts[0] == tenant:
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()


#: At most one re-read of a tenant's key file per this many seconds, for objects
#: sealed under an epoch newer than the cached keys know.
KEY_REREAD_INTERVAL_S = 1.0


def aead_lookup(tk: TenantKeys | None) -> Callable[[int], AESGCM | None]:
    def lookup(epoch: int) -> AESGCM | None:
        return tk.aead(epoch) if tk is not None else None

    return lookup
