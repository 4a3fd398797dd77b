"""Which KV blocks each worker can reach, by tier: the router's prefix index.

A *location* holds blocks: a worker's GPU prefix cache, its CPU offload
cache, a node's sidecar store (``STORAGE LOCAL`` for that node's workers) or a
store root shared by several nodes (``STORAGE REMOTE`` for all of their
workers). Each location has a bit; the index maps an engine block hash (the
64-bit external form, :func:`~kvoffload.router.hashing.external_hash`) to the
bitmask of the locations that hold it, so matching a prompt costs one dict
lookup per block, however many workers there are.

Keys are the engine's chained block hashes, which include the request's
``cache_salt`` (and LoRA) in the first block's extra keys: a prompt hashed
under one tenant's salt shares no key with the same prompt under another's,
so a tenant can only ever be credited with KV its own salt can reuse.

Three views are kept: what the event sources said (``events``); the router's
own routing history (``history``: the blocks of each request it sent,
credited to the worker's GPU cache, bounded per location, least recently
routed first out); and the blocks of the requests in flight on each worker
(``inflight``: sent and not finished, so in that worker's GPU cache by the time
a request queued behind them runs, before any event can say so). A query reads
the event view of every location whose source is live and the history of the
others (the DEGRADED mode of :mod:`kvoffload.router.core`), each joined with
the in-flight view.

A location's match is its longest consecutive prefix of the prompt (the
engine hits its GPU cache up to the first miss, and a connector loads a
consecutive run); tiers compose best-first: GPU, then CPU, local store, shared
store, each crediting only the blocks past the previous tiers' reach.
"""

from __future__ import annotations

import enum
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, repeat, takewhile
from operator import and_

__all__ = [
    "Location",
    "PrefixIndex",
    "SourceState",
    "Tier",
    "TierMatch",
]


class Tier(enum.Enum):
    GPU = "gpu"
    CPU = "cpu"
    STORAGE_LOCAL = "storage_local"
    STORAGE_REMOTE = "storage_remote"


class SourceState(enum.Enum):
    """An event source as the consumer sees it."""

    LIVE = "live"  # in sequence, recent
    STALE = "stale"  # silent past its bound, or a gap not yet resynced
    REPLAYING = "replaying"  # resyncing after a restart or gap
    UNKNOWN = "unknown"  # never heard from


@dataclass(frozen=True)
class Location:
    """Where blocks live: ``("gpu", worker)``, ``("cpu", worker)``, ``("store", node)``
    or ``("shared", root)``."""

    kind: str
    name: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"


@dataclass(frozen=True)
class TierMatch:
    """One worker's reach into a prompt, in blocks per tier (best-first, disjoint)."""

    gpu: int = 0
    cpu: int = 0
    storage_local: int = 0
    storage_remote: int = 0

    @property
    def longest(self) -> int:
        return self.gpu + self.cpu + self.storage_local + self.storage_remote

    def blocks(self, tier: Tier) -> int:
        value: int = getattr(self, tier.value)
        return value


@dataclass
class _History:
    capacity: int
    blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)


def _lacks(bit: int) -> Callable[[int], bool]:
    def key(mask: int) -> bool:
        return not mask & bit

    return key


