"""The recompute guard's probes, worker side: time one read of a stored chunk.

Once the guard (``kvoffload.integrations.payoff``) refuses loads, no load
measures the tier any more; every ``reprobe_s`` the scheduler names one stored
chunk in the step's metadata and each worker reads it here, on a thread and a
sidecar connection of their own, so that no load and no request ever waits
behind a probe. The read is reported like a load (one chunk, seconds from the
request to its last verified byte); a miss (the chunk was evicted meanwhile)
is not reported, as it says nothing about how fast the next hit would be.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from ...client import SidecarClient

log = logging.getLogger(__name__)


class TierProbe:
    """One probe at a time; ``report(chunks, seconds)`` gets each verified read."""

    def __init__(
        self, make_client: Callable[[int], SidecarClient], report: Callable[[int, float], None]
    ) -> None:
        self._make_client = make_client
        self._report = report
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvoffload-probe")
        self._running: Future[None] | None = None
        self.client: SidecarClient | None = None
        #: Staging of the probe's connection: one chunk (0 until the caches are known).
        self.chunk_bytes = 0

    def start(self, key: bytes) -> bool:
        """Read ``key`` in the background; false (nothing started) while one runs."""
        if self.chunk_bytes <= 0 or (self._running is not None and not self._running.done()):
            return False
        self._running = self._pool.submit(self._run, key)
        return True

    def wait(self, timeout: float | None = None) -> None:
        """Until the running probe (if any) ended: for shutdown and tests."""
        if self._running is not None:
            self._running.result(timeout)

    def _run(self, key: bytes) -> None:
        try:
            if self.client is None:
                self.client = self._make_client(self.chunk_bytes)
            started = time.monotonic()
            results = self.client.load([key], lambda _i, _k, _layers: None)
            seconds = time.monotonic() - started
        except Exception:
            log.debug("kvoffload: probe read failed", exc_info=True)
            return
        if results and results[0].ok:
            self._report(1, seconds)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self.client is not None:
            self.client.close()
