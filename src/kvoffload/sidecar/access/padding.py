"""Padded lookups: a tenant's ``lookup_floor`` and ``lookup_jitter`` (docs/threat-model.md).

Within a tenant a hit is faster than a miss by nature (the index walks every
present key; a miss stops at the first absent one). For a tenant whose policy
sets ``lookup_floor``, every ``lookup`` reply leaves no earlier than the
request's arrival (when its frame was read) + floor + U(0, jitter), with the
jitter drawn from the OS's CSPRNG. The connection holds the reply on a
timerfd its event loop watches (releasetimer.py: released at the deadline,
whatever the lookup cost), never a thread or a sleep, so neither the loop,
other connections nor this connection's other requests wait for it.

A reply whose computation alone took longer than the floor is an *overrun*:
it leaves as soon as its deadline allows, and the counter of overruns (in
``stats`` and ``kvoffload_lookup_floor_overruns_total``) tells the operator
that the floor is below the lookup's real cost and does not hide it.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..metrics import Metrics
from ..ports import TenantSettings

#: Jitter from the OS's CSPRNG (os.urandom): a prober must not predict it.
_RNG = random.SystemRandom()


@dataclass(frozen=True, slots=True)
class Pad:
    """One padded reply: ``floor`` seconds, and ``delay`` = floor + jitter drawn for it."""

    tenant: str
    floor: float
    delay: float


def pads(settings: TenantSettings) -> bool:
    """Whether ``settings`` pad a tenant's lookups (a ``lookup_floor`` or a jitter)."""
    return settings.lookup_floor_s > 0.0 or settings.lookup_jitter_s > 0.0


class LookupPadding:
    """Draws each padded lookup's delay and counts padded replies and overruns per tenant."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self._metrics = metrics
        self._mu = threading.Lock()
        self._padded: dict[str, int] = {}
        self._overruns: dict[str, int] = {}

    @staticmethod
    def pad(tenant: str, settings: TenantSettings) -> Pad | None:
        """The padding of one lookup of ``tenant``, or None if its policy sets none."""
        if not pads(settings):
            return None
        floor, jitter = settings.lookup_floor_s, settings.lookup_jitter_s
        return Pad(tenant, floor, floor + (_RNG.uniform(0.0, jitter) if jitter > 0.0 else 0.0))

    def count(self, pad: Pad, overrun: bool) -> None:
        """A padded reply was released; ``overrun``: it was computed after its floor."""
        with self._mu:
            self._padded[pad.tenant] = self._padded.get(pad.tenant, 0) + 1
            if overrun:
                self._overruns[pad.tenant] = self._overruns.get(pad.tenant, 0) + 1
        if overrun and self._metrics is not None:
            self._metrics.lookup_floor_overrun(pad.tenant)

    def summary(self, visible: Callable[[str], bool]) -> dict[str, dict[str, int]]:
        """tenant → {padded, overruns}, of the tenants for which ``visible`` is true."""
        with self._mu:
            counts = {t: (n, self._overruns.get(t, 0)) for t, n in self._padded.items()}
        return {
            t: {"padded": n, "overruns": o} for t, (n, o) in sorted(counts.items()) if visible(t)
        }


__all__ = ["LookupPadding", "Pad", "pads"]
