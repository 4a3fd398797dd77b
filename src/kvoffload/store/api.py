"""What crosses the door between the storage engine and the daemon.

The daemon (:mod:`kvoffload.sidecar`) may import this module and the package
:mod:`kvoffload.store`, never the engine's internals. Everything here is stdlib
only, so importing it pulls in neither LMDB nor cryptography (nor xxhash: the
layout module is imported where a lease's offsets are asked, not before).

The Protocols the daemon's parts implement: a tenant's retention limits
(:class:`RetentionSettings`) and the KV-event feed (:class:`EventsHook`);
those the store implements for the daemon: a root's layout facts
(:class:`LayoutFacts`) and the index's event log (:class:`EventLog`).
The values: an index record (:class:`ChunkRecord`) and a usage figure
(:class:`Usage`); capacity held for a write (:class:`Reservation`); the direct
path's leases (:class:`StoreLease`, :class:`ReadLease`); a load's plan
(:class:`LoadPlan`); and the reports of fsck (:class:`FsckReport`) and of a
purge (:class:`PurgeReport`, with the names of the tiers it reached).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..layouts.v1 import ObjectHeader


class EventsHook(Protocol):
    """What the store tells the daemon's KV-event feed
    (kvoffload.sidecar.events.SidecarEvents) of every chunk that leaves."""

    @property
    def lock(self) -> AbstractContextManager[Any]: ...

    def removed(self, tenant: str, blob: bytes, reason: str) -> None: ...


@runtime_checkable
class RetentionSettings(Protocol):
    """A tenant's retention limits, as the daemon's policy gives them
    (``TenantPolicy``; sidecar/access/policy.py documents them)."""

    @property
    def idle_ttl_s(self) -> float | None: ...

    def age_limit_s(self) -> float | None: ...


class LayoutFacts(Protocol):
    """What the daemon reads of a store root's layout (``layout.json``)."""

    @property
    def store_id(self) -> str: ...

    @property
    def version(self) -> int: ...


class EventLog(Protocol):
    """What the daemon's KV-event feed keeps in the store's index (events-v1 §5):
    the durable replay buffer, the engine block hashes of stored chunks, and
    small metadata (the incarnation counter). The index implements it."""

    def append_event(self, seq: int, payload: bytes, keep: int) -> None: ...

    def events_since(self, seq: int) -> list[tuple[int, bytes]]: ...

    def last_event_seq(self) -> int | None: ...

    def set_blocks(self, tenant: str, chunk_key: bytes, blob: bytes) -> bool: ...

    def all_blocks(self, tenant: str | None = None) -> Iterator[tuple[str, bytes, bytes]]: ...

    def drop_blocks(self, tenant: str, chunk_keys: Iterable[bytes]) -> None: ...

    def tenants(self) -> Mapping[str, Any]:
        """The tenants with at least one chunk (their usage)."""
        ...

    def get_meta(self, name: str) -> bytes | None: ...

    def set_meta(self, name: str, value: bytes) -> None: ...

    def flush(self) -> None: ...


@dataclass(frozen=True)
class ChunkRecord:
    """What the index knows about one stored chunk object."""

    tenant: str
    chunk_key: bytes  # 32
    namespace: bytes  # 32
    key_epoch: int  # 0 = plaintext
    size: int  # bytes on disk (object file size)
    payload: int  # plaintext bytes
    num_layers: int
    created_ns: int
    last_access_ns: int
    expires_ns: int  # 0 = never


@dataclass(frozen=True)
class Usage:
    """Bytes on disk and number of chunks."""

    bytes: int
    count: int


class Reservation:
    """Bytes held against the capacity for one in-flight write, until the store
    turns them into usage (the chunk is indexed) or they are released.

    ``give_back(reservation)`` is the store's (store/capacity.py): it returns
    the bytes to the capacity, once. ``record_intent(reservation, key)``, on a
    shared root only, records durably that the bytes are about to be written
    as ``key``'s object (:meth:`intend`)."""

    __slots__ = ("_give_back", "_record_intent", "_released", "intent", "nbytes", "tenant")

    def __init__(
        self,
        tenant: str,
        nbytes: int,
        give_back: Callable[[Reservation], None],
        record_intent: Callable[[Reservation, bytes], None] | None = None,
    ) -> None:
        self.tenant = tenant
        self.nbytes = nbytes
        self._give_back = give_back
        self._record_intent = record_intent
        self._released = False
        #: (tenant, key) once :meth:`intend` recorded it (store/capacity.py sets it).
        self.intent: tuple[str, bytes] | None = None

    @property
    def released(self) -> bool:
        return self._released

    def intend(self, key: bytes) -> None:
        """The reservation is about to be written as ``key``'s object: on a shared
        root, record that durably first, so that a restart after a crash counts
        the object against this node's grant if it took its name (and clears its
        directory of the temp file), instead of granting the bytes again."""
        if self._record_intent is not None and not self._released:
            self._record_intent(self, key)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._give_back(self)

    def _claim(self) -> bool:
        """For store/capacity.py only, under its lock: the bytes became usage.
        Whether the reservation was still held (then the caller un-reserves them)."""
        if self._released:
            return False
        self._released = True
        return True

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


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
    #: The tenant's load generation (cancel.py) at lease time: a purge or
    #: revocation since then refuses the lease at publication.
    generation: int = 0

    @property
    def offsets(self) -> tuple[int, list[int]]:
        """(data_offset, layer offsets) of the object the worker must write."""
        from ..layouts import v1

        return v1.plan_offsets(len(self.lengths), self.lengths, False)


