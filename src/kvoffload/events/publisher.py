"""A KV-event publisher in vLLM's format, with replay and snapshot (events-v1 §4-§7).

:class:`KVEventPublisher` binds a PUB socket and, optionally, a ROUTER that
answers replay requests exactly as vLLM's ``ZmqEventPublisher`` does and
snapshot requests (``snapshot/1``) as a kvoffload sidecar does. Unlike vLLM's,
it publishes synchronously (the caller's thread sends; a PUB send never
blocks), numbers batches ``make_seq(incarnation, counter)`` with the counter
from 1, and keeps its replay buffer behind the small :class:`ReplayBuffer`
interface, so the sidecar can keep it durable (:mod:`kvoffload.events.durable`).

Consistency of a snapshot: the snapshot source is called under :attr:`lock`,
and the caller holds the same lock across "change the store, publish the
change", so a snapshot taken at seq S holds exactly the effects of batches up
to S.
"""

from __future__ import annotations

import contextlib
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
]

log = logging.getLogger("kvoffload.events")

#: Events per message of a snapshot (a snapshot of a million chunks is ~4000 messages).
SNAPSHOT_EVENTS_PER_MESSAGE = 256

SnapshotSource = Callable[[], Iterable[Event]]


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


class KVEventPublisher:
    """PUB (+ ROUTER for replay and snapshots) for one topic.

    ``incarnation``: this run's number (the sidecar raises a durable counter
    at every start); the first batch is ``make_seq(incarnation, 1)``.
    ``ipc_mode``/``ipc_group``: permissions of ``ipc://`` socket files.
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
    ) -> None:
        self._ctx = context if context is not None else zmq.Context.instance()
        self._topic = topic.encode()
        self._incarnation = incarnation
        self._counter = 0
        self._buffer: ReplayBuffer = buffer if buffer is not None else MemoryReplayBuffer()
        self._snapshot = snapshot
        self._rank = data_parallel_rank
        self._ipc_mode = ipc_mode
        self._ipc_group = ipc_group
        self._curve = curve
        #: Hold it across a store change and the publish of that change.
        self.lock = threading.RLock()
        self._send_lock = threading.Lock()
        self._closed = threading.Event()
        self._ipc_files: list[Path] = []

        self._pub: zmq.Socket[bytes] = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        #: The bound endpoint (``tcp://host:*`` resolved to its port).
        self.endpoint = self._bind(self._pub, endpoint)

        self._routers: list[zmq.Socket[bytes]] = []
        bound: dict[str, str] = {}
        for ep in dict.fromkeys(e for e in (replay_endpoint, snapshot_endpoint) if e):
            router: zmq.Socket[bytes] = self._ctx.socket(zmq.ROUTER)
            # A whole replay or snapshot is queued, never dropped mid-stream.
            router.setsockopt(zmq.SNDHWM, 0)
            router.setsockopt(zmq.LINGER, 0)
            bound[ep] = self._bind(router, ep)
            self._routers.append(router)
        self.replay_endpoint = bound.get(replay_endpoint or "")
        self.snapshot_endpoint = bound.get(snapshot_endpoint or "") or self.replay_endpoint
        self._thread: threading.Thread | None = None
        if self._routers:
            self._thread = threading.Thread(
                target=self._serve, name="kvoffload-events-router", daemon=True
            )
            self._thread.start()

    # -- publishing ---------------------------------------------------------------------

    @property
    def incarnation(self) -> int:
        return self._incarnation

    def last_seq(self) -> int:
        """The seq of the last batch published in this incarnation (counter 0: none yet)."""
        with self.lock:
            return make_seq(self._incarnation, self._counter)

    def publish(self, events: Sequence[Event], ts: float | None = None) -> int:
        """Number, buffer and send one batch; returns its seq."""
        if self._closed.is_set():
            raise RuntimeError("the publisher is closed")
        with self.lock:
            self._counter += 1
            seq = make_seq(self._incarnation, self._counter)
            payload = encode_batch(
                EventBatch(time.time() if ts is None else ts, tuple(events), self._rank)
            )
            # Buffered first: a subscriber that sees seq N can always replay N.
            self._buffer.append(seq, payload)
            with self._send_lock:
                self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
            return seq

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._send_lock:
            self._pub.close(linger=0)
        for r in self._routers:
            r.close(linger=0)
        for path in self._ipc_files:
            with contextlib.suppress(OSError):
                path.unlink()

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
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # a stale file of a killed run
        sock.bind(endpoint)
        if path is not None:
            self._ipc_files.append(path)
            os.chmod(path, self._ipc_mode)
            if self._ipc_group is not None:
                os.chown(path, -1, self._ipc_group)
            return endpoint
        return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))

    def _serve(self) -> None:
        poller = zmq.Poller()
        for r in self._routers:
            poller.register(r, zmq.POLLIN)
        while not self._closed.is_set():
            try:
                ready = dict(poller.poll(100))
            except zmq.ZMQError:
                return
            for r in self._routers:
                if r in ready:
                    try:
                        self._answer(r)
                    except zmq.ZMQError as exc:
                        if self._closed.is_set():
                            return
                        log.warning("events: replay socket: %s", exc)

    def _answer(self, router: zmq.Socket[bytes]) -> None:
        frames = router.recv_multipart()
        if len(frames) != 3 or frames[1] != b"":
            log.warning("events: ignored a request of %d frames", len(frames))
            return
        client, _, body = frames
        if body == SNAPSHOT_REQUEST:
            self._send_snapshot(router, client)
            return
        try:
            start = decode_replay_request(body)
        except EventDecodeError as exc:
            log.warning("events: ignored a replay request: %s", exc)
            return
        for seq, payload in self._buffer.since(start):
            router.send_multipart([client, b"", self._topic, seq.to_bytes(8, "big"), payload])
        router.send_multipart([client, b"", b"", END_SEQ_BYTES, b""])

    def _send_snapshot(self, router: zmq.Socket[bytes], client: bytes) -> None:
        if self._snapshot is None:
            # Not a snapshot source: only the end marker, which a consumer
            # reads as "no snapshot" (it carries no seq).
            router.send_multipart([client, b"", b"", END_SEQ_BYTES, b""])
            return
        with self.lock:
            seq = make_seq(self._incarnation, self._counter)
            events = list(self._snapshot())
        seq_bytes = seq.to_bytes(8, "big")
        ts = time.time()
        step = SNAPSHOT_EVENTS_PER_MESSAGE
        for i in range(0, max(len(events), 1), step):
            payload = encode_batch(EventBatch(ts, tuple(events[i : i + step]), self._rank))
            router.send_multipart([client, b"", self._topic, seq_bytes, payload])
        router.send_multipart([client, b"", b"", END_SEQ_BYTES, b""])
        log.info("events: snapshot of %d events at seq %s", len(events), split_seq(seq))
