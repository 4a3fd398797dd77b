"""The connector's KV events on vLLM's own publisher, with vLLM's real scheduler.

Engine A (real v1 scheduler, ``kv_events_config`` enabled, vLLM's own
``ZmqEventPublisher`` on an ipc socket) saves a prompt through a real
sidecar with its event feed on. A subscriber of vLLM's stream must see
STORAGE ``BlockStored`` whose hashes are the engine's own hashes of the saved
blocks, and only after the sidecar acknowledged them; after a purge in the
sidecar, ``BlockRemoved`` for exactly those hashes, on vLLM's stream.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")
pytest.importorskip("zmq")

from vllm.config.kv_events import KVEventsConfig
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvoffload import protocol as p
from kvoffload.events.consumer import EventConsumer
from kvoffload.events.sources import SourceSpec
from kvoffload.events.wire import BlockStored
from kvoffload.transport import UnixTransport

from ..sidecar_proc import DevSidecar, dev_sidecar
from .engine import Engine, make_request, make_vllm_config

pytestmark = pytest.mark.vllm

CT = 32  # two 16-token blocks per chunk


@pytest.fixture
def events_sidecar(tmp_path: Path) -> Iterator[DevSidecar]:
    policy = tmp_path / "policy.toml"
    policy.write_text(
        'version = 1\n[tenants.tiny]\nquota = "1KiB"\n'
        f'[[grants]]\nuid = {os.getuid()}\ntenants = ["*"]\nadmin = true\n'
    )
    with dev_sidecar(env={"KVOFFLOAD_POLICY": str(policy), "KVOFFLOAD_EVENTS_ENABLED": "1"}) as s:
        yield s


def _purge(sc: DevSidecar, tenant: str) -> None:
    t = UnixTransport.connect(sc.socket_path, timeout_s=20)
    try:
        for rid, req in enumerate((p.Hello(1, 1, "events-test", (tenant,)), p.Purge(tenant)), 1):
            t.send(p.request_message(rid, req))
            got, reply = p.parse_reply(t.recv().msg)
            assert got == rid and not isinstance(reply, p.ErrorReply), reply
    finally:
        t.close()


def _engine(model: Path, sc: DevSidecar, endpoint: str, **extra: Any) -> Engine:
    cfg = make_vllm_config(
        model,
        {
            "tenant": extra.pop("tenant", "ev"),
            "socket_path": str(sc.socket_path),
            "chunk_tokens": CT,
            "staging_bytes": 1 << 20,
            "attention_backend": "FLASH_ATTN",
            "load_mode": "sync",
            "save_mode": "async",
            **extra,
        },
        async_scheduling=False,
    )
    cfg.kv_events_config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic="kv@test@tiny"
    )
    return Engine(cfg, num_blocks=128)


def _subscribed(consumer: EventConsumer) -> None:
    """Let the consumer's subscription reach vLLM's publisher before the engine
    runs: a PUB socket drops what it sends before a subscriber has joined (ZMQ's
    slow joiner), and this stream has no replay socket. An ipc connect is retried
    every 100 ms, so a second of polling is ample (synchronisation, not timing)."""
    for _ in range(20):
        consumer.poll(0.05)


def _storage(consumer: EventConsumer) -> frozenset[Any]:
    with consumer.lock:
        return consumer.view("vllm").hashes("STORAGE", "LOCAL")


@pytest.mark.parametrize("token_ids", [False, True])
def test_vllm_publishes_storage_events_for_saved_and_purged_chunks(
    tiny_model: Path, events_sidecar: DevSidecar, token_ids: bool
) -> None:
    d = Path(tempfile.mkdtemp(prefix="kvev-", dir="/tmp"))
    endpoint = f"ipc://{d}/vllm.pub"
    seen: list[BlockStored] = []

    def record(_src: str, _seq: int, batch: Any) -> None:
        seen.extend(e for e in batch.events if isinstance(e, BlockStored))

    consumer = EventConsumer(
        [SourceSpec("vllm", endpoint, topic="kv@test@tiny")], idle_check_s=0, on_batch=record
    )
    a = _engine(tiny_model, events_sidecar, endpoint, events_token_ids=token_ids)
    _subscribed(consumer)
    try:
        prompt = [(31 * i + 5) % 997 for i in range(3 * CT + 7)]
        ra = a.add(make_request("a", prompt))
        a.run_to_completion([ra])
        engine_hashes = [maybe_convert_block_hash(h) for h in ra.block_hashes[: 3 * CT // 16]]
        # GPU events flow from the first step: wait for the STORAGE ones.
        deadline = time.monotonic() + 30
        while _storage(consumer) != frozenset(engine_hashes):
            assert time.monotonic() < deadline, f"STORAGE view: {len(_storage(consumer))}"
            consumer.poll(0.05)
        stored = [e for e in seen if e.medium == "STORAGE"]
        assert {h for e in stored for h in e.block_hashes} == set(engine_hashes)
        for e in stored:
            assert e.locality == "LOCAL" and e.block_size == 16
            assert len(e.block_hashes) == CT // 16
            first = engine_hashes.index(e.block_hashes[0])
            assert e.parent_block_hash == (engine_hashes[first - 1] if first else None)
            if token_ids:
                assert list(e.token_ids) == prompt[first * 16 : (first + len(e.block_hashes)) * 16]
            else:
                assert e.token_ids == ()

        # The sidecar purges the tenant: its feed → the connector → vLLM's stream.
        _purge(events_sidecar, "ev")
        rb = a.add(make_request("b", [7] * 5))
        deadline = time.monotonic() + 60
        while _storage(consumer):
            assert time.monotonic() < deadline, "no BlockRemoved on vLLM's stream"
            if not rb.is_finished() or a.scheduler.requests:
                a.step()
            else:
                a.step()  # idle steps still collect connector events
            consumer.poll(0.05)
        assert consumer.status("vllm").gaps == 0
    finally:
        a.close()
        consumer.close()


def test_no_storage_event_for_a_save_the_sidecar_refused(
    tiny_model: Path, events_sidecar: DevSidecar
) -> None:
    """A tenant over its quota: the saves are rejected, vLLM's GPU events flow,
    and not one STORAGE BlockStored is published."""
    d = Path(tempfile.mkdtemp(prefix="kvev-", dir="/tmp"))
    endpoint = f"ipc://{d}/vllm.pub"
    consumer = EventConsumer([SourceSpec("vllm", endpoint, topic="kv@test@tiny")], idle_check_s=0)
    a = _engine(tiny_model, events_sidecar, endpoint, tenant="tiny")
    _subscribed(consumer)
    try:
        prompt = [(17 * i + 3) % 997 for i in range(3 * CT + 7)]
        ra = a.add(make_request("a", prompt))
        a.run_to_completion([ra])
        rb = a.add(make_request("b", [(5 * i) % 997 for i in range(2 * CT)]))
        for _ in range(40):  # steps in which a late STORAGE event would be published
            a.step()
            consumer.poll(0.02)
        a.run_to_completion([rb])
        consumer.poll(0.2)
        st = consumer.status("vllm")
        assert st.batches > 0  # vLLM's stream is flowing (GPU events)
        with consumer.lock:
            assert consumer.view("vllm").hashes("STORAGE", "LOCAL") == frozenset()
    finally:
        a.close()
        consumer.close()