@dataclass(frozen=True)
class ReadLease:
    """What a worker needs to read one verified-at-rest direct-path object itself."""

    path: Path
    size: int
    header: ObjectHeader


@dataclass(frozen=True)
class SealedLease:
    """One object handed to a worker to verify and decrypt itself (protocol §5.33).

    ``fd``: a read-only descriptor of the object, the caller's to pass on and
    close; None where the object is stored but only the store may open it (sealed
    under the tenant's DEK itself, before per-object keys: layout-v1.md §3.3).
    ``key``: the object's own key (keys-v1.md §14); empty for a plaintext object.
    """

    fd: int | None
    size: int
    key: bytes
    namespace: bytes


@dataclass(frozen=True)
class LoadPlan:
    """The chunks one load will read (store/reads.py ``plan_load``): its cancel
    check (``guard``), taken before the records were looked up, so that a purge
    or revocation after the lookup still stops the load; and the records of the
    leading chunks found, in order, up to the first miss."""

    tenant: str
    guard: Callable[[int], None]
    records: tuple[ChunkRecord, ...]
    #: How many chunks were asked for (``len(records)`` of them were found).
    asked: int

    @property
    def complete(self) -> bool:
        """Every chunk asked for was found."""
        return len(self.records) == self.asked


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
    #: "tenant: why" for key files that cannot be read: those tenants' chunks
    #: miss, their objects are kept (the key file may be restored), others serve.
    unreadable_key_files: list[str] = field(default_factory=list)
    repaired: bool = False

    @property
    def clean(self) -> bool:
        # Unindexed objects are not a problem: a crash between an object's
        # rename and its index insert leaves one (layout-v1.md §4); fsck
        # indexes those that verify.
        return not (
            self.missing_files
            or self.corrupt_files
            or self.orphan_tmp_files
            or self.purged_tenant_files
            or self.mismatched_records
            or self.unreadable_key_files
        )

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items()}
        d["clean"] = self.clean
        return d


#: The store's tiers a purge can reach (protocol-v1.md §5.11), in the order a
#: whole-tenant purge reaches them.
TIER_RAM: Final = "ram_tier"
TIER_KEYS: Final = "keys"
TIER_SHARED: Final = "shared_nodes"
TIER_OBJECTS: Final = "objects"
TIER_RETENTION: Final = "retention_journal"
TIER_CONTRACTS: Final = "contracts"
TIER_QUARANTINE: Final = "quarantine"
TIER_INDEX: Final = "index"
STORE_TIERS: Final = (
    TIER_RAM,
    TIER_KEYS,
    TIER_SHARED,
    TIER_OBJECTS,
    TIER_RETENTION,
    TIER_CONTRACTS,
    TIER_QUARANTINE,
    TIER_INDEX,
)


@dataclass
class PurgeReport:
    """What one purge removed, tier by tier (store/purge.py).

    Built by the code that removes: each removal step calls :meth:`reach` with
    the tier it worked on and how many things of the tenant it removed there
    (records, files, images, key files; ``shared_nodes``: the journal record
    that tells the other nodes). A tier is *reached* when the purge removed
    something of the tenant from it on this node (``shared_nodes``: the other
    nodes were told): a tier that held nothing of the tenant, or that this node
    does not have (no RAM tier, no shared root), is not named, so the report
    never claims an erase that did not happen.
    """

    tenant: str
    namespace: bytes | None = None
    #: Index records removed on this node (what ``purge_tenant`` returns).
    removed: int = 0
    #: tier → how many things of the tenant the purge removed there; only
    #: tiers with a count above 0.
    reached: dict[str, int] = field(default_factory=dict)

    def reach(self, tier: str, count: int) -> None:
        """A removal step removed ``count`` things of the tenant from ``tier``."""
        if tier not in STORE_TIERS:
            raise ValueError(f"{tier!r} is not a store tier")
        if count > 0:
            self.reached[tier] = self.reached.get(tier, 0) + count

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tiers reached, in :data:`STORE_TIERS` order (protocol-v1.md 5.11):
        a whole-tenant purge removes its index records before the files of its
        tree moved aside, yet names them in the documented order."""
        return tuple(t for t in STORE_TIERS if t in self.reached)


__all__ = [
    "STORE_TIERS",
    "TIER_CONTRACTS",
    "TIER_INDEX",
    "TIER_KEYS",
    "TIER_OBJECTS",
    "TIER_QUARANTINE",
    "TIER_RAM",
    "TIER_RETENTION",
    "TIER_SHARED",
    "ChunkRecord",
    "EventLog",
    "EventsHook",
    "FsckReport",
    "LayoutFacts",
    "LoadPlan",
    "PurgeReport",
    "ReadLease",
    "Reservation",
    "RetentionSettings",
    "SealedLease",
    "StoreLease",
    "Usage",
]
