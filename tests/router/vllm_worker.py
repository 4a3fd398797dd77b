"""A STAND-IN for vLLM's OpenAI API server over vLLM 0.33's real v1 scheduler (test double).

vLLM's API server and GPU model runner cannot run here; this process puts
vLLM's real ``Scheduler`` (prefix caching, ``cache_salt``, its block hashes)
over the CPU stand-in model runner of ``tests/e2e/standin``, publishes vLLM's
own KV events with vLLM's own ZMQ publisher (``EventPublisherFactory``, as
``--kv-events-config`` would), and answers ``/v1/completions`` (token-id
prompts), ``/health`` and ``/metrics`` over real HTTP (``POST /_control {"waiting": N}``
adds N requests to what ``/metrics`` reports waiting). With ``--connector`` the
kvoffload connector saves to and loads from a sidecar. Each answer carries
``usage.prompt_tokens_details.cached_tokens``: the tokens vLLM's own prefix
cache served. Run as ``python -m tests.router.vllm_worker --name NAME
--events ENDPOINT --replay ENDPOINT``; prints its port once listening.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from aiohttp import web


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--events", required=True)
    ap.add_argument("--replay", required=True)
    ap.add_argument("--connector", help="the kvoffload connector's extra_config, as JSON")
    args = ap.parse_args()

    from vllm import SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import EventPublisherFactory
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from tests.e2e.standin import TinyLlamaSpec, VllmSchedulerDriver
    from tests.e2e.standin.driver import VllmRequestResult, write_model_dir

    spec = TinyLlamaSpec(num_layers=2)
    model_dir = write_model_dir(spec, Path(tempfile.mkdtemp(prefix="tiny-llama-")))
    conn = json.loads(args.connector) if args.connector else None
    driver = VllmSchedulerDriver(
        spec,
        model_dir,
        num_blocks=256,
        block_size=16,
        kv_connector=None if conn is None else "KVOffloadConnector",
        kv_connector_module_path=None if conn is None else "kvoffload.integrations.vllm",
        kv_connector_extra_config=conn,
    )
    sched = driver.scheduler
    sched.kv_event_publisher = EventPublisherFactory.create(
        KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=args.events,
            replay_endpoint=args.replay,
        ),
        0,
    )
    sched.kv_cache_manager.block_pool.enable_kv_cache_events = True
    if conn is not None:
        # The connector publishes its STORAGE events when vLLM's events are on, which
        # the stand-in turns on after building the scheduler: tell the connector too.
        sched.connector._scheduler._events.publish = True
    lock = threading.Lock()
    extra = {"waiting": 0}
    ids = itertools.count()

    def generate(prompt: list[int], max_tokens: int, salt: str | None) -> dict[str, Any]:
        with lock:
            rid = f"{args.name}-{next(ids)}"
            init_none_hash(sha256)
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            params.update_from_generation_config({}, driver.eos_token_id)
            sched.add_request(
                Request(
                    request_id=rid,
                    prompt_token_ids=list(prompt),
                    sampling_params=params,
                    pooling_params=None,
                    cache_salt=salt,
                    block_hasher=get_request_block_hasher(16, sha256),
                )
            )
            driver.results[rid] = VllmRequestResult(rid, tuple(prompt))
            driver.run()
            res = driver.results.pop(rid)
        return {
            "id": rid,
            "worker": args.name,
            "choices": [{"index": 0, "token_ids": res.tokens}],
            "usage": {
                "prompt_tokens": len(prompt),
                "prompt_tokens_details": {"cached_tokens": res.num_local_cached_tokens},
                "external_cached_tokens": res.num_external_cached_tokens,
            },
        }

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        prompt = body["prompt"]
        out = await asyncio.to_thread(
            generate, prompt, int(body.get("max_tokens", 4)), body.get("cache_salt")
        )
        return web.json_response(out)

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            text=(
                f"vllm:num_requests_waiting {len(sched.waiting) + extra['waiting']}\n"
                f"vllm:num_requests_running {len(sched.running)}\n"
                f"vllm:kv_cache_usage_perc {sched.kv_cache_manager.usage}\n"
            )
        )

    async def control(request: web.Request) -> web.Response:
        extra.update(await request.json())
        return web.json_response(extra)

    app = web.Application()
    app.router.add_post("/_control", control)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)

    async def serve() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
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
            sched.kv_event_publisher.shutdown()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


if __name__ == "__main__":
    main()
