"""A KV-event publisher in vLLM's format, with replay, snapshots and access (events-v1 §4-§7).

:class:`KVEventPublisher` binds an XPUB socket (a PUB to its subscribers)
and, optionally, a ROUTER that answers replay requests exactly as vLLM's
``ZmqEventPublisher`` does and snapshot requests (``snapshot/1``) as a
kvoffload sidecar does. Unlike vLLM's, it numbers batches
``make_seq(incarnation, counter)`` with the counter from 1, and keeps its
replay buffer behind the small :class:`ReplayBuffer` interface, so the
sidecar can keep it durable.

One thread of its own owns the sockets: :meth:`KVEventPublisher.publish`
numbers and buffers a batch on the caller's thread, under :attr:`lock`, and
hands it to that thread through an inproc pipe (in order, never dropped),
which sends it, answers requests and, with a :class:`~.access.FeedAccess`,
the ZAP handshakes and every subscription (events-v1 §7.1): a reader gets
the full feed, a peer that may see a tenant gets that tenant's *channel*, a
feed of its own (topic ``kvoffload-tenant/<tenant>/<topic>``, its own seqs,
an in-memory buffer, a snapshot of the tenant's chunks; ``publish(...,
tenant=)`` sends a batch on both).

Consistency of a snapshot: the snapshot source is called under :attr:`lock`,
and the caller holds the same lock across "change the store, publish the
change", so a snapshot taken at seq S holds exactly the effects of batches up
to S.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import zmq

from kvoffload.errors import EventDecodeError

from .access import (
    TENANT_TOPIC_PREFIX,
    FeedAccess,
    FeedPeer,
    Visibility,
    check_feed_topic,
    peer_from_ipc_address,
    tenant_of_topic,
    tenant_topic,
)
from .wire import (
    END_SEQ_BYTES,
    SNAPSHOT_REQUEST,
    Event,
    EventBatch,
    decode_replay_request,
    encode_batch,
    make_seq,
    split_seq,
)

__all__ = [
    "SNAPSHOT_REQUEST",
    "CurveServer",
    "KVEventPublisher",
    "MemoryReplayBuffer",
    "ReplayBuffer",
    "SnapshotSource",
    "TenantSnapshotSource",
]

log = logging.getLogger("kvoffload.events")

#: Events per message of a snapshot (a snapshot of a million chunks is ~4000 messages).
SNAPSHOT_EVENTS_PER_MESSAGE = 256
#: Tenant channels a request may make (publishing makes them regardless): a
#: peer granted every tenant naming ever new ones must not grow memory.
MAX_CHANNELS = 10_000

SnapshotSource = Callable[[], Iterable[Event]]
TenantSnapshotSource = Callable[[str], Iterable[Event]]

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_ZAP_IPC = b"kvoffload-ipc"
_ZAP_OTHER = b"kvoffload-net"
_REBIND = b"rebind"
_FLUSH = b"flush"
_pipe_ids = itertools.count()


class ReplayBuffer(Protocol):
    """Published batches by seq, oldest dropped first beyond a bound."""

    def append(self, seq: int, payload: bytes) -> None: ...

    def since(self, seq: int) -> list[tuple[int, bytes]]: ...

    def last_seq(self) -> int | None: ...


class MemoryReplayBuffer:
    """vLLM's kind of buffer: in memory, lost with the process."""

    def __init__(self, maxlen: int = 100_000) -> None:
        self._items: deque[tuple[int, bytes]] = deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def append(self, seq: int, payload: bytes) -> None:
        with self._lock:
            self._items.append((seq, payload))

    def since(self, seq: int) -> list[tuple[int, bytes]]:
        with self._lock:
            return [(s, p) for s, p in self._items if s >= seq]

    def last_seq(self) -> int | None:
        with self._lock:
            return self._items[-1][0] if self._items else None


@dataclass(frozen=True)
class CurveServer:
    """The publisher's CURVE key pair (Z85); subscribers need the public key."""

    public_key: bytes
    secret_key: bytes


def _ipc_path(endpoint: str) -> Path | None:
    return Path(endpoint.removeprefix("ipc://")) if endpoint.startswith("ipc://") else None


@dataclass
class _Channel:
    """One numbered stream: the full feed (``tenant`` None) or a tenant's channel."""

    topic: bytes
    buffer: ReplayBuffer
    tenant: str | None = None
    counter: int = 0


