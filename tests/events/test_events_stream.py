"""Publisher and consumer over real ZMQ sockets: gaps, replay, snapshot, restarts.

A small "store" (chunk → engine hashes) stands for the sidecar's index: each
change is made and published under the publisher's lock, and its snapshot is
the store's truth. Every scenario ends by comparing the consumer's view with
that truth.
"""

from __future__ import annotations

import os
import stat
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

zmq = pytest.importorskip("zmq")

from kvoffload.events.consumer import EventConsumer  # noqa: E402
from kvoffload.events.publisher import KVEventPublisher, MemoryReplayBuffer  # noqa: E402
from kvoffload.events.sources import Health, Recovery, SourceSpec  # noqa: E402
from kvoffload.events.view import BlockView  # noqa: E402
from kvoffload.events.wire import (  # noqa: E402
    BlockRemoved,
    BlockStored,
    Event,
    make_seq,
    split_seq,
)

MEDIUM = "STORAGE"


class Store:
    """Chunks and their engine hashes; publishes each change."""

    def __init__(self) -> None:
        self.chunks: dict[int, tuple[bytes, ...]] = {}
        self.pub: KVEventPublisher | None = None
        self._next = 0

    @staticmethod
    def stored(hashes: tuple[bytes, ...]) -> BlockStored:
        return BlockStored(hashes, None, (), 16, None, MEDIUM, None, locality="LOCAL")

    def snapshot(self) -> list[Event]:
        return [self.stored(h) for h in self.chunks.values()]

    def truth(self) -> dict[tuple[str | None, str | None], dict[bytes | int, int]]:
        view = BlockView()
        view.apply_all(self.snapshot())
        return view.snapshot()

    def _publish(self, events: list[Event]) -> None:
        if self.pub is not None:
            self.pub.publish(events)

    def save(self, n_blocks: int = 2) -> int:
        lock = self.pub.lock if self.pub is not None else threading.RLock()
        with lock:
            cid = self._next
            self._next += 1
            hashes = tuple(cid.to_bytes(4, "big") + bytes([i]) * 28 for i in range(n_blocks))
            self.chunks[cid] = hashes
            self._publish([self.stored(hashes)])
            return cid

    def evict(self, cid: int) -> None:
        lock = self.pub.lock if self.pub is not None else threading.RLock()
        with lock:
            hashes = self.chunks.pop(cid)
            self._publish([BlockRemoved(hashes, MEDIUM, locality="LOCAL")])


@pytest.fixture
def endpoints(tmp_path: Path) -> tuple[str, str]:
    # ipc paths are limited to ~107 bytes: keep them short.
    d = Path("/tmp") / f"kvev-{os.getpid()}-{tmp_path.name[-12:]}"
    d.mkdir(exist_ok=True)
    return f"ipc://{d}/pub", f"ipc://{d}/replay"


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _publisher(
    store: Store, endpoints: tuple[str, str], ctx: zmq.Context, **kw: object
) -> KVEventPublisher:
    pub, rep = endpoints
    p = KVEventPublisher(pub, replay_endpoint=rep, snapshot=store.snapshot, context=ctx, **kw)  # type: ignore[arg-type]
    store.pub = p
    return p


def _spec(endpoints: tuple[str, str], snapshots: bool = True) -> SourceSpec:
    return SourceSpec("node", endpoints[0], endpoints[1], snapshots=snapshots)


def _settle(consumer: EventConsumer, pub: KVEventPublisher, rounds: int = 400) -> None:
    """Poll until the consumer has the publisher's last seq (a wait, not a timing check)."""
    for _ in range(rounds):
        consumer.poll(0.02)
        st = consumer.status("node")
        if st.last_seq == pub.last_seq() and st.health is Health.LIVE:
            return
        if st.last_seq is not None and st.last_seq < pub.last_seq():
            consumer.sync("node")
    raise AssertionError(f"the consumer never caught up: {consumer.status('node')}")


