"""Capacity: reservations, the store's byte limit with its watermarks, per-tenant
quotas, pins, and the one eviction loop that serves both limits.

Capacity rule: ``used + reserved <= capacity`` at all times. A write reserves
its object size first, evicting least-recently-used unpinned chunks if it
must; if it still cannot fit it fails with :class:`StoreFull`, never
exceeding the limit. Above the high watermark, eviction runs down to the low
watermark. A tenant's quota works the same way on the tenant's own chunks
(:class:`QuotaExceeded`), never evicting another tenant's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..errors import QuotaExceeded, StoreFull
from .api import ChunkRecord, Reservation
from .base import StoreBase, boundary


@dataclass(frozen=True)
class _Scope:
    """What a reservation must fit under: the store's capacity (``tenant`` None)
    or one tenant's quota. Eviction frees room within the scope only."""

    store: Capacity
    limit: int
    tenant: str | None = None

    def accounted_locked(self) -> int:
        s = self.store
        if self.tenant is None:
            if s._shared is not None:
                # A shared root's capacity is the root's: this node may write
                # what the evictor granted it (shared-root-v1.md §4.1).
                return self.limit - s._shared.remaining_locked() + s._reserved
            return s._used + s._reserved
        # The index's usage is read under the lock that every insert takes,
        # so two writers cannot both fit into the same room.
        return s.index.usage(self.tenant).bytes + s._tenant_reserved.get(self.tenant, 0)

    def add_locked(self, nbytes: int) -> None:
        s = self.store
        if self.tenant is None:
            s._reserved += nbytes
        else:
            s._tenant_reserved[self.tenant] = s._tenant_reserved.get(self.tenant, 0) + nbytes

    def full(self, nbytes: int) -> StoreFull:
        s = self.store
        if self.tenant is None:
            return StoreFull(nbytes, self.limit, s._used)
        return QuotaExceeded(self.tenant, nbytes, self.limit, s.index.usage(self.tenant).bytes)

    @property
    def slack(self) -> int:
        """Evicted beyond the need, so that quota eviction runs in batches (down to
        the quota's low watermark); the store's own batches come from _after_write."""
        if self.tenant is None:
            return 0
        return int(self.limit * (1 - self.store.config.low_watermark))

    @property
    def reason(self) -> str:
        return "evict" if self.tenant is None else "quota"

    def candidates(self) -> Iterator[ChunkRecord]:
        """The scope's chunks, least recently used first."""
        s = self.store
        if self.tenant is None:
            return s.index.lru()
        return iter(sorted(s.index.records(self.tenant), key=lambda r: r.last_access_ns))


