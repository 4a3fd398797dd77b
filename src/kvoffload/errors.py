"""Every exception kvoffload raises on purpose, in one tree.

::

    KVOffloadError                   base: anything kvoffload refuses or fails at
    ├── ContractError         (ValueError)  a compatibility-contract field is missing or invalid
    ├── KeyDerivationError    (ValueError)  invalid input to the chunk-key derivation
    ├── ConfigError           (ValueError)  a bad sidecar setting; the message names source and key
    ├── PolicyError           (ValueError)  a bad policy file; reads ``<file>:<line>: <reason>``
    ├── ConnectorConfigError  (ValueError)  a bad engine integration config: vLLM, SGLang, LMCache
    ├── ProtocolError                       peer input that breaks protocol v1
    ├── EventDecodeError      (ValueError)  a KV-event frame or batch that breaks events-v1
    ├── BadBody               (ValueError)  a router request body that is no JSON object (a 400)
    ├── Reject                              a verb the sidecar refuses as a whole (an error reply)
    ├── TransportError                      the connection failed and is closed
    │   ├── TransportClosed                 the peer closed or reset it, or this end did
    │   └── TransportTimeout                no frame, or no send, within the timeout
    ├── StagingError                        a staging buffer cannot be created or mapped
    │   └── RegionError                     a peer's region file refused, or one access to it
    ├── ChunkTooLarge         (ValueError)  a chunk can never fit the staging buffer
    ├── DirectIOError         (OSError)     a direct-path read or write failed: a miss / not saved
    ├── LayoutError                         the on-disk layout layer
    │   ├── UnknownLayoutVersion            a version this build does not implement
    │   └── CorruptObject                   an object fails a structural or integrity check
    │       ├── ObjectMismatch              valid, but not the object asked for
    │       └── UnknownKeyEpoch             sealed under a DEK epoch the reader's keys lack
    ├── JournalError                        a shared root's node journal or lease file is damaged
    ├── KeyringError                        wrong KEK, corrupt or unknown key file, key I/O
    ├── IndexFailure                        the LMDB index cannot be opened, read or written
    │   ├── IndexCorrupt                    it holds data it cannot decode (fsck rebuilds)
    │   └── IndexVersionError               a schema version this code does not know
    ├── StoreError                          what the store refuses or fails at (its boundary)
    │   ├── StoreFull                       no room under the byte limit, even after eviction
    │   │   └── QuotaExceeded               no room under the tenant's quota
    │   ├── StoreLocked                     another process holds this store's index
    │   ├── StoreIOError                    the file system failed (ENOSPC, EACCES, EIO…)
    │   ├── AuditFormatError                an audit log file or anchor of an unknown version
    │   ├── LeaseInvalid                    a direct-path object failed its check
    │   ├── TransferCancelled               its tenant was purged or revoked during a load/write
    │   ├── UnknownTenant                   no keys for this tenant (never created, or purged)
    │   ├── StoreKeyError                   a tenant's key file is corrupt, unreadable or unwritable
    │   └── IOBackendUnavailable            a requested I/O backend cannot work on this node
    ├── ListenError           (OSError)     the sidecar cannot listen on its socket
    └── SidecarStartError     (RuntimeError) a development sidecar did not come up

Where a class also derives from a builtin (in brackets), code that catches the
builtin keeps working. Lower-layer errors (``OSError``, ``lmdb.Error``,
``InvalidTag``, index and keyring errors) are mapped at the store and client
boundaries with ``raise … from exc``; read-side failures never surface as
exceptions at all: a chunk that cannot be read and verified is a miss.

This module imports the standard library only, so a worker that catches
these stays light. The modules that raise them re-export their own names.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = [
    "AuditFormatError",
    "BadBody",
    "ChunkTooLarge",
    "ConfigError",
    "ConnectorConfigError",
    "ContractError",
    "CorruptObject",
    "DirectIOError",
    "ErrorCode",
    "EventDecodeError",
    "IOBackendUnavailable",
    "IndexCorrupt",
    "IndexFailure",
    "IndexVersionError",
    "JournalError",
    "KVOffloadConfigError",
    "KVOffloadError",
    "KeyDerivationError",
    "KeyringError",
    "LayoutError",
    "LeaseInvalid",
    "ListenError",
    "ObjectMismatch",
    "PolicyError",
    "ProtocolError",
    "QuotaExceeded",
    "RegionError",
    "Reject",
    "SidecarStartError",
    "StagingError",
    "StoreError",
    "StoreFull",
    "StoreIOError",
    "StoreKeyError",
    "StoreLocked",
    "TransferCancelled",
    "TransportClosed",
    "TransportError",
    "TransportTimeout",
    "UnknownKeyEpoch",
    "UnknownLayoutVersion",
    "UnknownTenant",
]


class KVOffloadError(Exception):
    """Base class of every exception kvoffload raises on purpose."""


# -- inputs: contract, keys, configuration ------------------------------------


class ContractError(KVOffloadError, ValueError):
    """A contract field is missing or invalid."""


class KeyDerivationError(KVOffloadError, ValueError):
    """Invalid input to the key derivation."""


class EventDecodeError(KVOffloadError, ValueError):
    """A KV-event frame, batch or event that does not decode (docs/spec/events-v1.md)."""


class BadBody(KVOffloadError, ValueError):
    """A request body the router cannot read: the message is the client's one line."""


