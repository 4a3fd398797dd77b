"""The request table of protocol v1: every request class, by its verb (§5).

Made from the union :data:`Request`, as the reply table is from its union
(replies.py), so a class is reachable exactly when it is listed here.
"""

from __future__ import annotations

from .fields import op_table
from .limits import Op
from .region_requests import RegionLoad, RegionStore, RegisterRegion
from .requests import (
    Abort,
    Bye,
    CompleteLoad,
    CompleteStore,
    Delete,
    DropCache,
    Fsck,
    Hello,
    Inspect,
    Invalidate,
    LeaseLoad,
    LeaseStore,
    Lookup,
    LookupLoad,
    Ls,
    Namespaces,
    PrepareLoad,
    PrepareStore,
    Purge,
    PurgeOlder,
    RegisterStaging,
    SealedLoad,
    Stats,
    StoreBatch,
    Touch,
)

Request = (
    Hello
    | RegisterStaging
    | Lookup
    | PrepareStore
    | CompleteStore
    | Abort
    | PrepareLoad
    | CompleteLoad
    | Touch
    | Stats
    | Purge
    | Fsck
    | Bye
    | LeaseStore
    | LeaseLoad
    | Inspect
    | Ls
    | PurgeOlder
    | Invalidate
    | Namespaces
    | StoreBatch
    | DropCache
    | LookupLoad
    | SealedLoad
    | RegisterRegion
    | RegionStore
    | RegionLoad
    | Delete
)

#: op → request class, made from :data:`Request`.
REQUEST_TYPES: dict[Op, type[Request]] = op_table(Request)

__all__ = ["REQUEST_TYPES", "Request"]
