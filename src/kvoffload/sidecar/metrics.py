"""Prometheus metrics of one sidecar.

Request-path numbers (latency per verb, errors by code) are recorded as they
happen; store numbers (hits, misses, bytes, evictions, usage) are read from
the store's counters at scrape time by a custom collector, so the hot path
pays for one histogram observation per request and nothing else.

The HTTP endpoint is optional and binds to 127.0.0.1 unless told otherwise:
metrics name tenants' usage and must not leak off the node by default.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

# Lookups are sub-millisecond; 32 MiB loads take tens of milliseconds.
_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip

#: store.stats() key → (metric name, help, kind)
_STORE_METRICS: dict[str, tuple[str, str, str]] = {
    "hits": ("kvoffload_chunk_hits", "Chunks read and verified", "counter"),
    "misses": ("kvoffload_chunk_misses", "Chunk reads that were misses", "counter"),
    "puts": ("kvoffload_chunks_stored", "Chunks written", "counter"),
    "put_exists": ("kvoffload_chunks_already_present", "Writes of present chunks", "counter"),
    "evictions": ("kvoffload_evictions", "Chunks evicted for capacity", "counter"),
    "corrupt": ("kvoffload_corrupt_objects", "Objects that failed verification", "counter"),
    "bytes_in": ("kvoffload_bytes_in", "Payload bytes stored", "counter"),
    "bytes_out": ("kvoffload_bytes_out", "Payload bytes loaded", "counter"),
    "used_bytes": ("kvoffload_used_bytes", "Bytes of objects on disk", "gauge"),
    "reserved_bytes": ("kvoffload_reserved_bytes", "Bytes reserved by writes", "gauge"),
    "chunks": ("kvoffload_chunks", "Chunks in the index", "gauge"),
}


class _StoreCollector(Collector):
    def __init__(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        try:
            stats = self._stats()
        except Exception:  # a closing store must not break the scrape
            return []
        out: list[Metric] = []
        for key, (name, doc, kind) in _STORE_METRICS.items():
            value = stats.get(key)
            if not isinstance(value, int | float):
                continue
            if kind == "counter":
                out.append(CounterMetricFamily(name, doc, value=value))
            else:
                out.append(GaugeMetricFamily(name, doc, value=value))
        cap = stats.get("capacity_bytes")
        if isinstance(cap, int):
            out.append(GaugeMetricFamily("kvoffload_capacity_bytes", "Byte limit", value=cap))
        return out


class Metrics:
    def __init__(self, store_stats: Callable[[], Mapping[str, Any]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.latency = Histogram(
            "kvoffload_request_seconds",
            "Time from a request's arrival to its reply, per verb",
            ["verb"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.errors = Counter(
            "kvoffload_errors",
            "Error replies and dropped connections, by protocol error code",
            ["code"],
            registry=self.registry,
        )
        self.connections = Counter(
            "kvoffload_connections", "Accepted connections", registry=self.registry
        )
        if store_stats is not None:
            self.registry.register(_StoreCollector(store_stats))
        self._http: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def observe(self, verb: str, seconds: float) -> None:
        self.latency.labels(verb=verb).observe(seconds)

    def error(self, code: str) -> None:
        self.errors.labels(code=code).inc()

    def summary(self) -> dict[str, Any]:
        """Request counts, mean latency per verb and errors by code, for the stats verb."""
        requests: dict[str, dict[str, float | int]] = {}
        errors: dict[str, int] = {}
        connections = 0
        for metric in self.registry.collect():
            for sample in metric.samples:
                if sample.name == "kvoffload_request_seconds_count":
                    requests.setdefault(sample.labels["verb"], {})["count"] = int(sample.value)
                elif sample.name == "kvoffload_request_seconds_sum":
                    requests.setdefault(sample.labels["verb"], {})["seconds"] = sample.value
                elif sample.name == "kvoffload_errors_total":
                    errors[sample.labels["code"]] = int(sample.value)
                elif sample.name == "kvoffload_connections_total":
                    connections = int(sample.value)
        return {"requests": requests, "errors": errors, "connections_total": connections}

    def render(self) -> bytes:
        """The text exposition format (what `kvoffload stats` and /metrics return)."""
        return bytes(generate_latest(self.registry))

    def start_http(self, host: str, port: int) -> int:
        """Serve /metrics; returns the bound port (``port=0`` is refused: 0 means off)."""
        if port <= 0:
            raise ValueError("metrics port must be positive")
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        self._http, self._thread = server, thread
        return int(server.server_port)

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
