"""What crosses the door between the storage engine and the daemon.

The daemon (:mod:`kvoffload.sidecar`) may import this module and the package
:mod:`kvoffload.store`, never the engine's internals. Everything here is stdlib
only, so importing it pulls in neither LMDB nor cryptography.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


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


__all__ = ["LayoutFacts", "RetentionSettings"]