class KVEventPublisher:
    """XPUB (+ ROUTER for replay and snapshots) for one topic and its tenant channels.

    ``incarnation``: this run's number (the sidecar raises a durable counter
    at every start); the first batch is ``make_seq(incarnation, 1)``.
    ``ipc_mode``/``ipc_group``: permissions of ``ipc://`` socket files.
    ``access``: check every peer (events-v1 §7.1; the publisher then runs a
    ZMQ context of its own, whose ZAP endpoint it binds); None: anyone who
    can connect reads the full feed. ``tenant_snapshot``: serve tenant
    channels (each buffering its last ``tenant_buffer`` batches in memory).
    ``start``: False to :meth:`start` the socket thread later (after a first
    batch, say), so that no request is answered before.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        snapshot_endpoint: str | None = None,
        topic: str = "",
        incarnation: int = 0,
        buffer: ReplayBuffer | None = None,
        snapshot: SnapshotSource | None = None,
        data_parallel_rank: int | None = None,
        ipc_mode: int = 0o660,
        ipc_group: int | None = None,
        curve: CurveServer | None = None,
        hwm: int = 100_000,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        access: FeedAccess | None = None,
        tenant_snapshot: TenantSnapshotSource | None = None,
        tenant_buffer: int = 1000,
        start: bool = True,
    ) -> None:
        if tenant_snapshot is not None:
            check_feed_topic(topic.encode())
        self._access = access
        self._own_ctx = access is not None  # its ZAP endpoint must be its own
        self._ctx: zmq.Context[zmq.Socket[bytes]] = (
            zmq.Context() if self._own_ctx else context or zmq.Context.instance()
        )
        self._incarnation = incarnation
        full_buffer = buffer if buffer is not None else MemoryReplayBuffer()
        self._full = _Channel(topic.encode(), full_buffer)
        self._channels: dict[str, _Channel] = {}
        self._tenant_snapshot = tenant_snapshot
        self._tenant_buffer = tenant_buffer
        self._snapshot = snapshot
        self._rank = data_parallel_rank
        self._ipc_mode = ipc_mode
        self._ipc_group = ipc_group
        self._curve = curve
        self._hwm = hwm
        #: Hold it across a store change and the publish of that change.
        self.lock = threading.RLock()
        self._send_lock = threading.Lock()
        self._closed = threading.Event()
        self._ipc_files: list[Path] = []
        self._thread: threading.Thread | None = None
        self._poller = zmq.Poller()
        self._flushes: dict[bytes, threading.Event] = {}
        #: When a refusal was last logged, per uid.
        self._refused: dict[int | None, float] = {}
        try:
            self._zap: zmq.Socket[bytes] | None = None
            if access is not None:
                self._zap = self._ctx.socket(zmq.REP)
                self._zap.setsockopt(zmq.LINGER, 0)
                self._zap.bind(_ZAP_ENDPOINT)
            # publish() hands batches to the socket thread through this pipe.
            pipe = f"inproc://kvoffload-feed-{os.getpid()}-{next(_pipe_ids)}"
            self._pipe_out: zmq.Socket[bytes] = self._socket(zmq.PAIR)
            self._pipe_out.bind(pipe)
            self._pipe_in: zmq.Socket[bytes] = self._socket(zmq.PAIR)
            self._pipe_in.connect(pipe)
            self._xpub = self._new_xpub()
            #: The bound endpoint (``tcp://host:*`` resolved to its port).
            self.endpoint = self._bind(self._xpub, endpoint)
            self._routers: list[zmq.Socket[bytes]] = []
            bound: dict[str, str] = {}
            for ep in dict.fromkeys(e for e in (replay_endpoint, snapshot_endpoint) if e):
                router = self._socket(zmq.ROUTER)
                bound[ep] = self._bind(router, ep)
                self._routers.append(router)
        except BaseException:
            self._close_sockets()
            raise
        self.replay_endpoint = bound.get(replay_endpoint or "")
        self.snapshot_endpoint = bound.get(snapshot_endpoint or "") or self.replay_endpoint
        if start:
            self.start()

    def _socket(self, kind: int) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        # The pipe and the ROUTERs queue whole batches, replays and snapshots,
        # never dropped mid-stream.
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        return sock

    def _new_xpub(self) -> zmq.Socket[bytes]:
        xpub: zmq.Socket[bytes] = self._ctx.socket(zmq.XPUB)
        xpub.setsockopt(zmq.SNDHWM, self._hwm)
        xpub.setsockopt(zmq.LINGER, 0)
        if self._access is not None:
            # Each subscription is granted here, per peer (_on_subscription).
            xpub.setsockopt(zmq.XPUB_MANUAL, 1)
        return xpub

    def start(self) -> None:
        """Start the socket thread (once): batches go out, requests are answered."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._serve, name="kvoffload-events", daemon=True
            )
            self._thread.start()

    # -- publishing ---------------------------------------------------------------------

    @property
    def incarnation(self) -> int:
        return self._incarnation

    @property
    def topic(self) -> bytes:
        return self._full.topic

    def last_seq(self) -> int:
        """The seq of the last batch published in this incarnation (counter 0: none yet)."""
        with self.lock:
            return make_seq(self._incarnation, self._full.counter)

    def publish(
        self, events: Sequence[Event], ts: float | None = None, *, tenant: str | None = None
    ) -> int:
        """Number, buffer and send one batch; returns its seq (of the full feed).

        ``tenant``: the batch is also sent on that tenant's channel (when the
        publisher serves channels), numbered there.
        """
        if self._closed.is_set():
            raise RuntimeError("the publisher is closed")
        with self.lock:
            now = time.time() if ts is None else ts
            seq = self._emit(self._full, events, now)
            if tenant is not None and self._tenant_snapshot is not None:
                self._emit(self._channel(tenant), events, now)
            return seq

    def announce(self, tenants: Iterable[str] = ()) -> int:
        """An empty batch on the full feed and on each of ``tenants``' channels: the
        start of an incarnation (events-v1 §4) for those who follow them."""
        with self.lock:
            seq = self.publish([])
            if self._tenant_snapshot is not None:
                for t in tenants:
                    self._channel(t)
            return seq

    def _channel(self, tenant: str) -> _Channel:
        """``tenant``'s channel (under :attr:`lock`); a new one starts with an empty batch."""
        ch = self._channels.get(tenant)
        if ch is None:
            ch = _Channel(
                tenant_topic(tenant, self._full.topic),
                MemoryReplayBuffer(self._tenant_buffer),
                tenant=tenant,
            )
            self._channels[tenant] = ch
            self._emit(ch, [], time.time())
        return ch

    def _emit(self, ch: _Channel, events: Sequence[Event], ts: float) -> int:
        ch.counter += 1
        seq = make_seq(self._incarnation, ch.counter)
        payload = encode_batch(EventBatch(ts, tuple(events), self._rank))
        # Buffered first: a subscriber that sees seq N can always replay N.
        ch.buffer.append(seq, payload)
        with self._send_lock:
            if not self._closed.is_set():
                self._pipe_out.send_multipart([ch.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def refresh_access(self) -> None:
        """The access changed (a policy reload): cut every subscriber off so that each
        reconnects and is checked anew (ZMQ resubscribes on its own; what it missed
        meanwhile it replays). Nothing to do without access control."""
        if self._access is None:
            return
        with self._send_lock:
            if not self._closed.is_set():
                self._pipe_out.send_multipart([_REBIND])

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every batch published so far has been sent (False: not within
        ``timeout_s``, or the socket thread is not running)."""
        if self._thread is None or self._closed.is_set():
            return False
        done = threading.Event()
        key = str(id(done)).encode()
        self._flushes[key] = done
        try:
            with self._send_lock:
                self._pipe_out.send_multipart([_FLUSH, key])
            return done.wait(timeout_s)
        finally:
            self._flushes.pop(key, None)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self.flush(timeout_s=1.0)  # what was published before close goes out
        with self._send_lock:
            self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._close_sockets()
        for path in self._ipc_files:
            with contextlib.suppress(OSError):
                path.unlink()
        if self._own_ctx:
            self._ctx.term()

    def _close_sockets(self) -> None:
        for name in ("_pipe_out", "_pipe_in", "_xpub", "_zap"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=0)
        for r in getattr(self, "_routers", ()):
            r.close(linger=0)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sockets ------------------------------------------------------------------------

    def _bind(self, sock: zmq.Socket[bytes], endpoint: str) -> str:
        if self._curve is not None:
            sock.curve_server = True
            sock.curve_publickey = self._curve.public_key
            sock.curve_secretkey = self._curve.secret_key
        path = _ipc_path(endpoint)
        if self._access is not None:
            sock.zap_domain = _ZAP_IPC if path is not None else _ZAP_OTHER
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # a stale file of a killed run
        sock.bind(endpoint)
        if path is not None:
            if path not in self._ipc_files:
                self._ipc_files.append(path)
            os.chmod(path, self._ipc_mode)
            if self._ipc_group is not None:
                os.chown(path, -1, self._ipc_group)
            return endpoint
        return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))

    def _serve(self) -> None:
        poller = self._poller = zmq.Poller()
        poller.register(self._pipe_in, zmq.POLLIN)
        poller.register(self._xpub, zmq.POLLIN)
        for r in self._routers:
            poller.register(r, zmq.POLLIN)
        if self._zap is not None:
            poller.register(self._zap, zmq.POLLIN)
        while not self._closed.is_set():
            try:
                ready = dict(poller.poll(100))
                if self._zap is not None and self._zap in ready:
                    self._answer_zap(self._zap)
                if self._pipe_in in ready:
                    self._forward()
                if self._xpub in ready:
                    self._on_subscriptions()
                for r in self._routers:
                    if r in ready:
                        self._answer(r)
            except zmq.ZMQError as exc:
                if self._closed.is_set():
                    return
                log.warning("events: %s", exc)

    def _forward(self) -> None:
        """Send what publish() handed over, in order; a rebind where it was asked."""
        for _ in range(10_000):  # then let requests in
            try:
                frames = self._pipe_in.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) == 1:
                if frames[0] == _REBIND:
                    self._rebind()
                continue
            if len(frames) == 2:  # a flush marker: everything before it is sent
                done = self._flushes.get(frames[1])
                if done is not None:
                    done.set()
                continue
            self._xpub.send_multipart(frames)

    def _rebind(self) -> None:
        """A new XPUB on the same endpoint: every subscriber reconnects and is checked."""
        self._poller.unregister(self._xpub)
        self._xpub.close(linger=0)
        self._xpub = self._new_xpub()
        self._bind(self._xpub, self.endpoint)
        self._poller.register(self._xpub, zmq.POLLIN)
        log.info("events: the access changed; subscribers of %s reconnect", self.endpoint)

    # -- access (events-v1 §7.1) --------------------------------------------------------

    def _answer_zap(self, zap: zmq.Socket[bytes]) -> None:
        msg = zap.recv_multipart()
        if len(msg) < 6:
            return  # not a ZAP request; a REP must still answer something
        version, request_id, domain, address = msg[0], msg[1], msg[2], msg[3]
        peer: FeedPeer | None = FeedPeer(None)
        if domain == _ZAP_IPC:
            peer = peer_from_ipc_address(address)
        vis = self._visibility(peer)
        if peer is None or not vis.anything:
            # ZMQ reconnects a refused peer every 100 ms: one line a minute per uid.
            who = peer.uid if peer is not None else None
            now = time.monotonic()
            if now - self._refused.get(who, -60.0) >= 60.0:
                self._refused[who] = now
                log.warning(
                    "events: refused a subscriber (uid %s, pid %s): it may read nothing "
                    "(events-v1 §7.1)",
                    who,
                    peer.pid if peer is not None else address.decode("ascii", "replace"),
                )
            zap.send_multipart([version, request_id, b"400", b"may read nothing", b"", b""])
            return
        zap.send_multipart([version, request_id, b"200", b"OK", peer.user_id(), b""])

    def _visibility(self, peer: FeedPeer | None) -> Visibility:
        if self._access is None:
            return Visibility(full=True)
        if peer is None:
            return Visibility()
        try:
            return self._access.visibility(peer)
        except Exception:  # a policy that cannot answer grants nothing
            log.exception("events: checking a subscriber's access failed")
            return Visibility()

    def _peer_of(self, frame: zmq.Frame) -> FeedPeer | None:
        try:
            uid = frame.get("User-Id")
        except zmq.ZMQError:
            return None
        return FeedPeer.from_user_id(uid) if isinstance(uid, str) else None

    def _on_subscriptions(self) -> None:
        while True:
            try:
                frame = self._xpub.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            data = frame.bytes
            if self._access is None or not data or data[0] not in (0, 1):
                continue  # without access control, ZMQ applied it
            peer = self._peer_of(frame)
            if peer is None:
                continue  # a pipe that is gone: ZMQ dropped its subscriptions
            opt = zmq.SUBSCRIBE if data[0] == 1 else zmq.UNSUBSCRIBE
            for topic in self._granted(self._visibility(peer), data[1:]):
                with contextlib.suppress(zmq.ZMQError):
                    self._xpub.setsockopt(opt, topic)

    def _granted(self, vis: Visibility, prefix: bytes) -> list[bytes]:
        """What a subscription to ``prefix`` of a peer that sees ``vis`` delivers."""
        if not prefix.startswith(TENANT_TOPIC_PREFIX):
            full = self._full.topic
            if not vis.full:
                return []
            if full.startswith(prefix):
                return [full]
            return [prefix] if prefix.startswith(full) else []
        if self._tenant_snapshot is None:
            return []
        if vis.every_tenant:
            return [prefix]
        out = []
        for t in sorted(vis.tenants):
            topic = tenant_topic(t, self._full.topic)
            if topic.startswith(prefix):
                out.append(topic)
            elif prefix.startswith(topic):
                out.append(prefix)
        return out

    def _resolve(self, topic: bytes | None, peer: FeedPeer | None) -> _Channel | None:
        """The channel a request names (no topic: the full feed), if the peer may read it."""
        vis = self._visibility(peer)
        if topic is None or topic == self._full.topic:
            return self._full if vis.full else None
        tenant = tenant_of_topic(topic)
        if tenant is None or self._tenant_snapshot is None or not vis.sees(tenant):
            return None
        with self.lock:
            if tenant not in self._channels and len(self._channels) >= MAX_CHANNELS:
                return None  # requests naming ever new tenants make no more
            return self._channel(tenant)

    # -- replay and snapshots -----------------------------------------------------------

    def _answer(self, router: zmq.Socket[bytes]) -> None:
        parts = router.recv_multipart(copy=False)
        frames = [f.bytes for f in parts]
        if len(frames) not in (3, 4) or frames[1] != b"":
            log.warning("events: ignored a request of %d frames", len(frames))
            return
        client, body = frames[0], frames[2]
        ch = self._resolve(frames[3] if len(frames) == 4 else None, self._peer_of(parts[-1]))
        if ch is None:
            # Not readable by this peer (or no such channel): the answer of a
            # source with nothing, the end marker alone.
            router.send_multipart([client, b"", b"", END_SEQ_BYTES, b""])
            return
        if body == SNAPSHOT_REQUEST:
            self._send_snapshot(router, client, ch)
            return
        try:
            start = decode_replay_request(body)
        except EventDecodeError as exc:
            log.warning("events: ignored a replay request: %s", exc)
            return
        for seq, payload in ch.buffer.since(start):
            router.send_multipart([client, b"", ch.topic, seq.to_bytes(8, "big"), payload])
        router.send_multipart([client, b"", b"", END_SEQ_BYTES, b""])

    def _send_snapshot(self, router: zmq.Socket[bytes], client: bytes, ch: _Channel) -> None:
        source: SnapshotSource | None = self._snapshot
        if ch.tenant is not None:
            tenant, of = ch.tenant, self._tenant_snapshot
            source = (lambda: of(tenant)) if of is not None else None
        if source is None:
            # Not a snapshot source: only the end marker, which a consumer
            # reads as "no snapshot" (it carries no seq).
            router.send_multipart([client, b"", b"", END_SEQ_BYTES, b""])
            return
        with self.lock:
            seq = make_seq(self._incarnation, ch.counter)
            events = list(source())
        seq_bytes = seq.to_bytes(8, "big")
        ts = time.time()
        step = SNAPSHOT_EVENTS_PER_MESSAGE
        for i in range(0, max(len(events), 1), step):
            payload = encode_batch(EventBatch(ts, tuple(events[i : i + step]), self._rank))
            router.send_multipart([client, b"", ch.topic, seq_bytes, payload])
        router.send_multipart([client, b"", b"", END_SEQ_BYTES, b""])
        log.info(
            "events: snapshot of %d events at seq %s (%s)",
            len(events),
            split_seq(seq),
            ch.topic.decode("utf-8", "replace"),
        )
