"""What one source holds, as its events announced it (events-v1 §8).

A :class:`BlockView` counts block hashes per ``(medium, locality)``: a
``BlockStored`` adds one for each of its hashes, a ``BlockRemoved`` takes one
away, ``AllBlocksCleared`` empties it. Counting, not a set, because two
chunks of a shared store may carry the same engine hash (two tenants without
a cache salt): the hash stays held until the last of them is removed. For an
engine's GPU stream, where each block is stored and removed once, the count
is 0 or 1 and the view is the set vLLM's own consumers keep.

No ZMQ here: a router may keep views it fills by other means.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from .wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event, UnknownEvent

__all__ = ["BlockView", "Tier"]

#: ``(medium, locality)``; either may be None (unspecified by the publisher).
Tier = tuple[str | None, str | None]


class BlockView:
    """Block hashes by tier with their counts; not thread-safe (the consumer locks)."""

    __slots__ = ("_tiers", "unmatched_removals")

    def __init__(self) -> None:
        self._tiers: dict[Tier, Counter[BlockHash]] = {}
        #: BlockRemoved hashes that the view did not hold (a publisher bug or a
        #: view that missed a store): counted, never negative.
        self.unmatched_removals = 0

    def apply(self, event: Event | UnknownEvent) -> None:
        if isinstance(event, BlockStored):
            tier = self._tiers.setdefault((event.medium, event.locality), Counter())
            tier.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            key = (event.medium, event.locality)
            found = self._tiers.get(key)
            for h in event.block_hashes:
                if found is None or found[h] <= 0:
                    self.unmatched_removals += 1
                    continue
                found[h] -= 1
                if found[h] == 0:
                    del found[h]
            if found is not None and not found:
                del self._tiers[key]
        elif isinstance(event, AllBlocksCleared):
            self._tiers.clear()
        # An UnknownEvent changes nothing: the consumer counts it.

    def apply_all(self, events: Iterable[Event | UnknownEvent]) -> None:
        for event in events:
            self.apply(event)

    def clear(self) -> None:
        self._tiers.clear()

    def holds(self, block_hash: BlockHash, medium: str | None = None) -> bool:
        """Whether any tier (of ``medium``, when given) holds the hash."""
        return any(
            block_hash in counts
            for (m, _), counts in self._tiers.items()
            if medium is None or m == medium
        )

    def prefix_hits(self, hashes: Sequence[BlockHash], medium: str | None = None) -> int:
        """How many leading hashes of a request's chain are held (prefix reuse stops at a miss)."""
        n = 0
        for h in hashes:
            if not self.holds(h, medium):
                break
            n += 1
        return n

    def tiers(self) -> list[Tier]:
        return list(self._tiers)

    def hashes(self, medium: str | None, locality: str | None) -> frozenset[BlockHash]:
        return frozenset(self._tiers.get((medium, locality), ()))

    def snapshot(self) -> dict[Tier, dict[BlockHash, int]]:
        """A copy to compare with another view or with a store's truth."""
        return {tier: dict(counts) for tier, counts in self._tiers.items() if counts}

    def __len__(self) -> int:
        return sum(len(c) for c in self._tiers.values())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockView):
            return self.snapshot() == other.snapshot()
        if isinstance(other, Mapping):
            return self.snapshot() == dict(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]
