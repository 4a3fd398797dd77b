"""What the daemon needs of the store and of the policy: one port each.

:class:`StoreAPI` is every call the daemon makes on :class:`kvoffload.store.Store`
(protocol v1's verbs, ``docs/spec/protocol-v1.md``, the admin verbs, the audit
log, retention, the server's sweep); :class:`PolicyAPI` the calls on
:class:`kvoffload.sidecar.access.policy.Policy`. Both are structural
(``typing.Protocol``): the real classes satisfy them without inheriting. The
port is complete, so the daemon never probes a store for what it can do; test
doubles subclass :class:`kvoffload.testing.FakeStore`, which implements all of it.

The store's value types are imported for type checking only, from the store's
public surface (:mod:`kvoffload.store`), so importing this module (and the
server) does not import the store's dependencies (LMDB, cryptography).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ..store.api import LayoutFacts, RetentionSettings

if TYPE_CHECKING:
    from ..store import (
        ChunkRecord,
        FsckReport,
        PurgeReport,
        ReadLease,
        Reservation,
        SealedLease,
        StoreConfig,
        StoreLease,
        Usage,
    )

#: ``plan(layers)`` of a layer-wise load: every planned chunk's layer lengths.
PlanFn = Callable[[list[tuple[int, ...]]], None]
#: ``report(layers_done, chunks_verified)`` of a layer-wise load.
ReportFn = Callable[[int, int], None]
#: The cancel check of a load (``load_guard``): raises once a purge or revocation ran.
Guard = Callable[[int], None]


class ReservationAPI(Protocol):
    """Store capacity held for one chunk until it is written or released."""

    def release(self) -> None: ...


class StoreAPI(Protocol):
    """Every store call the daemon makes (one port, no optional parts)."""

    # -- facts ----------------------------------------------------------------------
    @property
    def layout(self) -> LayoutFacts: ...

    @property
    def config(self) -> StoreConfig: ...

    @property
    def durability(self) -> str:
        """The durability setting's name (``object``, ``batch``, ``none``)."""
        ...

    @property
    def alignment(self) -> int:
        """The offset alignment of an object's layers (layout-v1.md §3)."""
        ...

    @property
    def used_bytes(self) -> int: ...

    @property
    def has_ram_tier(self) -> bool: ...

    def stats(self) -> dict[str, Any]: ...

    def shared_info(self) -> dict[str, Any] | None: ...

    # -- tenants, retention, the audit log ----------------------------------------
    def tenant_salt(self, tenant: str) -> bytes: ...

    def tenants(self) -> list[str]: ...

    def key_problems(self) -> dict[str, str]: ...

    def set_retention(self, provider: Callable[[str], RetentionSettings | None] | None) -> None: ...

    def record_audit(self, event: str, details: dict[str, Any]) -> None: ...

    # -- writes ---------------------------------------------------------------------
    def shape_ok(self, lengths: Sequence[int], encrypt: bool) -> bool:
        """Whether a chunk of these layer lengths can be stored (layout-v1.md §3.2)."""
        ...

    def reserve_chunk(
        self, tenant: str, lengths: Sequence[int], *, encrypt: bool, quota: int | None = ...
    ) -> Reservation:
        """Capacity for one chunk's object, sized by the store from its layer lengths."""
        ...

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

    def record_contract(self, tenant: str, namespace: bytes, fields: Mapping[str, Any]) -> bool: ...

    # -- reads ----------------------------------------------------------------------
    def lookup(self, tenant: str, keys: Sequence[bytes]) -> int: ...

    def lookup_cached(self, tenant: str, keys: Sequence[bytes]) -> int | None: ...

    def payload_info(self, tenant: str, chunk_key: bytes) -> ChunkRecord | None: ...

    def payload_info_cached(self, tenant: str, key: bytes) -> tuple[bool, ChunkRecord | None]: ...

    def pin(self, tenant: str, keys: Sequence[bytes]) -> None: ...

    def unpin(self, tenant: str, keys: Sequence[bytes]) -> None: ...

    def touch(self, tenant: str, keys: Sequence[bytes]) -> None: ...

    def delete(self, tenant: str, key: bytes) -> bool: ...

    def load_guard(self, tenant: str) -> Guard: ...

    def load_planned(
        self,
        tenant: str,
        recs: Sequence[ChunkRecord],
        outs: Sequence[memoryview],
        guard: Guard,
        on_chunk: Callable[[int, list[int]], None] | None = ...,
    ) -> list[list[int] | None]: ...

    def load_planned_cached(
        self,
        tenant: str,
        recs: Sequence[ChunkRecord],
        outs: Sequence[memoryview],
        guard: Guard,
    ) -> list[list[int] | None]: ...

    def load_planned_layerwise(
        self,
        tenant: str,
        recs: Sequence[ChunkRecord],
        outs: Sequence[memoryview],
        plan: PlanFn,
        report: ReportFn,
        cancelled: Callable[[int], bool],
        guard: Guard,
    ) -> list[list[int] | None]: ...

    def cancel_loads(self, tenant: str) -> None: ...

    def drop_cache(self) -> tuple[int, int]: ...

    # -- the direct path (protocol-v1.md 5.14, 5.15; layout-v1.md §4.1) --------------
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

    def sealed_lease(self, tenant: str, key: bytes) -> SealedLease | None: ...

    def check_reported(self, tenant: str, key: bytes) -> bool: ...

    # -- admin: views, purges, fsck, contracts ----------------------------------------
    def chunks(
        self, tenant: str | None = ..., namespace: bytes | None = ...
    ) -> Iterator[ChunkRecord]: ...

    def chunk_count(self) -> int: ...

    def tenant_usage(self) -> dict[str, Usage]: ...

    def namespace_usage(self, tenant: str) -> dict[bytes, Usage]: ...

    def purge(self, tenant: str, namespace: bytes | None = ...) -> PurgeReport: ...

    def purge_tenant(self, tenant: str, *, wait: bool = ...) -> int: ...

    def purge_namespace(self, tenant: str, namespace: bytes) -> int: ...

    def purge_older_than(self, age_s: float, tenant: str | None = ...) -> int: ...

    def fsck(
        self,
        repair: bool = ...,
        *,
        verify_data: bool = ...,
        progress: Callable[[int], None] | None = ...,
    ) -> FsckReport: ...

    def maintain(self) -> dict[str, int]: ...

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


class TenantSettings(RetentionSettings, Protocol):
    """One tenant's effective policy (``kvoffload.sidecar.access.policy.TenantPolicy``),
    its retention limits included."""

    @property
    def events(self) -> bool: ...

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
    @property
    def source(self) -> str:
        """Where the policy came from (a file, ``<built-in>``), for stats and the audit log."""
        ...

    def may_use(self, uid: int, gids: Sequence[int], tenant: str) -> bool: ...

    def is_admin(self, uid: int, gids: Sequence[int]) -> bool: ...

    def tenant(self, tenant: str) -> TenantSettings: ...


__all__ = [
    "Guard",
    "PlanFn",
    "PolicyAPI",
    "ReportFn",
    "ReservationAPI",
    "RetentionSettings",
    "StoreAPI",
    "TenantSettings",
]