def _wait_subscribed(consumer: EventConsumer, store: Store, pub: KVEventPublisher) -> None:
    """Publish until one batch arrives live (ZMQ's slow joiner drops the first ones)."""
    for _ in range(200):
        store.save(1)
        before = consumer.status("node").batches
        consumer.poll(0.02)
        if consumer.status("node").batches > before:
            return
    raise AssertionError("the SUB socket never received a batch")


def test_a_consumer_follows_live_batches(endpoints: tuple[str, str], ctx: zmq.Context) -> None:
    store = Store()
    with (
        _publisher(store, endpoints, ctx) as pub,
        EventConsumer(
            [_spec(endpoints)], context=ctx, request_timeout_s=2, idle_check_s=0
        ) as consumer,
    ):
        st = consumer.status("node")
        assert st.health is Health.LIVE and st.recoveries[Recovery.SNAPSHOT] == 1
        _wait_subscribed(consumer, store, pub)
        ids = [store.save() for _ in range(20)]
        for cid in ids[:7]:
            store.evict(cid)
        _settle(consumer, pub)
        with consumer.lock:
            assert consumer.view("node").snapshot() == store.truth()
        assert len(consumer.view("node")) == sum(len(h) for h in store.chunks.values())
        first = ids[8]
        hashes = list(store.chunks[first])
        assert consumer.locate([*hashes, b"x" * 32], MEDIUM) == {"node": 2}
        assert consumer.status("node").gaps == 0


def test_a_gap_is_replayed_from_the_buffer(endpoints: tuple[str, str], ctx: zmq.Context) -> None:
    store = Store()
    with (
        _publisher(store, endpoints, ctx) as pub,
        EventConsumer(
            [_spec(endpoints)], context=ctx, request_timeout_s=2, idle_check_s=0
        ) as consumer,
    ):
        _wait_subscribed(consumer, store, pub)
        consumer.pause("node")
        missed = [store.save() for _ in range(10)]
        store.evict(missed[3])
        assert pub.flush()  # sent while the consumer is away
        consumer.resume("node")
        _wait_subscribed(consumer, store, pub)  # the first live batch shows the gap
        _settle(consumer, pub)
        st = consumer.status("node")
        assert st.gaps >= 1 and st.recoveries[Recovery.REPLAY] >= 1
        assert st.recoveries[Recovery.SNAPSHOT] == 1  # the first contact only
        with consumer.lock:
            assert consumer.view("node").snapshot() == store.truth()


def test_a_gap_older_than_the_buffer_loads_a_snapshot(
    endpoints: tuple[str, str], ctx: zmq.Context
) -> None:
    store = Store()
    with (
        _publisher(store, endpoints, ctx, buffer=MemoryReplayBuffer(4)) as pub,
        EventConsumer(
            [_spec(endpoints)], context=ctx, request_timeout_s=2, idle_check_s=0
        ) as consumer,
    ):
        _wait_subscribed(consumer, store, pub)
        consumer.pause("node")
        ids = [store.save() for _ in range(30)]
        for cid in ids[::3]:
            store.evict(cid)
        assert pub.flush()
        consumer.resume("node")
        _wait_subscribed(consumer, store, pub)
        _settle(consumer, pub)
        st = consumer.status("node")
        assert st.recoveries[Recovery.SNAPSHOT] == 2  # first contact, then the overrun
        with consumer.lock:
            assert consumer.view("node").snapshot() == store.truth()


def test_a_lost_last_batch_is_found_by_the_idle_check(
    endpoints: tuple[str, str], ctx: zmq.Context
) -> None:
    store = Store()
    with (
        _publisher(store, endpoints, ctx) as pub,
        EventConsumer(
            [_spec(endpoints)], context=ctx, request_timeout_s=2, idle_check_s=0.05
        ) as consumer,
    ):
        _wait_subscribed(consumer, store, pub)
        consumer.pause("node")
        store.evict(store.save())  # nothing after it will show a gap
        assert pub.flush()  # sent while the consumer is away
        consumer.resume("node")
        for _ in range(200):
            consumer.poll(0.02)
            if consumer.status("node").last_seq == pub.last_seq():
                break
        st = consumer.status("node")
        assert st.last_seq == pub.last_seq() and st.gaps == 0
        assert st.recoveries[Recovery.REPLAY] >= 1
        with consumer.lock:
            assert consumer.view("node").snapshot() == store.truth()


