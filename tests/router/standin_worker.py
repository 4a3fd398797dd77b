"""A stand-in for a vLLM OpenAI API server: a real HTTP server (aiohttp) on a real socket.

Not vLLM: it answers the routes the router uses with fixed, known bytes, so
the tests can check what the router forwards and passes back. Run as
``python -m tests.router.standin_worker --name w0``; it prints its port on the
first line of stdout once it listens.

- ``POST /v1/completions``, ``/v1/chat/completions``: records the JSON body;
  streams :data:`SSE_CHUNKS` (``"stream": true``) or answers one JSON object
  naming the worker; waits ``delay`` seconds first.
- ``GET /health`` (200, or 503 when told ``healthy: false``), ``GET /metrics``
  (vLLM's gauge names with the values it is told), ``GET /v1/models``.
- ``POST /_control`` sets ``delay``, ``healthy``, ``waiting``, ``running``,
  ``status`` (an HTTP status to answer completions with), ``cookie`` (a
  ``Set-Cookie`` on its JSON answers), ``die_after`` (the next streamed answer
  kills this process, as a crashed engine dies, after
  that many of :data:`SSE_CHUNKS`: 0 is right after the response headers, as
  vLLM sends them before the first token); ``GET /_requests`` lists the
  bodies received, parsed and as sent (``raw``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from typing import Any

from aiohttp import web

#: The streamed answer: SSE events split mid-event and mid-UTF-8 character, so that
#: any re-framing by a proxy would show.
SSE_CHUNKS = (
    b'data: {"id":"cmpl-1","choices":[{"text":"h\xc3',
    b'\xa9llo"}]}\n\n',
    b'data: {"id":"cmpl-1","choices":[{"text":" w',
    b'orld"}]}\n\ndata: [DONE]\n\n',
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    state: dict[str, Any] = {
        "delay": 0.0,
        "healthy": True,
        "waiting": 0,
        "running": 0,
        "status": 200,
        "die_after": None,
        "cookie": None,
    }
    received: list[dict[str, Any]] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        received.append(
            {
                "path": request.path,
                "body": body,
                "raw": raw.decode("utf-8", "replace"),
                "cookie": request.headers.get("Cookie"),
            }
        )
        await asyncio.sleep(float(state["delay"]))
        if state["status"] != 200:
            return web.json_response({"error": "told to fail"}, status=int(state["status"]))
        if body.get("stream") and state["die_after"] is not None:
            return await die(request, int(state["die_after"]))
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for chunk in SSE_CHUNKS:
                await resp.write(chunk)
                await asyncio.sleep(0.01)
            await resp.write_eof()
            return resp
        answer = {"id": "cmpl-1", "worker": args.name, "choices": [{"text": "hi"}]}
        cookie = state["cookie"]
        return web.json_response(answer, headers={"Set-Cookie": cookie} if cookie else None)

    async def die(request: web.Request, after: int) -> web.StreamResponse:
        transport = request.transport
        assert transport is not None
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        transport.write(head + b"Transfer-Encoding: chunked\r\n\r\n")
        for chunk in SSE_CHUNKS[:after]:
            transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        await asyncio.sleep(0.2)  # the bytes leave; then the process dies, mid-answer
        os._exit(1)

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200 if state["healthy"] else 503)

    async def metrics(request: web.Request) -> web.Response:
        text = (
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="m"}} {state["waiting"]}\n'
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="m"}} {state["running"]}\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
        )
        return web.Response(text=text)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "owned_by": args.name}]})

    async def control(request: web.Request) -> web.Response:
        state.update(await request.json())
        return web.json_response(state)

    async def requests(request: web.Request) -> web.Response:
        return web.json_response(received)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/_control", control)
    app.router.add_get("/_requests", requests)

    async def serve() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", args.port)
        await site.start()
        server = site._server
        assert server is not None
        port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        sys.stdout.write(f"{port}\n")
        sys.stdout.flush()
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


if __name__ == "__main__":
    main()