class PrefixIndex:
    """Hash → bitmask of locations, from events and from routing history."""

    def __init__(self, *, history_capacity: int = 1 << 18) -> None:
        self._bits: dict[Location, int] = {}
        self._events: dict[int, int] = {}
        self._held: dict[Location, set[int]] = {}
        self._history: dict[int, int] = {}
        self._routed: dict[Location, _History] = {}
        self._state: dict[Location, SourceState] = {}
        self._inflight: dict[int, int] = {}
        self._inflight_refs: dict[tuple[int, int], int] = {}
        self.history_capacity = history_capacity

    # -- locations and their sources ------------------------------------------------

    def bit(self, location: Location) -> int:
        b = self._bits.get(location)
        if b is None:
            b = 1 << len(self._bits)
            self._bits[location] = b
            self._held[location] = set()
            self._state.setdefault(location, SourceState.UNKNOWN)
        return b

    def set_state(self, location: Location, state: SourceState) -> None:
        self.bit(location)
        self._state[location] = state

    def state(self, location: Location) -> SourceState:
        return self._state.get(location, SourceState.UNKNOWN)

    def live(self, location: Location) -> bool:
        return self.state(location) is SourceState.LIVE

    # -- the event view (fed by the KV-event consumer) ------------------------------

    def apply_stored(self, location: Location, hashes: Iterable[int]) -> None:
        b = self.bit(location)
        held = self._held[location]
        ev = self._events
        for h in hashes:
            ev[h] = ev.get(h, 0) | b
            held.add(h)

    def apply_removed(self, location: Location, hashes: Iterable[int]) -> None:
        b = self.bit(location)
        held = self._held[location]
        ev = self._events
        for h in hashes:
            m = ev.get(h, 0) & ~b
            if m:
                ev[h] = m
            else:
                ev.pop(h, None)
            held.discard(h)

    def cleared(self, location: Location) -> None:
        """``AllBlocksCleared`` (or a resync's start): the location holds nothing."""
        self.bit(location)
        held = self._held[location]
        self.apply_removed(location, list(held))
        held.clear()

    def size(self, location: Location) -> int:
        return len(self._held.get(location, ()))

    # -- the history view (the router's own decisions) ------------------------------

    def record_routed(self, location: Location, hashes: Sequence[int]) -> None:
        b = self.bit(location)
        hist = self._routed.get(location)
        if hist is None:
            hist = self._routed[location] = _History(self.history_capacity)
        od = self._history
        for h in hashes:
            if h in hist.blocks:
                hist.blocks.move_to_end(h)
            else:
                hist.blocks[h] = None
                od[h] = od.get(h, 0) | b
        while len(hist.blocks) > hist.capacity:
            old, _ = hist.blocks.popitem(last=False)
            m = od.get(old, 0) & ~b
            if m:
                od[old] = m
            else:
                od.pop(old, None)

    # -- the in-flight view (sent, not finished: in the worker's GPU when it runs) ---

    def add_inflight(self, location: Location, hashes: Iterable[int]) -> None:
        b = self.bit(location)
        refs = self._inflight_refs
        inf = self._inflight
        for h in hashes:
            k = (b, h)
            n = refs.get(k, 0)
            refs[k] = n + 1
            if not n:
                inf[h] = inf.get(h, 0) | b

    def drop_inflight(self, location: Location, hashes: Iterable[int]) -> None:
        b = self.bit(location)
        refs = self._inflight_refs
        inf = self._inflight
        for h in hashes:
            k = (b, h)
            n = refs.get(k, 0)
            if n > 1:
                refs[k] = n - 1
                continue
            refs.pop(k, None)
            m = inf.get(h, 0) & ~b
            if m:
                inf[h] = m
            else:
                inf.pop(h, None)

    def has_history(self) -> bool:
        return bool(self._history)

    # -- matching -------------------------------------------------------------------

    @staticmethod
    def _prefix_masks(table: dict[int, int], hashes: Sequence[int]) -> list[int]:
        """The running AND of the location masks of ``hashes``, up to the first empty one."""
        masks = map(table.get, hashes, repeat(0))
        return list(takewhile(bool, accumulate(masks, and_)))

    def prefix_lengths(self, hashes: Sequence[int]) -> dict[Location, int]:
        """Per location, its longest consecutive prefix of ``hashes`` in blocks.

        A location whose source is live is read from the events, any other
        from the routing history.
        """
        ev = self._prefix_masks(self._events, hashes) if self._events else []
        hi = self._prefix_masks(self._history, hashes) if self._history else []
        inf = self._prefix_masks(self._inflight, hashes) if self._inflight else []
        out: dict[Location, int] = {}
        for loc, b in self._bits.items():
            acc = ev if self._state.get(loc) is SourceState.LIVE else hi
            n = 0
            # Each list is monotone (a running AND): the entries holding b are a prefix of it.
            if acc and acc[0] & b:
                n = bisect_left(acc, True, key=_lacks(b))
            if inf and inf[0] & b:
                n = max(n, bisect_left(inf, True, key=_lacks(b)))
            if n:
                out[loc] = n
        return out

    @staticmethod
    def compose(
        lengths: dict[Location, int],
        gpu: Location,
        cpu: Location,
        local: Sequence[Location],
        remote: Sequence[Location],
    ) -> TierMatch:
        """A worker's :class:`TierMatch`: each tier credits the blocks past the previous reach."""
        reach = 0
        per: list[int] = []
        for locs in ((gpu,), (cpu,), local, remote):
            n = max((lengths.get(loc, 0) for loc in locs), default=0)
            per.append(max(0, n - reach))
            reach = max(reach, n)
        return TierMatch(per[0], per[1], per[2], per[3])
