"""What crosses the door between the storage engine and the daemon.

The daemon (:mod:`kvoffload.sidecar`) may import this module and the package
:mod:`kvoffload.store`, never the engine's internals. Everything here is stdlib
only, so importing it pulls in neither LMDB nor cryptography.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable


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


__all__ = ["EventLog", "LayoutFacts", "RetentionSettings"]