def test_a_restarted_publisher_is_a_new_incarnation_and_the_view_is_resynced(
    endpoints: tuple[str, str], ctx: zmq.Context
) -> None:
    store = Store()
    consumer = EventConsumer([_spec(endpoints)], context=ctx, request_timeout_s=0.5, idle_check_s=0)
    try:
        pub = _publisher(store, endpoints, ctx, incarnation=3)
        consumer.sync("node")
        _wait_subscribed(consumer, store, pub)
        ids = [store.save() for _ in range(5)]
        _settle(consumer, pub)
        old_last = pub.last_seq()
        pub.close()
        # While it is down the store changes and nothing is published (a crash
        # between a store change and its event).
        store.pub = None
        store.evict(ids[0])
        store.save()
        consumer.sync("node")  # nobody answers: stale, not wrong
        assert consumer.status("node").health is Health.STALE
        pub = _publisher(store, endpoints, ctx, incarnation=4)
        _wait_subscribed(consumer, store, pub)
        _settle(consumer, pub)
        st = consumer.status("node")
        assert split_seq(st.last_seq or 0)[0] == 4 and (st.last_seq or 0) > old_last
        assert st.recoveries[Recovery.SNAPSHOT] >= 2
        with consumer.lock:
            assert consumer.view("node").snapshot() == store.truth()
        pub.close()
    finally:
        consumer.close()


def test_an_engine_without_snapshots_that_restarts_is_cleared(
    endpoints: tuple[str, str], ctx: zmq.Context
) -> None:
    """A vLLM engine restarts its seqs at 0 and its GPU blocks are gone."""
    store = Store()
    consumer = EventConsumer(
        [_spec(endpoints, snapshots=False)], context=ctx, request_timeout_s=1, idle_check_s=0
    )
    try:
        pub = KVEventPublisher(endpoints[0], replay_endpoint=endpoints[1], context=ctx)
        store.pub = pub
        for _ in range(200):
            store.save()
            consumer.poll(0.02)
            if consumer.status("node").batches:
                break
        for _ in range(50):  # the new run's seqs will be seen below the old last
            store.save()
        _settle(consumer, pub)
        assert consumer.status("node").health is Health.LIVE
        with consumer.lock:
            assert consumer.view("node").snapshot() == store.truth()
        pub.close()
        store.chunks.clear()  # the engine's GPU blocks died with it
        pub = KVEventPublisher(endpoints[0], replay_endpoint=endpoints[1], context=ctx)
        store.pub = pub
        for _ in range(200):
            store.save()
            consumer.poll(0.02)
            if consumer.status("node").recoveries[Recovery.RESTART]:
                break
        _settle(consumer, pub)
        with consumer.lock:
            assert consumer.view("node").snapshot() == store.truth()
        assert consumer.status("node").recoveries[Recovery.RESTART] == 1
        pub.close()
    finally:
        consumer.close()


