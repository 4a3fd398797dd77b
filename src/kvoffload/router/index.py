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
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

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


class Location(NamedTuple):
    """Where blocks live: ``("gpu", worker)``, ``("cpu", worker)`` or ``("store", root)``.

    A tuple: hashed in C, it is the key of every per-location table."""

    kind: str
    name: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"


class TierMatch(NamedTuple):
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


_EMPTY = TierMatch()


@dataclass
class _History:
    capacity: int
    blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)


class PrefixIndex:
    """Hash → bitmask of locations, from events and from routing history."""

    def __init__(self, *, history_capacity: int = 1 << 18) -> None:
        self._bits: dict[Location, int] = {}
        self._by_bit: list[Location] = []
        self._live_bits = 0
        self.version = 0  # changes whenever a source's state does
        self._events: dict[int, int] = {}
        self._children: dict[int, set[int]] = {}
        self._held: dict[Location, set[int]] = {}
        self._history: dict[int, int] = {}
        self._routed: dict[Location, _History] = {}
        self._state: dict[Location, SourceState] = {}
        self._inflight: dict[int, int] = {}
        self._inflight_refs: dict[int, dict[int, int]] = {}  # bit → hash → requests
        self.history_capacity = history_capacity

    # -- locations and their sources ------------------------------------------------

    def bit(self, location: Location) -> int:
        b = self._bits.get(location)
        if b is None:
            b = 1 << len(self._bits)
            self._bits[location] = b
            self._by_bit.append(location)
            self._held[location] = set()
            self._state.setdefault(location, SourceState.UNKNOWN)
        return b

    def set_state(self, location: Location, state: SourceState) -> None:
        b = self.bit(location)
        self._state[location] = state
        if state is SourceState.LIVE:
            self._live_bits |= b
        else:
            self._live_bits &= ~b
        self.version += 1

    def state(self, location: Location) -> SourceState:
        return self._state.get(location, SourceState.UNKNOWN)

    def live(self, location: Location) -> bool:
        return self.state(location) is SourceState.LIVE

    # -- the event view (fed by the KV-event consumer) ------------------------------

    def apply_stored(
        self,
        location: Location,
        hashes: Sequence[int],
        parent: int | None = None,
        *,
        chain: bool = True,
    ) -> None:
        """``BlockStored``: a chain of blocks (each the next one's parent) after ``parent``.

        ``chain=False`` for blocks that are not one prefix chain (no links are kept).
        """
        b = self.bit(location)
        held = self._held[location]
        ev = self._events
        kids = self._children
        prev = parent
        for h in hashes:
            ev[h] = ev.get(h, 0) | b
            held.add(h)
            if chain and prev is not None:
                k = kids.get(prev)
                if k is None:
                    kids[prev] = {h}
                else:
                    k.add(h)
            prev = h

    def stored_run(self, hashes: Sequence[int], start: int, location: Location) -> int:
        """How far from ``start`` the blocks of ``hashes`` are at ``location`` by its
        events (what it has stored; routing history and in-flight credit do not count)."""
        b = self.bit(location)
        ev = self._events
        k = start
        n = len(hashes)
        while k < n and ev.get(hashes[k], 0) & b:
            k += 1
        return k

    def apply_removed(self, location: Location, hashes: Iterable[int]) -> None:
        """``BlockRemoved``: those blocks, and what this location holds below them.

        A block under a removed one can no longer be part of a matched prefix;
        dropping it keeps each location's blocks prefix-closed, which is what
        lets :meth:`_reach` bisect instead of walking every block.
        """
        b = self.bit(location)
        held = self._held[location]
        ev = self._events
        kids = self._children
        stack = list(hashes)
        while stack:
            h = stack.pop()
            if h not in held:
                continue
            held.discard(h)
            m = ev.get(h, 0) & ~b
            if m:
                ev[h] = m
            else:
                ev.pop(h, None)
            below = kids.get(h)
            if below:
                stack.extend(below)
                if not m:
                    del kids[h]

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
        blocks = hist.blocks
        move = blocks.move_to_end
        for h in hashes:
            if h in blocks:
                move(h)
            else:
                blocks[h] = None
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
        refs = self._inflight_refs.get(b)
        if refs is None:
            refs = self._inflight_refs[b] = {}
        inf = self._inflight
        for h in hashes:
            n = refs.get(h, 0)
            refs[h] = n + 1
            if not n:
                inf[h] = inf.get(h, 0) | b

    def drop_inflight(self, location: Location, hashes: Iterable[int]) -> None:
        b = self.bit(location)
        refs = self._inflight_refs.get(b)
        if refs is None:
            refs = self._inflight_refs[b] = {}
        inf = self._inflight
        keep = ~b
        for h in hashes:
            n = refs.get(h, 0)
            if n > 1:
                refs[h] = n - 1
                continue
            refs.pop(h, None)
            m = inf.get(h, 0) & keep
            if m:
                inf[h] = m
            else:
                inf.pop(h, None)

    def has_history(self) -> bool:
        return bool(self._history)

    # -- matching -------------------------------------------------------------------

    @staticmethod
    def _reach(table: dict[int, int], hashes: Sequence[int]) -> list[tuple[int, int]]:
        """``(bits, blocks)`` pairs: the locations in ``bits`` hold the first ``blocks`` hashes.

        Galloping, then bisecting, for the last block every still-matching
        location holds: O(log n) lookups per distinct reach instead of one per
        block (a 32k-token prompt is 2,048 blocks of 16). It takes each
        location's blocks as prefix-closed, as the engines keep them (a block is
        stored after its prefix, and vLLM frees a request's blocks tail first):
        a hole inside a run that the search jumps over is counted as held,
        which can only mislead an estimate, never reuse KV.
        """
        get = table.get
        n = len(hashes)
        out: list[tuple[int, int]] = []
        alive = get(hashes[0], 0) if n else 0
        pos = 0
        while alive:
            lo, step = pos, 1
            while lo + step < n and get(hashes[lo + step], 0) & alive == alive:
                lo += step
                step *= 2
            hi = min(n, lo + step)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if get(hashes[mid], 0) & alive == alive:
                    lo = mid
                else:
                    hi = mid
            still = get(hashes[hi], 0) & alive if hi < n else 0
            out.append((alive & ~still, hi))
            alive, pos = still, hi
        return out

    def prefix_lengths(self, hashes: Sequence[int]) -> dict[Location, int]:
        """Per location, its longest consecutive prefix of ``hashes`` in blocks.

        A location whose source is live is read from the events, any other
        from the routing history; either is joined with the in-flight blocks.
        """
        live = self._live_bits
        out: dict[Location, int] = {}
        by_bit = self._by_bit
        for table, allowed in (
            (self._events, live),
            (self._history, ~live),
            (self._inflight, -1),
        ):
            if not table:
                continue
            for bits, length in self._reach(table, hashes):
                bits &= allowed
                while bits:
                    low = bits & -bits
                    loc = by_bit[low.bit_length() - 1]
                    if out.get(loc, 0) < length:
                        out[loc] = length
                    bits ^= low
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
        if not lengths:
            return _EMPTY
        get = lengths.get
        g = get(gpu, 0)
        c = max(g, get(cpu, 0))
        n_local = c
        for loc in local:
            n_local = max(n_local, get(loc, 0))
        n_remote = n_local
        for loc in remote:
            n_remote = max(n_remote, get(loc, 0))
        return TierMatch(g, c - g, n_local - c, n_remote - n_local)

    def _mask(self, h: int) -> int:
        """The locations that hold block ``h`` in the view each one is read from."""
        live = self._live_bits
        return (
            (self._events.get(h, 0) & live)
            | (self._history.get(h, 0) & ~live)
            | self._inflight.get(h, 0)
        )

    def _extend(self, hashes: Sequence[int], start: int, bits: int) -> int:
        """How far from ``start`` each block is held by one of ``bits`` (galloping)."""
        n = len(hashes)
        mask = self._mask
        if start >= n or not mask(hashes[start]) & bits:
            return start
        lo, step = start, 1
        while lo + step < n and mask(hashes[lo + step]) & bits:
            lo += step
            step *= 2
        hi = min(n, lo + step)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if mask(hashes[mid]) & bits:
                lo = mid
            else:
                hi = mid
        return self._extend(hashes, hi, bits) if hi < n else hi

    def tier_match(
        self,
        hashes: Sequence[int],
        lengths: dict[Location, int],
        gpu: Location,
        cpu: Location,
        local: Sequence[Location],
        remote: Sequence[Location],
    ) -> TierMatch:
        """A worker's :class:`TierMatch`, each tier continuing where the better ones stop.

        A tier need not hold the prompt from its first block: blocks the GPU
        evicted to the CPU tier are the prompt's middle (its prefix is still in
        the GPU), and the engine reads them there. Each tier is credited the
        consecutive blocks past the previous reach that it, or a better read tier,
        holds; what it holds from the first block on (:meth:`compose`) counts too.
        """
        base = self.compose(lengths, gpu, cpu, local, remote)
        bit = self._bits.get
        g = base.gpu
        # The GPU's own hits end at its first miss (the engine's prefix match): past
        # it only the read tiers count, each with the ones before it.
        bits = bit(cpu, 0)
        c = max(g + base.cpu, self._extend(hashes, g, bits))
        for loc in local:
            bits |= bit(loc, 0)
        n_local = max(g + base.cpu + base.storage_local, self._extend(hashes, c, bits))
        for loc in remote:
            bits |= bit(loc, 0)
        n_remote = max(base.longest, self._extend(hashes, n_local, bits))
        return TierMatch(g, c - g, n_local - c, n_remote - n_local)
