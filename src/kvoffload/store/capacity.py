"""Capacity: the bytes used and reserved, the store's byte limit with its
watermarks, per-tenant quotas, pins, and the one eviction loop that serves them.

Capacity rule: ``used + reserved <= capacity`` at all times. A write reserves
its object size first, evicting least-recently-used unpinned chunks if it
must; if it still cannot fit it fails with :class:`StoreFull`, never
exceeding the limit. Above the high watermark, eviction runs down to the low
watermark. A tenant's quota works the same way on the tenant's own chunks
(:class:`QuotaExceeded`), never evicting another tenant's.

:class:`Capacity` is the only writer of its counters (``used``, ``reserved``,
the tenants' reserved shares, the pins): the index inserts that add bytes go
through :meth:`Capacity.admit` (a reservation turns into usage in the same
step), every removal through :meth:`Capacity.removed`, a rebuilt index
through :meth:`Capacity.rebuilt`. On a shared root the evictor lease's
holder evicts from :meth:`Capacity.evictor_tick`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from ..errors import QuotaExceeded, StoreFull
from ..layouts import v1
from .api import ChunkRecord, Reservation
from .state import StoreState

#: ``drop(tenant, key, reason=..., lease_epoch=...)``: removal.py's, for evictions.
DropFn = Callable[..., bool]


@dataclass(frozen=True)
class _Scope:
    """What a reservation must fit under: the store's capacity (``tenant`` None)
    or one tenant's quota. Eviction frees room within the scope only."""

    cap: Capacity
    limit: int
    tenant: str | None = None

    def accounted_locked(self) -> int:
        c = self.cap
        if self.tenant is None:
            if c.shared is not None:
                # A shared root's capacity is the root's: this node may write
                # what the evictor granted it (shared-root-v1.md §4.1).
                return self.limit - c.shared.remaining_locked() + c._reserved
            return c._used + c._reserved
        # The index's usage is read under the lock that every insert takes,
        # so two writers cannot both fit into the same room.
        return c.index.usage(self.tenant).bytes + c._tenant_reserved.get(self.tenant, 0)

    def full(self, nbytes: int) -> StoreFull:
        c = self.cap
        if self.tenant is None:
            return StoreFull(nbytes, self.limit, c._used)
        return QuotaExceeded(self.tenant, nbytes, self.limit, c.index.usage(self.tenant).bytes)

    @property
    def slack(self) -> int:
        """Evicted beyond the need, so that quota eviction runs in batches (down to
        the quota's low watermark); the store's own batches come from after_write."""
        if self.tenant is None:
            return 0
        return int(self.limit * (1 - self.cap.config.low_watermark))

    @property
    def reason(self) -> str:
        return "evict" if self.tenant is None else "quota"

    def candidates(self) -> Iterator[ChunkRecord]:
        """The scope's chunks, least recently used first."""
        c = self.cap
        if self.tenant is None:
            return c.index.lru()
        return iter(sorted(c.index.records(self.tenant), key=lambda r: r.last_access_ns))