def test_an_engine_that_restarted_unseen_is_cleared_even_when_its_seq_looks_next(
    endpoints: tuple[str, str], ctx: zmq.Context
) -> None:
    """A lost engine comes back restarted; the consumer missed its first batches (a
    partition, or a late subscription), so the first batch it sees carries exactly
    the seq after its own last. That is no proof of continuity: the consumer checks
    its last batch through the replay socket, sees the restart and clears the view."""
    store = Store()
    # No retry of the stale source while the test runs: the live batch is what
    # brings it back (a retry's replay would find the restart on its own).
    consumer = EventConsumer(
        [_spec(endpoints, snapshots=False)],
        context=ctx,
        request_timeout_s=1,
        idle_check_s=0,
        retry_after_s=600,
    )
    try:
        pub = KVEventPublisher(endpoints[0], replay_endpoint=endpoints[1], context=ctx)
        store.pub = pub
        for _ in range(200):
            store.save()
            consumer.poll(0.02)
            if consumer.status("node").batches:
                break
        store.save()
        _settle(consumer, pub)
        last = consumer.status("node").last_seq
        assert last is not None
        # The stream is lost: the consumer cannot reach it and goes stale.
        consumer.pause("node")
        pub.close()
        consumer.sync("node")
        batches = consumer.status("node").batches
        assert consumer.status("node").health is Health.STALE
        # The engine restarts (its GPU blocks died with it) and numbers from 0 again;
        # its batches 0..last go by while the consumer is cut off.
        store.chunks.clear()
        pub = KVEventPublisher(endpoints[0], replay_endpoint=endpoints[1], context=ctx)
        store.pub = pub
        while pub.last_seq() < last:
            store.save()
        assert pub.last_seq() == last
        assert pub.flush()
        consumer.resume("node")
        time.sleep(0.5)  # let the SUB socket join, so that seq last + 1 is the first it gets
        for _ in range(200):
            store.save()
            consumer.poll(0.02)
            if consumer.status("node").batches > batches:
                break
        assert consumer.status("node").recoveries[Recovery.RESTART] == 1
        _settle(consumer, pub)
        with consumer.lock:
            assert consumer.view("node").snapshot() == store.truth()
        assert consumer.status("node").recoveries[Recovery.RESTART] == 1
        pub.close()
    finally:
        consumer.close()


def test_malformed_messages_are_counted_and_skipped(
    endpoints: tuple[str, str], ctx: zmq.Context
) -> None:
    raw = ctx.socket(zmq.PUB)
    raw.bind(endpoints[0])
    consumer = EventConsumer(
        [SourceSpec("node", endpoints[0])], context=ctx, request_timeout_s=1, idle_check_s=0
    )
    try:
        good = [b"", make_seq(0, 0).to_bytes(8, "big"), b"\x92\xcb" + b"\x00" * 8 + b"\x90"]
        for _ in range(200):
            raw.send_multipart([b"t", b"short"])
            raw.send_multipart([b"t", b"\x00" * 8, b"\xc1"])
            raw.send_multipart(good)
            consumer.poll(0.02)
            if consumer.status("node").batches:
                break
        st = consumer.status("node")
        assert st.batches >= 1 and st.malformed >= 2
        assert st.last_error is not None and "\n" not in st.last_error
    finally:
        consumer.close()
        raw.close(linger=0)


def test_ipc_sockets_are_0660(endpoints: tuple[str, str], ctx: zmq.Context) -> None:
    store = Store()
    with _publisher(store, endpoints, ctx):
        for ep in endpoints:
            mode = stat.S_IMODE(os.stat(ep.removeprefix("ipc://")).st_mode)
            assert mode == 0o660, oct(mode)
    assert not Path(endpoints[0].removeprefix("ipc://")).exists()


def test_replay_answers_like_vllm(endpoints: tuple[str, str], ctx: zmq.Context) -> None:
    """DEALER ["", start] → ["", topic, seq, payload]* then ["", "", -1, ""]."""
    store = Store()
    pub_ep, rep_ep = endpoints
    with KVEventPublisher(pub_ep, replay_endpoint=rep_ep, topic="kv@n@m", context=ctx) as pub:
        store.pub = pub
        for _ in range(5):
            store.save()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 5000)
        dealer.connect(rep_ep)
        start = make_seq(0, 3)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            parts = dealer.recv_multipart()
            assert parts[0] == b"" and len(parts) == 4
            if parts[2] == (-1).to_bytes(8, "big", signed=True):
                assert parts[1] == b"" and parts[3] == b""
                break
            assert parts[1] == b"kv@n@m"
            got.append(int.from_bytes(parts[2], "big"))
        assert got == [make_seq(0, c) for c in (3, 4, 5)]
        dealer.close(linger=0)


