"""kvoffload as a secondary tier of vLLM's native offloading (``TieringOffloadingSpec``).

vLLM 0.33's native offloading keeps a CPU primary tier (one shared mmap
region, ``SharedOffloadRegion``, a row of ``kv_bytes_per_chunk`` bytes per
chunk) and cascades every chunk stored there to its ``secondary_tiers``. This
module is such a tier, loaded out of tree::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "KVOffloadTier",
          "module_path": "kvoffload.integrations.vllm.tier",
          "tenant": "acme"}]}}'

What the tier stores is the primary tier's row as vLLM wrote it (every
worker's slot, every layer and group), one kvoffload chunk per vLLM chunk,
split into one layer per worker slot. The chunk's kvoffload key is derived
from vLLM's ``OffloadKey`` (the chained block hash plus the group index)
under the tenant's secret salt and a compatibility contract of its own
(:func:`tier_contract`), so a tier object can never be read as a connector
object, nor under another model, dtype, layout, parallel shape or tenant.

Nothing here blocks the scheduler: ``lookup`` answers from vLLM's own
:class:`AsyncLookupManager` (``RETRY`` until the sidecar answered, misses
when it cannot), ``submit_store``/``submit_load`` queue a job for the tier's
I/O threads and return, and the jobs finish through ``get_finished_jobs``. A
sidecar that is gone makes lookups miss and jobs fail; the client reconnects
with backoff on its own. Every byte of a load is verified by the sidecar
before the job succeeds; a failed load marks its keys a miss so the
scheduler does not ask again for the same doomed promotion.

Bytes move in place where they can (``inplace``, default ``"auto"``;
protocol-v1 §5.34): each I/O thread's :class:`~kvoffload.client.SidecarClient`
hands the primary region's descriptor (vLLM's ``SharedOffloadRegion`` file)
to the sidecar, which reads a stored row from that file itself and writes a
load's verified plaintext straight into the row; this process copies
nothing. Where the region's descriptor is not reachable (a multi-segment
region, another vLLM), ``inplace`` is ``"off"`` or the sidecar is older than
revision 17, bytes go through the client's sealed staging memfd (§5.2): one
copy between the primary row and staging on the I/O thread. With ``direct``
(a plaintext tenant the policy gives the direct path) a load reads the
object straight into the primary row and a save writes from it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    ConfigInfo,
    ConfigInfoMapping,
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob

from kvoffload.errors import ContractError, KVOffloadConfigError

from ...client import SidecarClient
from ...contract import CompatContract, LayerLayout, Shard, canonical_json
from ...keys import next_key, root_key
from ...protocol import EngineBlocks
from .common import (
    KVOffloadSettings,
    configured_attention_backend,
    default_tokenizer_hash,
    make_client,
    model_revision,
    rope_config,
)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger("kvoffload.vllm.tier")

#: ``LayerLayout.cache_layout`` of a tier object: vLLM's primary-tier row, as is.
TIER_ROW_LAYOUT = "vllm-row-v1"
#: The extra key that binds a chunk key to vLLM's ``OffloadKey`` (contract-v1 §8).
OFFLOAD_KEY_PERSON = b"vllm-offload-key-v1"

#: The connector settings a tier takes as they are (common.KVOffloadSettings).
SHARED_FIELDS = (
    "tenant",
    "socket_path",
    "tokenizer_hash",
    "chat_template_version",
    "staging_bytes",
    "timeout_s",
    "ttl_s",
    "model_revision",
    "attention_backend",
    "direct",
)
DEFAULT_IO_THREADS = 2
#: Options of the tier itself (besides the connector's SHARED_FIELDS).
_TIER_FIELDS = ("io_threads", "enable_kv_events", "locality", "inplace")
INPLACE_MODES = ("auto", "off")


class TierMetrics:
    """Metric names of the kvoffload tier (besides the tiering manager's own)."""

    STORED_CHUNKS = "vllm:kv_offload_kvoffload_stored_chunks"
    LOADED_CHUNKS = "vllm:kv_offload_kvoffload_loaded_chunks"
    FAILED_STORES = "vllm:kv_offload_kvoffload_failed_store_chunks"
    FAILED_LOADS = "vllm:kv_offload_kvoffload_failed_load_chunks"
    LOOKUP_ERRORS = "vllm:kv_offload_kvoffload_unanswered_lookups"
    INPLACE_CHUNKS = "vllm:kv_offload_kvoffload_inplace_chunks"


@dataclass(frozen=True)
class KVOffloadTierInfo(ConfigInfo):  # type: ignore[misc]
    """The tier's info labels: which tenant and which sidecar it uses."""

    kvoffload_tenant: str
    kvoffload_socket: str


def _tier_settings(options: Mapping[str, Any]) -> KVOffloadSettings:
    """The tier's options through the connector's own validation (one clear line)."""
    unknown = sorted(str(k) for k in options if k not in SHARED_FIELDS)
    if unknown:
        raise KVOffloadConfigError(
            f"kvoffload tier: unknown option(s) {', '.join(unknown)}; known options: "
            f"{', '.join(sorted((*SHARED_FIELDS, *_TIER_FIELDS)))}"
        )
    return KVOffloadSettings.from_extra_config(dict(options))


def _current_vllm_config() -> Any:
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:  # pragma: no cover - older vLLM
        return None
    cfg = get_current_vllm_config_or_none()
    return cfg if cfg is not None and getattr(cfg, "model_config", None) is not None else None


def _row_geometry(spec: OffloadingSpec, row_bytes: int) -> dict[str, Any]:
    """Everything that decides what the bytes of a primary row mean."""
    cfg = spec.config
    return {
        "row_bytes": row_bytes,
        "worker_kv_bytes_per_block": cfg.worker_kv_bytes_per_block,
        "cpu_page_size": int(getattr(spec, "cpu_page_size_per_worker", 0)),
        "blocks_per_chunk": cfg.cache.blocks_per_chunk,
        "tokens_per_hash": cfg.cache.tokens_per_hash,
        "groups": [
            [g.group_id, g.tokens_per_block, list(g.layer_names), g.sliding_window_size_in_chunks]
            for g in cfg.groups
        ],
        "world_size": cfg.parallel.world_size,
        "pcp": cfg.parallel.pcp_size,
        "dcp": cfg.parallel.dcp_size,
        "replicated_layout": bool(getattr(spec, "replicated_layout", cfg.replicated_layout)),
        "canonical_layout": cfg.canonical_layout,
        "kv_cache_layout": cfg.kv_cache_layout,
    }


def tier_contract(
    spec: OffloadingSpec, settings: KVOffloadSettings, row_bytes: int, vllm_config: Any = None
) -> CompatContract:
    """The tier's compatibility contract (contract-v1 §8).

    The model identity comes from the connector's own derivation
    (common.model_revision, default_tokenizer_hash, rope_config,
    configured_attention_backend) when vLLM's config is current, else from
    the settings, which must then name ``model_revision`` and
    ``tokenizer_hash``. The row geometry (its hash in ``cache_layout``) and
    the parallel shape make the rest; a different one is a different
    namespace, so a miss.
    """
    cfg = spec.config
    mc = vllm_config.model_config if vllm_config is not None else None
    if mc is None and (settings.model_revision is None or settings.tokenizer_hash is None):
        raise KVOffloadConfigError(
            "kvoffload tier: vLLM's model config is not available here; set model_revision "
            "and tokenizer_hash in the tier's options"
        )
    algo = str(getattr(getattr(vllm_config, "cache_config", None), "prefix_caching_hash_algo", ""))
    if mc is not None and not algo.startswith("sha256"):
        raise KVOffloadConfigError(
            f"kvoffload tier: prefix_caching_hash_algo {algo!r} is not a cryptographic hash; "
            "a collision would be a wrong hit: use sha256 or sha256_cbor"
        )
    revision = settings.model_revision or model_revision(mc)
    tokenizer = settings.tokenizer_hash or default_tokenizer_hash(mc)
    backend = settings.attention_backend
    if backend is None:
        backend = configured_attention_backend(vllm_config) if mc is not None else "vllm-default"
    geometry = _row_geometry(spec, row_bytes)
    digest = hashlib.blake2b(canonical_json(geometry), digest_size=16).hexdigest()
    block_size = cfg.groups[0].tokens_per_block if cfg.groups else 1
    pp = cfg.parallel.pp_size
    tp = cfg.parallel.tp_size
    try:
        return CompatContract(
            model_revision=revision,
            tokenizer_hash=tokenizer,
            chat_template_version=settings.chat_template_version,
            attention_backend=backend,
            kv_dtype=cfg.model.dtype,
            block_size=block_size,
            layer_layout=LayerLayout(
                num_layers=sum(len(g.layer_names) for g in cfg.groups) or 1,
                num_kv_heads=1,
                head_dim=1,
                cache_layout=f"{TIER_ROW_LAYOUT}:{digest}",
            ),
            tenant_namespace=settings.tenant,
            rope_config=rope_config(mc.hf_text_config) if mc is not None else (),
            shard=Shard(0, tp, 0, pp),
            chunk_tokens=block_size * cfg.cache.blocks_per_chunk,
        )
    except ContractError as exc:
        raise KVOffloadConfigError(f"kvoffload tier: cannot build the contract: {exc}") from exc


def _address(buf: Any) -> int:
    """The address of a writable buffer's first byte."""
    c = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(c)
    finally:
        del c


def primary_region(spec: Any, view: memoryview) -> tuple[int, int] | None:
    """The descriptor and size of vLLM's primary ``SharedOffloadRegion`` file, when
    ``view`` is exactly its one-file mapping (so an offset into the file is the
    same byte of ``view``); None otherwise (the tier then uses staging)."""
    region = getattr(spec, "_scheduler_mmap", None)
    fd = getattr(region, "fd", None)
    mm = getattr(region, "mmap_obj", None)
    size = getattr(region, "total_size_bytes", None)
    if not isinstance(fd, int) or fd < 0 or mm is None or not isinstance(size, int):
        return None
    if len(getattr(region, "_segments", ())) != 1 or view.nbytes != size or size % 4096:
        return None
    try:
        if os.fstat(fd).st_size < size or _address(view) != _address(mm):
            return None
    except (OSError, TypeError, ValueError, BufferError):
        return None
    return fd, size


def tier_key(root: bytes, salt: bytes, key: bytes) -> bytes:
    """The kvoffload chunk key of vLLM's ``OffloadKey`` (contract-v1 §8)."""
    return next_key(root, salt, (), (OFFLOAD_KEY_PERSON, bytes(key)))


class _Lookups(AsyncLookupManager):  # type: ignore[misc]
    """vLLM's non-blocking lookup state, answered by the sidecar on its own thread."""

    def __init__(self, tier: KVOffloadTier) -> None:
        self._tier = tier
        super().__init__(tier_type=tier.tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier._lookup_batch(keys)


class KVOffloadTier(SecondaryTierManager):  # type: ignore[misc]
    """A secondary tier backed by the node's kvoffload sidecar (see the module docstring)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        io_threads: int = DEFAULT_IO_THREADS,
        enable_kv_events: bool = False,
        locality: str | None = None,
        inplace: str = "auto",
        **options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.settings = _tier_settings(options)
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
            raise KVOffloadConfigError(
                f"kvoffload tier: io_threads must be >= 1, got {io_threads!r}"
            )
        try:
            self.locality = Locality(locality) if locality is not None else None
        except ValueError:
            raise KVOffloadConfigError(
                f"kvoffload tier: locality must be LOCAL or REMOTE, got {locality!r}"
            ) from None
        if inplace not in INPLACE_MODES:
            raise KVOffloadConfigError(
                f"kvoffload tier: inplace must be one of {', '.join(INPLACE_MODES)}, "
                f"got {inplace!r}"
            )
        row = self.block_size_bytes
        page = int(getattr(offloading_spec, "cpu_page_size_per_worker", 0) or row)
        # One layer per worker slot of the row (vLLM's SharedOffloadRegion layout).
        self._layers = [page] * (row // page) if page and row % page == 0 else [row]
        if self.settings.staging_bytes < row:
            raise KVOffloadConfigError(
                f"kvoffload tier: staging_bytes ({self.settings.staging_bytes}) is smaller "
                f"than one chunk ({row} bytes)"
            )
        self.contract = tier_contract(offloading_spec, self.settings, row, _current_vllm_config())
        self.namespace = self.contract.fingerprint()
        #: The primary region as bytes: chunk c is [c * row, (c + 1) * row). Taken
        #: after every check, so that a refused start exports no buffer of it.
        self._flat = primary_kv_view.cast("B")
        #: The primary region's file, for in-place transfers (§5.34); None: staging.
        self._region = primary_region(offloading_spec, self._flat) if inplace == "auto" else None
        if inplace == "auto" and self._region is None:
            log.info("kvoffload tier: the primary region's file is not reachable; using staging")
        self._roots: dict[bytes, bytes] = {}  # salt -> root key
        self._tokens_per_chunk = self.contract.chunk_tokens
        self.events: list[OffloadingEvent] | None = None
        if enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self.events = []
            else:
                log.warning("kvoffload tier: enable_kv_events is set but KV events are off")
        self._info = KVOffloadTierInfo(self.settings.tenant, self.settings.socket_path)
        self._clients: queue.SimpleQueue[SidecarClient] = queue.SimpleQueue()
        self._all_clients: list[SidecarClient] = []
        self._clients_mu = threading.Lock()
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvoffload_tier")
        self._inflight: dict[JobId, Future[None]] = {}
        self._finished: queue.SimpleQueue[tuple[JobResult, list[OffloadKey], bool]] = (
            queue.SimpleQueue()
        )
        self._stats_mu = threading.Lock()
        self._counts: dict[str, int] = {}
        self._closed = False
        self._lookups = _Lookups(self)

    # -- vLLM's SecondaryTierManager ------------------------------------------------

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return {
            TierMetrics.STORED_CHUNKS: OffloadingCounterMetadata(
                "Chunks the kvoffload tier stored in the sidecar (or found there already)."
            ),
            TierMetrics.LOADED_CHUNKS: OffloadingCounterMetadata(
                "Chunks the kvoffload tier loaded from the sidecar, every byte verified."
            ),
            TierMetrics.FAILED_STORES: OffloadingCounterMetadata(
                "Chunks the kvoffload tier could not store (sidecar down, full, refused)."
            ),
            TierMetrics.FAILED_LOADS: OffloadingCounterMetadata(
                "Chunks the kvoffload tier could not load (gone, purged, corrupt, sidecar down)."
            ),
            TierMetrics.LOOKUP_ERRORS: OffloadingCounterMetadata(
                "Lookups the sidecar could not answer; each counted as a miss."
            ),
            TierMetrics.INPLACE_CHUNKS: OffloadingCounterMetadata(
                "Chunks stored or loaded in place: the sidecar read or wrote the primary "
                "region's file itself, no copy through staging."
            ),
        }

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        keys: tuple[str, ...] = KVOffloadTierInfo.config_info_keys()
        return keys

    def config_info(self) -> ConfigInfoMapping:
        return self._info.as_config_info()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        rows = [int(c) for c in job_metadata.chunk_ids]
        self._submit(job_metadata.job_id, keys, rows, store=True)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        rows = [int(c) for c in job_metadata.chunk_ids]
        self._submit(job_metadata.job_id, keys, rows, store=False)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results: list[JobResult] = []
        while True:
            try:
                result, keys, store = self._finished.get_nowait()
            except queue.Empty:
                break
            self._inflight.pop(result.job_id, None)
            if store and result.success and self.events is not None:
                self.events.append(
                    OffloadingEvent(
                        keys=keys, medium=self.medium, removed=False, locality=self.locality
                    )
                )
            if not store and not result.success:
                ok = set(result.successful_keys or ())
                self._lookups.mark_miss([k for k in keys if k not in ok])
            results.append(result)
        return results

    def has_pending_work(self) -> bool:
        return bool(self._inflight)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events:
            events, self.events = self.events, []
            yield from events

    def drain_jobs(self) -> None:
        for fut in list(self._inflight.values()):
            fut.exception()  # waits; the job itself never raises (see _run)

    def get_stats(self) -> OffloadingConnectorStats | None:
        with self._stats_mu:
            counts, self._counts = self._counts, {}
        if not counts:
            return None
        stats = OffloadingConnectorStats()
        for name, n in counts.items():
            stats.increase_counter(name, n)
        return stats

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._lookups.shutdown()
        self._pool.shutdown(wait=True)
        with self._clients_mu:
            clients, self._all_clients = self._all_clients, []
        for c in clients:
            c.close()
        self._flat.release()

    # -- the I/O threads ----------------------------------------------------------

    def _submit(self, job_id: JobId, keys: list[OffloadKey], rows: list[int], store: bool) -> None:
        if len(keys) != len(rows):
            raise ValueError(f"job {job_id}: {len(keys)} keys but {len(rows)} chunk ids")
        self._inflight[job_id] = self._pool.submit(self._run, job_id, keys, rows, store)

    def _count(self, name: str, n: int) -> None:
        if n:
            with self._stats_mu:
                self._counts[name] = self._counts.get(name, 0) + n

    def _client(self) -> SidecarClient:
        try:
            return self._clients.get_nowait()
        except queue.Empty:
            pass
        c = make_client(
            self.settings,
            name=f"kvoffload-vllm-tier {self.tier_type}",
            staging_bytes=self.settings.staging_bytes,
        )
        with self._clients_mu:
            self._all_clients.append(c)
        if self._region is not None:
            c.register_region(*self._region)  # region 0 of this client
        return c

    def _keys(self, client: SidecarClient, keys: Sequence[OffloadKey]) -> list[bytes] | None:
        """kvoffload keys of ``keys`` under the tenant's current salt; None: no sidecar."""
        client.register_contract(self.contract)
        salt = client.salt
        if salt is None:
            return None
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = root_key(self.namespace, salt)
        return [tier_key(root, salt, k) for k in keys]

    def _lookup_batch(self, keys: list[OffloadKey]) -> list[bool]:
        client = self._client()
        try:
            kkeys = self._keys(client, keys)
            if kkeys is None:
                self._count(TierMetrics.LOOKUP_ERRORS, len(keys))
                return [False] * len(keys)
            found = client.lookup(kkeys)
            return [i < found for i in range(len(keys))]
        finally:
            self._clients.put(client)

    def _row(self, row: int) -> list[memoryview]:
        views: list[memoryview] = []
        off = row * self.block_size_bytes
        for n in self._layers:
            views.append(self._flat[off : off + n])
            off += n
        return views

    def _blocks(self, key: OffloadKey) -> EngineBlocks | None:
        h = bytes(get_offload_block_hash(key))
        if not 1 <= len(h) <= 64:
            return None
        return EngineBlocks(
            hashes=(h,), block_size=self._tokens_per_chunk, group_idx=get_offload_group_idx(key)
        )

    def _run(self, job_id: JobId, keys: list[OffloadKey], rows: list[int], store: bool) -> None:
        """One job on an I/O thread; it always ends in exactly one result."""
        t0 = time.monotonic()
        ok: list[bool] = [False] * len(keys)
        client: SidecarClient | None = None
        try:
            client = self._client()
            kkeys = self._keys(client, keys)
            if kkeys is not None:
                ok = (
                    self._store(client, kkeys, keys, rows)
                    if store
                    else self._load(client, kkeys, rows)
                )
        except Exception:
            log.exception("kvoffload tier: job %d failed", job_id)
            ok = [False] * len(keys)
        finally:
            if client is not None:
                self._clients.put(client)
        self._finish(job_id, keys, ok, store, time.monotonic() - t0)

    def _store(
        self,
        client: SidecarClient,
        kkeys: list[bytes],
        keys: list[OffloadKey],
        rows: list[int],
    ) -> list[bool]:
        blocks = [self._blocks(k) for k in keys]
        if self._in_place(client):
            spans = [(0, r * self.block_size_bytes, self._layers) for r in rows]
            done = client.save_in_place(
                self.namespace,
                list(zip(kkeys, spans, strict=True)),
                ttl_s=self.settings.ttl_s,
                blocks=blocks,
            )
            if done is not None:
                self._count(TierMetrics.INPLACE_CHUNKS, sum(done))
                return done
        chunks = [(k, self._row(r)) for k, r in zip(kkeys, rows, strict=True)]
        try:
            return client.save(
                self.namespace,
                chunks,
                ttl_s=self.settings.ttl_s,
                blocks=blocks,
            )
        finally:
            for _, views in chunks:
                for v in views:
                    v.release()

    def _in_place(self, client: SidecarClient) -> bool:
        """In place (§5.34) where the region is reachable, unless the direct path
        serves the tenant (which writes and reads the row with one copy fewer)."""
        return self._region is not None and not client.uses_direct()

    def _load(self, client: SidecarClient, kkeys: list[bytes], rows: list[int]) -> list[bool]:
        if self._in_place(client):
            # Verified by the sidecar, then written into the rows; an object of
            # another shape than the row's layers is a miss (§5.34).
            spans = [(0, r * self.block_size_bytes, self._layers) for r in rows]
            done = client.load_in_place(kkeys, spans)
            if done is not None:
                self._count(TierMetrics.INPLACE_CHUNKS, sum(done))
                return done
        held: list[memoryview] = []
        wrong: set[int] = set()

        def dest_for(idx: int, _key: bytes, sizes: Sequence[int]) -> list[Any]:
            if list(sizes) != self._layers:
                # Not a row of this geometry (the namespace binds it, so only a
                # damaged store): read into scratch, and count it a miss.
                wrong.add(idx)
                return [bytearray(n) for n in sizes]
            views = self._row(rows[idx])
            held.extend(views)
            return list(views)

        try:
            got = client.load_to(kkeys, dest_for)
        finally:
            for v in held:
                v.release()
        first_wrong = min(wrong, default=len(got))
        return [g and i < first_wrong for i, g in enumerate(got)]

    def _finish(
        self, job_id: JobId, keys: list[OffloadKey], ok: list[bool], store: bool, took: float
    ) -> None:
        n_ok = 0
        while n_ok < len(ok) and ok[n_ok]:
            n_ok += 1
        done = sum(ok) if store else n_ok
        failed = len(keys) - done
        if store:
            self._count(TierMetrics.STORED_CHUNKS, done)
            self._count(TierMetrics.FAILED_STORES, failed)
        else:
            self._count(TierMetrics.LOADED_CHUNKS, done)
            self._count(TierMetrics.FAILED_LOADS, failed)
        success = failed == 0
        partial = None if success or store or not n_ok else tuple(keys[:n_ok])
        result = JobResult(
            job_id=job_id,
            success=success,
            successful_keys=partial,
            transfer_time=took,
            transfer_bytes=done * self.block_size_bytes or None,
        )
        self._finished.put((result, keys, store))


__all__ = ["KVOffloadTier", "TierMetrics", "tier_contract", "tier_key"]
