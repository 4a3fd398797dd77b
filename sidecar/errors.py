"""Errors the sidecar's store raises at its public boundary.

    StoreError                      base: anything the store refuses or fails at
    ├── StoreFull                   the write cannot fit under the byte limit, even after eviction
    │   └── QuotaExceeded           ... under the tenant's quota, even after evicting its own chunks
    ├── StoreLocked                 another process holds this store's index
    ├── StoreIOError                the file system failed (ENOSPC, EACCES, EIO…); errno kept
    ├── LeaseInvalid                a direct-path object failed the check before publication
    └── UnknownTenant               no keys for this tenant (never created, or purged)

Lower-layer errors (``OSError``, ``lmdb.Error``, ``InvalidTag``,
``layouts.CorruptObject``) are mapped to these with ``raise … from exc``;
read-side failures never surface as exceptions at all: a chunk that cannot be
read and verified is a miss.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class of the store's errors."""


class StoreFull(StoreError):
    def __init__(self, need: int, capacity: int, used: int) -> None:
        self.need = need
        self.capacity = capacity
        self.used = used
        super().__init__(
            f"store full: {need} bytes needed, {used} of {capacity} in use and the rest "
            "is pinned or reserved"
        )


class QuotaExceeded(StoreFull):
    """The tenant's quota has no room, even after evicting its own unpinned chunks."""

    def __init__(self, tenant: str, need: int, quota: int, used: int) -> None:
        self.tenant = tenant
        self.need = need
        self.capacity = quota
        self.used = used
        StoreError.__init__(
            self,
            f"tenant {tenant!r} quota full: {need} bytes needed, {used} of {quota} in use "
            "and the rest pinned or reserved",
        )


class StoreLocked(StoreError):
    """The index is held by another process (normally a running sidecar)."""


class StoreIOError(StoreError):
    def __init__(self, message: str, errno: int | None = None) -> None:
        self.errno = errno
        super().__init__(message)


class LeaseInvalid(StoreError):
    """A worker's direct-path object failed verification; it was deleted, not stored."""


class UnknownTenant(StoreError):
    """The tenant has no keys: nothing of it can be read."""
