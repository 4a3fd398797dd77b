"""One connection's handle table (protocol-v1.md §7) and what its flows need of the session.

A ``prepare_*`` or ``lease_*`` that holds something until its ``complete_*``
(regions of the staging buffer, reservations, leased files, pins) gets a
handle here; whoever takes it (a complete, an abort, the expiry sweep, a
revocation) is the only one to release it. :class:`Handles` also keeps the
registered staging buffer and its region allocator (§5.2), which the write
and read flows (writes.py, reads.py) carve regions from.

Verbs run on pool threads while the event loop answers some inline, so the
table and the allocator are guarded by one lock, ``mu``; this module is the
only writer of both.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from kvoffload.errors import Reject
from kvoffload.protocol import MAX_FRAME, EngineBlocks, ErrorCode, LeaseSlot, StoreSlot
from kvoffload.staging import RegionAllocator, StagingBuffer

from .ports import StoreAPI

if TYPE_CHECKING:
    from ..store import Reservation, StoreLease

log = logging.getLogger("kvoffload.server")

#: Handles released by revocation whose complete/abort is still awaited, per connection.
MAX_REVOKED_HANDLES = 4096
#: A reply frame's room for the lease entries of ``lease_store``/``lease_load``
#: (§5.14, §5.15), and what one entry costs besides its path.
REPLY_ROOM = MAX_FRAME - 4096
LEASE_ENTRY_BYTES = 96


@dataclass
class StagedWrite:
    """One chunk of a ``prepare_store`` with status ``write``: its region and reservation."""

    index: int
    key: bytes
    layers: tuple[int, ...]
    offset: int
    reservation: Reservation


@dataclass
class LeasedWrite:
    """One chunk of a ``lease_store`` with status ``write``: its leased temp file."""

    index: int
    lease: StoreLease


@dataclass
class WriteHandle:
    """A ``prepare_store`` (``staged``) or a ``lease_store`` (``leased``); one list is empty."""

    tenant: str
    namespace: bytes
    encrypt: bool
    ttl_s: float | None
    slots: tuple[StoreSlot, ...] | tuple[LeaseSlot, ...]
    staged: list[StagedWrite]
    leased: list[LeasedWrite]
    created: float
    #: ``blocks`` of the request's chunks by index (protocol-v1 §5.4), for KV events.
    blocks: dict[int, EngineBlocks] = field(default_factory=dict)


@dataclass
class LoadHandle:
    """A ``prepare_load`` (regions in ``offsets``) or a ``lease_load`` (``direct``):
    the pinned keys, and the regions holding their bytes."""

    tenant: str
    keys: list[bytes]
    offsets: list[int]
    created: float
    direct: bool = False


Handle = WriteHandle | LoadHandle
_H = TypeVar("_H", WriteHandle, LoadHandle)


class Access(Protocol):
    """The isolation checks of a connection (§6) that its flows ask: the session."""

    tenants: frozenset[str]

    def may_use(self, tenant: str) -> bool: ...

    def direct_ok(self, tenant: str) -> bool: ...

    def listed(self, tenant: str) -> None: ...

    def register_contract(
        self, tenant: str, namespace: bytes, fields: Mapping[str, Any]
    ) -> None: ...


class Handles:
    """The staging buffer, its region allocator and the open handles of one connection."""

    def __init__(self, store: StoreAPI, max_handles: int, draining: Callable[[], bool]) -> None:
        self._store = store
        self._max = max_handles
        self._draining = draining
        self.mu = threading.Lock()
        self.staging: StagingBuffer | None = None
        self.alloc: RegionAllocator | None = None
        self._open: dict[int, Handle] = {}
        self._next = 1
        # §6.1: handles released by a revocation or purge → their chunk count
        # (0 for a load): their complete/abort answers "nothing stored" once.
        self._revoked: dict[int, int] = {}

    # -- the staging buffer (§5.2) ---------------------------------------------------

    def register(self, staging: StagingBuffer, alignment: int) -> None:
        self.staging = staging
        self.alloc = RegionAllocator(staging.size, alignment)

    def registered(self) -> tuple[StagingBuffer, RegionAllocator]:
        if self.staging is None or self.alloc is None:
            raise Reject(ErrorCode.NOT_REGISTERED, "register a staging buffer first")
        return self.staging, self.alloc

    def alloc_region(self, nbytes: int) -> int | None:
        """A region of ``nbytes`` anywhere in the buffer, or None (none free)."""
        _, alloc = self.registered()
        with self.mu:
            return alloc.alloc(nbytes)

    def claim_region(self, offset: int, nbytes: int) -> bool:
        """The region the client chose (§5.21), unless a handle holds any of it."""
        _, alloc = self.registered()
        with self.mu:
            return alloc.claim(offset, nbytes)

    def free(self, offset: int) -> None:
        assert self.alloc is not None
        with self.mu:
            self.alloc.free(offset)

    # -- the table (§7) ----------------------------------------------------------------

    def open_slot(self) -> None:
        """Refuse a new handle while draining or at ``max_handles``."""
        if self._draining():
            raise Reject(ErrorCode.SHUTTING_DOWN, "the sidecar is shutting down")
        with self.mu:
            if len(self._open) >= self._max:
                raise Reject(ErrorCode.BUSY, "too many open handles")

    def add(self, handle: Handle) -> int:
        handle.created = time.monotonic()
        with self.mu:
            h = self._next
            self._next += 1
            self._open[h] = handle
        return h

    def take(self, h: int, kind: type[_H]) -> _H:
        """Remove and return the handle: whoever takes it is the only one to release it."""
        with self.mu:
            handle = self._open.get(h)
            if not isinstance(handle, kind):
                raise Reject(ErrorCode.BAD_HANDLE, f"no such handle {h}")
            del self._open[h]
        return handle

    def take_any(self, h: int) -> Handle | None:
        with self.mu:
            return self._open.pop(h, None)

    def count(self) -> int:
        with self.mu:
            return len(self._open)

    def expire(self, cutoff: float) -> list[Handle]:
        """§7: take the handles created before ``cutoff`` (monotonic); they are
        ``BAD_HANDLE`` from now on. The caller releases them (:meth:`release_all`)."""
        with self.mu:
            old = [h for h, v in self._open.items() if v.created < cutoff]
            return [self._open.pop(h) for h in old]

    def revoke(self, hit: Callable[[Handle], bool]) -> list[Handle]:
        """§6.1: take the handles ``hit`` selects, remembering their numbers so that
        their complete/abort answers "nothing stored" once. The caller releases them."""
        with self.mu:
            gone = [h for h, v in self._open.items() if hit(v)]
            taken = [self._open.pop(h) for h in gone]
            for h, v in zip(gone, taken, strict=True):
                if len(self._revoked) < MAX_REVOKED_HANDLES:
                    self._revoked[h] = len(v.slots) if isinstance(v, WriteHandle) else 0
        return taken

    def revoked(self, h: int) -> int | None:
        """§6.1: the chunk count of a handle a revocation or purge released (once)."""
        with self.mu:
            return self._revoked.pop(h, None)

    # -- releasing ----------------------------------------------------------------------

    def release(self, h: Handle) -> None:
        """Everything a handle holds: regions, reservations, leased files, pins."""
        store = self._store
        if isinstance(h, WriteHandle):
            for lw in h.leased:
                store.cancel_lease(lw.lease)  # a no-op for a published one
            for sw in h.staged:
                sw.reservation.release()
                self.free(sw.offset)
            return
        for off in h.offsets:
            self.free(off)
        if h.keys:
            store.unpin(h.tenant, h.keys)

    def release_all(self, handles: Sequence[Handle] | None = None, who: object = None) -> None:
        """§7, "a disconnect releases everything": release ``handles``, or all of them.
        Call only once no verb of the connection runs."""
        if handles is None:
            with self.mu:
                handles = list(self._open.values())
                self._open.clear()
        for h in handles:
            try:
                self.release(h)
            except Exception:
                log.exception("%r: releasing a handle failed", who)

    def close(self) -> None:
        """Unmap the staging buffer (after :meth:`release_all`)."""
        if self.staging is not None:
            self.staging.close()


__all__ = [
    "LEASE_ENTRY_BYTES",
    "REPLY_ROOM",
    "Access",
    "Handle",
    "Handles",
    "LeasedWrite",
    "LoadHandle",
    "StagedWrite",
    "WriteHandle",
]