def test_metrics_report_health_counters_and_blocks(
    endpoints: tuple[str, str], ctx: zmq.Context
) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    store = Store()
    with (
        _publisher(store, endpoints, ctx) as pub,
        EventConsumer(
            [_spec(endpoints)], context=ctx, request_timeout_s=2, idle_check_s=0
        ) as consumer,
    ):
        registry = CollectorRegistry()
        consumer.register_metrics(registry)
        _wait_subscribed(consumer, store, pub)
        store.save(3)
        _settle(consumer, pub)
        text = generate_latest(registry).decode()
        n = sum(len(h) for h in store.chunks.values())
        assert (
            f'kvoffload_events_blocks{{locality="LOCAL",medium="STORAGE",source="node"}} {n}.0'
            in text
        )
        assert 'kvoffload_events_source_health{source="node",state="live"} 1.0' in text
        assert 'kvoffload_events_recoveries_total{kind="snapshot",source="node"} 1.0' in text
        assert f'kvoffload_events_last_seq{{source="node"}} {float(pub.last_seq())}' in text


def test_randomized_interleavings_never_diverge(
    endpoints: tuple[str, str], ctx: zmq.Context
) -> None:
    """Failure mode 5 over real sockets: saves, evictions, purges, consumer pauses,
    buffer overruns and publisher restarts (a new incarnation, changes lost
    between store and feed) in random order; after each round the consumer's
    view must equal the store's truth. Divergences and recoveries are printed.
    """
    import random

    rng = random.Random(1234)
    store = Store()
    buffer = MemoryReplayBuffer(16)  # the durable buffer survives restarts, bounded
    incarnation = 1
    pub = _publisher(store, endpoints, ctx, buffer=buffer, incarnation=incarnation)
    consumer = EventConsumer([_spec(endpoints)], context=ctx, request_timeout_s=2, idle_check_s=0)
    kinds: Counter[str] = Counter()
    divergences = 0
    # A fixed seed: the same 300 operations every run (85 publisher restarts, 55
    # pauses; each recovery kind dozens of times), 1000 added no kind of event.
    rounds = 300
    try:
        _wait_subscribed(consumer, store, pub)
        for _ in range(rounds):
            op = rng.choice(["save", "save", "evict", "purge", "pause", "restart", "lost"])
            kinds[op] += 1
            if op == "save":
                for _ in range(rng.randint(1, 3)):
                    store.save(rng.randint(1, 3))
            elif op == "evict" and store.chunks:
                for cid in rng.sample(sorted(store.chunks), min(len(store.chunks), 2)):
                    store.evict(cid)
            elif op == "purge":
                for cid in sorted(store.chunks):
                    store.evict(cid)
            elif op == "pause":
                consumer.pause("node")
                for _ in range(rng.randint(1, 30)):  # may overrun the buffer of 16
                    store.save(1)
                    if store.chunks and rng.random() < 0.3:
                        store.evict(rng.choice(sorted(store.chunks)))
                consumer.resume("node")
            elif op == "restart":
                pub.close()
                incarnation += 1
                pub = _publisher(store, endpoints, ctx, buffer=buffer, incarnation=incarnation)
            elif op == "lost":
                # Killed between a store change and its event: nothing published.
                pub.close()
                store.pub = None
                store.save(1)
                if len(store.chunks) > 1:
                    store.evict(min(store.chunks))
                incarnation += 1
                pub = _publisher(store, endpoints, ctx, buffer=buffer, incarnation=incarnation)
            store.save(1)  # a live batch after every round shows any gap
            _settle(consumer, pub)
            with consumer.lock:
                if consumer.view("node").snapshot() != store.truth():
                    divergences += 1
        st = consumer.status("node")
        print(
            f"\n{rounds} interleavings {dict(kinds)}: divergences {divergences}; "
            f"recoveries {dict(st.recoveries)}, gaps {st.gaps}, duplicates {st.duplicates}"
        )
        assert divergences == 0
        assert st.recoveries[Recovery.REPLAY] > 0 and st.recoveries[Recovery.SNAPSHOT] > 1
        assert st.recoveries[Recovery.RESTART] > 0
    finally:
        consumer.close()
        pub.close()


