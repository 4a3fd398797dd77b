"""End to end: ``kvoffload router`` in front of workers running vLLM 0.33's real scheduler.

Each worker (tests/router/vllm_worker.py) is a stand-in for vLLM's API server
over vLLM's real v1 ``Scheduler`` with prefix caching and the CPU stand-in
model runner, publishing vLLM's own KV events with vLLM's own ZMQ publisher.
The router consumes those events (kvoffload.events), hashes prompts itself, and
must agree with vLLM about what is cached: the test reads vLLM's own count of
prefix-cached tokens (``usage.prompt_tokens_details.cached_tokens``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("zmq")

from tests.router.procs import RouterProc, Worker
from tests.router.proxy_helpers import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = [(i * 7 + 3) % 500 for i in range(16 * 12 + 5)]  # 12 full blocks and a tail
ALICE = {"Authorization": "Bearer key-alice"}
MALLORY = {"Authorization": "Bearer key-mallory"}


@pytest.fixture
def ipc_dir(tmp_path: Path) -> Iterator[Path]:
    d = Path("/tmp") / f"kvre-{os.getpid()}-{tmp_path.name[-10:]}"
    d.mkdir(exist_ok=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def complete(router: RouterProc, prompt: list[int], who: dict[str, str]) -> tuple[str, int]:
    status, headers, body = router.post(
        "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 2}, **who
    )
    assert status == 200, body
    out: dict[str, Any] = json.loads(body)
    return headers["x-kvoffload-worker"], int(
        out["usage"]["prompt_tokens_details"]["cached_tokens"]
    )


def matched(router: RouterProc, prompt: list[int], who: dict[str, str]) -> dict[str, int]:
    status, _, body = router.post("/v1/kv/query", {"tokens": prompt}, **who)
    assert status == 200, body
    return {w: int(t["gpu"]) for w, t in json.loads(body)["workers"].items()}


def test_routing_follows_vllms_own_prefix_cache_and_never_crosses_tenants(
    tmp_path: Path, ipc_dir: Path
) -> None:
    workers: list[Worker] = []
    router: RouterProc | None = None
    try:
        lines = ['[router]\nhealth_interval = "60s"\nconnect_timeout = "2s"']
        for name in ("w0", "w1"):
            pub, rep = f"ipc://{ipc_dir}/{name}-pub", f"ipc://{ipc_dir}/{name}-rep"
            w = Worker(
                name,
                "tests.router.vllm_worker",
                ("--events", pub, "--replay", rep),
                start_timeout_s=240,
            )
            workers.append(w)
            lines.append(
                f'[[workers]]\nname = "{name}"\nurl = "{w.url}"\nnode = "n-{name}"\n'
                f'events = "{pub}"\nevents_replay = "{rep}"'
            )
        lines.append(
            "[tenants.alice]\napi_keys = ['key-alice']\ncache_salt = 'salt-alice-0123456789'\n"
            "[tenants.mallory]\napi_keys = ['key-mallory']\ncache_salt = 'salt-mallory-012345'"
        )
        cfg = tmp_path / "router.toml"
        cfg.write_text("\n".join(lines) + "\n", encoding="utf-8")
        router = RouterProc(cfg, tmp_path / "router.log")
        wait_until(
            lambda: json.loads(router.get("/health")[2])["mode"] == "exact",
            "every event source to be live",
            120,
        )

        holder, cached = complete(router, PROMPT, ALICE)
        assert cached == 0
        # vLLM's own BlockStored events reach the router, under the hashes it computes.
        wait_until(
            lambda: matched(router, PROMPT, ALICE)[holder] == 12 * 16,
            "vLLM's events for the first request",
            60,
        )
        other = next(w for w in ("w0", "w1") if w != holder)
        assert matched(router, PROMPT, ALICE)[other] == 0

        # A second request with the shared prefix goes to the holder, and vLLM serves
        # the prefix from its cache there.
        second, cached = complete(router, [*PROMPT, 9, 9, 9], ALICE)
        assert second == holder
        assert cached == 12 * 16

        # Mallory's identical prompt: the router credits her nothing, and vLLM agrees
        # (her salt gives other hashes): wherever it lands, nothing is reused.
        assert matched(router, PROMPT, MALLORY) == {"w0": 0, "w1": 0}
        _, cached = complete(router, PROMPT, MALLORY)
        assert cached == 0

        # The holder dies (health checks are 60 s apart: the request itself finds out):
        # it is retried on the other worker (which recomputes),
        # its event source goes stale and the router runs DEGRADED.
        next(w for w in workers if w.name == holder).kill()
        where, cached = complete(router, [*PROMPT, 4, 4], ALICE)
        assert where == other
        health = json.loads(router.get("/health")[2])
        assert health["workers"][holder] is False
        wait_until(
            lambda: (
                json.loads(router.get("/health")[2])["event_sources"][f"worker:{holder}"] == "stale"
            ),
            "the dead worker's event source to go stale",
            60,
        )
        _, _, metrics = router.get("/metrics")
        assert b"kvoffload_router_retries_total 1.0" in metrics
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            w.stop()
