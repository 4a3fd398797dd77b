"""KV events into the router's index: decoded batches (:mod:`kvoffload.events.wire`) → locations.

A *source* is one publisher the router follows: a worker's own vLLM stream
(its GPU and CPU prefix caches, and the kvoffload connector's ``STORAGE``
events) or a sidecar's feed (one store root). :func:`apply_batch` maps each
event to the :class:`~kvoffload.router.index.Location` it speaks of:

===================  ==========================  ===============================
source               event medium (locality)     location
===================  ==========================  ===============================
worker ``w``         ``GPU`` or nil              ``gpu:w``
worker ``w``         ``CPU``                     ``cpu:w``
worker ``w``         ``STORAGE`` (``LOCAL``)     the node's own store root
worker ``w``         ``STORAGE`` (``REMOTE``)    the node's shared store root
sidecar of root r    any                         ``store:r``
===================  ==========================  ===============================

``AllBlocksCleared`` empties every location of its source. Hashes are keyed
by their 64-bit event form (:func:`~kvoffload.router.hashing.external_hash`),
so 32-byte and integer hashes meet. Events of another KV-cache group than the
first (``group_idx`` > 0, hybrid models) are skipped: the router hashes the
full-attention group only. The consumer of :mod:`kvoffload.events` owns
sequence, gaps, replay and resync; it tells the router a source's state
(:meth:`~kvoffload.router.core.Router.set_worker_source`, ``set_store_source``)
and hands it the batches.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.events.wire import (
    LOCALITY_REMOTE,
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
)

from .core import Router
from .hashing import external_hash
from .index import Location

__all__ = ["Source", "apply_batch", "location_of", "source_locations"]


@dataclass(frozen=True)
class Source:
    """``kind`` is ``"worker"`` (name = the worker) or ``"store"`` (name = the store root)."""

    kind: str
    name: str


def source_locations(router: Router, source: Source) -> list[Location]:
    if source.kind == "store":
        return [Location("store", source.name)]
    gpu, cpu, local, remote = router.topology.locations(
        next(w for w in router.topology.workers if w.name == source.name)
    )
    return [gpu, cpu, *local, *remote]


def location_of(
    router: Router, source: Source, medium: str | None, locality: str | None
) -> Location | None:
    if source.kind == "store":
        return Location("store", source.name)
    info = next((w for w in router.topology.workers if w.name == source.name), None)
    if info is None:
        return None
    gpu, cpu, local, remote = router.topology.locations(info)
    if medium == MEDIUM_STORAGE:
        roots = remote if locality == LOCALITY_REMOTE else local
        return roots[0] if roots else None
    return cpu if medium == MEDIUM_CPU else gpu


def apply_batch(router: Router, source: Source, batch: EventBatch) -> int:
    """Apply one batch's events in order; returns how many changed the index."""
    applied = 0
    for ev in batch.events:
        if isinstance(ev, BlockStored | BlockRemoved):
            if ev.group_idx not in (None, 0):
                continue
            loc = location_of(router, source, ev.medium, ev.locality)
            if loc is None:
                continue
            hashes = [external_hash(h) for h in ev.block_hashes]
            if isinstance(ev, BlockStored):
                parent = ev.parent_block_hash
                router.index.apply_stored(
                    loc, hashes, None if parent is None else external_hash(parent)
                )
            else:
                router.index.apply_removed(loc, hashes)
            applied += 1
        elif isinstance(ev, AllBlocksCleared):
            for loc in source_locations(router, source):
                if source.kind == "store" or loc.kind in ("gpu", "cpu"):
                    router.index.cleared(loc)
            applied += 1
    return applied
