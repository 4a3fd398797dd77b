"""What every part of the store shares: its configuration, its state, its chunk
bookkeeping (paths, dropping a chunk, batched access times, a failed read as a
miss) and the boundary that maps lower-layer errors to :class:`StoreError`.

The store is built as a stack, each layer using only those below it::

    StoreBase (here) → Capacity → Maintenance (fsck) → Pipeline → Leases → Store
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
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

from ...layouts import LayoutInfo, UnknownLayoutVersion, v1
from ..errors import StoreIOError
from ..fileio import Durability, ScratchBuffers
from ..index import Index
from ..iobackend import IOBackend, IOMode, IOPlan
from ..keyring import Keyring, KeyringError, TenantKeys
from .audit import AuditLog

log = logging.getLogger("kvoffload.store")

#: Objects larger than this are refused on read (a corrupt size must not OOM us).
MAX_OBJECT_BYTES = 4 << 30
#: NIST SP 800-38D: at most 2**32 random 96-bit nonces per key. Layer segments
#: count against it; we rotate the tenant's DEK well before.
DEFAULT_MAX_SEGMENTS_PER_EPOCH = 2**31
SEAL_COUNT_BLOCK = 1 << 16

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
    _scratch_alt: ScratchBuffers  # the second buffer of put_many/get_many_into
    _pipe: ThreadPoolExecutor | None
    #: The KV-event feed (kvoffload.sidecar.events), told of every chunk that leaves.
    events_hook: EventsHook | None = None

    def _path(self, tenant: str, key: bytes) -> Path:
        return self.root / v1.object_relpath(tenant, key)

    # ------------------------------------------------------------- dropping

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
        return rec is not None

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
            self.index.touch(tenant, keys, latest[tenant])

    # ------------------------------------------------- hits and misses

    def _hit(self, tenant: str, key: bytes, payload: int) -> None:
        self._touch_later(tenant, key)
        self.counters.hits += 1
        self.counters.bytes_out += payload

    def _miss(self, tenant: str, key: bytes, reason: str, remove_file: bool) -> None:
        self.counters.misses += 1
        self._drop(tenant, key, reason=reason, remove_file=remove_file)

    def _unreadable(self, tenant: str, key: bytes, exc: OSError) -> None:
        # ENOENT (evicted/deleted elsewhere), ESTALE (NFS), EIO: all misses.
        log.info("chunk %s unreadable: %s", key.hex()[:16], exc)
        self._miss(tenant, key, errno.errorcode.get(exc.errno or 0, "oserror"), False)

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


def aead_lookup(tk: TenantKeys | None) -> Callable[[int], AESGCM | None]:
    def lookup(epoch: int) -> AESGCM | None:
        return tk.aead(epoch) if tk is not None else None

    return lookup
