"""What the store's parts share: the :class:`StoreState` the :class:`~.store.Store`
owns and hands to each part's constructor, and the store boundary that maps
lower-layer errors to :class:`StoreError`.

Who writes what (every mutable field is written in one module):

- ``StoreState.layout``, ``events_hook`` and ``retention_policy``: store.py
  (at open, on a KEK rotation, when the daemon wires its feed and policy in);
- the :class:`Counters`, the :class:`AccessTimes` waiting for the index and
  the :class:`IOStreams`' pools: this module, through their methods;
- everything else in :class:`StoreState` is set once, at open, and names an
  object that keeps its own state behind its own methods (the index, the
  keyring, the RAM tier, the shared root, the load generations…).

The byte accounting (used, reserved, pins) is not here: it is
:class:`~.capacity.Capacity`'s alone.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import ParamSpec, TypeVar

import lmdb

from ..errors import IndexFailure, StoreIOError, StoreKeyError
from ..layouts import LayoutInfo, v1
from .api import ChunkRecord, EventsHook, RetentionSettings
from .audit import AuditLog
from .cancel import LoadGenerations, TenantWrites
from .config import StoreConfig
from .contracts import ContractRegistry
from .files import PartReader, ScratchBuffers
from .index import Index
from .iobackend import IOBackend, IOPlan
from .keys.keyring import Keyring, KeyringError
from .ramtier import RamTier
from .retention import RetentionJournal
from .shared.root import SharedRoot

log = logging.getLogger("kvoffload.store")

_P = ParamSpec("_P")
_R = TypeVar("_R")


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


#: tenant -> its current retention limits (None: no limits beyond the stamped ttl).
RetentionProvider = Callable[[str], "RetentionSettings | None"]


@dataclass
class Counters:
    """The store's counters (``stats``). Read anywhere; written only here, by
    the methods the parts call."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_exists: int = 0
    evictions: int = 0
    corrupt: int = 0
    bytes_in: int = 0
    bytes_out: int = 0

    def hit(self, payload: int) -> None:
        self.hits += 1
        self.bytes_out += payload

    def unhit(self, payload: int) -> None:
        """A chunk counted as a hit that was not handed out after all (read past a miss)."""
        self.hits -= 1
        self.bytes_out -= payload

    def miss(self) -> None:
        self.misses += 1

    def stored(self, payload: int) -> None:
        self.puts += 1
        self.bytes_in += payload

    def existed(self) -> None:
        self.put_exists += 1

    def evicted(self) -> None:
        self.evictions += 1

    def corrupted(self) -> None:
        self.corrupt += 1


class AccessTimes:
    """Accesses waiting to be written to the index, in batches (a write txn per
    get is most of a small get's cost). The LRU order is at most a batch stale."""

    #: A batch is written once it has this many accesses, or is this old.
    BATCH = 512
    MAX_AGE_NS = 500_000_000

    def __init__(self, index: Index) -> None:
        self._index = index
        self._mu = threading.Lock()
        self.pending: dict[tuple[str, bytes], int] = {}
        self.flushed = time.time_ns()

    def touch(self, tenant: str, key: bytes) -> None:
        """Record an access to (tenant, key) now."""
        now = time.time_ns()
        with self._mu:
            self.pending[(tenant, key)] = now
            due = len(self.pending) >= self.BATCH or now - self.flushed > self.MAX_AGE_NS
        if due:
            self.flush()

    def flush(self) -> None:
        """Write the accesses recorded so far (before eviction reads the LRU order)."""
        with self._mu:
            pending, self.pending = self.pending, {}
            self.flushed = time.time_ns()
        # One write txn per tenant per batch: the batch shares one access time.
        by_tenant: dict[str, list[bytes]] = {}
        latest: dict[str, int] = {}
        for (tenant, key), ts in pending.items():
            by_tenant.setdefault(tenant, []).append(key)
            latest[tenant] = max(ts, latest.get(tenant, 0))
        for tenant, keys in by_tenant.items():
            try:
                self._index.touch(tenant, keys, latest[tenant])
            except Exception as exc:
                # Access times steer eviction only: a full disk or a failing
                # index must never fail the read that recorded them.
                log.warning("recording access times of %d chunks failed: %s", len(keys), exc)


