"""The store: objects on disk (layout v1), an LMDB index, a per-tenant keyring.

Usable in-process (tests, CLI) and served by the sidecar. Thread-safe: the
server calls it from a thread pool.

Read rule: a chunk is returned only after every byte of its object has been
verified (structure, zero padding, every tag or checksum). Any failure —
missing file, torn or flipped bytes, another object's file, a purged key —
is a miss of that chunk alone; the index entry is dropped and a corrupt file
quarantined (layout-v1.md §5).

Capacity rule: ``used + reserved <= capacity`` at all times. A write reserves
its object size first, evicting least-recently-used unpinned chunks if it
must; if it still cannot fit it fails with :class:`StoreFull`, never
exceeding the limit. Above the high watermark, eviction runs down to the low
watermark.

Errors: what leaves a Store method is a :class:`StoreError`; index and keyring
failures are mapped at the boundary (``raise … from exc``) to
:class:`StoreIOError` and :class:`StoreKeyError`.

I/O: objects are written and read through the backend ``StoreConfig.io`` (or
``$KVOFFLOAD_IO``) selects at open (``store/iobackend.py``; ``auto`` by
default, logged with its reason). ``put_many`` and ``get_many_into`` pipeline
a batch on a small thread pool: chunk n+1 is sealed while chunk n is
written, and read while chunk n is verified and decrypted.

The package, one job a module, stacked (each layer uses those below it):

- ``base``: configuration, shared state, dropping a chunk, access times,
  failed reads as misses, the error boundary
- ``audit``: the append-only, fsync'd audit log
- ``retention``: the retention journal a rebuilt index takes expiries from
- ``capacity``: reservations, the byte limit and watermarks, quotas, pins,
  the one eviction loop
- ``fsck``: fsck, walking the object tree, adopting objects, garbage collection
- ``pipeline``: put / put_many, sealing, writing, lookups, get / get_many_into
- ``leases``: the direct path (write leases, publish, cancel, read leases,
  reported corruption)
- ``purges``: whole-tenant purges, with the tenant's writes closed meanwhile
- ``facade``: :class:`Store` itself (open/close, tenants, purges, stats, views)
"""

from __future__ import annotations

from ..errors import LeaseInvalid, QuotaExceeded, StoreError, StoreFull, StoreIOError, StoreLocked
from .audit import AuditLog
from .base import DEFAULT_MAX_SEGMENTS_PER_EPOCH, MAX_OBJECT_BYTES, Counters, StoreConfig
from .capacity import Reservation
from .files import Durability
from .index import ChunkRecord, Usage
from .iobackend import IOMode, parse_mode
from .leases import ReadLease, StoreLease
from .maintenance import FsckReport
from .store import Store, open_store

__all__ = [
    "DEFAULT_MAX_SEGMENTS_PER_EPOCH",
    "MAX_OBJECT_BYTES",
    "AuditLog",
    "ChunkRecord",
    "Counters",
    "Durability",
    "FsckReport",
    "IOMode",
    "LeaseInvalid",
    "QuotaExceeded",
    "ReadLease",
    "Reservation",
    "Store",
    "StoreConfig",
    "StoreError",
    "StoreFull",
    "StoreIOError",
    "StoreLease",
    "StoreLocked",
    "Usage",
    "open_store",
    "parse_mode",
]
