"""End to end with the shared store tier: an overloaded holder loses to an idle worker on
another node that loads the prefix from the store root both nodes share, and what it
answers equals a recompute.

Workers: tests/router/vllm_worker.py (a stand-in for vLLM's API server over
vLLM 0.33's real scheduler and the CPU stand-in runner) with the kvoffload
connector, each to its own node's real sidecar process; the two sidecars share
one store root (``[store] shared``, each with its own index, learning the
other's chunks from its journal). The connectors' STORAGE REMOTE events reach
the router on each worker's vLLM event stream. A third worker without
connector, outside the router, gives the recompute.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("zmq")
pytest.importorskip("kvoffload.integrations.vllm")

from tests.router.procs import RouterProc, Worker, request
from tests.router.proxy_helpers import wait_until
from tests.sidecar_proc import shared_root_sidecars

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SHARED = [(i * 11 + 5) % 500 for i in range(160)]  # five chunks of 32 tokens
PROMPT = [*SHARED, 1, 2, 3, 4, 5, 6, 7]


@pytest.fixture
def ipc_dir(tmp_path: Path) -> Iterator[Path]:
    d = Path("/tmp") / f"kvrs-{os.getpid()}-{tmp_path.name[-10:]}"
    d.mkdir(exist_ok=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def answer(
    port: int, prompt: list[int], path: str = "/v1/completions"
) -> tuple[dict[str, Any], str]:
    status, headers, body = request(
        port, "POST", path, {"model": "m", "prompt": prompt, "max_tokens": 4}
    )
    assert status == 200, body
    out: dict[str, Any] = json.loads(body)
    return out, headers.get("x-kvoffload-worker", "")


def test_an_idle_worker_loads_the_prefix_from_the_store_and_matches_a_recompute(
    tmp_path: Path, ipc_dir: Path
) -> None:
    workers: list[Worker] = []
    router: RouterProc | None = None
    root = ipc_dir / "root"
    with shared_root_sidecars(ipc_dir, [root, root]) as sidecars:
        tenant = f"t-{uuid.uuid4().hex[:12]}"

        def conn(node: int) -> str:
            return json.dumps(
                {
                    "tenant": tenant,
                    "socket_path": str(sidecars[node].socket_path),
                    "chunk_tokens": 32,
                    "model_revision": "tiny-llama-l2@seed0",
                    "attention_backend": "STANDIN_CPU_EAGER",
                    "tokenizer_hash": "tiny-vocab-512",
                    "load_mode": "sync",
                    "save_mode": "sync",
                    "timeout_s": 30.0,
                    "events_locality": "REMOTE",
                }
            )

        try:
            lines = ['[router]\nhealth_interval = "60s"\nmetrics_interval = "0.2s"']
            for i, name in enumerate(("w0", "w1", "ref")):
                pub, rep = f"ipc://{ipc_dir}/{name}-pub", f"ipc://{ipc_dir}/{name}-rep"
                args = ("--events", pub, "--replay", rep)
                if name != "ref":
                    args = (*args, "--connector", conn(i))
                workers.append(Worker(name, "tests.router.vllm_worker", args, start_timeout_s=240))
                if name != "ref":
                    lines.append(
                        f'[[workers]]\nname = "{name}"\nurl = "{workers[-1].url}"\nnode = "n{i}"\n'
                        f'events = "{pub}"\nevents_replay = "{rep}"'
                    )
            lines.append('[[stores]]\nname = "root"\nnodes = ["n0", "n1"]\nshared = true')
            cfg = tmp_path / "router.toml"
            cfg.write_text("\n".join(lines) + "\n", encoding="utf-8")
            router = RouterProc(cfg, tmp_path / "router.log")
            wait_until(
                lambda: json.loads(router.get("/health")[2])["mode"] == "exact",
                "every event source to be live",
                120,
            )
            _, holder = answer(router.port, SHARED)
            idle = "w1" if holder == "w0" else "w0"

            def terms() -> dict[str, Any]:
                status, _, body = router.post("/v1/kv/query", {"tokens": PROMPT})
                assert status == 200
                got: dict[str, Any] = json.loads(body)["workers"]
                return got

            # The holder's GPU (vLLM's events) and the shared root (the connector's
            # STORAGE REMOTE events once the sidecar has the chunks) both reach the
            # router: the idle worker, on the other node, is credited with the root's.
            wait_until(lambda: terms()[idle]["storage_remote"] == 160, "the root's chunks", 60)
            assert terms()[holder]["gpu"] == 160

            busy = next(w for w in workers if w.name == holder)
            status, _, _ = request(busy.port, "POST", "/_control", {"waiting": 60})
            assert status == 200
            wait_until(lambda: terms()[holder]["queue_s"] > 1.0, "the holder's queue", 30)

            out, where = answer(router.port, PROMPT)
            assert where == idle
            assert out["usage"]["external_cached_tokens"] == 160  # loaded from the shared root
            ref = next(w for w in workers if w.name == "ref")
            recompute, _ = answer(ref.port, PROMPT)
            assert recompute["usage"]["external_cached_tokens"] == 0
            assert out["choices"][0]["token_ids"] == recompute["choices"][0]["token_ids"]
        finally:
            if router is not None:
                router.stop()
            for w in workers:
                w.stop()