class Capacity(StoreBase):
    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    @property
    def accounted_bytes(self) -> int:
        """used + reserved, read atomically: never above the capacity."""
        with self._mu:
            return self._used + self._reserved

    def _commit_locked(self, res: Reservation) -> None:
        """A reservation's bytes just became usage (the caller holds the lock
        and has added them to ``used``)."""
        if res._claim():
            self._unreserve_locked(res.tenant, res.nbytes)
            if self._shared is not None:
                self._shared.committed_locked(res.nbytes)

    def _unreserve(self, tenant: str, n: int) -> None:
        with self._mu:
            self._unreserve_locked(tenant, n)

    def _unreserve_locked(self, tenant: str, n: int) -> None:
        self._reserved -= n
        self._drop_tenant_share_locked(tenant, n)

    def _drop_tenant_share_locked(self, tenant: str, n: int) -> None:
        left = self._tenant_reserved.get(tenant, 0) - n
        if left > 0:
            self._tenant_reserved[tenant] = left
        else:
            self._tenant_reserved.pop(tenant, None)

    @boundary
    def reserve(self, tenant: str, nbytes: int, *, quota: int | None = None) -> Reservation:
        """Hold ``nbytes`` of capacity, evicting LRU chunks if needed; else StoreFull.

        ``quota``: the tenant's byte limit (its policy's ``quota``). The tenant's
        stored plus reserved bytes stay at or below it: its own least recently
        used unpinned chunks are evicted to make room (down to the low
        watermark of the quota, so that eviction runs in batches), never
        another tenant's; if that cannot make room, :class:`QuotaExceeded`.
        """
        tenant_scope = _Scope(self, quota, tenant) if quota is not None else None
        if tenant_scope is not None:
            self._hold(tenant_scope, nbytes)
        else:
            with self._mu:
                self._tenant_reserved[tenant] = self._tenant_reserved.get(tenant, 0) + nbytes
        try:
            cap = self.config.capacity_bytes
            if cap is not None:
                self._hold(_Scope(self, cap), nbytes)
            else:
                with self._mu:
                    self._reserved += nbytes
        except BaseException:
            with self._mu:
                self._drop_tenant_share_locked(tenant, nbytes)
            raise
        return Reservation(tenant, nbytes, self._unreserve)

    @boundary
    def tenant_accounted(self, tenant: str) -> int:
        """The tenant's stored + reserved bytes (what its quota bounds)."""
        with self._mu:
            return self.index.usage(tenant).bytes + self._tenant_reserved.get(tenant, 0)

    def _hold(self, scope: _Scope, nbytes: int) -> None:
        """Add ``nbytes`` to the scope's reserved bytes once they fit under its limit,
        evicting the scope's LRU unpinned chunks to make room; else ``scope.full``."""
        if nbytes > scope.limit:
            raise scope.full(nbytes)
        if scope.tenant is None and self._shared is not None:
            # Within this node's grant or not at all: the root's evictor makes room.
            for attempt in (0, 1):
                with self._mu:
                    if scope.accounted_locked() + nbytes > scope.limit:
                        self._shared.refill_own_locked(self._used, scope.limit)
                    if scope.accounted_locked() + nbytes <= scope.limit:
                        scope.add_locked(nbytes)
                        return
                    excess = self._used + nbytes - int(scope.limit * self.config.low_watermark)
                if attempt or self._shared.lease.held is None or excess <= 0:
                    break
                self._evict(scope, excess)  # the holder only; each removal fenced
            raise scope.full(nbytes)
        for _attempt in range(1000):
            with self._mu:
                over = scope.accounted_locked() + nbytes - scope.limit
                if over <= 0:
                    scope.add_locked(nbytes)
                    return
            if self._evict(scope, over + scope.slack) > 0:
                continue
            # Freed nothing: another writer is evicting the same chunks, or
            # nothing in the scope is evictable. Decide on one consistent view:
            # the room and the evictable chunks are read under the lock that
            # every commit takes, so a write that commits (and becomes
            # evictable) between the two reads cannot make a full verdict.
            if not self._may_evict():
                raise scope.full(nbytes)
            with self._mu:
                over = scope.accounted_locked() + nbytes - scope.limit
                if over <= 0:
                    scope.add_locked(nbytes)
                    return
                if not self._evictable_locked(scope):
                    # The rest of the room is pinned or reserved by writes in flight.
                    raise scope.full(nbytes)
        raise scope.full(nbytes)

    def _may_evict(self) -> bool:
        """On a shared root only the evictor lease's holder removes, and only
        while its lease is fenced in (shared-root-v1.md §4)."""
        return self._eviction_epoch() is not None

    def _eviction_epoch(self) -> int | None:
        """:meth:`_may_evict`, with the lease epoch the removal is made under (0
        off a shared root); None when this node may not evict now."""
        return 0 if self._shared is None else self._shared.lease.fenced_epoch()

    def _evictable_locked(self, scope: _Scope) -> bool:
        return any(not self._pins.get((r.tenant, r.chunk_key)) for r in scope.candidates())

    def _evict(self, scope: _Scope, nbytes: int) -> int:
        """Evict the scope's unpinned chunks, oldest access first, until ``nbytes``
        are freed; returns the bytes freed."""
        self._flush_touches()
        freed = 0
        for rec in scope.candidates():
            if freed >= nbytes:
                break
            with self._mu:
                if self._pins.get((rec.tenant, rec.chunk_key)):
                    continue
            epoch = self._eviction_epoch()
            if epoch is None:
                break
            if self._drop(rec.tenant, rec.chunk_key, reason=scope.reason, lease_epoch=epoch):
                freed += rec.size
                self.counters.evictions += 1
        return freed

    def _after_write(self) -> None:
        cap = self.config.capacity_bytes
        if cap is None or self._shared is not None:
            return  # a shared root's evictor works from its tick (facade.evictor_tick)
        if self._used + self._reserved > cap * self.config.high_watermark:
            target = int(cap * self.config.low_watermark)
            self._evict(_Scope(self, cap), self._used + self._reserved - target)

    def pin(self, tenant: str, keys: Sequence[bytes]) -> None:
        with self._mu:
            for k in keys:
                self._pins[(tenant, k)] = self._pins.get((tenant, k), 0) + 1

    def unpin(self, tenant: str, keys: Sequence[bytes]) -> None:
        with self._mu:
            for k in keys:
                n = self._pins.get((tenant, k), 0) - 1
                if n > 0:
                    self._pins[(tenant, k)] = n
                else:
                    self._pins.pop((tenant, k), None)
