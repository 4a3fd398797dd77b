"""What every part of the store shares, during the move from a stack of
classes to parts the :class:`~.store.Store` owns (state.py, capacity.py,
removal.py): the references the remaining layers read, and the delegation to
the capacity.

The store is built as a stack, each layer using only those below it::

    StoreBase (here) → Maintenance (fsck) → Pipeline → Leases → Store
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..errors import StoreIOError
from ..layouts import LayoutInfo
from .api import ChunkRecord, Reservation
from .audit import AuditLog
from .cancel import LoadGenerations
from .capacity import Capacity
from .config import StoreConfig
from .files import Durability, ScratchBuffers
from .index import Index
from .iobackend import IOBackend, IOPlan
from .keys.budget import NonceBudget
from .keys.keyring import Keyring
from .ramtier import RamTier
from .removal import Removal
from .retention import RetentionJournal
from .shared.journal import JournalRecord
from .shared.root import SharedRoot
from .state import Counters, EventsHook, RetentionProvider, StoreState, boundary


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
    _state: StoreState
    _capacity: Capacity
    _removal: Removal
    _budget: NonceBudget
    _audit: AuditLog
    _scratch: ScratchBuffers
    _retention: RetentionJournal
    #: Tenants whose fan-out directories this process has made sure of.
    _leaves_ready: set[str]
    _shared: SharedRoot | None = None
    #: The RAM tier (ramtier.py); None: off.
    _ram: RamTier | None = None
    _load_gens: LoadGenerations

    @property
    def events_hook(self) -> EventsHook | None:
        """The KV-event feed (kvoffload.sidecar.events), told of every chunk that leaves."""
        return self._state.events_hook

    @events_hook.setter
    def events_hook(self, hook: EventsHook | None) -> None:
        self._state.events_hook = hook

    @property
    def retention_policy(self) -> RetentionProvider | None:
        """The tenants' current retention limits (the sidecar's policy), enforced on
        every read and by the sweep; None: only each chunk's stamped expiry."""
        return self._state.retention_policy

    def _path(self, tenant: str, key: bytes) -> Path:
        """The object file of a chunk."""
        return self._state.path(tenant, key)

    def _path_str(self, tenant: str, key: bytes) -> str:
        return self._state.path_str(tenant, key)

    def _journal_stored(self, rec: ChunkRecord) -> None:
        """Tell the other nodes of a shared root about a chunk this node published."""
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
                        grant_epoch=self._shared.view_epoch,
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

    # ------------------------------------------------------------ capacity

    @property
    def used_bytes(self) -> int:
        return self._capacity.used_bytes

    @property
    def reserved_bytes(self) -> int:
        return self._capacity.reserved_bytes

    @property
    def accounted_bytes(self) -> int:
        """used + reserved, read atomically: never above the capacity."""
        return self._capacity.accounted_bytes

    @boundary
    def reserve(self, tenant: str, nbytes: int, *, quota: int | None = None) -> Reservation:
        return self._capacity.reserve(tenant, nbytes, quota=quota)

    @boundary
    def tenant_accounted(self, tenant: str) -> int:
        return self._capacity.tenant_accounted(tenant)

    def pin(self, tenant: str, keys: Sequence[bytes]) -> None:
        self._capacity.pin(tenant, keys)

    def unpin(self, tenant: str, keys: Sequence[bytes]) -> None:
        self._capacity.unpin(tenant, keys)

    def _hit(self, tenant: str, key: bytes, payload: int) -> None:
        self._state.access.touch(tenant, key)
        self.counters.hit(payload)