class ConfigError(KVOffloadError, ValueError):
    """An invalid configuration value; the message names the source and key."""


class PolicyError(KVOffloadError, ValueError):
    """A policy file that cannot be read or is invalid.

    ``str(err)`` reads ``<file>:<line>: <reason>`` (``<file>: <reason>`` where
    no line applies), the form editors and CI logs link to.
    """

    def __init__(
        self, source: str, reason: str, line: int | None = None, column: int | None = None
    ) -> None:
        self.source = source
        self.reason = reason
        self.line = line
        self.column = column
        where = source
        if line is not None:
            where += f":{line}"
            if column is not None:
                where += f":{column}"
        super().__init__(f"{where}: {reason}")


class ConnectorConfigError(KVOffloadError, ValueError):
    """An engine integration's configuration (vLLM's connector or tier, SGLang's
    HiCache backend, LMCache's L2 adapter) is invalid or describes an unsupported engine."""


#: The name the vLLM integration has always exported.
KVOffloadConfigError = ConnectorConfigError


# -- the wire -----------------------------------------------------------------


class ErrorCode(IntEnum):
    """Error codes on the wire (protocol-v1.md §4): these numbers never change."""

    OK = 0
    BAD_REQUEST = 1
    UNSUPPORTED_VERSION = 2
    FRAME_TOO_LARGE = 3
    BAD_MAGIC = 4
    NOT_REGISTERED = 5
    FORBIDDEN = 6
    NO_SPACE = 7
    BUSY = 8
    TOO_LARGE = 9
    NOT_FOUND = 10
    BAD_HANDLE = 11
    INTERNAL = 12
    SHUTTING_DOWN = 13
    UNSUPPORTED = 14

    @classmethod
    def from_wire(cls, value: int) -> ErrorCode:
        """Unknown codes read as INTERNAL (protocol-v1.md §4)."""
        try:
            return cls(value)
        except ValueError:
            return cls.INTERNAL


class ProtocolError(KVOffloadError):
    """Peer input that breaks the protocol.

    ``request_id`` is set when the error concerns one readable request: the
    receiver can answer it and keep the connection. Without it the error is
    fatal for the connection.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        request_id: int | None = None,
        op: str | None = None,
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id
        self.op = op

    @property
    def fatal(self) -> bool:
        return self.request_id is None


class Reject(KVOffloadError):
    """A verb the sidecar refuses as a whole: the session answers an error reply with ``code``.

    Raised inside the daemon's verb layer only; the connection never dies of it.
    """

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class TransportError(KVOffloadError):
    """The connection failed; it is closed and cannot be used again."""


class TransportClosed(TransportError):
    """The peer closed or reset the connection, or this end was closed."""


class TransportTimeout(TransportError):
    """No complete frame arrived, or a send did not finish, within the timeout."""


# -- the worker's side of the data path ---------------------------------------


class StagingError(KVOffloadError):
    """A staging buffer cannot be created or mapped as asked."""


class RegionError(StagingError):
    """A peer's region file (protocol §5.34) refused, or one access to it that cannot be done."""


