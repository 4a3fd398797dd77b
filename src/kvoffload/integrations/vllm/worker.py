"""Worker side of the connector: moves KV between vLLM's paged blocks and the sidecar.

Paged layouts
-------------
vLLM 0.33 hands ``register_kv_caches`` one tensor per attention layer: a
*logical* ``[num_blocks, num_kv_heads, block_size, head_size + head_size_v]``
view (``[B, H, N, C]``, K and V side by side in the last dimension), whose
strides encode the physical ``KVCacheLayout`` the engine resolved for its
backends: ``LBNHC`` (per layer, token-major: the old FlashAttention "NHD"),
``LBHNC`` (head-major "HND": FlashInfer, the CPU backend), ``BLNHC``/``BLHNC``
(block-outermost, all layers of a block together), ``LHBNC`` and ``BHLNC``.
When the backend's kernel blocks are smaller than vLLM's blocks, the first
dimension counts kernel blocks (``num_blocks × ratio``, ``block_size / ratio``
tokens each). All of these are supported: gathers and scatters index the
logical view and let the strides do the rest. Refused, with an error naming
what was found: any other rank or shape (MLA's single latent head, packed or
scaled quantized pages), a dtype or head count that disagrees with the KV
spec, and a layer count that disagrees with the contract.

Threads
-------
Loads and saves each have their own sidecar connection and one background
thread, so a long save never delays a load. Async loads run on the load
thread. Sync loads (``start_load_kv`` is called before the forward pass when
a step carries one) run layer-wise on a step thread of their own: the sidecar
reports each layer once verified, the thread copies it into the cache, and
``wait_for_layer_load`` (called by each attention layer) returns when that
layer of every chunk is in place, so layer i+1 streams while layer i
computes; ``wait_for_save`` and ``get_block_ids_with_load_errors`` (after the
forward) wait for the rest and report what failed. With ``layerwise = false``
they run inline in ``start_load_kv``, whole chunks before the forward.
Async saves gather and write on the save thread; the scheduler keeps the
blocks of finished requests until the save is reported, and
``handle_preemptions`` drains saves of preempted requests before their
blocks can be overwritten.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from ...client import ChunkTooLarge
from ...protocol import region_size
from ..sealed_loads import SealedLoader, sealed_loader
from . import common
from .common import (
    EngineContracts,
    KVOffloadConfigError,
    KVOffloadMetadata,
    KVOffloadSettings,
    KVOffloadWorkerMetadata,
    LoadJob,
    SaveJob,
    registered_attention_backend,
)
from .paged import PagedCache, StatePages, _BadChunk, build_paged_cache, build_state_pages
from .pinned import PinnedStaging
from .probe import TierProbe
from .stats import FIELDS as STATS_FIELDS

log = logging.getLogger(__name__)


class _Stream:
    """Where background copies run: a side CUDA stream on a GPU, inline on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self._stream = (
            torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            if device.type == "cuda"
            else None
        )

    def mark(self) -> Any:
        """An event after everything queued so far on the current stream (the forward)."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return event

    @property
    def on_device(self) -> bool:
        return self._stream is not None

    def record(self) -> Any:
        """An event after everything queued so far on this (side) stream."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._stream)
        return event

    @contextmanager
    def active(self, after: Any = None) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        with torch.cuda.stream(self._stream):
            if after is not None:
                self._stream.wait_event(after)
            yield
        # Reported done means the bytes are in place.
        self._stream.synchronize()


