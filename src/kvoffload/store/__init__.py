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

The package: a :class:`Store` (store.py) that owns its parts, each in its
own module and built on one :class:`~.state.StoreState` (state.py: who writes
which field), and delegates to them:

- ``capacity``: used/reserved/quota bytes, pins, watermarks, the one eviction
  loop (the only writer of its counters)
- ``removal``: the one way a chunk leaves (RAM image, file, index entry,
  bytes, event, journal); failed reads as misses; the quarantine
- ``writes``: put / put_many (reserve, seal, write, index)
- ``reads``: lookups, load plans, get / get_many_into / load
- ``leases``: the direct path; ``layerwise``: layer-wise loads
- ``purge``: tenant, namespace and a peer's purge, with their PurgeReport (a
  tenant's with its writes closed meanwhile: cancel.TenantWrites)
- ``maintenance``: fsck, sweep, expiry, adoption, rebuild
- ``views``: read-only reports; ``peers``: a shared root's other nodes
- ``api``: the value types that cross into the daemon (stdlib only)
"""

from __future__ import annotations

from ..errors import LeaseInvalid, QuotaExceeded, StoreError, StoreFull, StoreIOError, StoreLocked
from .api import (
    ChunkRecord,
    FsckReport,
    LoadPlan,
    PurgeReport,
    ReadLease,
    Reservation,
    RetentionSettings,
    SealedLease,
    StoreLease,
    Usage,
)
from .audit import AuditLog
from .config import DEFAULT_MAX_SEGMENTS_PER_EPOCH, MAX_OBJECT_BYTES, StoreConfig
from .files import Durability
from .iobackend import IOMode, parse_mode
from .state import Counters
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
    "LoadPlan",
    "PurgeReport",
    "QuotaExceeded",
    "ReadLease",
    "Reservation",
    "RetentionSettings",
    "SealedLease",
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
