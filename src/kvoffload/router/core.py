"""The router's decision code: index match, per-worker estimates, the choice.

One :class:`Router` holds the topology (workers, their nodes, the store roots
each node reads), the :class:`~kvoffload.router.index.PrefixIndex`, the
:class:`~kvoffload.router.model.TTFTModel` and each worker's load. It knows
nothing of HTTP or of time sources: the proxy calls it with the wall clock,
``scripts/sim_router.py`` with a simulated one, so the simulator runs this very
code.

Modes (:class:`Mode`): EXACT when the event source of every location the
candidates can read is live; DEGRADED when some are not (those locations are
read from the routing history); FALLBACK when no source is live and there is
no history (least loaded: the smallest queue).

The deadline: when no candidate's estimate meets it, ``on_deadline_miss``
decides: ``"shed"`` (the proxy answers 429 with ``Retry-After``) or
``"fastest"`` (route to the best anyway).
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from .index import Location, PrefixIndex, SourceState, TierMatch
from .model import Estimate, Priors, TTFTModel, WorkerLoad

__all__ = ["Candidate", "Decision", "Mode", "Router", "Ticket", "Topology", "WorkerInfo"]

log = logging.getLogger("kvoffload.router.decisions")


class Mode(enum.Enum):
    EXACT = "exact"
    DEGRADED = "degraded"
    FALLBACK = "fallback"


@dataclass(frozen=True)
class WorkerInfo:
    name: str
    node: str


@dataclass(frozen=True)
class Topology:
    """Workers, their nodes, and the store roots: ``roots[root] = (shared, nodes)``."""

    workers: tuple[WorkerInfo, ...]
    roots: dict[str, tuple[bool, tuple[str, ...]]] = field(default_factory=dict)

    def locations(
        self, worker: WorkerInfo
    ) -> tuple[Location, Location, list[Location], list[Location]]:
        local = [
            Location("store", r)
            for r, (shared, nodes) in self.roots.items()
            if worker.node in nodes and not shared
        ]
        remote = [
            Location("store", r)
            for r, (shared, nodes) in self.roots.items()
            if worker.node in nodes and shared
        ]
        return Location("gpu", worker.name), Location("cpu", worker.name), local, remote


@dataclass(slots=True)
class Candidate:
    worker: str
    match: TierMatch
    estimate: Estimate

    def as_dict(self, block_tokens: int) -> dict[str, object]:
        return {
            "worker": self.worker,
            "longest_matched": self.match.longest * block_tokens,
            "gpu": self.match.gpu * block_tokens,
            "cpu": self.match.cpu * block_tokens,
            "storage_local": self.match.storage_local * block_tokens,
            "storage_remote": self.match.storage_remote * block_tokens,
            **self.estimate.as_dict(),
        }


@dataclass(frozen=True)
class Decision:
    worker: str | None  # None: shed (or no healthy worker)
    mode: Mode
    candidates: tuple[Candidate, ...]
    deadline_s: float | None
    retry_after_s: float | None
    hashes: tuple[int, ...]
    n_tokens: int

    @property
    def chosen(self) -> Candidate | None:
        return next((c for c in self.candidates if c.worker == self.worker), None)

    @property
    def shed(self) -> bool:
        return self.worker is None and bool(self.candidates)

    def as_dict(self, block_tokens: int) -> dict[str, object]:
        return {
            "worker": self.worker,
            "mode": self.mode.value,
            "deadline_s": self.deadline_s,
            "retry_after_s": self.retry_after_s,
            "n_tokens": self.n_tokens,
            "candidates": [c.as_dict(block_tokens) for c in self.candidates],
        }


@dataclass(slots=True)
class _Watch:
    """A request not answered yet, as its KV events show its progress."""

    hashes: tuple[int, ...]
    credited: int  # tokens it was credited from a cache (not its own progress)
    stored: int  # blocks of it the worker's GPU holds by events
    looked: float  # when the router last looked


@dataclass
class Ticket:
    """A request the router sent: what it booked, to settle on its first token."""

    worker: str
    estimate: Estimate
    sent_at: float
    expected_at: float
    id: int = 0
    hashes: tuple[int, ...] = ()
    settled: bool = False
    done: bool = False


class Router:
    def __init__(
        self,
        topology: Topology,
        *,
        priors: Priors | None = None,
        block_tokens: int = 16,
        on_deadline_miss: str = "shed",
        history_capacity: int = 1 << 18,
        work_weight: float = 1.0,
        risk: float = 2.0,
    ) -> None:
        if on_deadline_miss not in ("shed", "fastest"):
            raise ValueError(
                f"on_deadline_miss must be 'shed' or 'fastest', not {on_deadline_miss!r}"
            )
        self.topology = topology
        self.index = PrefixIndex(history_capacity=history_capacity)
        self.model = TTFTModel(priors or Priors(), block_tokens)
        self.block_tokens = block_tokens
        self.on_deadline_miss = on_deadline_miss
        self.work_weight = work_weight
        self.risk = risk
        self.loads: dict[str, WorkerLoad] = {
            w.name: self.model.new_load() for w in topology.workers
        }
        self.healthy: dict[str, bool] = {w.name: True for w in topology.workers}
        self._locs = {w.name: topology.locations(w) for w in topology.workers}
        for gpu, cpu, local, remote in self._locs.values():
            for loc in (gpu, cpu, *local, *remote):
                self.index.bit(loc)
        self.decisions = 0
        self._tickets = 0
        # Per worker, its requests not answered yet, by ticket id.
        self._watch: dict[str, dict[int, _Watch]] = {w.name: {} for w in topology.workers}
        self._mode_cache: tuple[tuple[int, tuple[str, ...], bool], Mode] | None = None

    # -- sources --------------------------------------------------------------------

    def worker_locations(self, worker: str) -> tuple[Location, Location]:
        gpu, cpu, _, _ = self._locs[worker]
        return gpu, cpu

    def set_worker_source(self, worker: str, state: SourceState) -> None:
        """The state of a worker's own KV-event stream (its GPU and CPU tiers)."""
        for loc in self.worker_locations(worker):
            self.index.set_state(loc, state)

    def set_store_source(self, root: str, state: SourceState) -> None:
        self.index.set_state(Location("store", root), state)

    def mode(self, workers: Iterable[str]) -> Mode:
        names = tuple(workers)
        key = (self.index.version, names, self.index.has_history())
        cached = self._mode_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        mode = self._mode(names)
        self._mode_cache = (key, mode)
        return mode

    def _mode(self, workers: tuple[str, ...]) -> Mode:
        locs = {
            loc
            for w in workers
            for loc in (self._locs[w][0], self._locs[w][1], *self._locs[w][2], *self._locs[w][3])
        }
        live = [self.index.live(loc) for loc in locs]
        if live and all(live):
            return Mode.EXACT
        if any(live) or self.index.has_history():
            return Mode.DEGRADED
        return Mode.FALLBACK

    # -- deciding -------------------------------------------------------------------

    def matches(self, hashes: Sequence[int], workers: Iterable[str]) -> dict[str, TierMatch]:
        lengths = self.index.prefix_lengths(hashes)
        out: dict[str, TierMatch] = {}
        for w in workers:
            gpu, cpu, local, remote = self._locs[w]
            out[w] = self.index.tier_match(hashes, lengths, gpu, cpu, local, remote)
        return out

    def candidates(
        self, hashes: Sequence[int], n_tokens: int, now: float, exclude: Iterable[str] = ()
    ) -> tuple[Mode, list[Candidate]]:
        skip = set(exclude)
        workers = [
            w.name for w in self.topology.workers if self.healthy[w.name] and w.name not in skip
        ]
        mode = self.mode(workers)
        if mode is Mode.EXACT:
            for w in workers:
                self._see(w, now)
        empty = TierMatch()
        matches = (
            self.matches(hashes, workers)
            if mode is not Mode.FALLBACK
            else dict.fromkeys(workers, empty)
        )
        cands = [
            Candidate(w, matches[w], self.model.estimate(n_tokens, matches[w], self.loads[w], now))
            for w in workers
        ]
        return mode, cands

    def _see(self, worker: str, now: float) -> None:
        """The worker's oldest unanswered request's progress, from its KV events.

        vLLM stores (and publishes) a prompt's blocks as its chunks are computed, so
        the run of its hashes the worker's GPU holds by events is how far its prefill
        is: the model learns where it is and how fast it goes (:meth:`TTFTModel.seen`).
        Seen between the last look and now: the midpoint is when it counts.
        """
        load = self.loads[worker]
        if not load.pending:
            return
        watch = self._watch[worker].get(next(iter(load.pending)))
        if watch is None:
            return
        k = self.index.stored_run(watch.hashes, watch.stored, self._locs[worker][0])
        last, watch.looked = watch.looked, now
        if k > watch.stored:
            watch.stored = k
            done = k * self.block_tokens - watch.credited
            if done > 0:
                self.model.seen(load, float(done), 0.5 * (last + now))

    def decide(
        self,
        hashes: Sequence[int],
        n_tokens: int,
        *,
        now: float,
        deadline_s: float | None = None,
        exclude: Iterable[str] = (),
    ) -> Decision:
        """The worker with the lowest estimated TTFT (or none: shed / nobody healthy)."""
        self.decisions += 1
        mode, cands = self.candidates(hashes, n_tokens, now, exclude)
        hs = tuple(hashes)
        if not cands:
            return Decision(None, mode, (), deadline_s, None, hs, n_tokens)
        if mode is Mode.FALLBACK:
            best = min(cands, key=lambda c: (c.estimate.queue_s, self.loads[c.worker].inflight))
        else:
            best = min(cands, key=self._score(cands))
        worker: str | None = best.worker
        retry: float | None = None
        if deadline_s is not None and best.estimate.ttft_s > deadline_s:
            retry = max(1.0, math.ceil(best.estimate.ttft_s - deadline_s))
            if self.on_deadline_miss == "shed":
                worker = None
        decision = Decision(worker, mode, tuple(cands), deadline_s, retry, hs, n_tokens)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("decision %s", decision.as_dict(self.block_tokens))
        return decision

    def _score(self, cands: Sequence[Candidate]) -> Callable[[Candidate], tuple[float, int]]:
        """The choice's key: estimated TTFT plus the work the request adds, weighed by load.

        On an idle cluster the key is the TTFT. When workers are busy, the service
        a request adds on a worker delays the requests that will queue behind it
        there, about as many as the queue is deep in service times: its weight is
        ``work_weight × busy share × queue depth`` (mean queue / mean service),
        capped at 64. Under overload this favours the worker that does the least
        work (its cache), where pure TTFT would spread load evenly and lose cache
        affinity; at light load the weight is ~0 and the fastest answer wins.
        """
        n = len(cands)
        busy = sum(c.estimate.queue_s > 0 for c in cands) / n
        depth = sum(c.estimate.queue_s for c in cands) / n / max(self.model.mean_service_s, 1e-3)
        weight = min(64.0, self.work_weight * busy * depth)
        loads = self.loads
        risk = self.risk

        def key(c: Candidate) -> tuple[float, int]:
            e = c.estimate
            return (e.ttft_s + risk * e.spread_s + weight * e.work_s, loads[c.worker].inflight)

        return key

    # -- accounting -----------------------------------------------------------------

    def dispatch(self, decision: Decision, now: float, worker: str | None = None) -> Ticket:
        """Book the decision's request on ``worker`` (default: the chosen one)."""
        name = worker or decision.worker
        if name is None:
            raise ValueError("a shed decision is not dispatched")
        cand = next(c for c in decision.candidates if c.worker == name)
        load = self.loads[name]
        self._tickets += 1
        expected = self.model.dispatched(load, self._tickets, cand.estimate, now)
        gpu = self._locs[name][0]
        # Progress counts from what it was credited, or what the GPU's events already
        # hold of it (cached, not computed: no progress of its own).
        credited = sum(cand.estimate.cached)
        first = min(len(decision.hashes), credited // self.block_tokens)
        first = self.index.stored_run(decision.hashes, first, gpu)
        credited = max(credited, first * self.block_tokens)
        self._watch[name][self._tickets] = _Watch(decision.hashes, credited, first, now)
        self.index.record_routed(gpu, decision.hashes)
        self.index.add_inflight(gpu, decision.hashes)
        return Ticket(name, cand.estimate, now, expected, self._tickets, decision.hashes)

    def first_token(self, ticket: Ticket, now: float, *, observed: bool = True) -> None:
        """The request's first token (``observed=False``: its answer, not timed by token)."""
        if ticket.settled:
            return
        ticket.settled = True
        self._watch[ticket.worker].pop(ticket.id, None)
        self.model.first_token(
            self.loads[ticket.worker],
            ticket.id,
            ticket.estimate,
            ticket.sent_at,
            now,
            observed=observed,
        )

    def finished(self, ticket: Ticket, now: float | None = None) -> None:
        """The request is done (or abandoned after its first token) at ``now``."""
        if ticket.done:
            return
        ticket.done = True
        self.index.drop_inflight(self._locs[ticket.worker][0], ticket.hashes)
        self.model.finished(self.loads[ticket.worker], ticket.id, now)

    def failed(self, ticket: Ticket, now: float) -> None:
        """The request failed: before its first token, unbook it; after, it stops decoding."""
        if ticket.settled:
            self.finished(ticket, now)
            return
        ticket.settled = True
        ticket.done = True
        self._watch[ticket.worker].pop(ticket.id, None)
        self.index.drop_inflight(self._locs[ticket.worker][0], ticket.hashes)
        self.model.failed(self.loads[ticket.worker], ticket.id, ticket.estimate, now)

    def reserve(self, decision: Decision, now: float) -> Ticket:
        """Select-and-reserve for another gateway: book the choice as if sent now."""
        return self.dispatch(decision, now)

    def default_priors(self) -> Priors:
        return self.model.priors
