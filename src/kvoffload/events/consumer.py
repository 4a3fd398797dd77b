"""Follow KV-event publishers and keep a view per source that never diverges (events-v1 §8).

One :class:`EventConsumer` subscribes to any number of sources: vLLM engines
(their ``--kv-events-config`` endpoints) and kvoffload sidecars. Per source it
keeps a :class:`~kvoffload.events.view.BlockView` and a health:

- **live**: every batch since the last sync was applied in seq order;
- **replaying**: a gap is being filled from the source's replay socket;
- **stale**: the view may be incomplete (the source did not answer, or its
  buffer no longer held what was missed and it cannot send a snapshot).

Recovery, in the order tried:

- a seq gap in the same incarnation → replay from the first missing seq;
- a replay that does not start there (the buffer moved on), a new
  incarnation of a kvoffload sidecar (it may have crashed between a store
  change and its event), a falling seq from a sidecar, and the first contact
  with a sidecar → snapshot;
- a falling seq from a vLLM engine → the engine restarted, its blocks are
  gone: the view is cleared and followed from the new seq (replayed from 0
  when the engine has a replay socket).

A lost *last* batch leaves no gap to see; :meth:`EventConsumer.sync` (called
by :meth:`EventConsumer.poll` for a source idle for ``idle_check_s``) asks for
anything after the last seq, so a quiet source converges too.

Live batches that arrive during a recovery stay queued in the SUB socket and
are applied afterwards; those already covered are skipped by seq. All of it
runs on the thread that calls :meth:`poll` (or :meth:`run`); readers on other
threads take :attr:`lock` or use the accessors, which take it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import zmq
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvoffload.errors import EventDecodeError

from .access import request_frames
from .sources import CurveClient, Health, Recovery, SourceSpec, SourceStatus, copy_status
from .view import BlockView
from .wire import (
    END_SEQ_BYTES,
    SNAPSHOT_REQUEST,
    EventBatch,
    Frame,
    UnknownEvent,
    decode_batch,
    encode_replay_request,
    is_end_marker,
    split_seq,
    unpack_frames,
)

__all__ = [
    "SNAPSHOT_REQUEST",
    "ConsumerMetrics",
    "EventConsumer",
]

log = logging.getLogger("kvoffload.events")


_RECENT = 16384


class _SourceRestarted(Exception):
    """A replay showed another batch under a seq already applied."""


class _RequestFailed(Exception):
    """A replay or snapshot request got no complete answer in time."""


@dataclass
class _Source:
    spec: SourceSpec
    sub: zmq.Socket[bytes]
    view: BlockView = field(default_factory=BlockView)
    status: SourceStatus = field(init=False)
    #: Digests of recently applied batches by seq: a live seq at or below
    #: the last one is a duplicate the SUB queue still held (same batch) or
    #: an engine that restarted its numbering (another batch).
    recent: dict[int, int] = field(default_factory=dict)
    last_heard: float = field(default_factory=time.monotonic)
    retry_at: float = 0.0
    #: Batches of this source were lost for good (an engine without a
    #: snapshot whose buffer moved on): stale until it restarts.
    lossy: bool = False
    paused: bool = False

    def __post_init__(self) -> None:
        self.status = SourceStatus(self.spec.name)


BatchCallback = Callable[[str, int, EventBatch], None]


class EventConsumer:
    """Subscribe to KV-event sources and keep each one's view in line with it."""

    def __init__(
        self,
        sources: Iterable[SourceSpec] = (),
        *,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        request_timeout_s: float = 5.0,
        idle_check_s: float = 2.0,
        retry_after_s: float = 1.0,
        on_batch: BatchCallback | None = None,
    ) -> None:
        self._ctx = context if context is not None else zmq.Context.instance()
        self._request_timeout_ms = int(request_timeout_s * 1000)
        self._idle_check_s = idle_check_s
        self._retry_after_s = retry_after_s
        self._on_batch = on_batch
        self._sources: dict[str, _Source] = {}
        self._poller = zmq.Poller()
        #: Held while a batch is applied or a view is read.
        self.lock = threading.RLock()
        for spec in sources:
            self.add_source(spec)

    # -- sources ------------------------------------------------------------------------

    def add_source(self, spec: SourceSpec) -> None:
        if spec.name in self._sources:
            raise ValueError(f"a source named {spec.name!r} is already followed")
        src = _Source(spec, self._subscribe(spec))
        with self.lock:
            self._sources[spec.name] = src
        self._poller.register(src.sub, zmq.POLLIN)
        if spec.snapshots:
            # First contact with a sidecar: its whole store, then the live feed.
            self._recover(src, reason="first contact", snapshot=True)

    def remove_source(self, name: str) -> None:
        with self.lock:
            src = self._sources.pop(name)
        if not src.paused:
            self._poller.unregister(src.sub)
            src.sub.close(linger=0)

    def pause(self, name: str) -> None:
        """Disconnect from the source's feed, keeping its view: what it publishes
        meanwhile is missed, as in a network partition (:meth:`resume` recovers it)."""
        src = self._sources[name]
        self._poller.unregister(src.sub)
        src.sub.close(linger=0)
        src.paused = True

    def resume(self, name: str) -> None:
        src = self._sources[name]
        if not src.paused:
            return
        src.sub = self._subscribe(src.spec)
        src.paused = False
        src.last_heard = time.monotonic()
        self._poller.register(src.sub, zmq.POLLIN)

    def _subscribe(self, spec: SourceSpec) -> zmq.Socket[bytes]:
        sub: zmq.Socket[bytes] = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)  # a slow consumer must not lose what it queued
        _apply_curve(sub, spec.curve)
        sub.setsockopt(zmq.SUBSCRIBE, spec.topic.encode())
        sub.connect(spec.endpoint)
        return sub

    def sources(self) -> list[str]:
        with self.lock:
            return list(self._sources)

    # -- reading ------------------------------------------------------------------------

    def view(self, name: str) -> BlockView:
        """The source's live view object; read it under :attr:`lock`."""
        return self._sources[name].view

    def status(self, name: str) -> SourceStatus:
        with self.lock:
            return copy_status(self._sources[name].status)

    def statuses(self) -> list[SourceStatus]:
        with self.lock:
            return [copy_status(s.status) for s in self._sources.values()]

    def locate(self, hashes: list[bytes | int], medium: str | None = None) -> dict[str, int]:
        """Per live source, how many leading hashes of the chain it holds (0 omitted)."""
        with self.lock:
            out: dict[str, int] = {}
            for name, src in self._sources.items():
                if src.status.health is not Health.LIVE:
                    continue
                n = src.view.prefix_hits(hashes, medium)
                if n:
                    out[name] = n
            return out

    # -- the loop -----------------------------------------------------------------------

    def poll(self, timeout_s: float = 0.0) -> int:
        """Apply what arrives within ``timeout_s``; returns the number of batches applied."""
        applied = 0
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            ready = dict(self._poller.poll(int(remaining * 1000)))
            if not ready:
                break
            for src in list(self._sources.values()):
                if not src.paused and src.sub in ready:
                    applied += self._drain(src)
            if time.monotonic() >= deadline:
                break
        self._maintain()
        return applied

    def run(self, stop: threading.Event, tick_s: float = 0.1) -> None:
        """Poll until ``stop`` is set (for a thread of its own)."""
        while not stop.is_set():
            self.poll(tick_s)

    def sync(self, name: str | None = None) -> None:
        """Ask each source (or one) for anything after its last seq; a stale one recovers."""
        for src in list(self._sources.values()):
            if name is None or src.spec.name == name:
                self._sync(src)

    def register_metrics(self, registry: CollectorRegistry) -> ConsumerMetrics:
        """Expose health and counters per source on ``registry`` (read at scrape time)."""
        collector = ConsumerMetrics(self)
        registry.register(collector)
        return collector

    def close(self) -> None:
        for name in list(self._sources):
            self.remove_source(name)

    def __enter__(self) -> EventConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------

    def _maintain(self) -> None:
        now = time.monotonic()
        for src in list(self._sources.values()):
            if src.spec.replay_endpoint is None or src.paused:
                continue
            if src.status.health is Health.STALE:
                if now >= src.retry_at and not src.lossy:
                    self._sync(src)
            elif self._idle_check_s > 0 and now - src.last_heard >= self._idle_check_s:
                self._sync(src)

    def _sync(self, src: _Source) -> None:
        src.last_heard = time.monotonic()
        st = src.status
        if src.spec.replay_endpoint is None:
            return
        if src.spec.snapshots and (st.health is Health.STALE or st.last_seq is None):
            self._recover(src, reason="resync", snapshot=True)
        elif st.last_seq is None:
            self._recover(src, reason="resync", snapshot=False, start=0)
        else:
            reason = None if st.health is Health.LIVE else "resync"
            self._recover(src, reason=reason, snapshot=False, start=st.last_seq + 1)

    def _drain(self, src: _Source) -> int:
        applied = 0
        while True:
            try:
                frames = src.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return applied
            src.last_heard = time.monotonic()
            try:
                frame = unpack_frames(frames)
                batch = decode_batch(frame.payload)
            except EventDecodeError as exc:
                self._malformed(src, exc)
                continue
            applied += self._on_live(src, frame.seq, batch)

    def _malformed(self, src: _Source, exc: EventDecodeError) -> None:
        src.status.malformed += 1
        src.status.last_error = str(exc)
        log.warning("events: %s sent a malformed message: %s", src.spec.name, exc)

    def _on_live(self, src: _Source, seq: int, batch: EventBatch) -> int:
        st = src.status
        spec = src.spec
        last = st.last_seq
        if last is None:
            if spec.snapshots:
                self._recover(src, reason="first contact", snapshot=True)
                return self._after_recovery(src, seq, batch)
            if spec.replay_endpoint is not None and seq > 0:
                self._recover(src, reason="first contact", snapshot=False, start=0, through=seq)
                if st.last_seq is not None:
                    return self._after_recovery(src, seq, batch)
            # Nothing to learn what came before: follow from here.
            if seq > 0:
                src.lossy = True
                st.health = Health.STALE
            else:
                st.health = Health.LIVE
            self._apply(src, seq, batch)
            return 1
        if seq <= last:
            seen = src.recent.get(seq)
            if seen == hash(batch) or (seen is None and spec.snapshots):
                # A sidecar's seqs never fall: one not seen here was in a snapshot.
                st.duplicates += 1
                return 0
            # A vLLM engine numbers from 0 at each start: its GPU blocks are gone.
            self._restarted(src, seq)
            return self._on_live(src, seq, batch)
        inc_last = split_seq(last)[0]
        inc_now = split_seq(seq)[0]
        if inc_now != inc_last:
            st.recoveries[Recovery.RESTART] += 1
            log.info("events: %s restarted (incarnation %d → %d)", spec.name, inc_last, inc_now)
            if spec.snapshots:
                # It may have died between a store change and its event.
                self._recover(src, reason="restart", snapshot=True)
            else:
                self._recover(src, reason="restart", snapshot=False, start=last + 1, through=seq)
            return self._after_recovery(src, seq, batch)
        if seq == last + 1 and st.health is Health.STALE and spec.replay_endpoint is not None:
            # Back from a lost stream: the next seq proves nothing. An engine that
            # restarted unseen numbers from 0 again, and a subscription that joins
            # late drops its first batches, so its seq can land right after ours.
            # The replay checks the batch of our last seq (a restart if it differs).
            self._recover(src, reason="stale", snapshot=False, start=last + 1, through=seq)
            return self._after_recovery(src, seq, batch)
        if seq != last + 1:
            st.gaps += 1
            log.info("events: %s: gap after seq %d (got %d)", spec.name, last, seq)
            if spec.replay_endpoint is None:
                src.lossy = True
                st.health = Health.STALE
                st.last_error = f"missed seqs {last + 1}..{seq - 1} and no replay socket"
                self._apply(src, seq, batch)
                return 1
            self._recover(src, reason="gap", snapshot=False, start=last + 1, through=seq)
            return self._after_recovery(src, seq, batch)
        self._apply(src, seq, batch)
        return 1

    def _after_recovery(self, src: _Source, seq: int, batch: EventBatch) -> int:
        """The live batch that set off a recovery: applied if it is still next."""
        last = src.status.last_seq
        if last is None:
            return 0  # the recovery failed: the retry fetches this batch too
        if seq <= last:
            src.status.duplicates += 1
            return 0
        if self._follows(last, seq) and not (
            src.spec.snapshots and split_seq(seq)[0] != split_seq(last)[0]
        ):
            self._apply(src, seq, batch)
            return 1
        return 0  # still a hole before it: the next sync fills it, this batch with it

    def _restarted(self, src: _Source, seq: int) -> None:
        st = src.status
        st.recoveries[Recovery.RESTART] += 1
        log.info("events: %s restarted (seq fell from %s to %d)", src.spec.name, st.last_seq, seq)
        with self.lock:
            src.view.clear()
            st.last_seq = None
            st.incarnation = None
        src.recent.clear()
        src.lossy = False

    def _apply(self, src: _Source, seq: int, batch: EventBatch) -> None:
        st = src.status
        with self.lock:
            src.view.apply_all(batch.events)
            st.last_seq = seq
            st.incarnation = split_seq(seq)[0]
            st.batches += 1
            st.events += len(batch.events)
            st.unknown_events += sum(isinstance(e, UnknownEvent) for e in batch.events)
            src.recent[seq] = hash(batch)
            if len(src.recent) > _RECENT:
                del src.recent[next(iter(src.recent))]
        if self._on_batch is not None:
            self._on_batch(src.spec.name, seq, batch)

    # -- replay and snapshot ------------------------------------------------------------

    def _recover(
        self,
        src: _Source,
        *,
        reason: str | None,
        snapshot: bool,
        start: int = 0,
        through: int | None = None,
    ) -> None:
        """Replay from ``start`` (``through``: a seq known to exist), or load a snapshot.

        ``reason`` None: a routine check for a lost tail, not a known gap.
        """
        st = src.status
        if src.spec.replay_endpoint is None:
            st.health = Health.STALE
            return
        st.health = Health.REPLAYING
        try:
            if snapshot:
                self._load_snapshot(src)
                st.recoveries[Recovery.SNAPSHOT] += 1
            else:
                complete = self._replay(src, start, through)
                if complete is not None:
                    st.recoveries[Recovery.REPLAY] += 1
                if complete is False:
                    if src.spec.snapshots:
                        self._load_snapshot(src)
                        st.recoveries[Recovery.SNAPSHOT] += 1
                    else:
                        src.lossy = True
                        st.last_error = f"replay from seq {start}: the buffer no longer held it"
            st.health = Health.STALE if src.lossy else Health.LIVE
            if not src.lossy:
                st.last_error = None
        except _SourceRestarted:
            if src.spec.snapshots:
                st.recoveries[Recovery.RESTART] += 1
                self._recover(src, reason="restart", snapshot=True)
                return
            self._restarted(src, st.last_seq or 0)
            self._recover(src, reason="restart", snapshot=False, start=0)
        except _RequestFailed as exc:
            st.failed_requests += 1
            st.health = Health.STALE
            st.last_error = str(exc)
            src.retry_at = time.monotonic() + self._retry_after_s
            log.warning("events: %s (%s): %s", src.spec.name, reason or "check", exc)

    def _request(self, src: _Source, frame: bytes) -> Iterator[Frame]:
        """Send one request on a fresh DEALER; yield replies up to the end marker."""
        assert src.spec.replay_endpoint is not None
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.RCVTIMEO, self._request_timeout_ms)
            sock.setsockopt(zmq.SNDTIMEO, self._request_timeout_ms)
            _apply_curve(sock, src.spec.curve)
            sock.connect(src.spec.replay_endpoint)
            try:
                sock.send_multipart(request_frames(frame, src.spec.topic))
            except zmq.Again as exc:
                raise _RequestFailed("the replay socket does not accept requests") from exc
            while True:
                try:
                    parts = sock.recv_multipart()
                except zmq.Again as exc:
                    raise _RequestFailed("no complete answer from the replay socket") from exc
                if parts and parts[0] == b"":
                    parts = parts[1:]
                if len(parts) == 3 and parts[1] == END_SEQ_BYTES and not parts[2]:
                    return
                try:
                    reply = unpack_frames(parts)
                except EventDecodeError as exc:
                    raise _RequestFailed(f"a malformed replay message: {exc}") from exc
                if is_end_marker(reply):
                    return
                yield reply
        finally:
            sock.close(linger=0)

    def _replay(self, src: _Source, start: int, through: int | None) -> bool | None:
        """Apply buffered batches from ``start``.

        True: contiguous from what the view holds; False: batches were lost
        (the buffer began later, skipped, or held nothing though ``through``
        exists); None: nothing after ``start`` existed, as a routine check
        expects. A sidecar's view is left untouched on False (a snapshot
        replaces it); an engine's gets what was there (best effort, stale).
        """
        st = src.status
        # Ask from the last applied batch too: if the source's batch of that
        # seq is not the one applied, the source restarted its numbering.
        last0 = st.last_seq
        check = src.recent.get(last0) if last0 is not None and start == last0 + 1 else None
        ask = start if check is None or last0 is None else last0
        replies: list[tuple[int, EventBatch]] = []
        for reply in self._request(src, encode_replay_request(ask)):
            try:
                replies.append((reply.seq, decode_batch(reply.payload)))
            except EventDecodeError as exc:
                raise _RequestFailed(f"a malformed replayed batch: {exc}") from exc
        if check is not None and replies and replies[0][0] == last0:
            if hash(replies[0][1]) != check:
                raise _SourceRestarted
            replies = replies[1:]
        if not replies:
            return None if through is None else False
        sidecar = src.spec.snapshots
        complete = True
        for seq, batch in replies:
            last = st.last_seq
            if last is None:
                # From the start of the publisher's run: its first batch has
                # counter 0 (vLLM) or 1 (kvoffload).
                if seq != start and not (start == 0 and split_seq(seq)[1] <= 1):
                    complete = False
                    if sidecar:
                        return False
            elif seq <= last:
                continue
            elif sidecar and split_seq(seq)[0] != split_seq(last)[0]:
                raise _SourceRestarted  # a new incarnation: resync from a snapshot
            elif not self._follows(last, seq):
                complete = False
                if sidecar:
                    return False
            self._apply(src, seq, batch)
        return complete

    @staticmethod
    def _follows(last: int, seq: int) -> bool:
        if seq == last + 1:
            return True
        inc_last, _ = split_seq(last)
        inc_now, counter = split_seq(seq)
        # A sidecar's next incarnation starts at counter 1 (0 names its empty start).
        return inc_now > inc_last and counter <= 1

    def _load_snapshot(self, src: _Source) -> None:
        st = src.status
        fresh = BlockView()
        seq_s: int | None = None
        for reply in self._request(src, SNAPSHOT_REQUEST):
            if seq_s is None:
                seq_s = reply.seq
            elif reply.seq != seq_s:
                raise _RequestFailed("a snapshot whose messages disagree on its seq")
            try:
                fresh.apply_all(decode_batch(reply.payload).events)
            except EventDecodeError as exc:
                raise _RequestFailed(f"a malformed snapshot batch: {exc}") from exc
        if seq_s is None:
            raise _RequestFailed("an empty snapshot (no seq)")
        with self.lock:
            src.view = fresh
            st.last_seq = seq_s
            st.incarnation = split_seq(seq_s)[0]
        src.recent.clear()


