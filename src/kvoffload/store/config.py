"""The store's settings (:class:`StoreConfig`) and the limits every part shares."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .files import Durability
from .iobackend import IOMode

#: Objects larger than this are refused on read (a corrupt size must not OOM us).
MAX_OBJECT_BYTES = 4 << 30
#: NIST SP 800-38D: at most 2**32 random 96-bit nonces per key. Layer segments
#: count against it; we rotate the tenant's DEK well before.
DEFAULT_MAX_SEGMENTS_PER_EPOCH = 2**31
#: A batch of fewer bytes than this is worked through in the calling thread:
#: a batch saved without fsync (writes.py; loads, which wait on the device, and
#: fsync'd saves always use the streams), a layer of a layer-wise load
#: (layerwise.py). Writing or verifying small objects costs mostly Python (which
#: holds the GIL), and the hop to a pool thread and back costs more than the
#: overlap gains.
PARALLEL_MIN_BYTES = 1 << 20
#: The most I/O streams the default picks (more rarely helps one NVMe device).
MAX_DEFAULT_IO_STREAMS = 16


def default_io_streams() -> int:
    """One I/O stream per core, at least 4 (a read or write in flight while a
    core seals or verifies another chunk), at most :data:`MAX_DEFAULT_IO_STREAMS`."""
    return min(MAX_DEFAULT_IO_STREAMS, max(4, os.cpu_count() or 1))


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
    #: Seal each new object under its own key derived from the DEK (layout-v1.md
    #: §3.3), so that a worker can be handed that object alone (protocol §5.33).
    #: False: seal under the DEK itself, as builds before it did (a shared root
    #: with nodes that do not read such objects yet).
    object_keys: bool = True

    def resolved_index_dir(self) -> Path:
        if self.index_dir is not None:
            return Path(self.index_dir)
        root = Path(self.root)
        return root.parent / f"{root.name}.index"

    def resolved_io_streams(self) -> int:
        """Chunks of one batch sealed/read and written/verified at once."""
        return self.io_streams or default_io_streams()

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
