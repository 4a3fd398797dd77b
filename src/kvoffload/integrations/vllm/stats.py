"""The connector's numbers in vLLM's KV-connector stats (``get_kv_connector_stats``).

Each worker counts, per logging interval, the chunks it loaded and the ones
that failed to load (a miss after a positive lookup: evicted, purged,
corrupt, sidecar gone), and the chunks it saved and failed to save. vLLM
sums the workers' counts (:meth:`KVOffloadStats.aggregate`) and logs the
interval's totals (:meth:`KVOffloadStats.reduce`).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

#: The counters, in the order vLLM's log line shows them.
FIELDS = ("chunks_loaded", "chunks_load_failed", "chunks_saved", "chunks_save_failed")


class KVOffloadStats(KVConnectorStats):  # type: ignore[misc]
    """Counts of one interval; ``data`` maps each of :data:`FIELDS` to an int."""

    def reset(self) -> None:
        self.data = dict.fromkeys(FIELDS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVOffloadStats:
        for name in FIELDS:
            self.data[name] = int(self.data.get(name, 0)) + int(other.data.get(name, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: int(self.data.get(name, 0)) for name in FIELDS}

    def is_empty(self) -> bool:
        return not any(self.data.get(name, 0) for name in FIELDS)

    @classmethod
    def from_data(cls, data: dict[str, Any] | None) -> KVOffloadStats:
        return cls(data={k: int(v) for k, v in (data or {}).items() if k in FIELDS})


__all__ = ["FIELDS", "KVOffloadStats"]
