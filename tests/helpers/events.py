"""Helpers shared by the tests (moved out of test_events_store.py)."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvoffload import protocol as p
from kvoffload.events.consumer import EventConsumer
from kvoffload.events.sources import Health, SourceSpec
from kvoffload.sidecar.access.policy import TenantPolicy
from kvoffload.sidecar.config import EventsSettings
from kvoffload.sidecar.events import SidecarEvents, start_events
from kvoffload.store import Store, StoreConfig
from kvoffload.store.keys.keyring import Kek

NS = b"\x01" * 32


def chunk_key(i: int) -> bytes:
    return hashlib.blake2b(f"ev/{i}".encode(), digest_size=32).digest()


def blocks(i: int) -> p.EngineBlocks:
    return p.EngineBlocks(tuple(i.to_bytes(4, "big") + bytes([j]) * 28 for j in range(2)), 16)


def wired_store(
    tmp_path: Path, kek_file: Path
) -> Iterator[tuple[Store, SidecarEvents, EventConsumer]]:
    store = Store(
        StoreConfig(root=tmp_path / "store", durability="none", capacity_bytes=1 << 20),
        Kek.from_file(kek_file),
        create=True,
    )
    sock_dir = Path(tempfile.mkdtemp(prefix="kvev-st-", dir="/tmp"))
    events = start_events(
        EventsSettings(enabled=True), store.index, EventsPolicy, sock_dir / "k.sock"
    )
    store.events_hook = events
    base = sock_dir
    spec = SourceSpec(
        "s", f"ipc://{base / 'kvevents.pub'}", f"ipc://{base / 'kvevents.replay'}", snapshots=True
    )
    consumer = EventConsumer([spec], request_timeout_s=5, idle_check_s=0)
    try:
        yield store, events, consumer
    finally:
        consumer.close()
        store.events_hook = None
        events.close()
        store.close()
        shutil.rmtree(sock_dir, ignore_errors=True)


def announced(consumer: EventConsumer) -> set[Any]:
    for _ in range(200):
        consumer.poll(0.02)
        consumer.sync("s")
        if consumer.status("s").health is Health.LIVE:
            break
    with consumer.lock:
        return set(consumer.view("s").hashes("STORAGE", "LOCAL"))


class EventsPolicy:
    def __init__(self, off: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.off = off

    def tenant(self, tenant: str) -> TenantPolicy:
        return TenantPolicy(events=tenant not in self.off)