class IOStreams:
    """The I/O threads of the store (``StoreConfig.io_streams``): one pool that
    seals and writes, or reads and verifies, the chunks of a batch, and the
    part reader of large O_DIRECT loads; both made on first use."""

    def __init__(self, streams: int) -> None:
        self.streams = streams
        self._mu = threading.Lock()
        self.pool: ThreadPoolExecutor | None = None
        self.parts: PartReader | None = None

    def executor(self) -> ThreadPoolExecutor:
        with self._mu:
            if self.pool is None:
                self.pool = ThreadPoolExecutor(
                    max_workers=self.streams, thread_name_prefix="kvoffload-io"
                )
            return self.pool

    def part_reader(self) -> PartReader | None:
        """The store's :class:`~.files.PartReader`, io_streams threads; None with one stream."""
        if self.streams < 2:
            return None
        with self._mu:
            if self.parts is None:
                self.parts = PartReader(self.streams)
            return self.parts

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        if self.parts is not None:
            self.parts.close()


@dataclass(eq=False)
class StoreState:
    """What several parts read; see the module docstring for who writes what."""

    config: StoreConfig
    root: Path
    layout: LayoutInfo
    index: Index
    keyring: Keyring
    io: IOBackend
    io_plan: IOPlan
    audit: AuditLog
    contracts: ContractRegistry
    #: The retention journal a rebuilt index takes expiries from (retention.py).
    retention: RetentionJournal
    #: The shared root (shared/root.py); None: the root is this node's alone.
    shared: SharedRoot | None
    #: The RAM tier (ramtier.py); None: off.
    ram: RamTier | None
    #: The lock of the byte accounting and of what must change with it in one
    #: step (the index insert that turns a reservation into usage).
    mu: threading.Lock = field(default_factory=threading.Lock)
    counters: Counters = field(default_factory=Counters)
    #: Per-tenant load generations: a purge or revocation cancels loads in flight.
    load_gens: LoadGenerations = field(default_factory=LoadGenerations)
    #: Each thread's object-sized buffer (saves, whole reads).
    scratch: ScratchBuffers = field(default_factory=ScratchBuffers)
    #: The KV-event feed (kvoffload.sidecar.events), told of every chunk that leaves.
    events_hook: EventsHook | None = None
    #: The tenants' current retention limits (the sidecar's policy), enforced on
    #: every read and by the sweep; None: only each chunk's stamped expiry.
    retention_policy: RetentionProvider | None = None
    access: AccessTimes = field(init=False)
    streams: IOStreams = field(init=False)
    #: Writes in flight per tenant, closed while a whole-tenant purge runs (purge.py).
    tenant_writes: TenantWrites = field(init=False)

    def __post_init__(self) -> None:
        self.access = AccessTimes(self.index)
        self.tenant_writes = TenantWrites(self.load_gens)
        self.streams = IOStreams(self.config.resolved_io_streams())

    def path(self, tenant: str, key: bytes) -> Path:
        """The object file of a chunk."""
        return Path(self.path_str(tenant, key))

    def path_str(self, tenant: str, key: bytes) -> str:
        """:meth:`path` as a string, for the read paths: building a Path costs
        more than the open(2) it is for."""
        return f"{self.root}/{v1.object_relpath(tenant, key, self.layout.fanout)}"

    def cutoffs(self, tenant: str, now_ns: int) -> tuple[int, int]:
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

    def is_expired(self, rec: ChunkRecord, now_ns: int) -> bool:
        """Past its stamped expiry, or its tenant's current ttl, max_age or idle_ttl."""
        if rec.expires_ns and rec.expires_ns <= now_ns:
            return True
        created_after, accessed_after = self.cutoffs(rec.tenant, now_ns)
        return (created_after > 0 and rec.created_ns <= created_after) or (
            accessed_after > 0 and rec.last_access_ns <= accessed_after
        )


__all__ = [
    "AccessTimes",
    "Counters",
    "IOStreams",
    "RetentionProvider",
    "StoreState",
    "boundary",
    "log",
    "mapped_errors",
]
