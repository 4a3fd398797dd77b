"""Read-only views of a store: what the CLI's ``inspect``, ``ls`` and
``namespaces`` and the sidecar's ``stats`` show (index records, usage per
tenant and namespace, contract fields, counters). Nothing here writes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from .api import ChunkRecord, Usage
from .capacity import Capacity
from .contracts import contract_fields
from .state import StoreState


class Views:
    """The read-only views of one store (see the module docstring)."""

    def __init__(self, state: StoreState, capacity: Capacity) -> None:
        self._state = state
        self._capacity = capacity

    def chunks(
        self, tenant: str | None = None, namespace: bytes | None = None
    ) -> Iterator[ChunkRecord]:
        """Index records (no data I/O), of one tenant and/or namespace, in key order."""
        return self._state.index.records(tenant=tenant, namespace=namespace)

    def chunk_count(self) -> int:
        """How many chunks the index holds."""
        return self._state.index.count()

    def tenant_usage(self) -> dict[str, Usage]:
        """Stored chunks and bytes per tenant that has at least one chunk."""
        return self._state.index.tenants()

    def namespace_usage(self, tenant: str) -> dict[bytes, Usage]:
        """Stored chunks and bytes per namespace of ``tenant``."""
        return self._state.index.namespaces(tenant)

    def tenants(self) -> list[str]:
        """Tenants with keys."""
        return self._state.keyring.tenants()

    def key_problems(self) -> dict[str, str]:
        """Tenants whose key file cannot be read, with why: their chunks miss."""
        return self._state.keyring.problems()

    def shared_info(self) -> dict[str, Any] | None:
        """This node's view of the shared root (None when the root is not shared)."""
        shared = self._state.shared
        return None if shared is None else shared.describe()

    def namespaces_report(
        self, tenant: str | None = None, *, ages: bool = True
    ) -> list[dict[str, Any]]:
        """Every namespace with chunks (of one tenant or all), in tenant and
        fingerprint order: its contract fields (None: unknown, never registered),
        chunks, bytes and — with ``ages``, which reads every record of the
        tenants — the ages of its oldest and newest chunk in seconds."""
        index = self._state.index
        now = time.time_ns()
        tenants = [tenant] if tenant is not None else sorted(index.tenants())
        rows: list[dict[str, Any]] = []
        for t in tenants:
            spans = _created_spans(index.records(tenant=t)) if ages else {}
            for ns, usage in sorted(index.namespaces(t).items()):
                if not usage.count:
                    continue
                c = self._state.contracts.get(t, ns)
                row: dict[str, Any] = {
                    "tenant": t,
                    "namespace": ns.hex(),
                    "chunks": usage.count,
                    "bytes": usage.bytes,
                }
                if ages:
                    oldest, newest = spans.get(ns, [now, now])
                    row["oldest_age_s"] = round(max(0, now - oldest) / 1e9, 3)
                    row["newest_age_s"] = round(max(0, now - newest) / 1e9, 3)
                row["contract"] = None if c is None else contract_fields(c)
                rows.append(row)
        return rows

    def stats(self) -> dict[str, Any]:
        st = self._state
        c = st.counters
        return {
            "store_id": st.layout.store_id,
            "layout_version": st.layout.version,
            "capacity_bytes": st.config.capacity_bytes,
            "used_bytes": self._capacity.used_bytes,
            "reserved_bytes": self._capacity.reserved_bytes,
            "chunks": st.index.count(),
            "tenants": len(st.keyring.tenants()),
            "hits": c.hits,
            "misses": c.misses,
            "puts": c.puts,
            "put_exists": c.put_exists,
            "evictions": c.evictions,
            "corrupt": c.corrupt,
            "bytes_in": c.bytes_in,
            "bytes_out": c.bytes_out,
            "durability": str(st.config.durability),
            "io": st.io.describe(),
            "shared": self.shared_info(),
            "ram_tier": None if st.ram is None else st.ram.stats(),
        }


def _created_spans(recs: Iterator[ChunkRecord]) -> dict[bytes, list[int]]:
    """namespace -> [oldest, newest] creation time of its chunks."""
    spans: dict[bytes, list[int]] = {}
    for rec in recs:
        span = spans.setdefault(rec.namespace, [rec.created_ns, rec.created_ns])
        span[0] = min(span[0], rec.created_ns)
        span[1] = max(span[1], rec.created_ns)
    return spans


__all__ = ["Views"]
