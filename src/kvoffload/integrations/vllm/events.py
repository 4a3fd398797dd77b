"""The connector's KV events on vLLM's own stream (docs/spec/events-v1.md §1, §3).

vLLM publishes what its scheduler collects each step from the KV-cache
manager and from ``connector.take_events()``, under the engine's own topic,
seqs and replay buffer. This module builds the connector's share:

- at save planning, per chunk: the engine's block hashes (as vLLM publishes
  them: ``maybe_convert_block_hash``), the parent hash, per-block extra keys
  (``generate_block_hash_extra_keys`` → ``to_event_extra_keys``, as vLLM's
  own offloading tier does), LoRA name, and the token ids only with
  ``events_token_ids``. The hashes also travel to the sidecar with the save
  (protocol-v1 §5.4), token ids never;
- ``BlockStored`` (``medium="STORAGE"``) once every worker reported the
  sidecar's ``stored`` for the chunk (the worker metadata), never before;
- ``BlockRemoved`` for announced hashes whose chunk left the store, read
  from the tenant's channel of the sidecar's feed (events-v1 §7.1: what the
  worker's grant lets it read; ``kvoffload.events.consumer``, on a thread of
  its own) and handed to vLLM at the next step.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

from ...protocol import EngineBlocks
from .common import KVOffloadSettings

log = logging.getLogger(__name__)

__all__ = ["ConnectorEvents"]


def _events_enabled(vllm_config: Any) -> bool:
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and cfg.enable_kv_cache_events)


class ConnectorEvents:
    """Scheduler-side: what the connector stored, as vLLM KV events."""

    def __init__(
        self,
        vllm_config: Any,
        settings: KVOffloadSettings,
        block_size: int,
        blocks_per_chunk: int,
        *,
        feed: Any = None,
    ) -> None:
        #: vLLM publishes the connector's events only with kv events enabled;
        #: the hashes still go to the sidecar for its own feed.
        self.publish = _events_enabled(vllm_config)
        self._settings = settings
        self._bs = block_size
        self._bpc = blocks_per_chunk
        self._locality = settings.events_locality
        self._planned: dict[int, dict[int, BlockStored]] = {}
        self._out: list[KVCacheEvent] = []
        self._announced: Counter[Any] = Counter()
        self._lock = threading.Lock()  # _out and _announced: the feed's thread writes too
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._feed = feed if feed is not None else (self._open_feed() if self.publish else None)

    def _open_feed(self) -> Any:
        """The sidecar's feed, beside its socket (events-v1 §7); None if absent."""
        try:
            from kvoffload.events.access import tenant_topic
            from kvoffload.events.consumer import EventConsumer
            from kvoffload.events.sources import SourceSpec
        except ImportError:  # pyzmq missing: stores are announced, removals are not
            return None
        base = Path(self._settings.socket_path).parent
        if not (base / "kvevents.pub").exists():
            log.info("kvoffload: the sidecar publishes no KV events; removals are not announced")
            return None
        # The tenant's own channel (events-v1 §7.1): what this worker's grant
        # lets it read, and all it needs (the removals of its tenant's chunks).
        spec = SourceSpec(
            "sidecar",
            f"ipc://{base / 'kvevents.pub'}",
            f"ipc://{base / 'kvevents.replay'}",
            topic=tenant_topic(self._settings.tenant).decode(),
            snapshots=True,
        )
        # Its own thread: a slow snapshot or a sidecar gone away never holds
        # up the engine loop.
        consumer = EventConsumer(
            request_timeout_s=5.0, idle_check_s=5.0, retry_after_s=5.0, on_batch=self._on_feed
        )

        def follow() -> None:
            try:
                consumer.add_source(spec)
                consumer.run(self._stop)
            except Exception:
                log.exception("kvoffload: following the sidecar's event feed failed")
            finally:
                consumer.close()

        self._thread = threading.Thread(target=follow, name="kvoffload-events", daemon=True)
        self._thread.start()
        return consumer

    def _on_feed(self, _source: str, _seq: int, batch: Any) -> None:
        from kvoffload.events.wire import BlockRemoved as WireRemoved

        for ev in batch.events:
            if not isinstance(ev, WireRemoved):
                continue
            group = ev.group_idx or 0
            with self._lock:
                gone = [h for h in ev.block_hashes if self._announced[group, h] > 0]
                for h in gone:
                    self._announced[group, h] -= 1
                    if self._announced[group, h] <= 0:
                        del self._announced[group, h]
            if not gone:
                continue
            self._append(
                BlockRemoved(
                    block_hashes=gone,
                    medium=MEDIUM_STORAGE,
                    group_idx=ev.group_idx,
                    locality=self._locality,
                )
            )

    def chunk_blocks(
        self, request: Any, chunk: int, group: Any = None
    ) -> tuple[EngineBlocks, BlockStored] | None:
        """The hashes of chunk ``chunk`` of ``request`` (None if vLLM has not hashed it).

        ``group`` (a ``groups.GroupSpec``, hybrid models): the KV-cache group
        whose chunk it is; its index and kind (and window) go into the event,
        as vLLM's own events of that group carry them."""
        hashes_raw = list(getattr(request, "block_hashes", ()) or ())
        lo, hi = chunk * self._bpc, (chunk + 1) * self._bpc
        if len(hashes_raw) < hi:
            return None
        hashes = [maybe_convert_block_hash(h) for h in hashes_raw[lo:hi]]
        parent = maybe_convert_block_hash(hashes_raw[lo - 1]) if lo > 0 else None
        raw_extra: list[tuple[Any, ...] | None] = []
        mm_idx = 0
        for b in range(lo, hi):
            keys, mm_idx = generate_block_hash_extra_keys(
                request, b * self._bs, (b + 1) * self._bs, mm_idx
            )
            raw_extra.append(keys)
        extra = to_event_extra_keys(raw_extra)
        lora = getattr(request, "lora_request", None)
        lora_name = None if lora is None else str(lora.lora_name)
        lora_int = None if lora is None else getattr(lora, "adapter_id", None)
        tokens: list[int] = []
        if self._settings.events_token_ids:
            tokens = list(request.all_token_ids[lo * self._bs : hi * self._bs])
        group_idx = 0 if group is None else int(group.index)
        kind = "full_attention" if group is None else str(group.kind)
        window = None if group is None else group.sliding_window
        blocks = EngineBlocks(
            hashes=tuple(hashes),
            block_size=self._bs,
            parent=parent,
            lora_name=lora_name,
            extra_keys=tuple(extra) if extra is not None else None,
            group_idx=group_idx,
            kind=kind,
        )
        event = BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=self._bs,
            lora_id=lora_int,
            medium=MEDIUM_STORAGE,
            lora_name=lora_name,
            extra_keys=extra,
            group_idx=group_idx,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
            locality=self._locality,
        )
        return blocks, event

    def planned(self, job_id: int, chunk: int, event: BlockStored) -> None:
        if self.publish:
            self._planned.setdefault(job_id, {})[chunk] = event

    def job_done(self, job_id: int, stored: Mapping[int, int], workers: int) -> None:
        """Every worker finished the job: announce the chunks all of them stored."""
        events = self._planned.pop(job_id, None)
        if not events:
            return
        for chunk, event in sorted(events.items()):
            if stored.get(chunk, 0) >= workers:
                with self._lock:
                    self._announced.update((event.group_idx or 0, h) for h in event.block_hashes)
                self._append(event)

    def _append(self, event: KVCacheEvent) -> None:
        with self._lock:
            self._out.append(event)

    def take(self) -> list[KVCacheEvent]:
        with self._lock:
            out, self._out = self._out, []
        return out

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
