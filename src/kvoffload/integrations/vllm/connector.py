"""``KVOffloadConnector``: the class vLLM loads through ``kv_connector_module_path``.

vLLM builds the connector twice, in different processes: with role SCHEDULER
next to the scheduler, and with role WORKER in each GPU worker. This facade
validates the settings and derives the contract in both, then builds only
the half its role needs (:mod:`.scheduler` or :mod:`.worker`) and forwards
vLLM's hooks to it. A hook of the other role is a vLLM bug and raises.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ..vllm_version import check_vllm_version
from .common import EngineContracts, KVOffloadMetadata, KVOffloadSettings, KVOffloadWorkerMetadata
from .scheduler import KVOffloadScheduler
from .stats import KVOffloadStats
from .worker import KVOffloadWorker

log = logging.getLogger(__name__)


class KVOffloadConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """See the module docstring. ``SupportsHMA``: hybrid models (sliding-window,
    Mamba groups) run with vLLM's hybrid KV-cache manager, each group's chunks
    stored on their own (groups.py, contract-v1.md §7)."""

    # Hits come from the node's NVMe or a shared filesystem (vLLM's metrics label).
    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        check_vllm_version(vllm.__version__)
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = KVOffloadSettings.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config
        )
        self.contracts = EngineContracts.from_vllm(vllm_config, kv_cache_config, self.settings)
        if role == KVConnectorRole.SCHEDULER:
            c = self.contracts.contract(None, 0)
            # What `kvoffload ls --tenant T --namespace N` is to be checked against.
            log.info(
                "kvoffload: tenant %s on %s, namespace %s (shard 0 of %d; no LoRA); contract: "
                "model_revision=%s tokenizer_hash=%s chat_template_version=%s "
                "attention_backend=%s kv_dtype=%s block_size=%d chunk_tokens=%d layers=%s "
                "kv_group=%s",
                self.settings.tenant,
                self.settings.socket_path,
                c.fingerprint().hex(),
                self.contracts.num_shards,
                c.model_revision,
                c.tokenizer_hash,
                c.chat_template_version,
                c.attention_backend,
                c.kv_dtype,
                c.block_size,
                c.chunk_tokens,
                c.layer_layout,
                c.kv_group,
            )
        self._scheduler: KVOffloadScheduler | None = None
        self._worker: KVOffloadWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                log.warning(
                    "kvoffload: kv_load_failure_policy=%r fails a request whose cached chunk "
                    "cannot be loaded (evicted, purged, sidecar down); set 'recompute' to "
                    "recompute it instead",
                    self._kv_transfer_config.kv_load_failure_policy,
                )
            self._scheduler = KVOffloadScheduler(
                vllm_config,
                self.settings,
                self.contracts,
                consumer=bool(self._kv_transfer_config.is_kv_consumer),
                producer=bool(self._kv_transfer_config.is_kv_producer),
            )
        else:
            self._worker = KVOffloadWorker(
                vllm_config, kv_cache_config, self.settings, self.contracts
            )

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a save lost to a preemption is a later miss,
        # not an undelivered hand-off (vLLM's default ties this to kv_producer).
        return False

    @property
    def scheduler_side(self) -> KVOffloadScheduler:
        if self._scheduler is None:
            raise RuntimeError("kvoffload: scheduler hook called on a WORKER connector")
        return self._scheduler

    @property
    def worker_side(self) -> KVOffloadWorker:
        if self._worker is None:
            raise RuntimeError("kvoffload: worker hook called on a SCHEDULER connector")
        return self._worker

    def _metadata(self) -> KVOffloadMetadata:
        meta = self._connector_metadata
        if not isinstance(meta, KVOffloadMetadata):
            raise TypeError(f"kvoffload: bound connector metadata is {type(meta).__name__}")
        return meta

    # -- worker role -------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        """Sleep mode: finish this worker's saves; no transfer until restore."""
        self.worker_side.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        self.worker_side.restore_kv_caches()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if isinstance(kv_connector_metadata, KVOffloadMetadata):
            self.worker_side.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker_side.start_load_kv(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # A sync load started in start_load_kv streams layer by layer
        # (``layerwise``, protocol §5.26): this returns once the layer is in
        # the cache, so the next one streams while this one computes. An async
        # load belongs to a request that is not in this step's batch.
        self.worker_side.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # Saving happens in wait_for_save: a chunk object needs every layer,
        # and the saved chunks are ones vLLM processed in earlier steps (see
        # scheduler.py), whose blocks no layer of this forward writes.
        return

    def wait_for_save(self) -> None:
        self.worker_side.wait_for_save(self._metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return self.worker_side.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KVOffloadStats | None:
        """This worker's chunk counts since the last call (vLLM sums the workers')."""
        if self._worker is None:
            return None
        data = self._worker.take_stats()
        return None if data is None else KVOffloadStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVOffloadStats:
        return KVOffloadStats.from_data(data)

    def build_connector_worker_meta(self) -> KVOffloadWorkerMetadata | None:
        return self._worker.build_connector_worker_meta() if self._worker is not None else None

    # -- scheduler role --------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler_side.bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request: Any) -> None:
        self.scheduler_side.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVOffloadMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished_all_groups(request, block_ids)

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: refused.

        The store outlives this engine and is shared with other engines and
        nodes; one engine's reset must not empty it. What changed the KV (new
        weights) belongs in the contract (``model_revision``), and removing
        chunks is the operator's ``kvoffload invalidate`` / ``purge``.
        """
        log.warning(
            "kvoffload: reset_cache refused: the store is shared and persistent; remove "
            "chunks with `kvoffload invalidate --model-revision ...` or `kvoffload purge`"
        )
        return False

    def take_events(self) -> Iterable[Any]:
        """KV events of this step: vLLM publishes them on its own stream (events-v1 §1)."""
        if self._scheduler is None:
            return ()
        return self._scheduler.take_events()

    # -- both ------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