class _StepLoad:
    """This step's sync loads, handed to the forward pass layer by layer.

    Layer ``i`` is ready once every chunk of the step's sync loads either has
    its layer ``i`` in the cache or is known not to be loaded (its blocks are
    then reported failed after the forward, and vLLM recomputes them). On a
    GPU the copies run on the load stream and ``events[i]`` orders the compute
    stream after them; on the CPU the copies are done when ``ready[i]`` is set.
    """

    def __init__(self, num_layers: int, total_chunks: int, stream: _Stream | None) -> None:
        self.ready = [threading.Event() for _ in range(num_layers)]
        self.events: list[Any] = [None] * num_layers
        self._count = [0] * num_layers
        self._total = total_chunks
        self._stream = stream
        self._lock = threading.Lock()
        self.future: Future[set[int]] | None = None

    def add(self, layer: int, chunks: int) -> None:
        """``chunks`` more chunks are settled for ``layer`` (in the cache, or lost)."""
        with self._lock:
            self._count[layer] += chunks
            if self._count[layer] >= self._total and not self.ready[layer].is_set():
                self._release(layer)

    def release_all(self) -> None:
        with self._lock:
            for layer, ev in enumerate(self.ready):
                if not ev.is_set():
                    self._release(layer)

    def _release(self, layer: int) -> None:
        if self._stream is not None:
            self.events[layer] = self._stream.record()
        self.ready[layer].set()

    def wait(self, layer: int) -> None:
        self.ready[layer].wait()
        if self.events[layer] is not None:
            torch.cuda.current_stream().wait_event(self.events[layer])


def local_ranks(vllm_config: Any) -> tuple[int, int]:
    """(tp_rank, pp_rank) of this worker process."""
    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size == 1 and pc.pipeline_parallel_size == 1:
        return 0, 0
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    return int(get_tp_group().rank_in_group), int(get_pp_group().rank_in_group)


