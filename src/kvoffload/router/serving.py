"""What the router's HTTP service answers with besides the workers' bytes.

OpenAI's error object for every error it makes itself (and the middleware
that puts aiohttp's own 404/405/413 and any unexpected failure in it), its
Prometheus metrics, and the reading of a worker's ``/metrics``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "COMMITTED",
    "Metrics",
    "error",
    "error_body",
    "openai_errors",
    "parse_worker_metrics",
]

log = logging.getLogger("kvoffload.router")


def error_body(status: int, message: str, kind: str, param: str | None = None) -> bytes:
    """OpenAI's error object (as vLLM sends it: ``code`` is the HTTP status)."""
    err = {"message": message, "type": kind, "param": param, "code": status}
    return json.dumps({"error": err}).encode()


def error(
    status: int,
    message: str,
    kind: str,
    headers: Mapping[str, str] | None = None,
    param: str | None = None,
) -> web.Response:
    return web.Response(
        body=error_body(status, message, kind, param),
        status=status,
        headers=headers,
        content_type="application/json",
    )


#: The OpenAI error ``type`` of an HTTP status the router answers itself.
_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}

#: Set on a request once its response is committed to the client (headers sent).
COMMITTED = "kvoffload.committed"


@web.middleware
async def openai_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every error the router produces in the OpenAI format: aiohttp's own too."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        keep = {k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After")}
        message = exc.text if exc.text and exc.text != f"{exc.status}: {exc.reason}" else None
        return error(
            exc.status, message or exc.reason, _KINDS.get(exc.status, "server_error"), keep
        )
    except Exception:
        if request.get(COMMITTED):
            raise
        log.exception("the router failed on %s %s", request.method, request.path)
        return error(500, "the router failed on this request (see its log)", "server_error")


def parse_worker_metrics(text: str) -> dict[str, float]:
    """vLLM's ``/metrics``: requests waiting and running, KV-cache usage (summed over labels)."""
    want = {
        "vllm:num_requests_waiting": "waiting",
        "vllm:num_requests_running": "running",
        "vllm:kv_cache_usage_perc": "kv_usage",
        "vllm:gpu_cache_usage_perc": "kv_usage",
    }
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            key = want.get(sample.name)
            if key is not None:
                out[key] = out.get(key, 0.0) + float(sample.value)
    return out


class Metrics:
    """The router's Prometheus metrics (``GET /metrics``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "kvoffload_router_decisions", "Routing decisions, by mode.", ["mode"], registry=r
        )
        self.requests = Counter(
            "kvoffload_router_requests",
            "Proxied requests, by worker and outcome.",
            ["worker", "outcome"],
            registry=r,
        )
        self.shed = Counter("kvoffload_router_shed", "Requests refused with 429.", registry=r)
        self.retries = Counter(
            "kvoffload_router_retries", "Requests retried on another worker.", registry=r
        )
        buckets = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)
        self.estimated = Histogram(
            "kvoffload_router_estimated_ttft_seconds",
            "The chosen worker's estimated TTFT.",
            buckets=buckets,
            registry=r,
        )
        self.observed = Histogram(
            "kvoffload_router_observed_ttft_seconds",
            "Observed TTFT (streamed responses: first byte from the worker).",
            buckets=buckets,
            registry=r,
        )
        self.error = Histogram(
            "kvoffload_router_ttft_estimate_error_ratio",
            "(estimated − observed) / observed TTFT.",
            buckets=(-0.9, -0.5, -0.25, -0.1, 0, 0.1, 0.25, 0.5, 1, 2, 5),
            registry=r,
        )
        self.cached = Counter(
            "kvoffload_router_cached_tokens",
            "Prompt tokens the chosen worker was credited with, by tier.",
            ["tier"],
            registry=r,
        )
        self.healthy = Gauge(
            "kvoffload_router_worker_healthy",
            "1 if the worker passes health checks.",
            ["worker"],
            registry=r,
        )
        self.queue = Gauge(
            "kvoffload_router_worker_queue_seconds",
            "The router's estimate of each worker's queue.",
            ["worker"],
            registry=r,
        )
        self._children: dict[tuple[object, tuple[str, ...]], Any] = {}

    def labelled(self, metric: Counter, *labels: str) -> Any:
        """``metric.labels(*labels)``, looked up once (the lookup is per request otherwise)."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child
