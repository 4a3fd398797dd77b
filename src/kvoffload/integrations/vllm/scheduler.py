"""Scheduler side of the connector: lookups, load plans, save plans, block holds.

It runs in vLLM's engine-core process, next to the scheduler, and never
touches KV bytes. It computes every chunk key (it alone has the tokens), asks
the sidecar how many leading chunks it holds, tells the workers which blocks
to fill from which keys and which blocks to save under which keys, and keeps
a finished request's blocks alive until the workers have saved them.

What gets saved, and when: at each step, the chunks of a scheduled request
that vLLM has *processed* (``num_computed_tokens - num_in_flight_tokens``,
i.e. after ``update_from_output`` accepted them, truncated them for a failed
load, or dropped rejected draft tokens) and that the store does not hold yet.
Saving one step behind the forward pass is what keeps the store clean: KV
computed on top of a prefix whose load later turns out to have failed on
some worker is never saved, since vLLM rewinds the request before the next
step. A request that finishes with chunks still unsaved (or saves still
running) keeps its blocks: ``request_finished`` returns True and the
workers report it in ``finished_sending`` once its saves are done.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.request import RequestStatus

from ...keys import next_key, root_key
from ...protocol import ALIGNMENT
from ..payoff import Offer, RecomputeGuard
from . import common
from .common import (
    ChunkRef,
    EngineContracts,
    KVOffloadMetadata,
    KVOffloadSettings,
    KVOffloadWorkerMetadata,
    LoadJob,
    SaveJob,
)
from .events import ConnectorEvents
from .groups import FULL, MAMBA, SLIDING, GroupSpec, hit_boundary

log = logging.getLogger(__name__)

#: vLLM's block pool reserves block 0 as the "null" block (placeholder for
#: skipped positions); no real KV lives there.
_NULL_BLOCK_ID = 0

_CACHE_SALT_TAG = b"kvo-cache-salt\x00"
_MM_TAG = b"kvo-mm\x00"


#: A gap between two scheduling steps longer than this is idle time, not a step.
_MAX_STEP_S = 5.0


@dataclass
class _RequestState:
    request: Any  # vllm.v1.request.Request
    lora_id: str | None
    salt: bytes | None = None
    # Chunk keys computed so far, one list per (group, shard) stream, index
    # group * num_shards + shard (equal lengths; one group: one per shard).
    keys: list[list[bytes]] = field(default_factory=list)
    # The last get_num_new_matched_tokens: where vLLM's own hit ended, and
    # how many tokens the sidecar holds.
    query_start: int = 0
    query_hit: int = 0
    # Chunks [0, next_save_chunk) are in the store or being saved.
    next_save_chunk: int = 0
    pending_saves: set[int] = field(default_factory=set)
    # Blocks of the last load, block id -> chunk index, until its outcome is known.
    load_blocks: dict[int, int] = field(default_factory=dict)
    load_async: bool = False
    load_emitted: bool = False
    # The first chunk a load of this request failed at: never offered again.
    # vLLM asks again when a failed async load rewinds the request to token 0;
    # offering chunks the store still lists but the worker could not use
    # would repeat the failing load forever.
    load_failed_at: int | None = None


@dataclass
class _SaveStatus:
    req_id: str
    remaining: int  # workers that have not reported the job done
    # chunk index -> workers whose sidecar acknowledged it (``stored``)
    stored: Counter[int] = field(default_factory=Counter)


def offloadable(request: Any) -> bool:
    """Whether a request's KV is a function of its token ids (so chunk keys can name it).

    Prompt embeddings have no token ids; a resumable streaming session may
    still replace its last token, after its chunk was keyed.
    """
    return (
        request.prompt_token_ids is not None
        and getattr(request, "prompt_embeds", None) is None
        and not getattr(request, "resumable", False)
    )


def lora_id(request: Any) -> str | None:
    """The adapter's name: the stable identity across engines (``lora_int_id`` is a
    per-engine slot number, and adapter paths differ between nodes)."""
    lora = getattr(request, "lora_request", None)
    return None if lora is None else str(lora.lora_name)


def chunk_extra_keys(request: Any, chunk: int, chunk_tokens: int) -> list[bytes]:
    """Extra keys entering chunk ``chunk``'s key.

    ``cache_salt`` enters the first chunk: keys chain, so every chunk of the
    request then depends on it, exactly as vLLM folds it into its first block
    hash. It is not made part of the namespace because the namespace is the
    contract fingerprint, which the sidecar sees, indexes and accounts per
    value: a per-user salt would turn one namespace into thousands and show
    up in ``kvoffload ls``, while as an extra key it never leaves the worker.
    Multimodal inputs enter every chunk their placeholder tokens overlap.
    """
    out: list[bytes] = []
    salt = getattr(request, "cache_salt", None)
    if chunk == 0 and salt:
        out.append(_CACHE_SALT_TAG + str(salt).encode())
    lo, hi = chunk * chunk_tokens, (chunk + 1) * chunk_tokens
    for feature in getattr(request, "mm_features", None) or ():
        pos = feature.mm_position
        if pos.offset < hi and pos.offset + pos.length > lo:
            out.append(_MM_TAG + str(feature.identifier).encode())
    return out


class KVOffloadScheduler:
    def __init__(
        self,
        vllm_config: Any,
        settings: KVOffloadSettings,
        contracts: EngineContracts,
        *,
        consumer: bool,
        producer: bool,
    ) -> None:
        self._settings = settings
        self._contracts = contracts
        self._consumer = consumer
        self._producer = producer
        self._async_load = settings.load_mode == "async"
        self._ct = contracts.chunk_tokens
        self._bs = contracts.block_size
        self._blocks_per_chunk = self._ct // self._bs
        self._num_workers = int(vllm_config.parallel_config.world_size)
        # Lookups only: the staging buffer is never used, keep it minimal.
        self._client = common.make_client(
            settings, name="kvoffload-vllm-scheduler", staging_bytes=ALIGNMENT
        )
        self._requests: dict[str, _RequestState] = {}
        self._roots: dict[tuple[str | None, int, bytes], bytes] = {}
        self._pending_loads: list[LoadJob] = []
        self._pending_saves: list[SaveJob] = []
        self._saves: dict[int, _SaveStatus] = {}
        self._next_job_id = 1
        # Never slower than recompute: loads only the part of a hit that beats
        # recomputing it, from the tier's measured rate and the engine's
        # (payoff.py); each worker's loads, and its background probes, measure the tier.
        self._guard = (
            RecomputeGuard(
                prefill_tokens_per_s=settings.prefill_tokens_per_s,
                min_step_tokens=self._ct,
            )
            if settings.recompute_guard
            else None
        )
        # A sync layer-wise load streams while the step's forward computes the
        # rest of the prompt (up to one step's budget), layer by layer.
        overlapped = not self._async_load and settings.layerwise and not contracts.hybrid
        budget = getattr(vllm_config.scheduler_config, "max_num_batched_tokens", 0) or 0
        self._overlap_tokens = int(budget) if overlapped else 0
        self._stages = min(contracts.layers_per_stage)
        self._pending_probes: list[tuple[bytes, ...]] = []
        self._last_step: tuple[float, int] | None = None
        self._newly_held: set[str] = set()
        self._held: set[str] = set()
        self._kv_cache_manager: Any = None
        self._events = ConnectorEvents(vllm_config, settings, self._bs, self._blocks_per_chunk)
        self._groups = contracts.groups
        self._streams = contracts.num_groups * contracts.num_shards

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """Fallback source of block tables when a step carries no block state."""
        self._kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: Any) -> None:
        self._state(request)

    # -- keys ------------------------------------------------------------------

    def _state(self, request: Any) -> _RequestState:
        st = self._requests.get(request.request_id)
        if st is None or st.request is not request:
            st = _RequestState(request, lora_id(request))
            self._requests[request.request_id] = st
        return st

    def _keys(self, st: _RequestState, n_chunks: int) -> list[list[bytes]] | None:
        """Keys of chunks [0, n_chunks) for every shard; None if the sidecar is unreachable."""
        salt = self._client.salt
        if salt is None:
            return None
        if st.salt != salt:
            # First use, or the sidecar now serves another store: start over.
            st.salt = salt
            st.keys = [[] for _ in range(self._streams)]
        have = len(st.keys[0])
        if have < n_chunks:
            tokens = st.request.all_token_ids
            ct = self._ct
            for c in range(have, n_chunks):
                chunk_tokens = tokens[c * ct : (c + 1) * ct]
                extra = chunk_extra_keys(st.request, c, ct)
                for stream, shard_keys in enumerate(st.keys):
                    parent = shard_keys[-1] if shard_keys else self._root(st.lora_id, stream, salt)
                    shard_keys.append(next_key(parent, salt, chunk_tokens, extra))
        return [k[:n_chunks] for k in st.keys]

    def _root(self, lora: str | None, stream: int, salt: bytes) -> bytes:
        k = (lora, stream, salt)
        r = self._roots.get(k)
        if r is None:
            group, shard = divmod(stream, self._contracts.num_shards)
            ns = self._contracts.namespace(lora, shard, group)
            r = self._roots[k] = root_key(ns, salt)
        return r

    # -- loads -------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self._consumer or not offloadable(request):
            return 0, False
        # Whole chunks only, and never the last token: vLLM must compute at
        # least one token to sample the next.
        n_max = (request.num_tokens - 1) // self._ct
        st = self._state(request)
        if st.load_failed_at is not None:
            n_max = min(n_max, st.load_failed_at)
        st.query_start, st.query_hit = num_computed_tokens, 0
        if n_max * self._ct <= num_computed_tokens:
            return 0, False  # vLLM's own prefix cache covers all we could add
        keys = self._keys(st, n_max)
        if keys is None:
            return 0, False
        if self._groups:
            found = self._hybrid_hit(keys, n_max, num_computed_tokens)
        else:
            found = n_max
            for shard_keys in keys:
                # Every shard must hold the chunk: a worker without it could not load.
                found = min(found, self._client.lookup(shard_keys[:found]))
                if found == 0:
                    break
        # The store holds these chunks: a later save of them would only hear "exists".
        st.next_save_chunk = max(st.next_save_chunk, found)
        st.query_hit = self._worth_loading(request, found) * self._ct
        if st.query_hit <= num_computed_tokens:
            return 0, False
        log.debug(
            "kvoffload: %s: sidecar holds %d of %d tokens, vLLM's cache %d",
            request.request_id,
            st.query_hit,
            request.num_tokens,
            num_computed_tokens,
        )
        return st.query_hit - num_computed_tokens, self._async_load

    def _hybrid_hit(self, keys: list[list[bytes]], n_max: int, start: int) -> int:
        """vLLM's hit rule over the groups (groups.py): every group served, or none."""
        shards = self._contracts.num_shards

        def present(group: int, lo: int, hi: int) -> int:
            held = hi - lo
            for shard in range(shards):
                # Every shard must hold the chunk: a worker without it could not load.
                held = min(held, self._client.lookup(keys[group * shards + shard][lo : lo + held]))
                if held == 0:
                    break
            return held

        return hit_boundary(
            self._groups, self._ct, n_max, start, present, self._contracts.mamba_align
        )

    def _hybrid_load(
        self, st: _RequestState, block_ids: Any, start: int, end: int
    ) -> tuple[list[ChunkRef], bool]:
        """Each group's share of a hit ``[start, end)``: only the chunks vLLM's rule
        needs (a window, a state), only the blocks vLLM allocated (not null)."""
        shards = self._contracts.num_shards
        chunks: list[ChunkRef] = []
        broken = False
        for g in self._groups:
            ids = list(block_ids[g.index])
            keys = st.keys[g.index * shards : (g.index + 1) * shards]
            # Attention groups: every chunk with blocks vLLM allocated; a
            # sliding-window group's blocks before the window are null (vLLM
            # keeps none there), so only its window is loaded. Mamba: the
            # state at the boundary.
            first_c, end_c = start // self._ct, end // self._ct
            for c in range(end_c - 1, end_c) if g.kind == MAMBA else range(first_c, end_c):
                if g.kind == MAMBA:
                    lo = ((c + 1) * self._ct) // g.block_size - 1
                    hi = lo + 1
                else:
                    bpc = self._ct // g.block_size
                    lo, hi = max(c * bpc, start // g.block_size), (c + 1) * bpc
                run = ids[lo:hi]
                want = hi - lo
                while g.kind != FULL and run and run[0] == _NULL_BLOCK_ID:
                    run, lo, want = run[1:], lo + 1, want - 1  # below the window: none kept
                if g.kind == SLIDING and not run:
                    continue
                if not run or len(run) != want or _NULL_BLOCK_ID in run:
                    # vLLM allocated no block for a part of the hit: loading the
                    # rest would be a partial hit. Fail it all (vLLM recomputes).
                    broken = True
                    continue
                first = 0 if g.kind == MAMBA else lo - c * (self._ct // g.block_size)
                chunks.append(
                    ChunkRef(
                        c, tuple(k[c] for k in keys), tuple(run), first_block=first, group=g.index
                    )
                )
                st.load_blocks.update((b, c) for b in run)
        if broken:
            log.warning(
                "kvoffload: %s: vLLM allocated no block for part of the hit; not loading it",
                st.request.request_id,
            )
        return chunks, broken

    def _worth_loading(self, request: Any, found: int) -> int:
        """Of the ``found`` stored chunks, how many to load: the guard's answer,
        down to a chunk boundary (the rest is recomputed)."""
        st = self._requests[request.request_id]
        offered = found * self._ct - st.query_start
        if self._guard is None or offered <= 0:
            return found
        decision = self._guard.decide(
            Offer(
                offered,
                tail=request.num_tokens - found * self._ct,
                start=st.query_start,
                # A hybrid hit is whole or nothing: a shorter boundary needs
                # other windows and states than the ones the lookup found.
                granule=0 if self._groups else self._ct,
                overlap=self._overlap_tokens,
                stages=self._stages,
            )
        )
        if decision.tokens >= offered:
            return found
        log.debug("kvoffload: %s: %s", request.request_id, decision.reason)
        if self._guard.claim_probe():
            # The tier is measured again by a worker's background read of a
            # chunk the store holds; this request does not wait for it.
            self._queue_probe(st, found - 1)
        if decision.tokens <= 0:
            return 0
        return min(found, (st.query_start + decision.tokens) // self._ct)

    def _queue_probe(self, st: _RequestState, chunk: int) -> None:
        """Ask the workers to time one read of stored chunk ``chunk`` (a full-attention
        group's: every group of a hybrid model keeps its chunks, only those always)."""
        group = next((g.index for g in self._groups if g.kind == FULL), None)
        if self._groups and group is None:
            return
        shards = self._contracts.num_shards
        lo = (group or 0) * shards
        self._pending_probes.append(tuple(k[chunk] for k in st.keys[lo : lo + shards]))

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        st = self._requests.get(request.request_id)
        start = st.query_start if st is not None else 0
        end = start + num_external_tokens
        if st is None or end > st.query_hit or not st.keys:
            # vLLM only grants what get_num_new_matched_tokens offered.
            raise RuntimeError(
                f"vLLM asked kvoffload to load tokens [{start}, {end}) of request "
                f"{request.request_id}, more than the lookup offered"
            )
        st.load_blocks = {}
        st.load_async = self._async_load
        st.load_emitted = False
        if self._groups:
            planned, broken = self._hybrid_load(st, blocks.get_block_ids(), start, end)
            self._pending_loads.append(
                LoadJob(request.request_id, tuple(planned), self._async_load, fail=broken)
            )
            return
        block_ids = list(blocks.get_block_ids()[0])
        bs, bpc = self._bs, self._blocks_per_chunk
        first_blk, end_blk = start // bs, -(-end // bs)
        chunks: list[ChunkRef] = []
        for c in range(first_blk // bpc, -(-end_blk // bpc)):
            lo, hi = max(c * bpc, first_blk), min((c + 1) * bpc, end_blk)
            ids = tuple(block_ids[lo:hi])
            chunks.append(ChunkRef(c, tuple(k[c] for k in st.keys), ids, first_block=lo - c * bpc))
            st.load_blocks.update((b, c) for b in ids)
        self._pending_loads.append(LoadJob(request.request_id, tuple(chunks), self._async_load))

    # -- saves -----------------------------------------------------------------------

    def _save_blocks(self, group: GroupSpec | None, block_ids: Sequence[int], c: int) -> Any:
        """The blocks chunk ``c`` of a group is saved from, None where vLLM keeps none."""
        if group is not None and group.kind == MAMBA:
            end = (c + 1) * self._ct
            if end % group.block_size:
                return None  # no state ends inside this chunk's last block
            lo, hi = end // group.block_size - 1, end // group.block_size
        else:
            bpc = self._ct // (group.block_size if group is not None else self._bs)
            lo, hi = c * bpc, (c + 1) * bpc
        ids = tuple(block_ids[lo:hi])
        return None if len(ids) < hi - lo or _NULL_BLOCK_ID in ids else ids

    def _save_end(self, group: GroupSpec | None, block_ids: Sequence[int]) -> int:
        bs = group.block_size if group is not None else self._bs
        return len(block_ids) * bs // self._ct

    def _plan_save(self, st: _RequestState, groups: Sequence[Sequence[int]]) -> list[SaveJob]:
        """Jobs (one per KV-cache group) saving every processed, unsaved whole chunk."""
        req = st.request
        processed = min(req.num_computed_tokens - req.num_in_flight_tokens, req.num_tokens)
        specs: Sequence[GroupSpec | None] = self._groups or (None,)
        end = processed // self._ct
        for g in specs:
            end = min(end, self._save_end(g, groups[g.index if g is not None else 0]))
        if end <= st.next_save_chunk:
            return []
        keys = self._keys(st, end)
        if keys is None:
            return []  # sidecar unreachable: try again at a later step
        shards = self._contracts.num_shards
        jobs = []
        for g in specs:
            gi = g.index if g is not None else 0
            chunks = []
            for c in range(st.next_save_chunk, end):
                ids = self._save_blocks(g, groups[gi], c)
                if ids is None:
                    continue  # outside the window / no state kept: nothing to save
                made = self._events.chunk_blocks(req, c, g)
                if made is not None:
                    self._events.planned(self._next_job_id, c, made[1])
                blocks = made[0] if made is not None else None
                stream = keys[gi * shards : (gi + 1) * shards]
                chunks.append(
                    ChunkRef(c, tuple(k[c] for k in stream), ids, blocks=blocks, group=gi)
                )
            if chunks:
                jobs.append(self._new_job(st, tuple(chunks), gi))
        st.next_save_chunk = end
        return jobs

    def _new_job(self, st: _RequestState, chunks: tuple[ChunkRef, ...], group: int) -> SaveJob:
        shards = range(self._contracts.num_shards)
        job = SaveJob(
            self._next_job_id,
            st.request.request_id,
            tuple(self._contracts.namespace(st.lora_id, s, group) for s in shards),
            chunks,
            st.lora_id,
            group,
        )
        self._next_job_id += 1
        self._saves[job.job_id] = _SaveStatus(st.request.request_id, self._num_workers)
        st.pending_saves.add(job.job_id)
        return job

    def build_connector_meta(self, scheduler_output: Any) -> KVOffloadMetadata:
        self._observe_step(int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0))
        meta = KVOffloadMetadata(
            loads=self._pending_loads,
            saves=self._pending_saves,
            held_req_ids=self._newly_held,
            preempted_req_ids=set(scheduler_output.preempted_req_ids or ()),
            probes=self._pending_probes,
        )
        self._pending_loads, self._pending_saves, self._newly_held = [], [], set()
        self._pending_probes = []
        for load in meta.loads:
            st = self._requests.get(load.req_id)
            if st is not None:
                st.load_emitted = True
        if self._producer:
            block_state = scheduler_output.kv_connector_block_state
            for req_id in scheduler_output.num_scheduled_tokens:
                st = self._requests.get(req_id)
                if st is None or not offloadable(st.request):
                    continue
                groups = block_state.get_block_ids(req_id) if block_state is not None else None
                if groups is None and self._kv_cache_manager is not None:
                    groups = self._kv_cache_manager.get_block_ids(req_id)
                if groups is None:
                    continue
                meta.saves.extend(self._plan_save(st, groups))
        return meta

    def _observe_step(self, tokens: int) -> None:
        """The engine's prefill rate, from the time between two scheduling steps:
        the first step's tokens were computed in between (idle gaps left out)."""
        now = time.monotonic()
        if self._guard is not None and self._last_step is not None:
            then, n = self._last_step
            if now - then < _MAX_STEP_S:
                self._guard.observe_step(n, now - then)
        self._last_step = (now, tokens) if tokens > 0 else None

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Plan the last saves over every group; hold the blocks until they are done."""
        st = self._requests.get(request.request_id)
        if st is None:
            return False, None
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            # Aborted while loading: vLLM itself frees the blocks once the
            # load reports finished_recving; holding them too would free twice.
            # Saves it started before a preemption were drained by the workers
            # at that preemption.
            del self._requests[request.request_id]
            return False, None
        if self._producer and offloadable(request):
            if len(block_ids) != self._contracts.num_groups:
                raise RuntimeError(
                    f"kvoffload: {len(block_ids)} block tables for request "
                    f"{request.request_id}, the model has {self._contracts.num_groups} groups"
                )
            self._pending_saves.extend(self._plan_save(st, block_ids))
        if st.pending_saves:
            self._held.add(request.request_id)
            self._newly_held.add(request.request_id)
            return True, None
        del self._requests[request.request_id]
        return False, None

    def _take_worker_meta(self, meta: KVOffloadWorkerMetadata) -> None:
        if self._guard is not None:
            for chunks, seconds in meta.load_samples:
                self._guard.observe_load(chunks * self._ct, seconds)
        for job_id, counts in meta.stored_chunks.items():
            status = self._saves.get(job_id)
            if status is not None:
                status.stored.update(counts)
        for job_id, n in meta.completed_saves.items():
            status = self._saves.get(job_id)
            if status is None:
                continue
            status.remaining -= n
            if status.remaining > 0:
                continue
            del self._saves[job_id]
            # BlockStored only now: every worker's sidecar acknowledged it.
            self._events.job_done(job_id, status.stored, self._num_workers)
            st = self._requests.get(status.req_id)
            if st is not None:
                st.pending_saves.discard(job_id)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVOffloadWorkerMetadata):
            self._take_worker_meta(meta)
        invalid = connector_output.invalid_block_ids or set()
        recving = connector_output.finished_recving or set()
        for req_id, st in self._requests.items():
            if not st.load_blocks or not st.load_emitted:
                continue
            failed = [c for b, c in st.load_blocks.items() if b in invalid]
            if failed:
                # Those chunks are not (readably) in the store after all:
                # save them once vLLM has recomputed them, never load them again.
                st.next_save_chunk = min(st.next_save_chunk, min(failed))
                if st.load_failed_at is None or min(failed) < st.load_failed_at:
                    st.load_failed_at = min(failed)
            if not st.load_async or req_id in recving:
                st.load_blocks = {}
        for req_id in connector_output.finished_sending or ():
            self._held.discard(req_id)
            self._requests.pop(req_id, None)

    def has_held_requests(self) -> bool:
        return bool(self._held)

    def take_events(self) -> Iterable[Any]:
        """vLLM's ``take_events``: the connector's KV events since the last step."""
        return self._events.take()

    def shutdown(self) -> None:
        self._events.close()
        self._client.close()
