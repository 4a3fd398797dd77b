"""The admin verbs (protocol-v1.md §5.11, §5.12, §5.16-§5.20, §5.31), and what
``kvoffload inspect`` and ``ls`` show, computed the same way offline and by the sidecar.

The CLI opens the store in-process when no sidecar runs; while one runs it
asks the sidecar, whose :class:`Admin` verbs call these same functions on its
own store. One function per view, so that both paths print the same rows and
the same ``--json``. Every admin verb needs the admin right (§6).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvoffload.errors import ContractError, Reject
from kvoffload.protocol import (
    DropCache,
    DropCacheReply,
    ErrorCode,
    Fsck,
    FsckReply,
    InspectReply,
    Invalidate,
    InvalidateReply,
    Ls,
    LsReply,
    Namespaces,
    NamespacesReply,
    Purge,
    PurgeOlder,
    PurgeOlderReply,
    PurgeReply,
    Reply,
)

from ..units import age_cutoff_ns
from .ports import StoreAPI
from .service import Service, plainify

#: Most ``ls`` rows in one reply: a row packs to ~250 bytes, far below MAX_FRAME.
LS_PAGE = 1000


def inspect_report(store: StoreAPI, store_root: Path | str) -> dict[str, Any]:
    """Store id, layout version, capacity, usage per tenant and namespace."""
    tenants = store.tenant_usage()
    return {
        "store_root": str(store_root),
        "store_id": store.layout.store_id,
        "layout_version": store.layout.version,
        "capacity_bytes": store.config.capacity_bytes,
        "used_bytes": store.used_bytes,
        "chunks": store.chunk_count(),
        "tenants": {
            t: {
                "chunks": u.count,
                "bytes": u.bytes,
                "namespaces": {
                    ns.hex(): {"chunks": nu.count, "bytes": nu.bytes}
                    for ns, nu in sorted(store.namespace_usage(t).items())
                },
            }
            for t, u in sorted(tenants.items())
        },
        "tenants_with_keys": sorted(store.tenants()),
        "tenants_with_unreadable_keys": store.key_problems(),
        # A shared root: this node, the nodes it follows and the evictor (None: not shared).
        "shared": store.shared_info(),
    }


def ls_rows(
    store: StoreAPI,
    *,
    tenant: str | None = None,
    namespace: bytes | None = None,
    older_than_s: float | None = None,
    newer_than_s: float | None = None,
    skip: int = 0,
    limit: int = 0,
    now_ns: int | None = None,
) -> tuple[list[dict[str, Any]], bool]:
    """Index records matching the filters, after ``skip`` matches, at most ``limit`` (0: all).

    Returns the rows and whether more matches follow.
    """
    now = time.time_ns() if now_ns is None else now_ns
    old_cut = age_cutoff_ns(now, older_than_s) if older_than_s is not None else None
    new_cut = age_cutoff_ns(now, newer_than_s) if newer_than_s is not None else None
    rows: list[dict[str, Any]] = []
    seen = 0
    for rec in store.chunks(tenant=tenant, namespace=namespace):
        if old_cut is not None and rec.created_ns >= old_cut:
            continue
        if new_cut is not None and rec.created_ns < new_cut:
            continue
        seen += 1
        if seen <= skip:
            continue
        if limit and len(rows) >= limit:
            return rows, True
        rows.append(
            {
                "tenant": rec.tenant,
                "key": rec.chunk_key.hex(),
                "namespace": rec.namespace.hex(),
                "bytes": rec.size,
                "layers": rec.num_layers,
                "sealed": rec.key_epoch > 0,
                "age_s": round((now - rec.created_ns) / 1e9, 1),
            }
        )
    return rows, False


#: Tiers a purge can never reach: the engines' own prefix caches (HBM and their
#: CPU offload), which ``kvoffload purge --engine URL`` resets through vLLM's
#: ``POST /reset_prefix_cache`` (for every tenant of that engine).
TIERS_OUTSIDE: tuple[str, ...] = ("engine_gpu_prefix_cache", "engine_cpu_cache")

#: What the daemon itself reaches in a purge, beyond the store: its loads in
#: flight of the tenant (cancelled before their next layer), every
#: connection's leased files and pending stores (``Service.purged``).
DAEMON_TIERS: tuple[str, ...] = ("loads_in_flight", "direct_leases", "pending_stores")


def purge_tiers(
    store_tiers: Sequence[str], *, events: bool, daemon: bool = True
) -> dict[str, tuple[str, ...]]:
    """The ``tiers`` of a purge's report (protocol-v1.md §5.11).

    ``reached``: the store's tiers as its :class:`~kvoffload.store.api.PurgeReport`
    names them (those it removed something of the tenant from, in that order:
    the code that removed says so), then, with ``daemon`` (a sidecar served the
    purge), the daemon's own (:data:`DAEMON_TIERS`) and the KV-event feed
    (``BlockRemoved`` per published chunk) when it runs.
    """
    reached = list(store_tiers)
    if daemon:
        reached += DAEMON_TIERS
        if events:
            reached.append("events")
    return {"reached": tuple(reached), "outside": TIERS_OUTSIDE}


#: Namespace rows per reply of ``namespaces`` / ``invalidate`` (§5.20): a row with
#: its contract is under 1 KiB, so a page stays well inside MAX_FRAME.
NAMESPACES_PAGE = 500


class Admin:
    """The admin verbs of one connection; ``is_admin`` and ``actor`` come from its
    session (the peer's right under the current policy, its credentials)."""

    def __init__(
        self, service: Service, is_admin: Callable[[], bool], actor: Callable[[], dict[str, Any]]
    ) -> None:
        self.service = service
        self._is_admin = is_admin
        self._actor = actor

    def _admin(self, verb: str) -> StoreAPI:
        if not self._is_admin():
            raise Reject(ErrorCode.FORBIDDEN, f"{verb} needs the admin right")
        return self.service.store

    def purge(self, req: Purge) -> Reply:
        """§5.11; the tenant need not be named in ``hello``.

        A whole-tenant purge replies once the tenant's chunks are out of the
        index too (its keys are destroyed first), so that the next answer of
        this sidecar no longer counts them.
        """
        store = self._admin("purge")
        svc = self.service
        report = store.purge(req.tenant, req.namespace)  # whole tenant: waited for
        svc.purged(req.tenant, req.namespace)
        if not req.tiers:
            return PurgeReply(report.removed)
        tiers = purge_tiers(report.tiers, events=svc.events is not None)
        return PurgeReply(report.removed, tiers)

    def fsck(self, req: Fsck) -> Reply:
        """§5.12."""
        store = self._admin("fsck")
        report = store.fsck(req.repair, verify_data=req.verify_data)
        out = plainify(report.to_dict())
        out["verified_data"] = bool(req.verify_data)
        return FsckReply(out)

    def inspect(self) -> Reply:
        """§5.16: what ``kvoffload inspect`` prints."""
        store = self._admin("inspect")
        return InspectReply(plainify(inspect_report(store, store.config.root)))

    def ls(self, req: Ls) -> Reply:
        """§5.17: one page of what ``kvoffload ls`` prints."""
        store = self._admin("ls")
        limit = LS_PAGE if req.limit == 0 else min(req.limit, LS_PAGE)
        rows, more = ls_rows(
            store,
            tenant=req.tenant,
            namespace=req.namespace,
            older_than_s=req.older_than_s,
            newer_than_s=req.newer_than_s,
            skip=req.skip,
            limit=limit,
        )
        return LsReply({"chunks": plainify(rows), "more": more})

    def purge_older(self, req: PurgeOlder) -> Reply:
        """§5.18: remove chunks older than ``older_than_s``, of one tenant or all."""
        store = self._admin("purge_older")
        return PurgeOlderReply(store.purge_older_than(req.older_than_s, req.tenant))

    def invalidate(self, req: Invalidate) -> Reply:
        """§5.20: purge the namespaces built under the selected contract field."""
        store = self._admin("invalidate")
        actor = {**self._actor(), "verb": "invalidate"}
        try:
            report = store.invalidate(
                req.selector(), tenant=req.tenant, dry_run=req.dry_run, actor=actor
            )
        except ContractError as exc:
            raise Reject(ErrorCode.BAD_REQUEST, str(exc)) from None
        # The counts cover everything; the lists are cut to fit a frame (§5.20).
        for key in ("namespaces", "unknown_contract"):
            rows = report[key]
            report[f"{key}_total"] = len(rows)
            report[key] = rows[:NAMESPACES_PAGE]
        return InvalidateReply(plainify(report))

    def namespaces(self, req: Namespaces) -> Reply:
        """§5.20: the namespaces with their contract fields, sizes and ages."""
        store = self._admin("namespaces")
        rows = store.namespaces_report(req.tenant)
        page = rows[req.skip : req.skip + NAMESPACES_PAGE]
        more = len(rows) > req.skip + NAMESPACES_PAGE
        return NamespacesReply({"namespaces": plainify(page), "more": more})

    def drop_cache(self, req: DropCache) -> Reply:
        """§5.31: empty the RAM tier; the next load of every chunk reads its file."""
        dropped, held = self._admin("drop_cache").drop_cache()
        return DropCacheReply(dropped, held)


__all__ = [
    "DAEMON_TIERS",
    "LS_PAGE",
    "NAMESPACES_PAGE",
    "TIERS_OUTSIDE",
    "Admin",
    "inspect_report",
    "ls_rows",
    "purge_tiers",
]