class Capacity:
    """The byte accounting of one store (see the module docstring)."""

    def __init__(self, state: StoreState) -> None:
        self._state = state
        self.config = state.config
        self.index = state.index
        self.shared = state.shared
        self._mu = state.mu
        self._used = state.index.usage().bytes
        self._reserved = 0
        self._tenant_reserved: dict[str, int] = {}
        self._pins: dict[tuple[str, bytes], int] = {}
        self._drop: DropFn | None = None

    def evicts_with(self, drop: DropFn) -> None:
        """How an eviction removes a chunk (removal.py's ``drop``), given once at
        open: the removal part is built on this one."""
        self._drop = drop

    # ------------------------------------------------------------ the counters

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

    def tenant_accounted(self, tenant: str) -> int:
        """The tenant's stored + reserved bytes (what its quota bounds)."""
        with self._mu:
            return self.index.usage(tenant).bytes + self._tenant_reserved.get(tenant, 0)

    def admit(
        self,
        recs: Sequence[ChunkRecord],
        reservations: Sequence[Reservation | None] = (),
        generations: Sequence[int] = (),
    ) -> list[bool | None]:
        """Index ``recs`` (those not yet indexed) and count their bytes as used,
        in one step under the lock: a reservation given for a record
        (``reservations[i]``) turns into usage at once, so that used + reserved
        neither dips (letting another writer in) nor counts twice. Per record,
        whether it was new; None where ``generations[i]`` is given and its
        tenant was purged or revoked since (not indexed). The generation is
        compared under the lock, where a purge bumps it (removal.py
        ``stop_tenant``): a record is in before a purge looks, or never."""
        held = list(reservations) or [None] * len(recs)
        gens: list[int | None] = list(generations) or [None] * len(recs)
        with self._mu:
            current = self._state.load_gens.current
            late = [
                g is not None and current(r.tenant) != g for r, g in zip(recs, gens, strict=True)
            ]
            live = [r for r, lt in zip(recs, late, strict=True) if not lt]
            new_live = iter(self.index.put_each(live) if live else [])
            out: list[bool | None] = [None if lt else next(new_live) for lt in late]
            for rec, res, new in zip(recs, held, out, strict=True):
                if new:
                    self._used += rec.size
                    if res is not None:
                        self._commit_locked(res)
            if self.shared is not None:
                self.shared.persist_locked()  # counted with their records
        return out

    def admit_one(
        self,
        rec: ChunkRecord,
        reservation: Reservation | None = None,
        generation: int | None = None,
    ) -> bool | None:
        """:meth:`admit` of one record (another writer's object, a journaled
        store, a published lease): whether it was new; None if its tenant was
        purged or revoked since ``generation`` (not indexed)."""
        with self._mu:
            if generation is not None and self._state.load_gens.current(rec.tenant) != generation:
                return None
            new = self.index.put(rec)
            if new:
                self._used += rec.size
                if reservation is not None:
                    self._commit_locked(reservation)
                if self.shared is not None:
                    self.shared.persist_locked()  # counted with its record
        return new

    def removed(self, nbytes: int) -> None:
        """A chunk of ``nbytes`` left the index (removal.py)."""
        with self._mu:
            self._used -= nbytes

    def rebuilt(self, recs: Sequence[ChunkRecord]) -> None:
        """The index rebuilt from the files holds exactly ``recs`` (fsck --repair)."""
        with self._mu:
            self.index.clear()
            self.index.put_many(recs)
            self._used = self.index.usage().bytes

    def _commit_locked(self, res: Reservation) -> None:
        """A reservation's bytes just became usage (the caller holds the lock
        and has added them to ``used``); on a shared root the caller persists
        the accounting before it releases the lock."""
        if res._claim():
            self._unreserve_locked(res.tenant, res.nbytes)
            if self.shared is not None:
                self.shared.committed_locked(res.nbytes, res.intent)

    def _unreserve(self, res: Reservation) -> None:
        """A reservation's ``give_back``: its bytes return, its intent is forgotten."""
        with self._mu:
            self._unreserve_locked(res.tenant, res.nbytes)
            if res.intent is not None and self.shared is not None:
                self.shared.forget_locked(res.intent)

    def _intend(self, res: Reservation, key: bytes) -> None:
        """A reservation's ``record_intent`` on a shared root (:meth:`Reservation.intend`)."""
        shared = self.shared
        assert shared is not None
        with self._mu:
            shared.intend_locked(res.tenant, key, res.nbytes)
            res.intent = (res.tenant, key)

    def persist_shared(self) -> None:
        """Keep a shared root's grant accounting in the index (a no-op when unchanged)."""
        if self.shared is not None:
            with self._mu:
                self.shared.persist_locked()

    def _unreserve_locked(self, tenant: str, n: int) -> None:
        self._reserved -= n
        self._drop_tenant_share_locked(tenant, n)

    def _drop_tenant_share_locked(self, tenant: str, n: int) -> None:
        left = self._tenant_reserved.get(tenant, 0) - n
        if left > 0:
            self._tenant_reserved[tenant] = left
        else:
            self._tenant_reserved.pop(tenant, None)

    def _add_locked(self, scope: _Scope, nbytes: int) -> None:
        if scope.tenant is None:
            self._reserved += nbytes
        else:
            self._tenant_reserved[scope.tenant] = (
                self._tenant_reserved.get(scope.tenant, 0) + nbytes
            )

    # ------------------------------------------------------------ reservations

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
        return Reservation(
            tenant, nbytes, self._unreserve, self._intend if self.shared is not None else None
        )

    def reserve_chunk(
        self, tenant: str, lengths: Sequence[int], *, encrypt: bool, quota: int | None = None
    ) -> Reservation:
        """:meth:`reserve` the object of one chunk of these layer lengths: the store,
        not its caller, knows what an object of them costs on disk."""
        return self.reserve(tenant, v1.object_size(lengths, encrypt), quota=quota)

    def _hold(self, scope: _Scope, nbytes: int) -> None:
        """Add ``nbytes`` to the scope's reserved bytes once they fit under its limit,
        evicting the scope's LRU unpinned chunks to make room; else ``scope.full``."""
        if nbytes > scope.limit:
            raise scope.full(nbytes)
        if scope.tenant is None and self.shared is not None:
            self._hold_shared(scope, nbytes)
            return
        for _attempt in range(1000):
            with self._mu:
                over = scope.accounted_locked() + nbytes - scope.limit
                if over <= 0:
                    self._add_locked(scope, nbytes)
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
                    self._add_locked(scope, nbytes)
                    return
                if not self._evictable_locked(scope):
                    # The rest of the room is pinned or reserved by writes in flight.
                    raise scope.full(nbytes)
        raise scope.full(nbytes)

    def _hold_shared(self, scope: _Scope, nbytes: int) -> None:
        """:meth:`_hold` of a shared root's capacity: within this node's grant or
        not at all; the root's evictor makes room."""
        shared = self.shared
        assert shared is not None
        for attempt in (0, 1):
            with self._mu:
                if scope.accounted_locked() + nbytes > scope.limit:
                    shared.refill_own_locked(self._used, scope.limit, self._reserved)
                if scope.accounted_locked() + nbytes <= scope.limit:
                    self._add_locked(scope, nbytes)
                    return
                excess = self._used + nbytes - int(scope.limit * self.config.low_watermark)
            if attempt or shared.lease.held is None or excess <= 0:
                break
            self._evict(scope, excess)  # the holder only; each removal fenced
        raise scope.full(nbytes)

    # ---------------------------------------------------------------- eviction

    def _may_evict(self) -> bool:
        """On a shared root only the evictor lease's holder removes, and only
        while its lease is fenced in (shared-root-v1.md §4)."""
        return self._eviction_epoch() is not None

    def _eviction_epoch(self) -> int | None:
        """:meth:`_may_evict`, with the lease epoch the removal is made under (0
        off a shared root); None when this node may not evict now."""
        return 0 if self.shared is None else self.shared.lease.fenced_epoch()

    def _evictable_locked(self, scope: _Scope) -> bool:
        return any(not self._pins.get((r.tenant, r.chunk_key)) for r in scope.candidates())

    def _evict(self, scope: _Scope, nbytes: int) -> int:
        """The one eviction loop: evict the scope's unpinned chunks, oldest
        access first, until ``nbytes`` are freed; returns the bytes freed."""
        drop = self._drop
        assert drop is not None, "evicts_with() is called at open"
        self._state.access.flush()
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
            if drop(rec.tenant, rec.chunk_key, reason=scope.reason, lease_epoch=epoch):
                freed += rec.size
                self._state.counters.evicted()
        return freed

    def after_write(self) -> None:
        """Above the high watermark, evict down to the low one (not on a shared
        root: its evictor works from :meth:`evictor_tick`)."""
        cap = self.config.capacity_bytes
        if cap is None or self.shared is not None:
            return
        if self._used + self._reserved > cap * self.config.high_watermark:
            target = int(cap * self.config.low_watermark)
            self._evict(_Scope(self, cap), self._used + self._reserved - target)

    def evictor_tick(self) -> bool:
        """Renew or take a shared root's evictor lease; as holder, evict the root
        down to its low watermark. Whether this node holds the role."""
        sh = self.shared
        if sh is None:
            return False
        held = sh.lease.tick()
        cap = self.config.capacity_bytes
        to_free = 0
        with self._mu:
            before = dict(sh.lease.grants)
            if held and cap is not None:
                to_free = sh.issue_locked(
                    self._used,
                    cap,
                    self.config.high_watermark,
                    self.config.low_watermark,
                    now=time.monotonic(),
                    reserved=self._reserved,
                )
            else:
                sh.refresh_view_locked()
        if held and sh.lease.grants != before:
            sh.lease.publish()  # the new grants, on file before they are used
            held = sh.lease.held is not None
            with self._mu:
                sh.refresh_view_locked()
        if to_free and cap is not None:
            self._evict(_Scope(self, cap), to_free)  # each removal fenced
        return held

    # -------------------------------------------------------------------- pins

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


__all__ = ["Capacity", "DropFn"]
