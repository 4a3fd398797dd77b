"""The router fed by real KV-event publishers over ZMQ: live, events lost (DEGRADED), recovered.

The publisher is kvoffload's :class:`KVEventPublisher` speaking vLLM 0.33's
wire format with vLLM's replay protocol, standing in for a worker's engine
stream; the router is ``kvoffload router`` as a process. Needs pyzmq.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")

from kvoffload.events.publisher import KVEventPublisher, MemoryReplayBuffer  # noqa: E402
from kvoffload.events.wire import BlockStored  # noqa: E402
from kvoffload.router.hashing import BlockHasher  # noqa: E402
from tests.router.proxy_helpers import PROMPT, completion, wait_until, worker_of  # noqa: E402

from .procs import RouterProc, Worker  # noqa: E402

HASHES = BlockHasher(16).external_hashes(PROMPT)


def gpu_stored(hashes: list[int]) -> BlockStored:
    return BlockStored(
        block_hashes=tuple(hashes),
        parent_block_hash=None,
        token_ids=(),
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


@pytest.fixture
def endpoints(tmp_path: Path) -> Iterator[tuple[str, str]]:
    d = Path("/tmp") / f"kvrt-{os.getpid()}-{tmp_path.name[-10:]}"
    d.mkdir(exist_ok=True)
    yield f"ipc://{d}/pub", f"ipc://{d}/replay"
    shutil.rmtree(d, ignore_errors=True)


def query(router: RouterProc) -> dict[str, Any]:
    status, _, body = router.post("/v1/kv/query", {"tokens": PROMPT})
    assert status == 200
    got: dict[str, Any] = json.loads(body)
    return got


def source_health(router: RouterProc) -> str:
    health: dict[str, Any] = json.loads(router.get("/health")[2])
    return str(health["event_sources"]["worker:w1"])


def test_events_steer_routing_and_a_lost_stream_degrades_then_recovers(
    tmp_path: Path, endpoints: tuple[str, str]
) -> None:
    pub_ep, replay_ep = endpoints
    ctx = zmq.Context()
    workers = [Worker("w0"), Worker("w1")]
    router: RouterProc | None = None
    pub = KVEventPublisher(
        pub_ep, replay_endpoint=replay_ep, buffer=MemoryReplayBuffer(), context=ctx
    )
    try:
        cfg = tmp_path / "router.toml"
        cfg.write_text(
            '[router]\nhealth_interval = "0.2s"\nconnect_timeout = "1s"\n'
            f'[[workers]]\nname = "w0"\nurl = "{workers[0].url}"\nnode = "n0"\n'
            f'[[workers]]\nname = "w1"\nurl = "{workers[1].url}"\nnode = "n1"\n'
            f'events = "{pub_ep}"\nevents_replay = "{replay_ep}"\n',
            encoding="utf-8",
        )
        router = RouterProc(cfg, tmp_path / "router.log")

        def w1_holds() -> bool:
            pub.publish([gpu_stored(HASHES)])  # again until the SUB socket has joined
            return bool(query(router)["workers"]["w1"]["gpu"] == len(PROMPT) // 16 * 16)

        wait_until(w1_holds, "the router to learn w1's blocks from its events")
        wait_until(lambda: source_health(router) == "live", "the source to be live")
        _, h, _ = router.post("/v1/completions", completion(PROMPT))
        assert worker_of(h) == "w1"

        # The stream is lost: the consumer's sync fails, the source goes stale and the
        # router reads w1 from its routing history instead (DEGRADED for that source).
        pub.close()
        wait_until(lambda: source_health(router) == "stale", "the lost source to go stale", 30)
        assert query(router)["mode"] == "degraded"
        # Its blocks now come from the routing history: the request sent there.
        assert query(router)["workers"]["w1"]["gpu"] == 3200

        # The engine comes back (a restart: seq from 0, its cache empty) and says so.
        pub = KVEventPublisher(
            pub_ep, replay_endpoint=replay_ep, buffer=MemoryReplayBuffer(), context=ctx
        )

        def live_again() -> bool:
            pub.publish([gpu_stored(HASHES[:50])])
            return source_health(router) == "live"

        wait_until(live_again, "the source to recover", 30)
        wait_until(
            lambda: query(router)["workers"]["w1"]["gpu"] == 50 * 16,
            "w1's view to be the new stream's (the restart cleared the old blocks)",
        )
    finally:
        pub.close()
        if router is not None:
            assert router.stop() == 0
        for w in workers:
            w.stop()
        ctx.destroy(linger=0)
