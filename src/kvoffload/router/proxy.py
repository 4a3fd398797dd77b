"""``kvoffload router``: an OpenAI-compatible HTTP proxy in front of vLLM workers.

aiohttp serves and forwards: one package that is both the server and a
streaming client, already a dependency of vLLM (so the vLLM tier has it), whose
``StreamResponse`` and ``content.iter_any()`` pass SSE through byte for byte
with no re-framing.

Routes:

- ``POST /v1/completions``, ``POST /v1/chat/completions``: tokenized and hashed
  as the engine does, under the tenant's ``cache_salt`` (set on the forwarded
  body); sent to the worker with the lowest estimated TTFT; streamed back as
  received. 429 with ``Retry-After`` when no worker can meet the deadline
  (policy ``shed``). Nothing is sent to the client before the worker's first
  body byte, so a worker that fails until then (connection refused or reset,
  a 5xx, a connection cut after the headers, an empty 2xx) is marked and the
  request is retried once on the next best worker; one that breaks off later
  breaks the client's connection too (an OpenAI error event first, when an
  event stream is cut between two events): never a clean end of a partial
  answer.
- ``GET /v1/models``: the first healthy worker's answer.
- ``GET /health``: 200 while a worker is healthy, else 503; the mode and each
  worker's state.
- ``GET /metrics``: Prometheus text (decisions by mode, requests by worker and
  outcome, sheds, retries, estimated vs observed TTFT and their error).
- ``POST /v1/kv/query``: per worker the matched tokens per tier and the
  estimate with its terms. ``POST /v1/kv/select``: the choice, optionally
  reserved (``"reserve": true``), settled by ``POST /v1/kv/release``.

Every error the router answers itself is OpenAI's error object
(``{"error": {"message", "type", "param", "code"}}``, ``code`` the HTTP status
as vLLM sends it): bad JSON or JSON nested too deeply is a 400, a body over
``[router] max_body`` a 413, an unknown route a 404.

The deadline of a request: the ``X-KVOffload-Deadline-Ms`` header, else its
tenant's ``deadline``, else ``[router] default_deadline``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import generate_latest
from yarl import URL

from .body import BadBody, Body, forwarded, parse_body
from .config import RouterConfig, TenantSpec
from .core import Decision, Router, Ticket
from .index import SourceState
from .serving import COMMITTED, Metrics, error, error_body, openai_errors, parse_worker_metrics
from .tokenize import PromptHasher, Tokenizer

__all__ = ["RouterService", "parse_worker_metrics"]

log = logging.getLogger("kvoffload.router")
decisions_log = logging.getLogger("kvoffload.router.decisions")

TENANT_HEADER = "X-KVOffload-Tenant"
DEADLINE_HEADER = "X-KVOffload-Deadline-Ms"
WORKER_HEADER = "X-KVOffload-Worker"
_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "content-encoding",
    "host",
    "authorization",
}
#: Request headers the router does not pass on (it sets the content type itself).
_NOT_FORWARDED = _HOP | {"content-type", TENANT_HEADER.lower()}


@dataclass
class _Reservation:
    ticket: Ticket
    expires: float


class RouterService:
    """The proxy around one :class:`~kvoffload.router.core.Router`."""

    def __init__(
        self,
        cfg: RouterConfig,
        tokenizer: Tokenizer | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.clock = clock
        self.router = Router(
            cfg.topology(),
            priors=cfg.priors,
            block_tokens=cfg.block_size,
            on_deadline_miss=cfg.on_deadline_miss,
            work_weight=cfg.work_weight,
            risk=cfg.risk,
        )
        self.hasher = cfg.hasher()
        self.prompts = PromptHasher(
            tokenizer, self.hasher, processes=cfg.tokenizer_processes, path=cfg.tokenizer
        )
        self.workers = {w.name: w for w in cfg.workers}
        self.salts = cfg.tenant_salts()
        self.by_key = {k: t for t in cfg.tenants for k in t.api_keys}
        self.by_name = {t.name: t for t in cfg.tenants}
        self.metrics = Metrics()
        self.reservations: dict[int, _Reservation] = {}
        self._urls: dict[tuple[str, str], URL] = {}
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._bridge: Any = None
        # A worker with no event stream configured is read from the routing history;
        # one with a stream, from the stream once the consumer has it live.
        for w in cfg.workers:
            if w.events is None:
                self.router.set_worker_source(w.name, SourceState.STALE)
        for s in cfg.stores:
            if s.events is None:
                # No feed of its own: what the router knows of it comes from the
                # connectors' STORAGE events on the streams of the workers that read it.
                fed = any(w.events for w in cfg.workers if w.node in s.nodes)
                self.router.set_store_source(s.name, SourceState.LIVE if fed else SourceState.STALE)
        if any(w.events for w in cfg.workers) or any(s.events for s in cfg.stores):
            from .events import EventBridge, bridge_specs

            self._bridge = EventBridge(
                self.router, bridge_specs(cfg), request_timeout_s=cfg.connect_timeout_s
            )
        for name in self.workers:
            self.metrics.healthy.labels(name).set(1)

    # -- application ----------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[openai_errors])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/kv/query", self._query)
        app.router.add_post("/v1/kv/select", self._select)
        app.router.add_post("/v1/kv/release", self._release)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(
            total=self.cfg.request_timeout_s, sock_connect=self.cfg.connect_timeout_s
        )
        # No cookie jar: a cookie one worker set must never ride on another client's request.
        self._session = aiohttp.ClientSession(
            timeout=timeout, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
        )
        await self.prompts.start()
        if self._bridge is not None:
            self._bridge.start()
        self._tasks = [
            asyncio.create_task(self._every(self.cfg.health_interval_s, self._check_health)),
            asyncio.create_task(self._every(self.cfg.metrics_interval_s, self._scrape_metrics)),
        ]

    async def _stop(self, _app: web.Application) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._session is not None:
            await self._session.close()
        await asyncio.to_thread(self.prompts.close)
        if self._bridge is not None:
            await asyncio.to_thread(self._bridge.close)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the router service is not started")
        return self._session

    async def _every(self, interval: float, fn: Callable[[], Awaitable[None]]) -> None:
        while True:
            try:
                await fn()
            except asyncio.CancelledError:
                raise
            except Exception:  # a background probe must never stop the proxy
                log.exception("background check failed")
            await asyncio.sleep(interval)

    # -- workers: health and load ---------------------------------------------------

    async def _probe(self, name: str) -> None:
        url = self.workers[name].url + "/health"
        ok = False
        try:
            async with self.session.get(
                url, timeout=aiohttp.ClientTimeout(total=self.cfg.connect_timeout_s)
            ) as resp:
                ok = resp.status == 200
                await resp.read()
        except (TimeoutError, aiohttp.ClientError, OSError):
            ok = False
        if ok != self.router.healthy[name]:
            log.warning("worker %s is %s", name, "healthy again" if ok else "failing health checks")
        self.mark(name, ok)

    def mark(self, name: str, healthy: bool) -> None:
        self.router.healthy[name] = healthy
        self.metrics.healthy.labels(name).set(1 if healthy else 0)

    async def _check_health(self) -> None:
        await asyncio.gather(*(self._probe(n) for n in self.workers))

    async def _scrape(self, name: str) -> None:
        try:
            async with self.session.get(
                self.workers[name].metrics,
                timeout=aiohttp.ClientTimeout(total=self.cfg.connect_timeout_s),
            ) as resp:
                if resp.status != 200:
                    return
                text = await resp.text()
        except (TimeoutError, aiohttp.ClientError, OSError, UnicodeDecodeError):
            return
        try:
            m = parse_worker_metrics(text)
        except ValueError:
            log.warning("worker %s: unreadable /metrics", name)
            return
        now = self.clock()
        load = self.router.loads[name]
        self.router.model.refresh(
            load,
            waiting=int(m.get("waiting", 0)),
            running=int(m.get("running", 0)),
            kv_usage=float(m.get("kv_usage", 0.0)),
            now=now,
        )
        self.metrics.queue.labels(name).set(load.queue_s(now))

    async def _scrape_metrics(self) -> None:
        await asyncio.gather(*(self._scrape(n) for n in self.workers))

    # -- tenants --------------------------------------------------------------------

    def tenant(self, request: web.Request) -> TenantSpec | web.Response | None:
        """The request's tenant; None when the router has no tenants; a 401 response if unknown."""
        if not self.cfg.tenants:
            return None
        auth = request.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            t = self.by_key.get(auth[7:].strip())
            if t is not None:
                return t
        if self.cfg.trust_tenant_header:
            t = self.by_name.get(request.headers.get(TENANT_HEADER, ""))
            if t is not None:
                return t
        return error(401, "unknown or missing API key", "authentication_error")

    def salt(self, tenant: TenantSpec | None, client_salt: object) -> str | None:
        """The cache_salt forwarded to the engine (and hashed by the router)."""
        own = client_salt if isinstance(client_salt, str) and client_salt else None
        if tenant is None:
            return own
        base = self.salts[tenant.name]
        return base if own is None else f"{base}:{own}"

    def deadline(
        self, request: web.Request, tenant: TenantSpec | None
    ) -> float | web.Response | None:
        raw = request.headers.get(DEADLINE_HEADER)
        if raw is not None:
            try:
                ms = float(raw)
                if not ms > 0:
                    raise ValueError
            except ValueError:
                return error(
                    400,
                    f"{DEADLINE_HEADER} must be a positive number of milliseconds",
                    "invalid_request_error",
                )
            return ms / 1000.0
        if tenant is not None and tenant.deadline_s is not None:
            return tenant.deadline_s
        return self.cfg.default_deadline_s

    # -- the prompt -----------------------------------------------------------------

    async def _body(self, request: web.Request) -> Body | web.Response:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return error(
                413,
                f"the request body is larger than the router's limit of "
                f"{self.cfg.max_body_bytes} bytes ([router] max_body)",
                "invalid_request_error",
            )
        try:
            return parse_body(raw)
        except BadBody as exc:
            return error(400, str(exc), "invalid_request_error")

    async def hashes(
        self, body: Mapping[str, Any], chat: bool, salt: str | None
    ) -> tuple[list[int], int]:
        """The engine block hashes (64-bit) of a request and its prompt length in tokens.

        Tokenized once and hashed once, off the event loop where it costs
        (:class:`~kvoffload.router.tokenize.PromptHasher`); every try of the
        request routes on the same hashes.
        """
        try:
            got = await self.prompts.hashes(body, chat, salt, self.cfg.lora(body.get("model")))
        except Exception as exc:  # a template or tokenizer failure: route on load alone
            log.warning("cannot tokenize a request (%s): routed as cold", exc)
            got = None
        return got if got is not None else ([], 0)

    def _log(self, decision: Decision) -> None:
        m = self.metrics
        m.labelled(m.decisions, decision.mode.value).inc()
        level = logging.INFO if self.cfg.log_decisions else logging.DEBUG
        if decisions_log.isEnabledFor(level):
            decisions_log.log(level, "%s", json.dumps(decision.as_dict(self.cfg.block_size)))

    # -- proxying -------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, chat=True)

    async def _proxy(self, request: web.Request, chat: bool) -> web.StreamResponse:
        tenant = self.tenant(request)
        if isinstance(tenant, web.Response):
            return tenant
        parsed = await self._body(request)
        if isinstance(parsed, web.Response):
            return parsed
        body = parsed.data
        deadline = self.deadline(request, tenant)
        if isinstance(deadline, web.Response):
            return deadline
        salt = self.salt(tenant, body.get("cache_salt"))
        hashes, n_tokens = await self.hashes(body, chat, salt)
        try:
            payload = forwarded(parsed, salt)
        except BadBody as exc:
            return error(400, str(exc), "invalid_request_error")
        # The body forwarded is UTF-8 JSON (the client's own bytes where they are).
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        headers["Content-Type"] = "application/json"
        tried: list[str] = []
        last_error = "no healthy worker"
        for attempt in range(2):
            decision = self.router.decide(
                hashes, max(n_tokens, 1), now=self.clock(), deadline_s=deadline, exclude=tried
            )
            self._log(decision)
            if decision.worker is None:
                if decision.shed:
                    self.metrics.shed.inc()
                    retry = int(decision.retry_after_s or 1)
                    return error(
                        429,
                        f"no worker can answer within the deadline of {deadline:.3f}s",
                        "rate_limit_error",
                        {"Retry-After": str(retry)},
                    )
                return error(503, f"no worker available ({last_error})", "service_unavailable")
            if attempt:
                self.metrics.retries.inc()
            chosen = decision.chosen
            if chosen is not None:
                self.metrics.estimated.observe(chosen.estimate.ttft_s)
                for tier, n in chosen.estimate.cached_tokens.items():
                    if n:
                        self.metrics.labelled(self.metrics.cached, tier).inc(n)
            ticket = self.router.dispatch(decision, self.clock())
            tried.append(decision.worker)
            got = await self._send(ticket, request.path, payload, headers)
            if isinstance(got, str):
                last_error = got
                continue
            return await self._relay(request, ticket, *got)
        return error(502, f"the workers failed ({last_error})", "bad_gateway")

    def _url(self, worker: str, path: str) -> URL:
        """A worker's URL for a path, parsed once."""
        key = (worker, path)
        url = self._urls.get(key)
        if url is None:
            url = self._urls[key] = URL(self.workers[worker].url + path)
        return url

    async def _send(
        self, ticket: Ticket, path: str, payload: bytes, headers: Mapping[str, str]
    ) -> tuple[aiohttp.ClientResponse, bytes, float] | str:
        """Sends a request and waits for the first byte of the answer's body.

        Nothing is visible to the client before that byte, so any failure until
        then (refused, reset, a 5xx, a connection cut after the headers, an
        empty 2xx) is retried elsewhere: the reason is returned, the ticket
        settled as failed.
        """
        name = ticket.worker
        upstream: aiohttp.ClientResponse | None = None
        down = True
        try:
            upstream = await self.session.post(self._url(name, path), data=payload, headers=headers)
            if upstream.status >= 500:
                await upstream.read()
                reason, outcome, down = f"HTTP {upstream.status}", f"http_{upstream.status}", False
            else:
                first = await upstream.content.readany()
                if first or upstream.status >= 300 or upstream.headers.get("Content-Length") == "0":
                    return upstream, first, self.clock()
                reason, outcome = "no body after the headers", "broken_before_first_byte"
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            outcome = "connect_error" if upstream is None else "broken_before_first_byte"
        if upstream is not None:
            upstream.release()
        self.router.failed(ticket, self.clock())
        if down:
            self.mark(name, False)
        self.metrics.labelled(self.metrics.requests, name, outcome).inc()
        log.warning("worker %s failed before the first byte (%s): retrying elsewhere", name, reason)
        return f"{name}: {reason}"

    async def _relay(
        self,
        request: web.Request,
        ticket: Ticket,
        upstream: aiohttp.ClientResponse,
        first: bytes,
        first_at: float,
    ) -> web.StreamResponse:
        """Streams the answer through as received; a break upstream breaks the client's too."""
        name = ticket.worker
        out = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for k, v in upstream.headers.items():
            if k.lower() not in _HOP:
                out.headers[k] = v
        out.headers[WORKER_HEADER] = name
        streaming = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
        if streaming:
            self._first_token(ticket, first_at)
        outcome = "ok" if upstream.status < 400 else f"http_{upstream.status}"
        broke: BaseException | None = None
        tail = first[-4:]
        content = upstream.content
        try:
            request[COMMITTED] = True
            # The headers go out with the first bytes, and the last bytes with the end of
            # the answer: one send for an answer that came in one piece, not three.
            out._send_headers_immediately = False
            await out.prepare(request)
            chunk = first
            while chunk and not content.at_eof():
                await out.write(chunk)
                tail = (tail + chunk)[-4:]
                try:
                    chunk = await content.readany()
                except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                    broke = exc
                    break
            if broke is None:
                if not streaming:
                    self._first_token(ticket, self.clock(), observed=False)
                await out.write_eof(chunk)
        except ConnectionError:  # the client went away: closing upstream aborts the request
            outcome = "client_gone"
        finally:
            upstream.release()
            if not ticket.settled:
                self.router.failed(ticket, self.clock())
            else:
                self.router.finished(ticket, self.clock())
        if broke is not None:
            outcome = "broken"
            log.warning("worker %s: the response broke off (%s)", name, broke or type(broke))
            await self._abort(request, out, streaming, tail, name)
        self.metrics.labelled(self.metrics.requests, name, outcome).inc()
        return out

    async def _abort(
        self, request: web.Request, out: web.StreamResponse, sse: bool, tail: bytes, name: str
    ) -> None:
        """Ends a committed response as broken: never a clean end of a partial answer.

        An event stream cut between two events gets an OpenAI error event first
        (OpenAI's clients raise it as an ``APIError``); then the connection is
        closed without the chunked terminator, so any HTTP client sees a
        transport error (curl: exit 18, httpx: ``RemoteProtocolError``).
        """
        if sse and tail.endswith((b"\n\n", b"\r\n\r\n", b"\r\r")):
            event = error_body(502, f"worker {name} broke off the stream", "server_error")
            with contextlib.suppress(ConnectionError):
                await out.write(b"data: " + event + b"\n\n")
        out.force_close()
        if request.transport is not None:
            request.transport.close()

    def _first_token(self, ticket: Ticket, now: float, *, observed: bool = True) -> None:
        self.router.first_token(ticket, now, observed=observed)
        if observed:
            took = now - ticket.sent_at
            self.metrics.observed.observe(took)
            if took > 0:
                self.metrics.error.observe((ticket.estimate.ttft_s - took) / took)

    # -- other routes ---------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.StreamResponse:
        for name, spec in self.workers.items():
            if not self.router.healthy[name]:
                continue
            try:
                async with self.session.get(spec.url + "/v1/models") as resp:
                    data = await resp.read()
                    if resp.status == 200:
                        return web.Response(body=data, content_type="application/json")
            except (TimeoutError, aiohttp.ClientError, OSError):
                continue
        return error(503, "no worker answered /v1/models", "service_unavailable")

    async def _health(self, request: web.Request) -> web.Response:
        healthy = {n: self.router.healthy[n] for n in self.workers}
        mode = self.router.mode([n for n, ok in healthy.items() if ok])
        body: dict[str, object] = {
            "status": "ok" if any(healthy.values()) else "unavailable",
            "mode": mode.value,
            "workers": healthy,
        }
        if self._bridge is not None:
            body["event_sources"] = {
                st.name: st.health.value for st in self._bridge.consumer.statuses()
            }
        return web.json_response(body, status=200 if any(healthy.values()) else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    async def _kv_request(
        self, request: web.Request
    ) -> tuple[dict[str, Any], list[int], int, float | None] | web.Response:
        tenant = self.tenant(request)
        if isinstance(tenant, web.Response):
            return tenant
        parsed = await self._body(request)
        if isinstance(parsed, web.Response):
            return parsed
        body = parsed.data
        deadline = self.deadline(request, tenant)
        if isinstance(deadline, web.Response):
            return deadline
        salt = self.salt(tenant, body.get("cache_salt"))
        tokens = body.get("tokens")
        if tokens is not None:
            if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in tokens
            ):
                return error(400, "tokens must be a list of token ids", "invalid_request_error")
            lora = self.cfg.lora(body.get("model"))
            return (
                body,
                self.hasher.external_hashes(tokens, cache_salt=salt, lora=lora),
                len(tokens),
                deadline,
            )
        chat = "messages" in body
        hashes, n = await self.hashes(body, chat, salt)
        if n == 0:
            return error(
                400,
                "give tokens, or a prompt or messages the router can tokenize",
                "invalid_request_error",
            )
        return body, hashes, n, deadline

    async def _query(self, request: web.Request) -> web.Response:
        got = await self._kv_request(request)
        if isinstance(got, web.Response):
            return got
        _, hashes, n, _deadline = got
        mode, cands = self.router.candidates(hashes, n, self.clock())
        bt = self.cfg.block_size
        return web.json_response(
            {"mode": mode.value, "n_tokens": n, "workers": {c.worker: c.as_dict(bt) for c in cands}}
        )

    async def _select(self, request: web.Request) -> web.Response:
        got = await self._kv_request(request)
        if isinstance(got, web.Response):
            return got
        body, hashes, n, deadline = got
        now = self.clock()
        decision = self.router.decide(hashes, n, now=now, deadline_s=deadline)
        self._log(decision)
        out = decision.as_dict(self.cfg.block_size)
        if decision.worker is not None:
            out["url"] = self.workers[decision.worker].url
            if body.get("reserve") is True:
                ticket = self.router.reserve(decision, now)
                self._expire(now)
                self.reservations[ticket.id] = _Reservation(
                    ticket, now + self.cfg.request_timeout_s
                )
                out["reservation"] = ticket.id
        status = 429 if decision.shed else 200 if decision.worker else 503
        headers = {"Retry-After": str(int(decision.retry_after_s or 1))} if decision.shed else None
        return web.json_response(out, status=status, headers=headers)

    def _expire(self, now: float) -> None:
        for rid, res in list(self.reservations.items()):
            if res.expires < now:
                del self.reservations[rid]
                self.router.failed(res.ticket, now)

    async def _release(self, request: web.Request) -> web.Response:
        parsed = await self._body(request)
        if isinstance(parsed, web.Response):
            return parsed
        body = parsed.data
        rid, outcome = body.get("reservation"), body.get("outcome")
        if outcome not in ("first_token", "finished", "failed"):
            return error(
                400, "outcome must be first_token, finished or failed", "invalid_request_error"
            )
        res = self.reservations.get(rid) if isinstance(rid, int) else None
        if res is None:
            return error(404, "no such reservation", "not_found_error")
        now = self.clock()
        if outcome == "first_token":
            self._first_token(res.ticket, now)
        elif outcome == "failed":
            self.router.failed(res.ticket, now)
            del self.reservations[rid]  # type: ignore[arg-type]
        else:
            self.router.first_token(res.ticket, now)
            self.router.finished(res.ticket, now)
            del self.reservations[rid]  # type: ignore[arg-type]
        return web.json_response({"reservation": rid, "outcome": outcome})
