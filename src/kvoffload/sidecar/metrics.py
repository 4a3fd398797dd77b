"""Prometheus metrics of one sidecar.

Request-path numbers are recorded as they happen: errors by code in a
Prometheus counter (an error is rare), the latency of every request in plain
numbers (one list item and one float added, no lock: the event loop alone
records them), folded into the ``kvoffload_request_seconds`` histogram at
scrape time. Store numbers (hits, misses, bytes, evictions, usage) are read
from the store's counters at scrape time too, by a custom collector, so the
hot path pays for one bucket count per request and nothing else.

The HTTP endpoint is optional and binds to 127.0.0.1 unless told otherwise:
metrics name tenants' usage and must not leak off the node by default. It
serves ``/metrics`` (the text exposition), ``/healthz`` (200 while the
process answers), ``/readyz`` (200 once the socket is served, 503 before and
while draining) and 404 for every other path.

Names: counters end in ``_total`` and a unit comes before it
(``kvoffload_in_bytes_total``); gauges end in their unit
(``kvoffload_used_bytes``). Per-tenant usage is labelled by ``tenant``:
``kvoffload_tenant_used_bytes``, ``kvoffload_tenant_chunks``,
``kvoffload_tenant_quota_bytes`` (absent for a tenant without a quota).
``kvoffload_build_info`` (value 1) carries the version, and the process
collector adds ``process_*`` (CPU, memory, open fds).
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from itertools import accumulate
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Info,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

#: tenant → (chunks, bytes, quota bytes or None)
TenantUsage = Callable[[], Mapping[str, tuple[int, int, int | None]]]

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
    "bytes_in": ("kvoffload_in_bytes", "Payload bytes stored", "counter"),
    "bytes_out": ("kvoffload_out_bytes", "Payload bytes loaded", "counter"),
    "used_bytes": ("kvoffload_used_bytes", "Bytes of objects on disk", "gauge"),
    "reserved_bytes": ("kvoffload_reserved_bytes", "Bytes reserved by writes", "gauge"),
    "chunks": ("kvoffload_chunks", "Chunks in the index", "gauge"),
}


class _TenantCollector(Collector):
    def __init__(self, usage: TenantUsage) -> None:
        self._usage = usage

    def collect(self) -> Iterable[Metric]:
        try:
            usage = self._usage()
        except Exception:  # a closing store must not break the scrape
            return []
        used = GaugeMetricFamily(
            "kvoffload_tenant_used_bytes", "Bytes of the tenant's chunks", labels=["tenant"]
        )
        chunks = GaugeMetricFamily(
            "kvoffload_tenant_chunks", "Chunks of the tenant", labels=["tenant"]
        )
        quota = GaugeMetricFamily(
            "kvoffload_tenant_quota_bytes", "The tenant's quota (policy)", labels=["tenant"]
        )
        for tenant, (n, nbytes, q) in sorted(usage.items()):
            used.add_metric([tenant], nbytes)
            chunks.add_metric([tenant], n)
            if q is not None:
                quota.add_metric([tenant], q)
        return [used, chunks, quota]


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
        out.append(
            GaugeMetricFamily(
                "kvoffload_capacity_bytes",
                "Byte limit of the store (0: none)",
                value=cap if isinstance(cap, int) else 0,
            )
        )
        return out


class _Latency(Collector):
    """``kvoffload_request_seconds``: per verb, a count per bucket and the sum, kept
    as plain numbers by :meth:`observe` and made a histogram at scrape time.

    Written by one thread (the event loop's, where every request is answered),
    read by the scrape's: a count is a list item, copied whole (one C call,
    under the GIL) before it is summed, so a scrape sees a consistent count."""

    NAME = "kvoffload_request_seconds"
    HELP = "Time from a request's arrival to its reply, per verb"

    def __init__(self) -> None:
        #: verb → [count of bucket 0, ..., of +Inf, sum of seconds]
        self._verbs: dict[str, list[float]] = {}
        #: verb → when it was first observed (the histogram's ``_created``)
        self._created: dict[str, float] = {}
        self._bounds = (*map(floatToGoString, _BUCKETS), "+Inf")

    def observe(self, verb: str, seconds: float) -> None:
        counts = self._verbs.get(verb)
        if counts is None:
            self._created.setdefault(verb, time.time())
            counts = self._verbs.setdefault(verb, [0] * (len(_BUCKETS) + 1) + [0.0])
        counts[bisect_left(_BUCKETS, seconds)] += 1  # bucket le=b counts x <= b
        counts[-1] += seconds

    def collect(self) -> Iterable[Metric]:
        hist = HistogramMetricFamily(self.NAME, self.HELP, labels=["verb"])
        created = GaugeMetricFamily(f"{self.NAME}_created", self.HELP, labels=["verb"])
        for verb, counts in list(self._verbs.items()):
            snap = list(counts)
            hist.add_metric([verb], list(zip(self._bounds, accumulate(snap[:-1]), strict=True)),
                            snap[-1])  # fmt: skip
            created.add_metric([verb], self._created[verb])
        return [hist, created]


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class Metrics:
    def __init__(
        self,
        store_stats: Callable[[], Mapping[str, Any]] | None = None,
        tenant_usage: TenantUsage | None = None,
    ) -> None:
        from .. import __version__

        self.registry = CollectorRegistry(auto_describe=True)
        #: /readyz answers 200 while this is True (set by the daemon).
        self.ready = False
        Info("kvoffload_build", "kvoffload version", registry=self.registry).info(
            {"version": __version__}
        )
        ProcessCollector(registry=self.registry)
        self._latency = _Latency()
        self.registry.register(self._latency)
        #: Record one request's latency: ``observe(verb, seconds)``, on the event loop.
        self.observe: Callable[[str, float], None] = self._latency.observe
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
        if tenant_usage is not None:
            self.registry.register(_TenantCollector(tenant_usage))
        self.lookup_floor_overruns = Counter(
            "kvoffload_lookup_floor_overruns",
            "Padded lookups whose reply took longer than the tenant's lookup_floor to compute",
            ["tenant"],
            registry=self.registry,
        )
        self.key_cache_ttl = Gauge(
            "kvoffload_key_cache_ttl_seconds",
            "Bound on how long another node may use a purged tenant's cached keys",
            registry=self.registry,
        )
        self.high_watermark = Gauge(
            "kvoffload_high_watermark_ratio",
            "[store] high_watermark: above it, eviction runs down to the low watermark",
            registry=self.registry,
        )
        self.policy_reloads = Counter(
            "kvoffload_policy_reloads",
            "Policy reloads (SIGHUP or a change of the file), by result: ok or refused",
            ["result"],
            registry=self.registry,
        )
        self.policy_reload_ok = Gauge(
            "kvoffload_policy_last_reload_success",
            "1 if the last policy reload put the file in force, 0 if it was refused",
            registry=self.registry,
        )
        self.policy_reload_ok.set(1)
        self.policy_generation = Gauge(
            "kvoffload_policy_generation",
            "Policies put in force since start (each reload that succeeded adds one)",
            registry=self.registry,
        )
        self._http: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def error(self, code: str) -> None:
        self.errors.labels(code=code).inc()

    def lookup_floor_overrun(self, tenant: str) -> None:
        self.lookup_floor_overruns.labels(tenant=tenant).inc()

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

    def wsgi_app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        """``/metrics``, ``/healthz``, ``/readyz``; 404 elsewhere; GET and HEAD only."""
        path = environ.get("PATH_INFO", "")
        method = environ.get("REQUEST_METHOD", "GET")
        if method not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Content-Type", "text/plain")])
            return [b"GET only\n"]
        if path == "/metrics":
            body = self.render()
            start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST)])
        elif path == "/healthz":
            body = b"ok\n"
            start_response("200 OK", [("Content-Type", "text/plain")])
        elif path == "/readyz":
            body = b"ready\n" if self.ready else b"not ready\n"
            status = "200 OK" if self.ready else "503 Service Unavailable"
            start_response(status, [("Content-Type", "text/plain")])
        else:
            body = b"not found: /metrics, /healthz, /readyz\n"
            start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b""] if method == "HEAD" else [body]

    def start_http(self, host: str, port: int) -> int:
        """Serve the endpoints; returns the bound port (``port=0`` is refused: 0 means off).

        Raises OSError when the address cannot be bound."""
        if not 0 < port <= 65535:
            raise ValueError(f"metrics port {port} is not in 1-65535")
        server = make_server(
            host, port, self.wsgi_app, _ThreadingWSGIServer, handler_class=_QuietHandler
        )
        thread = threading.Thread(
            target=server.serve_forever, name="kvoffload-metrics", daemon=True
        )
        thread.start()
        self._http, self._thread = server, thread
        return int(server.server_port)

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