def _child_reads(endpoints: tuple[str, str], uid: int, gid: int, groups: list[int]) -> bool:
    """Fork, drop to ``uid``/``gid``/``groups``, and try the feed and the replay socket."""
    with warnings.catch_warnings():
        # Python 3.12 warns on fork() in a threaded process; the child only
        # drops privileges and opens a context of its own.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: a fresh ZMQ context, never the parent's
        code = 2
        try:
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            c = zmq.Context()
            sub = c.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoints[0])
            dealer = c.socket(zmq.DEALER)
            dealer.connect(endpoints[1])
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            got_replay = bool(dealer.poll(3000))
            got_live = bool(sub.poll(3000))
            code = 0 if (got_replay or got_live) else 1
            for s in (sub, dealer):
                s.close(linger=0)
            c.term()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code in (0, 1), f"the child failed ({code})"
    return code == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another uid")
def test_a_uid_outside_the_group_cannot_read_the_feed(ctx: zmq.Context) -> None:
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="kvev-perm-", dir="/tmp"))
    d.chmod(0o755)
    eps = (f"ipc://{d}/pub", f"ipc://{d}/replay")
    group = 54321  # the socket group; "nobody" is not in it unless given
    pub = KVEventPublisher(eps[0], replay_endpoint=eps[1], ipc_group=group, context=ctx)
    stop = threading.Event()

    def keep_publishing() -> None:
        while not stop.wait(0.05):
            pub.publish([BlockRemoved((1,), MEDIUM)])

    t = threading.Thread(target=keep_publishing)
    t.start()
    try:
        for ep in eps:
            st = os.stat(ep.removeprefix("ipc://"))
            assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == group
        assert not _child_reads(eps, 65534, 65534, [])
        assert _child_reads(eps, 65534, 65534, [group])
    finally:
        stop.set()
        t.join()
        pub.close()


def test_tcp_with_curve_keys_admits_only_the_key_holder(ctx: zmq.Context) -> None:
    if not zmq.has("curve"):
        pytest.skip("this libzmq has no CURVE")
    from kvoffload.events.publisher import CurveServer
    from kvoffload.events.sources import CurveClient

    server_pub, server_sec = zmq.curve_keypair()
    client_pub, client_sec = zmq.curve_keypair()
    wild = ("tcp://127.0.0.1:*", "tcp://127.0.0.2:*")
    store = Store()
    pub = _publisher(store, wild, ctx, curve=CurveServer(server_pub, server_sec))
    assert pub.replay_endpoint is not None
    eps = (pub.endpoint, pub.replay_endpoint)
    try:
        keyed = EventConsumer(
            [SourceSpec("node", *eps, snapshots=True,
                        curve=CurveClient(server_pub, client_pub, client_sec))],
            context=ctx, request_timeout_s=3, idle_check_s=0,
        )  # fmt: skip
        plain = EventConsumer(
            [SourceSpec("node", *eps, snapshots=True)],
            context=ctx, request_timeout_s=1, idle_check_s=0,
        )  # fmt: skip
        try:
            assert keyed.status("node").health is Health.LIVE  # its snapshot came
            assert plain.status("node").health is Health.STALE  # no answer without keys
            _wait_subscribed(keyed, store, pub)
            _settle(keyed, pub)
            plain.poll(0.2)
            st = plain.status("node")
            assert st.batches == 0 and st.last_seq is None
        finally:
            keyed.close()
            plain.close()
    finally:
        pub.close()