class ChunkTooLarge(KVOffloadError, ValueError):
    """A chunk's packed layers exceed the staging buffer: it can never be saved."""


class DirectIOError(KVOffloadError, OSError):
    """A direct-path read or write failed; the chunk is a miss or not saved."""


# -- the on-disk layout -------------------------------------------------------


class LayoutError(KVOffloadError):
    """Base class of everything the layout layer raises."""


class UnknownLayoutVersion(LayoutError):
    """A layout version outside ``supported``, the (min, max) range of the layout
    that raises it (the range lives with the layouts, :mod:`kvoffload.layouts`)."""

    def __init__(self, version: object, supported: tuple[int, int], where: str = "") -> None:
        self.version = version
        self.supported = supported
        loc = f" in {where}" if where else ""
        lo, hi = supported
        super().__init__(
            f"unknown layout version {version!r}{loc}: this kvoffload reads versions "
            f"{lo}..{hi}; upgrade kvoffload or migrate the store"
        )


class CorruptObject(LayoutError):
    """The bytes are not a valid object (torn, truncated, flipped, tampered)."""


class ObjectMismatch(CorruptObject):
    """A structurally valid object that is not the one requested (e.g. swapped files)."""


class UnknownKeyEpoch(CorruptObject):
    """A sealed object under a DEK epoch the reader's copy of the tenant's keys lacks:
    purged, forged, or newer than that copy (another node rotated, and this one
    does not see the new key file yet). A miss; the file is left in place."""


class JournalError(KVOffloadError):
    """A shared root's node journal or evictor lease file is damaged or of an unknown version.

    Journals are hints (shared-root-v1.md): a follower skips what it cannot read.
    """


# -- the daemon's lower layers ------------------------------------------------


class KeyringError(KVOffloadError):
    """Any failure of the keyring: wrong KEK, corrupt or unknown key file, I/O."""


class IndexFailure(KVOffloadError):
    """The index could not be opened, read or written."""


class IndexCorrupt(IndexFailure):
    """The index holds data it cannot decode; rebuild it from the files (fsck)."""


class IndexVersionError(IndexFailure):
    """The index was written with a schema version this code does not know."""


# -- the store's boundary -----------------------------------------------------


class StoreError(KVOffloadError):
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


class AuditFormatError(StoreError):
    """An audit log file or anchor of an unknown version, or unreadable (audit-v1.md)."""


class LeaseInvalid(StoreError):
    """A worker's direct-path object failed verification; it was deleted, not stored."""


class TransferCancelled(StoreError):
    """A load or write of a tenant purged or revoked while it ran: a miss / not stored."""


class UnknownTenant(StoreError):
    """The tenant has no keys: nothing of it can be read."""


class StoreKeyError(StoreError):
    """A tenant's keys cannot be used: its key file is corrupt or unreadable, or a
    key write failed (a :class:`KeyringError` underneath, mapped at the store
    boundary). Unlike :class:`UnknownTenant` the keys exist; restore or rotate them.
    """


class IOBackendUnavailable(StoreError):
    """An explicitly requested backend cannot work on this node; the reason says why."""

    def __init__(self, mode: str, reason: str, env_var: str = "KVOFFLOAD_IO") -> None:
        self.mode = mode
        self.reason = reason
        super().__init__(
            f"{env_var}={mode} cannot be used here: {reason} "
            f"(set {env_var}=auto to use the best backend that works)"
        )


class ListenError(KVOffloadError, OSError):
    """The sidecar cannot listen on its socket (in use, bad path, not a socket…)."""


# -- tools --------------------------------------------------------------------


class SidecarStartError(KVOffloadError, RuntimeError):
    """The development sidecar did not come up."""
