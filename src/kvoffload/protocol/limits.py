"""The constants of protocol v1 (``docs/spec/protocol-v1.md`` §3, §4, §9) and its enums."""

from __future__ import annotations

from enum import StrEnum

PROTOCOL_VERSION = 1
MIN_PROTOCOL_VERSION = 1
MAX_PROTOCOL_VERSION = 1

CLIENT_MAGIC = b"KVOFFCLT"
SERVER_MAGIC = b"KVOFFSRV"
MAGIC_SIZE = 8

MAX_FRAME = 1 << 20
MAX_BATCH = 1024
MAX_LAYERS = 0xFFFF
MAX_TENANTS = 64
MAX_CLIENT_NAME = 128
MAX_REQUEST_ID = 2**32 - 1
MAX_U64 = 2**64 - 1
MAX_U16 = 0xFFFF
ALIGNMENT = 4096
KEY_SIZE = 32
SALT_SIZE = 32
MAX_MESSAGE = 4096
#: Most descriptors one frame may declare, and most received but unclaimed.
MAX_FDS = 4
#: Descriptors one reply frame may carry (a ``sealed_load`` reply, §5.33), and
#: so the most chunks such a reply hands out.
MAX_REPLY_FDS = 32
#: Longest object path a lease may name.
MAX_PATH = 4096
#: Largest region alignment a server may announce.
MAX_ALIGNMENT = 1 << 30
#: The revision of protocol 1 this code speaks (docs/spec/protocol-v1.md §10);
#: a client names it in ``hello`` (§5.1, ``revision``).
PROTOCOL_REVISION = 18
#: Region files one connection may register (§5.34).
MAX_REGIONS = 4
#: Most load handles one request may complete on the way (``complete``, §5.32).
MAX_PIGGYBACK = 64


class Op(StrEnum):
    HELLO = "hello"
    REGISTER_STAGING = "register_staging"
    LOOKUP = "lookup"
    PREPARE_STORE = "prepare_store"
    COMPLETE_STORE = "complete_store"
    ABORT = "abort"
    PREPARE_LOAD = "prepare_load"
    COMPLETE_LOAD = "complete_load"
    TOUCH = "touch"
    STATS = "stats"
    PURGE = "purge"
    FSCK = "fsck"
    BYE = "bye"
    LEASE_STORE = "lease_store"
    LEASE_LOAD = "lease_load"
    INSPECT = "inspect"
    LS = "ls"
    PURGE_OLDER = "purge_older"
    #: Revision 5 (gov-keys): §5.20.
    INVALIDATE = "invalidate"
    NAMESPACES = "namespaces"
    #: Interim frame of a layer-wise ``prepare_load`` (revision 9, §5.26); never a request.
    LOAD_PROGRESS = "load_progress"
    #: Revision 6 (§5.21): prepare + complete of a batch in one round trip.
    STORE = "store"
    #: Revision 13 (§5.31, admin): empty the sidecar's RAM tier.
    DROP_CACHE = "drop_cache"
    #: Revision 15 (§5.32): ``lookup`` and ``prepare_load`` in one request.
    LOOKUP_LOAD = "lookup_load"
    #: Revision 16 (§5.33): objects handed by descriptor with their own keys.
    SEALED_LOAD = "sealed_load"
    #: Revision 17 (§5.34): a peer's region file, addressed in place.
    REGISTER_REGION = "register_region"
    REGION_STORE = "region_store"
    REGION_LOAD = "region_load"
    #: Revision 18 (§5.35): a tenant removes chunks of its own.
    DELETE = "delete"
    #: Server-initiated fatal error frame (id 0).
    ERROR = "error"


class StoreStatus(StrEnum):
    WRITE = "write"
    EXISTS = "exists"
    REJECTED = "rejected"