class KVOffloadWorker:
    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        settings: KVOffloadSettings,
        contracts: EngineContracts,
    ) -> None:
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._settings = settings
        self._contracts = contracts
        self._registered_ns: set[bytes] = set()
        tp_rank, pp_rank = local_ranks(vllm_config)
        self._shard = contracts.shard_index(tp_rank, pp_rank)
        self._num_layers = contracts.layers_per_stage[pp_rank]
        self._ct = contracts.chunk_tokens
        self._async_save = settings.save_mode == "async"
        rank = f"tp{tp_rank}pp{pp_rank}"
        self._load_client = common.make_client(
            settings, name=f"kvoffload-vllm-{rank}-load", staging_bytes=settings.staging_bytes
        )
        self._save_client = common.make_client(
            settings, name=f"kvoffload-vllm-{rank}-save", staging_bytes=settings.staging_bytes
        )
        self._load_pool = ThreadPoolExecutor(1, thread_name_prefix="kvoffload-load")
        # Sync loads of a step, layer by layer, while the forward runs.
        self._step_pool = ThreadPoolExecutor(1, thread_name_prefix="kvoffload-step-load")
        # Hybrid models load whole chunks before the forward: each group has
        # layers of its own, the layer-wise hand-off counts one group's.
        self._layerwise = settings.layerwise and not contracts.hybrid
        # One cache per KV-cache group (hybrid models; else only group 0).
        self._caches: dict[int, PagedCache | StatePages] = {}
        self._step: _StepLoad | None = None
        self._layer_of: dict[str, int] = {}
        self._pinned = PinnedStaging()
        self._save_pool = ThreadPoolExecutor(1, thread_name_prefix="kvoffload-save")
        self._cache: PagedCache | None = None
        self._sleeping = False
        self._load_stream: _Stream | None = None
        self._save_stream: _Stream | None = None
        self._loads: dict[str, Future[set[int]]] = {}
        self._load_errors: set[int] = set()
        self._saves: dict[int, tuple[str, Future[None]]] = {}
        self._req_saves: dict[str, set[int]] = {}
        self._held: set[str] = set()
        self._completed_saves: list[int] = []
        # job id -> chunk indices the sidecar acknowledged (for KV events)
        self._stored: dict[int, list[int]] = {}
        # vLLM's KV-connector stats of the current interval (get_kv_connector_stats);
        # the load and save threads both count.
        self._stats_lock = threading.Lock()
        self._stats: dict[str, int] = dict.fromkeys(STATS_FIELDS, 0)
        # Loads since the last worker metadata: (chunks, seconds), for the recompute guard.
        self._load_samples: list[tuple[int, float]] = []
        self._sealed: SealedLoader | None = None
        self._probe = TierProbe(
            lambda size: common.make_client(
                settings, name=f"kvoffload-vllm-{rank}-probe", staging_bytes=size
            ),
            self._sample_load,
        )

    # -- registration ----------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._contracts.hybrid:
            self._register_groups(kv_caches)
            return
        spec = self._contracts.spec
        cache = build_paged_cache(kv_caches, spec, int(self._kv_cache_config.num_blocks))
        if len(cache.layers) != self._num_layers:
            raise KVOffloadConfigError(
                f"this worker holds {len(cache.layers)} KV caches, the contract says "
                f"{self._num_layers} layers for its pipeline stage"
            )
        expected = self._contracts.base.attention_backend
        actual = registered_attention_backend(self._vllm_config, cache.layer_names)
        if actual is not None and actual != expected:
            raise KVOffloadConfigError(
                f"the workers run attention backend {actual}, the scheduler derived {expected}; "
                "pin it with --attention-backend (or kv_connector_extra_config.attention_backend)"
            )
        packed = region_size([cache.layer_nbytes(self._ct)] * len(cache.layers))
        if packed > self._settings.staging_bytes:
            raise KVOffloadConfigError(
                f"kv_connector_extra_config.staging_bytes ({self._settings.staging_bytes}) is "
                f"smaller than one chunk ({packed} bytes): raise it or lower chunk_tokens"
            )
        self._cache = cache
        self._caches = {0: cache}
        self._probe.chunk_bytes = packed
        self._sealed = sealed_loader(self._settings, packed)
        self._layer_of = {name: i for i, name in enumerate(cache.layer_names)}
        self._load_stream = _Stream(cache.device)
        self._save_stream = _Stream(cache.device)
        log.info(
            "kvoffload: %d layers, %d kv heads × %d, %s, %d-token blocks in %d-token chunks "
            "(%d bytes each), shard %d of %d",
            len(cache.layers),
            cache.num_kv_heads,
            cache.head_dim,
            cache.dtype,
            cache.block_size,
            self._ct,
            packed,
            self._shard,
            self._contracts.num_shards,
        )

    def _register_groups(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """A hybrid model: one cache per KV-cache group, each checked like a model's."""
        num_blocks = int(self._kv_cache_config.num_blocks)
        caches: dict[int, PagedCache | StatePages] = {}
        for g in self._contracts.groups:
            cache: PagedCache | StatePages
            if g.attn is not None:
                cache = build_paged_cache(kv_caches, g.attn, num_blocks)
            else:
                cache = build_state_pages(kv_caches, g, self._kv_cache_config)
            packed = region_size([cache.layer_nbytes(self._ct)] * len(cache.layers))
            if packed > self._settings.staging_bytes:
                raise KVOffloadConfigError(
                    f"kv_connector_extra_config.staging_bytes ({self._settings.staging_bytes}) "
                    f"is smaller than one chunk of KV-cache group {g.index} ({packed} bytes)"
                )
            caches[g.index] = cache
            self._probe.chunk_bytes = max(self._probe.chunk_bytes, packed)
        attn = [c for c in caches.values() if isinstance(c, PagedCache)]
        names = [n for c in attn for n in c.layer_names]
        expected = self._contracts.base.attention_backend
        actual = registered_attention_backend(self._vllm_config, names)
        if actual is not None and actual != expected:
            raise KVOffloadConfigError(
                f"the workers run attention backend {actual}, the scheduler derived {expected}; "
                "pin it with --attention-backend (or kv_connector_extra_config.attention_backend)"
            )
        self._caches = caches
        self._cache = attn[0]
        self._sealed = sealed_loader(self._settings, self._probe.chunk_bytes)
        self._load_stream = _Stream(attn[0].device)
        self._save_stream = _Stream(attn[0].device)
        log.info(
            "kvoffload: hybrid model, %d KV-cache groups (%s), %d-token chunks, shard %d of %d",
            len(caches),
            ", ".join(
                f"{g.index}:{g.kind}×{len(caches[g.index].layers)}" for g in self._contracts.groups
            ),
            self._ct,
            self._shard,
            self._contracts.num_shards,
        )

    def _group_cache(self, group: int) -> PagedCache | StatePages:
        cache = self._caches.get(group)
        if cache is None:
            raise RuntimeError(f"kvoffload: KV-cache group {group} has no registered cache")
        return cache

    def unregister_kv_caches(self) -> None:
        """Sleep mode: vLLM drained every transfer; the caches go away until restore."""
        self._finish_step()
        for _job, (_req, fut) in list(self._saves.items()):
            fut.result()
        self._poll_saves()
        self._pinned.unpin()
        self._sleeping = True

    def restore_kv_caches(self) -> None:
        """After wake-up: vLLM restored the same allocations, so the views stand."""
        self._sleeping = False

    def _require_cache(self) -> PagedCache:
        if self._sleeping:
            raise RuntimeError("kvoffload: KV transfer requested while vLLM sleeps")
        if self._cache is None:
            raise RuntimeError("kvoffload: KV transfer requested before register_kv_caches")
        return self._cache

    # -- loads -------------------------------------------------------------------

    def start_load_kv(self, meta: KVOffloadMetadata) -> None:
        self._finish_step()
        for keys in meta.probes:
            self._probe.start(keys[self._shard])
        # Async loads (and layer-wise sync ones) write on a side stream: order
        # them after what this step queued on the main one (vLLM zeroes newly
        # allocated blocks there).
        for job in meta.loads:
            if job.fail:
                self._fail_load(job)
        sync = [job for job in meta.loads if not job.is_async and not job.fail]
        layerwise = bool(sync) and self._layerwise
        background = layerwise or any(job.is_async for job in meta.loads)
        after = self._load_stream.mark() if background and self._load_stream else None
        for job in meta.loads:
            if job.fail:
                continue
            if job.is_async:
                self._loads[job.req_id] = self._load_pool.submit(self._run_load, job, True, after)
            elif not layerwise:
                # The step's forward reads these blocks right after this returns.
                self._load_errors |= self._run_load(job, False, None)
        if layerwise:
            # The forward waits for each layer in wait_for_layer_load.
            cache = self._require_cache()
            total = sum(len(j.chunks) for j in sync)
            step = _StepLoad(len(cache.layers), total, self._device_stream())
            step.future = self._step_pool.submit(self._run_step, sync, step, after)
            self._step = step

    def _fail_load(self, job: LoadJob) -> None:
        failed = {b for c in job.chunks for b in c.block_ids}
        self._count(chunks_load_failed=len(job.chunks))
        if job.is_async:
            done: Future[set[int]] = Future()
            done.set_result(failed)
            self._loads[job.req_id] = done
        else:
            self._load_errors |= failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Return once layer ``layer_name`` of this step's sync loads is in the cache
        (or known lost: its blocks are reported failed after the forward)."""
        step = self._step
        if step is None:
            return
        i = self._layer_of.get(layer_name)
        if i is None:
            # Not a layer this connector registered: wait for all of them,
            # which is always correct.
            for layer in range(len(step.ready)):
                step.wait(layer)
            return
        step.wait(i)

    def _finish_step(self) -> None:
        """Wait for the step's layer-wise load and take its failed blocks."""
        step, self._step = self._step, None
        if step is not None and step.future is not None:
            self._load_errors |= step.future.result()

    def _device_stream(self) -> _Stream | None:
        """The load stream where the cache is on a GPU (lever 6); None on the CPU."""
        s = self._load_stream
        return s if s is not None and s.on_device else None

    def _run_step(self, jobs: list[LoadJob], step: _StepLoad, after: Any) -> set[int]:
        failed: set[int] = set()
        try:
            with self._background(self._device_stream(), after):
                for job in jobs:
                    failed |= self._run_load_layerwise(job, step)
        except Exception:
            log.exception("kvoffload: layer-wise load failed")
            failed |= {b for job in jobs for c in job.chunks for b in c.block_ids}
        finally:
            step.release_all()
        return failed

    def _run_load_layerwise(self, job: LoadJob, step: _StepLoad) -> set[int]:
        """Load one request's chunks layer by layer; the block ids not verified in full."""
        cache = self._require_cache()
        started = time.monotonic()
        chunks = job.chunks
        num_layers = len(cache.layers)
        delivered = [0] * num_layers  # per layer: leading chunks in the cache
        bad = len(chunks)  # first chunk that must not count as loaded

        device = self._device_stream() is not None
        pinned = device and self._pinned.pin(self._load_client.staging, cache.device)

        def on_layer(layer: int, first: int, views: Sequence[memoryview]) -> None:
            try:
                scatter(layer, first, views)
            finally:
                if device:
                    # The views die with this call: their copies must be done.
                    torch.cuda.current_stream().synchronize()

        def scatter(layer: int, first: int, views: Sequence[memoryview]) -> None:
            nonlocal bad
            if layer >= num_layers:
                # An object with more layers than this shard: unusable from its first chunk.
                log.warning("kvoffload: chunk %d of %s has a layer %d", first, job.req_id, layer)
                bad = min(bad, first)
                return
            before = delivered[layer]
            for j, mv in enumerate(views):
                c = first + j
                if c >= bad:
                    break
                try:
                    if c != delivered[layer]:
                        raise _BadChunk(f"layer {layer} of chunk {c} arrived out of order")
                    cache.scatter_layer(chunks[c], self._ct, layer, mv, pinned)
                except _BadChunk as exc:
                    log.warning("kvoffload: chunk %d of %s unusable: %s", c, job.req_id, exc)
                    bad = c
                    break
                delivered[layer] = c + 1
            step.add(layer, delivered[layer] - before)

        done = 0
        try:
            results = self._load_client.load_layerwise(
                [c.keys[self._shard] for c in chunks], on_layer
            )
            verified = next((i for i, r in enumerate(results) if not r.ok), len(results))
            done = min(verified, bad, *delivered)
        except Exception:
            log.exception("kvoffload: load for %s failed", job.req_id)
        finally:
            for layer in range(num_layers):
                step.add(layer, len(chunks) - delivered[layer])
        self._sample_load(len(chunks), time.monotonic() - started)
        self._count(chunks_loaded=done, chunks_load_failed=len(chunks) - done)
        return {b for c in chunks[done:] for b in c.block_ids}

    def _run_load(self, job: LoadJob, background: bool, after: Any) -> set[int]:
        """Load a request's chunks; the block ids that did not get verified data."""
        self._require_cache()
        started = time.monotonic()
        chunks = job.chunks
        done = 0  # chunks [0, done) are in their blocks
        stop = False

        def place(i: int, layers: Sequence[memoryview]) -> bool:
            try:
                self._group_cache(chunks[i].group).scatter(chunks[i], self._ct, layers)
            except _BadChunk as exc:
                log.warning("kvoffload: chunk %d of %s unusable: %s", i, job.req_id, exc)
                return False
            return True

        def into(i: int, key: bytes, layers: Sequence[memoryview]) -> None:
            nonlocal done, stop
            if stop or i != done:
                return  # nothing after a failure counts as loaded
            if not place(i, layers):
                stop = True
                return
            done = i + 1

        keys = [c.keys[self._shard] for c in chunks]
        try:
            with self._background(self._load_stream if background else None, after):
                if self._sealed is not None and self._load_client.uses_sealed_direct():
                    done = self._sealed.load(self._load_client, keys, place)
                else:
                    results = self._load_client.load(keys, into)
                    verified = next((i for i, r in enumerate(results) if not r.ok), len(results))
                    done = min(done, verified)
        except Exception:
            log.exception("kvoffload: load for %s failed", job.req_id)
        self._sample_load(len(chunks), time.monotonic() - started)
        self._count(chunks_loaded=done, chunks_load_failed=len(chunks) - done)
        return {b for c in chunks[done:] for b in c.block_ids}

    def _sample_load(self, chunks: int, seconds: float) -> None:
        with self._stats_lock:
            self._load_samples.append((chunks, seconds))

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, n in deltas.items():
                self._stats[name] += n

    def take_stats(self) -> dict[str, int] | None:
        """The interval's counts (then zero), or None when nothing happened."""
        with self._stats_lock:
            stats, self._stats = self._stats, dict.fromkeys(STATS_FIELDS, 0)
        return stats if any(stats.values()) else None

    @staticmethod
    def _background(stream: _Stream | None, after: Any) -> AbstractContextManager[None]:
        return stream.active(after) if stream is not None else nullcontext()

    # -- saves -------------------------------------------------------------------

    def wait_for_save(self, meta: KVOffloadMetadata) -> None:
        # After the forward: the step's loads are over, whatever it waited for.
        self._finish_step()
        if meta.saves:
            self._require_cache()
            after = self._save_stream.mark() if self._save_stream is not None else None
            for job in meta.saves:
                cache = self._group_cache(job.group)
                # Hybrid models: vLLM frees a sliding-window block once the
                # window passed it, and an aligned Mamba state once a newer one
                # exists, to reuse them next step. Copy them out now.
                early = self._gather(cache, job) if self._contracts.hybrid else None
                if self._async_save:
                    fut = self._save_pool.submit(self._run_save, cache, job, after, early)
                    self._saves[job.job_id] = (job.req_id, fut)
                    self._req_saves.setdefault(job.req_id, set()).add(job.job_id)
                else:
                    self._run_save(cache, job, None, early)
                    self._completed_saves.append(job.job_id)
        # Registered only now, after this step's saves: get_finished may run
        # before wait_for_save (deferred finalize), and must not report a held
        # request whose last save has not even been submitted.
        self._held |= meta.held_req_ids

    def _run_save(
        self, cache: PagedCache | StatePages, job: SaveJob, after: Any, early: Any = None
    ) -> None:
        try:
            with self._background(self._save_stream, after):
                self._save(cache, job, early)
        except Exception:
            # A lost save is a later miss; the blocks must be released regardless.
            log.exception("kvoffload: save job %d of %s failed", job.job_id, job.req_id)

    def _gather(self, cache: PagedCache | StatePages, job: SaveJob) -> list[Any]:
        """The job's chunks, gathered a staging buffer's worth at a time:
        ``(chunks, layers)`` per batch, lazily unless listed."""
        return list(self._batches(cache, job))

    def _batches(self, cache: PagedCache | StatePages, job: SaveJob) -> Iterator[Any]:
        bpc = cache.blocks_per_chunk(self._ct)
        if any(len(c.block_ids) != bpc for c in job.chunks):
            raise ValueError(f"save job {job.job_id}: a chunk without {bpc} blocks")
        per_chunk = region_size([cache.layer_nbytes(self._ct)] * len(cache.layers))
        # Gather at most a staging buffer's worth at a time: the client sends
        # in batches of that size anyway, and a long prompt would otherwise
        # materialize all its chunks in host memory at once.
        group = max(1, self._settings.staging_bytes // per_chunk)
        for g in range(0, len(job.chunks), group):
            chunks = job.chunks[g : g + group]
            yield chunks, cache.gather([b for c in chunks for b in c.block_ids], len(chunks))

    def _save(self, cache: PagedCache | StatePages, job: SaveJob, early: Any = None) -> None:
        namespace = job.namespaces[self._shard]
        if namespace not in self._registered_ns:
            # The sidecar records the fields, so `kvoffload invalidate` finds them.
            if self._contracts.namespace(job.lora_id, self._shard, job.group) == namespace:
                self._save_client.register_contract(
                    self._contracts.contract(job.lora_id, self._shard, job.group)
                )
            self._registered_ns.add(namespace)
        stored = 0
        for chunks, layers in early if early is not None else self._batches(cache, job):
            items = [
                (c.keys[self._shard], [layer[i] for layer in layers]) for i, c in enumerate(chunks)
            ]
            # One shard announces a chunk on the sidecar's feed (one event per
            # chunk, not per shard); every worker still reports its ``stored``.
            blocks = [c.blocks if self._shard == 0 else None for c in chunks]
            try:
                ok = self._save_client.save(
                    namespace,
                    items,
                    ttl_s=self._settings.ttl_s,
                    blocks=blocks if any(b is not None for b in blocks) else None,
                )
            except ChunkTooLarge:
                log.exception("kvoffload: chunk larger than the staging buffer")
                self._count(chunks_saved=stored, chunks_save_failed=len(job.chunks) - stored)
                return
            stored += sum(ok)
            acked = self._stored.setdefault(job.job_id, [])
            acked.extend(c.index for c, good in zip(chunks, ok, strict=True) if good)
        self._count(chunks_saved=stored, chunks_save_failed=len(job.chunks) - stored)
        log.debug("kvoffload: job %d stored %d/%d chunks", job.job_id, stored, len(job.chunks))

    def handle_preemptions(self, meta: KVOffloadMetadata) -> None:
        """Finish the saves still reading preempted requests' blocks: vLLM has
        already handed those blocks to others, and this step's forward writes them."""
        waited = False
        for req_id in meta.preempted_req_ids:
            for job_id in list(self._req_saves.get(req_id, ())):
                self._saves[job_id][1].result()
                waited = True
        if waited:
            self._poll_saves()

    # -- reports -----------------------------------------------------------------

    def _poll_saves(self) -> None:
        for job_id, (req_id, fut) in list(self._saves.items()):
            if not fut.done():
                continue
            del self._saves[job_id]
            self._completed_saves.append(job_id)
            jobs = self._req_saves.get(req_id)
            if jobs is not None:
                jobs.discard(job_id)
                if not jobs:
                    del self._req_saves[req_id]

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(held requests whose saves are all done, requests whose async load is done).

        ``finished_req_ids`` is not needed: the scheduler names the requests
        whose blocks it holds in the metadata (``held_req_ids``), and those are
        the only ones that may appear in finished_sending.
        """
        self._poll_saves()
        sending = {r for r in self._held if r not in self._req_saves}
        self._held -= sending
        recving: set[str] = set()
        for req_id, fut in list(self._loads.items()):
            if fut.done():
                del self._loads[req_id]
                recving.add(req_id)
                # Reported with the same step as finished_recving, as vLLM requires.
                self._load_errors |= fut.result()
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_step()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVOffloadWorkerMetadata | None:
        with self._stats_lock:
            samples, self._load_samples = self._load_samples, []
        if not self._completed_saves and not samples:
            return None
        done, self._completed_saves = self._completed_saves, []
        stored = {job: dict.fromkeys(self._stored.pop(job, ()), 1) for job in done}
        return KVOffloadWorkerMetadata({job: 1 for job in done}, stored, samples)

    def shutdown(self) -> None:
        # Let running saves finish (they hold nothing vLLM needs back now).
        self._save_pool.shutdown(wait=True)
        self._load_pool.shutdown(wait=True)
        self._step_pool.shutdown(wait=True)
        self._probe.close()
        self._pinned.unpin()
        self._load_client.close()
        self._save_client.close()
