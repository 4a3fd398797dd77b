"""Cancelling loads in flight: a purge or a revocation stops copying into staging.

The store keeps a *load generation* per tenant. A load notes its tenant's
generation when it starts and checks it again before each layer segment is
copied into the caller's buffer (``v1.open_into``'s ``before_layer``); a
purge of the tenant (or of one of its namespaces, here or on another node of
a shared root through the journal) and a revocation bump the generation, so
every load of that tenant then stops before its next byte reaches a staging
buffer. A cancelled chunk is a miss, never a damaged object: nothing is
dropped or quarantined because of it.

Writes use the same generation: a put (or batch) notes it when it starts and
its index insert compares it under the store's lock, where a purge bumps it;
a purge or revocation in between discards the write. A whole-tenant purge
also closes the tenant's writes (:class:`TenantWrites`) for its length and
waits for the ones in flight, so that none of them lands among what it
removes (store/purge.py).

**Test hook** (never set in production): with ``KVO_TEST_HOOK_LOAD_GATE``
naming a directory, a load about to copy a layer while ``<dir>/hold`` exists
creates ``<dir>/waiting`` and waits (polling, at most 60 s) until ``hold`` is
removed, then checks for cancellation as always. ``hold`` may hold a layer
index N: then only layers N and later wait (the layers before are copied).
Tests use it to pause a load between layers, change the policy or purge,
and see that nothing more is copied. The variable is read once, when this module is imported; it is
outside the ``KVOFFLOAD_`` namespace on purpose: no product setting, never
documented for operators.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

from kvoffload.errors import TransferCancelled

log = logging.getLogger("kvoffload.store")

#: The test hook's variable (see the module docstring); unset in production.
TEST_LOAD_GATE_ENV: Final = "KVO_TEST_HOOK_LOAD_GATE"
_GATE: Final = os.environ.get(TEST_LOAD_GATE_ENV) or None
_GATE_MAX_S: Final = 60.0


#: A load stopped because its tenant was purged or revoked while it ran (a miss).
LoadCancelled = TransferCancelled
#: A write finished after its tenant was purged or revoked: not indexed, file removed.
PutCancelled = TransferCancelled


def may_wait_between_layers() -> bool:
    """Whether a load may wait between layers (the test hook is set): then no
    load is run on the event loop, which the wait would stall."""
    return _GATE is not None


def _test_gate(layer: int) -> None:
    if _GATE is None:
        return
    gate = Path(_GATE)
    try:
        first = int((gate / "hold").read_text().strip() or 0)
    except (OSError, ValueError):
        return
    if layer < first:
        return
    (gate / "waiting").touch()
    deadline = time.monotonic() + _GATE_MAX_S
    while (gate / "hold").exists() and time.monotonic() < deadline:
        time.sleep(0.01)


class LoadGenerations:
    """Per-tenant load generations (see the module docstring); thread-safe."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._gen: dict[str, int] = {}

    def current(self, tenant: str) -> int:
        return self._gen.get(tenant, 0)

    def cancel(self, tenant: str) -> None:
        """Every load of ``tenant`` now in flight stops before its next layer."""
        with self._mu:
            self._gen[tenant] = self._gen.get(tenant, 0) + 1

    def unchanged(self, tenant: str, generation: int) -> Callable[[], bool]:
        """Whether no purge or revocation of ``tenant`` began since ``generation``
        was read (asked later, e.g. under the RAM tier's lock)."""

        def still() -> bool:
            return self._gen.get(tenant, 0) == generation

        return still

    def guard(self, tenant: str) -> Callable[[int], None]:
        """The ``before_layer`` check of one load of ``tenant`` starting now."""
        start = self.current(tenant)

        def before_layer(layer: int) -> None:
            _test_gate(layer)
            if self._gen.get(tenant, 0) != start:
                raise LoadCancelled(f"the load of a chunk of {tenant!r} was cancelled")

        return before_layer


#: How long a purge waits for the tenant's writes in flight to end before it
#: goes on anyway (they are cancelled either way; this bounds a stuck disk).
DRAIN_S: Final = 30.0


class TenantWrites:
    """Which tenants' writes are open, and the writes of each in flight; thread-safe.

    ``writing(tenant)`` brackets one put (or batch): refused while a purge of
    the tenant runs, else it yields the tenant's load generation, which the
    put's commit compares. ``purge(tenant, cancel)`` closes the tenant's
    writes, runs ``cancel`` (the generation bump) under the same lock, so a
    put is either refused or holds the old generation, and waits for the
    puts in flight to end."""

    def __init__(self, gens: LoadGenerations) -> None:
        self._gens = gens
        self._cv = threading.Condition(threading.Lock())
        self._closed: dict[str, int] = {}
        self._writers: dict[str, int] = {}

    def purging(self, tenant: str) -> bool:
        """Whether a purge of ``tenant`` is running (one dict read: the read path asks)."""
        return tenant in self._closed

    @contextlib.contextmanager
    def writing(self, tenant: str) -> Iterator[int]:
        with self._cv:
            if tenant in self._closed:
                raise PutCancelled(f"tenant {tenant!r} is being purged: not stored")
            self._writers[tenant] = self._writers.get(tenant, 0) + 1
            generation = self._gens.current(tenant)
        try:
            yield generation
        finally:
            with self._cv:
                left = self._writers[tenant] - 1
                if left:
                    self._writers[tenant] = left
                else:
                    del self._writers[tenant]
                    self._cv.notify_all()

    @contextlib.contextmanager
    def purge(
        self, tenant: str, cancel: Callable[[], None], drain_s: float = DRAIN_S
    ) -> Iterator[None]:
        with self._cv:
            self._closed[tenant] = self._closed.get(tenant, 0) + 1
        try:
            with self._cv:
                cancel()
                if not self._cv.wait_for(lambda: tenant not in self._writers, drain_s):
                    log.warning(
                        "purge of %s: %d write(s) still in flight after %.0f s; going on "
                        "(they are cancelled and will not be indexed)",
                        tenant,
                        self._writers.get(tenant, 0),
                        drain_s,
                    )
            yield
        finally:
            with self._cv:
                left = self._closed[tenant] - 1
                if left:
                    self._closed[tenant] = left
                else:
                    del self._closed[tenant]


__all__ = [
    "DRAIN_S",
    "TEST_LOAD_GATE_ENV",
    "LoadCancelled",
    "LoadGenerations",
    "PutCancelled",
    "TenantWrites",
    "TransferCancelled",
]