def _apply_curve(sock: zmq.Socket[bytes], curve: CurveClient | None) -> None:
    if curve is None:
        return
    sock.curve_serverkey = curve.server_public_key
    sock.curve_publickey = curve.public_key
    sock.curve_secretkey = curve.secret_key


class ConsumerMetrics(Collector):
    """Prometheus metrics of a consumer, read from its state at scrape time.

    ``consumer.register_metrics(registry)`` adds it; nothing is counted twice
    on the hot path.
    """

    def __init__(self, consumer: EventConsumer) -> None:
        self._consumer = consumer

    def collect(self) -> Iterable[Metric]:
        c = self._consumer
        health = GaugeMetricFamily(
            "kvoffload_events_source_health",
            "1 for the source's health (live, replaying, stale)",
            labels=["source", "state"],
        )
        counters = {
            name: CounterMetricFamily(f"kvoffload_events_{name}", doc, labels=["source"])
            for name, doc in (
                ("batches", "Batches applied"),
                ("events", "Events applied"),
                ("gaps", "Seq gaps detected"),
                ("duplicates", "Batches skipped as already applied"),
                ("malformed", "Messages that did not decode"),
                ("unknown_events", "Events of an unknown type, kept not applied"),
                ("failed_requests", "Replay or snapshot requests without a complete answer"),
            )
        }
        recoveries = CounterMetricFamily(
            "kvoffload_events_recoveries", "Recoveries by kind", labels=["source", "kind"]
        )
        blocks = GaugeMetricFamily(
            "kvoffload_events_blocks",
            "Block hashes held per source and tier",
            labels=["source", "medium", "locality"],
        )
        last = GaugeMetricFamily("kvoffload_events_last_seq", "Last applied seq", labels=["source"])
        with c.lock:
            for name, src in c._sources.items():
                st = src.status
                for h in Health:
                    health.add_metric([name, h.value], 1.0 if st.health is h else 0.0)
                for key, fam in counters.items():
                    fam.add_metric([name], float(getattr(st, key)))
                for kind in Recovery:
                    recoveries.add_metric([name, kind.value], float(st.recoveries[kind]))
                for medium, locality in src.view.tiers():
                    n = len(src.view.hashes(medium, locality))
                    blocks.add_metric([name, medium or "", locality or ""], float(n))
                if st.last_seq is not None:
                    last.add_metric([name], float(st.last_seq))
        yield health
        yield from counters.values()
        yield recoveries
        yield blocks
        yield last
