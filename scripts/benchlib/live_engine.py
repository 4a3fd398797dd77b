"""A STAND-IN engine for the live router benchmark: vLLM's real scheduler behind real HTTP.

Not vLLM's API server (no GPU here): an OpenAI-compatible HTTP server
(aiohttp) whose inside is :class:`benchlib.vllm_engine.VllmWorker`, vLLM
0.33's real v1 ``Scheduler`` and KV-cache manager over the stand-in runner,
stepping in real time: each step sleeps what the step-time model says the
batch takes, times ``--time-scale`` (compressed time; the scheduler's own CPU
counts against that sleep, and a step that overruns is recorded as lag).

- ``POST /v1/completions``: a text ``prompt`` is tokenized with the model's
  tokenizer (``--tokenizer``, a local ``tokenizer.json``; as vLLM, special
  tokens added) or taken as token ids; ``max_tokens`` tokens are generated
  (``ignore_eos``). With ``"stream": true`` the response headers go out at
  once (as vLLM sends them before the first token), then one SSE event per
  token as the step that sampled it ends, the last with ``finish_reason``,
  then ``data: [DONE]``. Otherwise one JSON answer at the end.
- ``GET /health``; ``GET /metrics``: vLLM's gauge names the routers read
  (``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
  ``vllm:kv_cache_usage_perc``) and vLLM's prefix-cache counters
  (``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``).
- KV events: vLLM's own ZMQ publisher (``--events``, ``--replay``), as
  ``--kv-events-config`` would set it up.
- ``GET /_stats``: prompt and prefix-hit tokens, steps, preemptions, lag;
  ``POST /_reset``: empties the prefix cache (vLLM's ``reset_prefix_cache``,
  which publishes ``AllBlocksCleared``) and the stats, between two routers'
  runs (409 while requests are in flight).

Run as ``python -m benchlib.live_engine --name NAME ...`` with ``scripts/`` and
``src/`` on ``PYTHONPATH`` (under the vLLM venv); prints its port once listening.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

__all__ = ["main"]


@dataclass
class Stats:
    prompt_tokens: int = 0
    requests: int = 0
    steps: int = 0
    lag_s: float = 0.0  # wall time steps ran past their modelled (scaled) time
    busy_s: float = 0.0  # wall time spent stepping

    def as_dict(self, hit_tokens: int, preemptions: int) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": hit_tokens,
            "requests": self.requests,
            "steps": self.steps,
            "preemptions": preemptions,
            "lag_s": self.lag_s,
            "busy_s": self.busy_s,
        }


@dataclass
class Pending:
    out: int
    queue: asyncio.Queue[bool] = field(default_factory=asyncio.Queue)  # True: the last token


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--events", required=True, help="ZMQ PUB endpoint, e.g. tcp://127.0.0.1:5557")
    ap.add_argument("--replay", required=True, help="ZMQ ROUTER replay endpoint")
    ap.add_argument("--tokenizer", required=True, help="a folder holding tokenizer.json")
    ap.add_argument("--block-tokens", type=int, default=512)
    ap.add_argument("--gpu-blocks", type=int, default=600)
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--time-scale", type=float, default=0.1, help="wall s per modelled s")
    ap.add_argument("--noise", type=float, default=0.0, help="σ of each prefill's time")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def main() -> None:
    args = _parse()
    from tokenizers import Tokenizer
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import EventPublisherFactory

    from benchlib.vllm_engine import StepModel, VllmWorker, lognormal

    tok = Tokenizer.from_file(f"{args.tokenizer}/tokenizer.json")
    worker = VllmWorker(
        args.name,
        block_tokens=args.block_tokens,
        num_blocks=args.gpu_blocks,
        budget=args.budget,
        max_num_seqs=args.max_num_seqs,
        step=StepModel(),
    )
    sched = worker.scheduler
    publisher = EventPublisherFactory.create(
        KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=args.events,
            replay_endpoint=args.replay,
        ),
        0,
    )
    sched.kv_event_publisher = publisher
    scale = float(args.time_scale)
    rng = random.Random(args.seed)
    ids = itertools.count()
    pending: dict[str, Pending] = {}
    stats = Stats()
    hits0 = [0, 0]  # hit tokens and preemptions at the last reset
    wake = asyncio.Event()

    def add(tokens: list[int], out: int) -> tuple[str, Pending]:
        rid = f"{args.name}-{next(ids)}"
        p = Pending(out)
        pending[rid] = p
        worker.add(rid, tokens, out, lognormal(rng, args.noise))
        stats.prompt_tokens += len(tokens)
        stats.requests += 1
        wake.set()
        return rid, p

    async def engine_loop() -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not worker.busy:
                wake.clear()
                await wake.wait()
                continue
            t0 = loop.time()
            res = worker.step(t0 / scale)
            if res is None:
                await asyncio.sleep(0.001)
                continue
            spent = loop.time() - t0
            target = res.duration_s * scale
            stats.steps += 1
            stats.busy_s += max(spent, target)
            if spent > target:
                stats.lag_s += spent - target
                await asyncio.sleep(0)
            else:
                await asyncio.sleep(target - spent)
            done = set(res.done)
            for rid in res.tokens:
                p = pending.get(rid)
                if p is not None:
                    p.queue.put_nowait(rid in done)
            for rid in done:
                pending.pop(rid, None)

    def tokens_of_body(body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return list(tok.encode(prompt, add_special_tokens=True).ids)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return [int(t) for t in prompt]
        raise ValueError("prompt must be a string or a list of token ids")

    def event(rid: str, created: int, model: str, text: str, finish: str | None) -> bytes:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = {
            "id": f"cmpl-{rid}",
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [choice],
        }
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    async def completions(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
            tokens = tokens_of_body(body)
            out = max(1, int(body.get("max_tokens") or 16))
        except (ValueError, TypeError, AttributeError) as exc:
            err = {"message": str(exc), "type": "BadRequestError", "param": None, "code": 400}
            return web.json_response({"error": err}, status=400)
        rid, p = add(tokens, out)
        created = int(time.time())
        model = str(body.get("model") or "stand-in")
        if not body.get("stream"):
            n = 0
            while not await p.queue.get():
                n += 1
            usage = {"prompt_tokens": len(tokens), "completion_tokens": n + 1}
            obj = {
                "id": f"cmpl-{rid}",
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "text": " x" * (n + 1), "finish_reason": "length"}],
                "usage": usage,
            }
            return web.json_response(obj)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        while True:
            last = await p.queue.get()
            await resp.write(event(rid, created, model, " x", "length" if last else None))
            if last:
                break
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def metrics(request: web.Request) -> web.Response:
        hits = worker.hit_tokens - hits0[0]
        text = (
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="m"}} {len(sched.waiting)}\n'
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="m"}} {len(sched.running)}\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{model_name="m"}} {sched.kv_cache_manager.usage}\n'
            "# TYPE vllm:prefix_cache_queries counter\n"
            f'vllm:prefix_cache_queries_total{{model_name="m"}} {stats.prompt_tokens}\n'
            "# TYPE vllm:prefix_cache_hits counter\n"
            f'vllm:prefix_cache_hits_total{{model_name="m"}} {hits}\n'
        )
        return web.Response(text=text)

    async def get_stats(request: web.Request) -> web.Response:
        return web.json_response(
            stats.as_dict(worker.hit_tokens - hits0[0], worker.preemptions - hits0[1])
        )

    async def reset(request: web.Request) -> web.Response:
        nonlocal stats
        if worker.busy or not sched.reset_prefix_cache():
            return web.json_response({"reset": False}, status=409)
        worker._drain_events()  # the stand-in's own capture: unused here
        stats = Stats()
        hits0[:] = [worker.hit_tokens, worker.preemptions]
        return web.json_response({"reset": True})

    app = web.Application(client_max_size=256 << 20)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/_stats", get_stats)
    app.router.add_post("/_reset", reset)

    async def serve() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", args.port)
        await site.start()
        server = site._server
        assert server is not None
        port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        task = asyncio.create_task(engine_loop())
        sys.stdout.write(f"{port}\n")
        sys.stdout.flush()
        try:
            await asyncio.Event().wait()
        finally:
            task.cancel()
            await runner.cleanup()
            publisher.shutdown()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


if __name__ == "__main__":
    main()
