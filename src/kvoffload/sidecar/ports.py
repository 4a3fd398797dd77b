"""What the sidecar's verb layer needs of the store and of the policy.

:class:`StoreAPI` is the subset of :class:`kvoffload.store.Store`
that protocol v1 (``docs/spec/protocol-v1.md``) uses, :class:`PolicyAPI` the
subset of :class:`kvoffload.sidecar.access.policy.Policy`. Both are structural
(``typing.Protocol``): the real classes satisfy them without inheriting, and
tests pass in-memory doubles.

The store's own value types (reservations, leases, fsck reports, index
records) are imported for type checking only, so importing this module (and
the server) does not import the store's dependencies (LMDB, cryptography).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..store.api import RetentionSettings

if TYPE_CHECKING:
    from ..layouts.store_root import LayoutInfo
    from ..store import FsckReport, ReadLease, Reservation, StoreConfig, StoreLease
    from ..store.api import ChunkRecord, PurgeReport, Usage


class ReservationAPI(Protocol):
    """Store capacity held for one chunk until it is written or released."""

    def release(self) -> None: ...


class StoreAPI(Protocol):
    def tenant_salt(self, tenant: str) -> bytes: ...

    def put(
        self,
        tenant: str,
        namespace: bytes,
        chunk_key: bytes,
        layers: Sequence[memoryview],
        *,
        encrypt: bool = ...,
        ttl_s: float | None = ...,
        reservation: Reservation | None = ...,
    ) -> bool: ...

    def reserve(self, tenant: str, nbytes: int, *, quota: int | None = ...) -> Reservation: ...

    def put_many(
        self,
        tenant: str,
        namespace: bytes,
        chunks: Sequence[tuple[bytes, Sequence[memoryview]]],
        *,
        encrypt: bool = ...,
        ttl_s: float | None = ...,
        reservations: Sequence[Reservation | None] | None = ...,
    ) -> list[bool]: ...

    def get_many_into(
        self, tenant: str, keys: Sequence[bytes], outs: Sequence[memoryview]
    ) -> list[list[int] | None]: ...

    def get_into(self, tenant: str, chunk_key: bytes, out: memoryview) -> list[int] | None: ...

    def get_layerwise_into(
        self,
        tenant: str,
        keys: Sequence[bytes],
        outs: Sequence[memoryview],
        plan: Callable[[list[tuple[int, ...]]], None],
        report: Callable[[int, int], None],
        cancelled: Callable[[int], bool],
    ) -> list[list[int] | None]: ...

    def payload_info(self, tenant: str, chunk_key: bytes) -> ChunkRecord | None: ...

    def lookup(self, tenant: str, keys: Sequence[bytes]) -> int: ...

    def lookup_cached(self, tenant: str, keys: Sequence[bytes]) -> int | None: ...

    def pin(self, tenant: str, keys: Sequence[bytes]) -> None: ...

    def unpin(self, tenant: str, keys: Sequence[bytes]) -> None: ...

    def touch(self, tenant: str, keys: Sequence[bytes]) -> None: ...

    def purge_tenant(self, tenant: str) -> int: ...

    def purge_namespace(self, tenant: str, namespace: bytes) -> int: ...

    def fsck(self, repair: bool = ...) -> FsckReport: ...

    def stats(self) -> dict[str, Any]: ...

    def maintain(self) -> dict[str, int]: ...

    # The direct path (protocol-v1.md 5.14, 5.15; layout-v1.md §4.1).
    def lease_store(
        self,
        tenant: str,
        namespace: bytes,
        chunk_key: bytes,
        lengths: Sequence[int],
        *,
        ttl_s: float | None = ...,
        gid: int | None = ...,
        quota: int | None = ...,
    ) -> StoreLease | None: ...

    def publish_lease(self, lease: StoreLease) -> bool: ...

    def cancel_lease(self, lease: StoreLease) -> None: ...

    def lease_load(self, tenant: str, key: bytes) -> ReadLease | None: ...

    def check_reported(self, tenant: str, key: bytes) -> bool: ...


@runtime_checkable
class CacheAPI(Protocol):
    """What ``drop_cache`` (protocol-v1.md §5.31) needs: a store with a RAM tier."""

    def drop_cache(self) -> tuple[int, int]: ...


@runtime_checkable
class StoreViewsAPI(Protocol):
    """What the admin verbs inspect, ls and purge_older (protocol-v1.md §5.16-5.18) need,
    beyond :class:`StoreAPI`; the real store has it, a double may not (then: UNSUPPORTED)."""

    @property
    def layout(self) -> LayoutInfo: ...

    @property
    def config(self) -> StoreConfig: ...

    @property
    def used_bytes(self) -> int: ...

    def chunks(
        self, tenant: str | None = ..., namespace: bytes | None = ...
    ) -> Iterator[ChunkRecord]: ...

    def chunk_count(self) -> int: ...

    def tenant_usage(self) -> dict[str, Usage]: ...

    def namespace_usage(self, tenant: str) -> dict[bytes, Usage]: ...

    def tenants(self) -> list[str]: ...

    def key_problems(self) -> dict[str, str]: ...

    def shared_info(self) -> dict[str, Any] | None: ...

    def purge_tenant(self, tenant: str, *, wait: bool = ...) -> int: ...

    def purge(self, tenant: str, namespace: bytes | None = ...) -> PurgeReport: ...

    def purge_older_than(self, age_s: float, tenant: str | None = ...) -> int: ...

    def fsck(
        self,
        repair: bool = ...,
        *,
        verify_data: bool = ...,
        progress: Callable[[int], None] | None = ...,
    ) -> FsckReport: ...


@runtime_checkable
class PlannedLoadsAPI(Protocol):
    """Loads of chunks whose index records ``prepare_load`` just looked up, read
    without a second lookup each (store/reads.py); the real store has
    them, a double may not (then ``get_many_into``/``get_layerwise_into``)."""

    def load_guard(self, tenant: str) -> Callable[[int], None]: ...

    def load_planned(
        self,
        tenant: str,
        recs: Sequence[ChunkRecord],
        outs: Sequence[memoryview],
        guard: Callable[[int], None],
        on_chunk: Callable[[int, list[int]], None] | None = ...,
    ) -> list[list[int] | None]: ...

    def load_planned_layerwise(
        self,
        tenant: str,
        recs: Sequence[ChunkRecord],
        outs: Sequence[memoryview],
        plan: Callable[[list[tuple[int, ...]]], None],
        report: Callable[[int, int], None],
        cancelled: Callable[[int], bool],
        guard: Callable[[int], None],
    ) -> list[list[int] | None]: ...


@runtime_checkable
class CachedLoadsAPI(Protocol):
    """Loads answered without a wait on the device (store/reads.py):
    a small batch wholly in the page cache is served on the event loop instead
    of a hop to a pool thread and back (sidecar/connection.py)."""

    def payload_info_cached(self, tenant: str, key: bytes) -> tuple[bool, ChunkRecord | None]: ...

    def load_planned_cached(
        self,
        tenant: str,
        recs: Sequence[ChunkRecord],
        outs: Sequence[memoryview],
        guard: Callable[[int], None],
    ) -> list[list[int] | None]: ...


@runtime_checkable
class ContractsAPI(Protocol):
    """Namespaces' contract fields (protocol-v1.md §5.19, §5.20; layout-v1.md §2.1);
    the real store has them, a double may not (registration is then skipped and
    the admin verbs are UNSUPPORTED)."""

    def record_contract(self, tenant: str, namespace: bytes, fields: Mapping[str, Any]) -> bool: ...

    def namespaces_report(
        self, tenant: str | None = ..., *, ages: bool = ...
    ) -> list[dict[str, Any]]: ...

    def invalidate(
        self,
        selector: Mapping[str, str],
        *,
        tenant: str | None = ...,
        dry_run: bool = ...,
        actor: Mapping[str, Any] | None = ...,
    ) -> dict[str, Any]: ...


class TenantSettings(Protocol):
    """One tenant's effective policy (``kvoffload.sidecar.access.policy.TenantPolicy``)."""

    @property
    def encryption(self) -> bool: ...

    @property
    def ttl_s(self) -> float | None: ...

    @property
    def direct(self) -> bool: ...

    @property
    def direct_gid(self) -> int | None: ...

    @property
    def quota_bytes(self) -> int | None: ...

    @property
    def lookup_floor_s(self) -> float: ...

    @property
    def lookup_jitter_s(self) -> float: ...

    @property
    def trust_group(self) -> str | None: ...


class PolicyAPI(Protocol):
    def may_use(self, uid: int, gids: Sequence[int], tenant: str) -> bool: ...

    def is_admin(self, uid: int, gids: Sequence[int]) -> bool: ...

    def tenant(self, tenant: str) -> TenantSettings: ...


_IMPLEMENTS: dict[tuple[type, type], bool] = {}


def implements(obj: object, proto: type) -> bool:
    """``isinstance(obj, proto)`` for a runtime-checkable protocol of methods,
    remembered per class: typing's check walks every member of the protocol
    on each call (about 10 µs, twice per load on a small load's path)."""
    k = (type(obj), proto)
    hit = _IMPLEMENTS.get(k)
    if hit is None:
        hit = _IMPLEMENTS[k] = isinstance(obj, proto)
    return hit


__all__ = [
    "CacheAPI",
    "CachedLoadsAPI",
    "ContractsAPI",
    "PlannedLoadsAPI",
    "PolicyAPI",
    "ReservationAPI",
    "RetentionSettings",
    "StoreAPI",
    "StoreViewsAPI",
    "TenantSettings",
    "implements",
]
