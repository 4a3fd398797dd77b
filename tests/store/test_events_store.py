"""Every way a chunk leaves the store is published: TTL expiry, a failed
verification, an eviction for capacity, a purge; in-process store, real
LMDB, real files, real ZMQ sockets."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")

from kvoffload.events.consumer import EventConsumer  # noqa: E402
from kvoffload.layouts import v1  # noqa: E402
from kvoffload.sidecar.events import SidecarEvents  # noqa: E402
from kvoffload.store import Store  # noqa: E402
from tests.helpers.events import NS, EventsPolicy, announced, blocks, chunk_key  # noqa: E402
from tests.sidecar_proc import wait_until  # noqa: E402


def _put(store: Store, events: SidecarEvents, i: int, **kw: Any) -> None:
    assert store.put("acme", NS, chunk_key(i), [os.urandom(40_000)], **kw)
    assert events.record("acme", chunk_key(i), blocks(i))


def test_expiry_corruption_eviction_and_purge_are_published(
    wired: tuple[Store, SidecarEvents, EventConsumer],
) -> None:
    store, events, consumer = wired
    _put(store, events, 1, ttl_s=0.05)
    _put(store, events, 2)
    _put(store, events, 3)
    assert announced(consumer) == set(blocks(1).hashes) | set(blocks(2).hashes) | set(
        blocks(3).hashes
    )
    assert not events.record("acme", chunk_key(3), blocks(3))  # kept once, announced once
    time.sleep(0.1)
    assert store.expire() == 1
    assert announced(consumer) == set(blocks(2).hashes) | set(blocks(3).hashes)
    # A failed verification drops the chunk: published as removed.
    path = store.root / v1.object_relpath("acme", chunk_key(2))
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF
    path.chmod(0o600)
    path.write_bytes(bytes(raw))
    assert store.get("acme", chunk_key(2)) is None
    assert announced(consumer) == set(blocks(3).hashes)
    # Capacity: 1 MiB holds ~25 of these; older ones are evicted and published.
    for i in range(10, 60):
        _put_maybe(store, events, i)
    held = announced(consumer)
    present = {i for i in range(3, 60) if store.index.get("acme", chunk_key(i)) is not None}
    assert held == {h for i in present for h in blocks(i).hashes}
    assert 0 < len(present) < 50
    store.purge_tenant("acme", wait=True)
    assert announced(consumer) == set()


def _put_maybe(store: Store, events: SidecarEvents, i: int) -> None:
    if store.put("acme", NS, chunk_key(i), [os.urandom(40_000)]):
        events.record("acme", chunk_key(i), blocks(i))


def test_a_tenant_with_events_off_is_not_kept_or_published(
    wired: tuple[Store, SidecarEvents, EventConsumer],
) -> None:
    store, events, consumer = wired
    events._policy = lambda: EventsPolicy({"quiet"})  # type: ignore[assignment,return-value]
    assert store.put("quiet", NS, chunk_key(1), [b"x" * 1000])
    assert not events.record("quiet", chunk_key(1), blocks(1))
    assert store.index.get_blocks("quiet", chunk_key(1)) is None
    assert announced(consumer) == set()


def test_a_removal_is_published_whatever_the_tenant_setting_is_now(
    wired: tuple[Store, SidecarEvents, EventConsumer],
) -> None:
    store, events, consumer = wired
    _put(store, events, 1)
    _put(store, events, 2)
    assert announced(consumer) == set(blocks(1).hashes) | set(blocks(2).hashes)
    # The policy turned acme's events off, and its chunks leave before the
    # reload's retraction ran: they were announced, so their removal is too.
    events._policy = lambda: EventsPolicy({"acme"})  # type: ignore[assignment,return-value]
    assert store.delete("acme", chunk_key(1))
    assert announced(consumer) == set(blocks(2).hashes)
    store.purge_tenant("acme", wait=True)
    assert announced(consumer) == set()


def test_turning_events_off_retracts_and_forgets_what_was_announced(
    wired: tuple[Store, SidecarEvents, EventConsumer],
) -> None:
    store, events, consumer = wired
    for i in range(3):
        _put(store, events, i)
    assert store.put("beta", NS, chunk_key(9), [b"b" * 1000])
    assert events.record("beta", chunk_key(9), blocks(9))
    assert announced(consumer) == {h for i in (0, 1, 2, 9) for h in blocks(i).hashes}
    events._policy = lambda: EventsPolicy({"acme"})  # type: ignore[assignment,return-value]
    events.policy_changed()
    assert announced(consumer) == set(blocks(9).hashes)
    assert list(store.index.all_blocks("acme")) == []  # nothing left to announce or remove
    assert not events.record("acme", chunk_key(5), blocks(5))
    with events.lock:
        assert {h for e in events.snapshot() for h in e.block_hashes} == set(blocks(9).hashes)  # type: ignore[union-attr]
    # Removing a retracted chunk publishes nothing more (the view stays right).
    store.purge_tenant("acme", wait=True)
    assert announced(consumer) == set(blocks(9).hashes)
    assert consumer.view("s").unmatched_removals == 0


def test_an_expired_chunk_leaves_the_feed_without_a_read_or_a_sweep(
    wired: tuple[Store, SidecarEvents, EventConsumer],
) -> None:
    store, events, consumer = wired
    _put(store, events, 1, ttl_s=0.2)
    _put(store, events, 2)
    assert announced(consumer) == set(blocks(1).hashes) | set(blocks(2).hashes)
    events.watch_expiry(store.expire_due, 0.05)

    def gone() -> bool:
        return announced(consumer) == set(blocks(2).hashes)

    wait_until(gone, "the expired chunk's BlockRemoved")
    assert store.index.get("acme", chunk_key(1)) is None


def test_two_tenants_chunks_with_one_hash_are_counted_not_set(
    wired: tuple[Store, SidecarEvents, EventConsumer],
) -> None:
    # events-v1 §8: a consumer counts each hash; purging one tenant's chunk
    # leaves the other's, with the same engine hash, announced.
    store, events, consumer = wired
    _put(store, events, 1)
    assert store.put("beta", NS, chunk_key(1), [b"b" * 1000])
    assert events.record("beta", chunk_key(1), blocks(1))
    announced(consumer)
    with consumer.lock:
        assert set(consumer.view("s").snapshot()[("STORAGE", "LOCAL")].values()) == {2}
    store.purge_tenant("beta", wait=True)
    assert announced(consumer) == set(blocks(1).hashes)
    with consumer.lock:
        assert set(consumer.view("s").snapshot()[("STORAGE", "LOCAL")].values()) == {1}
