"""The router's event sources: :class:`kvoffload.events.consumer.EventConsumer` into the index.

One consumer follows every source in the config: each worker's vLLM event
stream (``[[workers]] events``, and ``events_replay`` for its replay socket)
and each sidecar's feed (``[[stores]] events``/``events_replay``; sidecars
answer snapshots). It runs on a thread of its own; every batch it applies is
applied to the router's index too (:func:`~kvoffload.router.feed.apply_batch`),
and after each poll:

- a source whose consumer recovered it (replay, snapshot, restart) since the
  last look is resynced: its locations are cleared and refilled from the
  consumer's view, which the consumer guarantees equals what the publisher
  announced;
- each source's health becomes its locations' state in the index (live →
  read from events; replaying or stale → read from the routing history: the
  router's DEGRADED mode for that source).

The index is written only by this thread and read by the proxy's: each
update is a few dict operations under the GIL, and a read that interleaves
with one sees a slightly older or newer view, which can only move an
estimate, never credit a tenant with another's KV. pyzmq is imported only when
a source is configured.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from kvoffload.events.consumer import EventConsumer
from kvoffload.events.sources import Health, SourceSpec
from kvoffload.events.wire import EventBatch

from .config import RouterConfig
from .core import Router
from .feed import Source, apply_batch, location_of, source_locations
from .hashing import external_hash
from .index import SourceState

__all__ = ["EventBridge", "bridge_specs"]

log = logging.getLogger("kvoffload.router.events")

_STATE = {Health.LIVE: SourceState.LIVE, Health.REPLAYING: SourceState.REPLAYING}


@dataclass(frozen=True)
class _Bound:
    source: Source
    spec: SourceSpec


def bridge_specs(cfg: RouterConfig) -> list[_Bound]:
    """The configured event sources, as consumer specs bound to router sources."""
    out: list[_Bound] = []
    for w in cfg.workers:
        if w.events is not None:
            spec = SourceSpec(f"worker:{w.name}", w.events, w.events_replay, snapshots=False)
            out.append(_Bound(Source("worker", w.name), spec))
    for s in cfg.stores:
        if s.events is not None:
            spec = SourceSpec(f"store:{s.name}", s.events, s.events_replay, snapshots=True)
            out.append(_Bound(Source("store", s.name), spec))
    return out


class EventBridge:
    def __init__(
        self, router: Router, bound: list[_Bound], *, request_timeout_s: float = 5.0
    ) -> None:
        self.router = router
        self._by_name = {b.spec.name: b.source for b in bound}
        self._recoveries: dict[str, int] = {}
        self.consumer = EventConsumer(
            [b.spec for b in bound],
            on_batch=self._on_batch,
            request_timeout_s=request_timeout_s,
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        for b in bound:
            self._set_state(b.source, SourceState.UNKNOWN)

    def _set_state(self, source: Source, state: SourceState) -> None:
        if source.kind == "worker":
            self.router.set_worker_source(source.name, state)
        else:
            self.router.set_store_source(source.name, state)

    def _on_batch(self, name: str, seq: int, batch: EventBatch) -> None:
        source = self._by_name.get(name)
        if source is not None:
            apply_batch(self.router, source, batch)

    def resync(self, name: str) -> None:
        """Refill a source's locations from the consumer's view of it."""
        source = self._by_name[name]
        index = self.router.index
        with self.consumer.lock:
            view = self.consumer.view(name)
            tiers = {tier: view.hashes(*tier) for tier in view.tiers()}
        for loc in source_locations(self.router, source):
            if source.kind == "store" or loc.kind in ("gpu", "cpu"):
                index.cleared(loc)
        for (medium, locality), hashes in tiers.items():
            into = location_of(self.router, source, medium, locality)
            if into is not None:
                index.apply_stored(into, [external_hash(h) for h in hashes], chain=False)
        log.info("events: %s resynced (%d tiers)", name, len(tiers))

    def step(self, timeout_s: float = 0.1) -> None:
        """Poll the sources once, then resync what recovered and publish each one's state."""
        self.consumer.poll(timeout_s)
        for st in self.consumer.statuses():
            total = sum(st.recoveries.values())
            if total != self._recoveries.get(st.name, 0):
                self._recoveries[st.name] = total
                self.resync(st.name)
            self._set_state(self._by_name[st.name], _STATE.get(st.health, SourceState.STALE))

    def start(self) -> None:
        def run() -> None:
            while not self._stop.is_set():
                try:
                    self.step()
                except Exception:  # a source's failure must not stop the others
                    log.exception("events: poll failed")
                    self._stop.wait(1.0)

        self._thread = threading.Thread(target=run, name="kvoffload-router-events", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self.consumer.close()
