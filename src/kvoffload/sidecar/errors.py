"""The store's errors; defined, with the whole tree, in :mod:`kvoffload.errors`."""

from __future__ import annotations

from kvoffload.errors import (
    LeaseInvalid,
    QuotaExceeded,
    StoreError,
    StoreFull,
    StoreIOError,
    StoreLocked,
    UnknownTenant,
)

__all__ = [
    "LeaseInvalid",
    "QuotaExceeded",
    "StoreError",
    "StoreFull",
    "StoreIOError",
    "StoreLocked",
    "UnknownTenant",
]
