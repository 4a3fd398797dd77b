"""What ``kvoffload inspect`` and ``ls`` show, computed the same way offline and by the sidecar.

The CLI opens the store in-process when no sidecar runs; while one runs it
asks the sidecar (protocol-v1.md §5.16, §5.17), whose session calls these
same functions on its own store. One function per view, so that both paths
print the same rows and the same ``--json``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .ports import StoreViewsAPI

#: Most ``ls`` rows in one reply: a row packs to ~250 bytes, far below MAX_FRAME.
LS_PAGE = 1000


def inspect_report(store: StoreViewsAPI, store_root: Path | str) -> dict[str, Any]:
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


def age_cutoff_ns(now_ns: int, age_s: float) -> int:
    """``now_ns`` less ``age_s`` seconds: chunks created before it are older than
    ``age_s``. An age reaching back past the Unix epoch (1e300 s, say: any
    finite number is a valid age, protocol-v1.md §5.17) is clamped there, so
    that nothing is older and everything is newer."""
    back = age_s * 1e9
    return now_ns - int(back) if back < now_ns else 0


def ls_rows(
    store: StoreViewsAPI,
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


__all__ = ["LS_PAGE", "age_cutoff_ns", "inspect_report", "ls_rows"]


#: Tiers a purge can never reach: the engines' own prefix caches (HBM and their
#: CPU offload), which ``kvoffload purge --engine URL`` resets through vLLM's
#: ``POST /reset_prefix_cache`` (for every tenant of that engine).
TIERS_OUTSIDE: tuple[str, ...] = ("engine_gpu_prefix_cache", "engine_cpu_cache")


def purge_tiers(store: object, *, events: bool, whole: bool = True) -> dict[str, tuple[str, ...]]:
    """The ``tiers`` of a purge's report (protocol-v1.md §5.11, revision 7).

    ``reached``: this node's index and object files, the tenant's data keys
    (a whole-tenant purge: crypto-erase), the loads in flight (cancelled),
    the direct path's leased files, open connections' pending stores, the
    KV-event feed (``BlockRemoved`` per published chunk) when it runs, and
    the other nodes of a shared root (a journal record they apply).
    """
    reached = ["index", "objects"]
    if whole:
        reached.append("keys")
    reached += ["loads_in_flight", "direct_leases", "pending_stores"]
    if getattr(store, "has_ram_tier", False):
        reached.append("ram_tier")
    if events:
        reached.append("events")
    info = getattr(store, "shared_info", None)
    if callable(info) and info() is not None:
        reached.append("shared_nodes")
    return {"reached": tuple(reached), "outside": TIERS_OUTSIDE}
