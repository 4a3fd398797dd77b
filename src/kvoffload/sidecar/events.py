"""The sidecar's KV-event feed (docs/spec/events-v1.md §4-§7).

:class:`SidecarEvents` keeps the engine block hashes a save carried
(protocol-v1 §5.4 ``blocks``) in the index beside the chunk, publishes
``BlockStored`` once the chunk is stored and ``BlockRemoved`` when it leaves
(eviction, TTL, purge, a failed verification: every path goes through the
store's ``_drop``, which calls :meth:`SidecarEvents.removed`), and answers
snapshots from the index. The replay buffer and the incarnation counter live
in the index too, so both survive restarts.

Every change that is published happens under :attr:`SidecarEvents.lock`
(the publisher's), and a snapshot is read under it: a snapshot at seq S holds
exactly the effects of the batches up to S.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import msgpack

from kvoffload.errors import ConfigError, ErrorCode, ProtocolError
from kvoffload.events.publisher import CurveServer, KVEventPublisher
from kvoffload.events.wire import (
    LOCALITY_LOCAL,
    MAX_INCARNATION,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    Event,
    split_seq,
)
from kvoffload.protocol import EngineBlocks
from kvoffload.protocol.fields import decode

from ..store.api import EventLog
from .config import DEFAULT_EVENTS_BUFFER, EventsSettings
from .ports import PolicyAPI

__all__ = [
    "EventsSettings",
    "IndexReplayBuffer",
    "SidecarEvents",
    "decode_blocks",
    "encode_blocks",
    "next_incarnation",
    "start_events",
]

log = logging.getLogger("kvoffload.events")

_INCARNATION_META = "events_incarnation"


def encode_blocks(blocks: EngineBlocks) -> bytes:
    packed: bytes = msgpack.packb(blocks.to_wire(), use_bin_type=True)
    return packed


def decode_blocks(blob: bytes) -> EngineBlocks:
    """The hashes kept for a chunk; ProtocolError if the index holds something else."""
    try:
        raw = msgpack.unpackb(blob, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"index.blocks: {exc}") from exc
    return decode(EngineBlocks, raw, "index.blocks")


def _extra(blocks: EngineBlocks) -> tuple[tuple[Any, ...] | None, ...] | None:
    if blocks.extra_keys is None:
        return None
    return tuple(tuple(x) if x is not None else None for x in blocks.extra_keys)


class IndexReplayBuffer:
    """The durable replay buffer (events-v1 §5): the newest ``keep`` batches in the index."""

    def __init__(self, index: EventLog, keep: int = DEFAULT_EVENTS_BUFFER) -> None:
        self._index = index
        self._keep = keep

    def append(self, seq: int, payload: bytes) -> None:
        self._index.append_event(seq, payload, self._keep)

    def since(self, seq: int) -> list[tuple[int, bytes]]:
        return self._index.events_since(seq)

    def last_seq(self) -> int | None:
        return self._index.last_event_seq()


def next_incarnation(index: EventLog) -> int:
    """Raise the durable incarnation counter (events-v1 §4) and return it.

    Above both the stored counter and the incarnation of the last buffered
    batch, so that seqs rise even over a counter lost with a damaged meta.
    """
    raw = index.get_meta(_INCARNATION_META)
    stored = int(raw.decode("ascii")) if raw else 0
    last = index.last_event_seq()
    n = max(stored, split_seq(last)[0] if last is not None else 0) + 1
    if n > MAX_INCARNATION:
        raise ConfigError(f"the event feed has used all {MAX_INCARNATION} incarnations")
    index.set_meta(_INCARNATION_META, str(n).encode("ascii"))
    index.flush()  # on disk before any batch of this incarnation is published
    return n


class SidecarEvents:
    """Publishes what enters and leaves the store, for the tenants that allow it."""

    def __init__(
        self,
        index: EventLog,
        publisher: KVEventPublisher,
        policy: Callable[[], PolicyAPI],
        locality: str = LOCALITY_LOCAL,
    ) -> None:
        self._index = index
        self._pub = publisher
        self._policy = policy
        self._locality = locality
        # What was stored and why it was or was not announced (stats, `events tail`).
        self._counts_mu = threading.Lock()
        self._counts = {"announced": 0, "without_hashes": 0, "tenant_events_off": 0}

    @property
    def lock(self) -> AbstractContextManager[Any]:
        return self._pub.lock

    @property
    def publisher(self) -> KVEventPublisher:
        return self._pub

    def enabled_for(self, tenant: str) -> bool:
        try:
            return self._policy().tenant(tenant).events
        except Exception:  # an unknown tenant of a reloaded policy: publish nothing
            return False

    def _stored(self, blocks: EngineBlocks) -> BlockStored:
        return BlockStored(
            block_hashes=blocks.hashes,
            parent_block_hash=blocks.parent,
            token_ids=(),
            block_size=blocks.block_size,
            lora_id=None,
            medium=MEDIUM_STORAGE,
            lora_name=blocks.lora_name,
            extra_keys=_extra(blocks),
            group_idx=blocks.group_idx,
            kv_cache_spec_kind=blocks.kind,
            locality=self._locality,
        )

    def _removed(self, blocks: EngineBlocks) -> BlockRemoved:
        return BlockRemoved(
            blocks.hashes, MEDIUM_STORAGE, group_idx=blocks.group_idx, locality=self._locality
        )

    def record(self, tenant: str, chunk_key: bytes, blocks: EngineBlocks) -> bool:
        """A chunk is stored with ``blocks``: keep them and publish ``BlockStored``.

        False when the tenant is not published, the chunk is gone already or
        it has its hashes from an earlier save.
        """
        if not self.enabled_for(tenant):
            return False
        blob = encode_blocks(blocks)
        with self._pub.lock:
            if not self._index.set_blocks(tenant, chunk_key, blob):
                return False
            self._pub.publish([self._stored(blocks)])
        self._count("announced", 1)
        return True

    def _count(self, what: str, n: int) -> None:
        with self._counts_mu:
            self._counts[what] += n

    def saved(self, tenant: str, written: int, with_hashes: int) -> None:
        """A save stored ``written`` new chunks, ``with_hashes`` of them with engine
        block hashes: count those that will not be announced, and why (§7)."""
        if not self.enabled_for(tenant):
            self._count("tenant_events_off", written)
        elif written > with_hashes:
            self._count("without_hashes", written - with_hashes)

    def stats(self) -> dict[str, Any]:
        """The feed for ``stats`` (admins; events-v1 §9): where it publishes, its last
        seq, and how many stored chunks were announced or not, and why."""
        with self._counts_mu:
            counts = dict(self._counts)
        return {
            "enabled": True,
            "endpoint": self._pub.endpoint,
            "replay_endpoint": self._pub.replay_endpoint,
            "incarnation": self._pub.incarnation,
            "last_seq": self._pub.last_seq(),
            "stored_announced": counts["announced"],
            "stored_without_hashes": counts["without_hashes"],
            "stored_tenant_events_off": counts["tenant_events_off"],
        }

    def removed(self, tenant: str, blob: bytes, reason: str) -> None:
        """The store dropped a chunk with hashes (called under :attr:`lock`)."""
        if not self.enabled_for(tenant):
            return
        try:
            blocks = decode_blocks(blob)
        except ProtocolError:
            log.warning("events: undecodable block hashes in the index (%s); not published", reason)
            return
        try:
            self._pub.publish([self._removed(blocks)])
        except Exception:  # the feed must never fail an eviction or a purge
            log.exception("events: publishing a removal (%s) failed", reason)

    def snapshot(self) -> list[Event]:
        """Every published chunk as a ``BlockStored`` (called under :attr:`lock`)."""
        out: list[Event] = []
        enabled: dict[str, bool] = {}
        for tenant, _key, blob in self._index.all_blocks():
            if tenant not in enabled:
                enabled[tenant] = self.enabled_for(tenant)
            if not enabled[tenant]:
                continue
            try:
                out.append(self._stored(decode_blocks(blob)))
            except ProtocolError:
                continue
        return out

    def close(self) -> None:
        self._pub.close()


def default_endpoints(socket_path: Path) -> tuple[str, str]:
    """``ipc://`` PUB and ROUTER beside the sidecar's socket (events-v1 §7)."""
    base = socket_path.parent
    return f"ipc://{base / 'kvevents.pub'}", f"ipc://{base / 'kvevents.replay'}"


def _load_curve(path: Path) -> CurveServer:
    """A CURVE key pair file: two lines, the Z85 public then secret key."""
    try:
        lines = path.read_text(encoding="ascii").split()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"[events] curve_secret_key_file {path}: {exc}") from exc
    if len(lines) != 2 or not all(len(x) == 40 for x in lines):
        raise ConfigError(
            f"[events] curve_secret_key_file {path}: expected two Z85 keys of 40 characters"
        )
    return CurveServer(lines[0].encode(), lines[1].encode())


def start_events(
    settings: EventsSettings,
    index: EventLog,
    policy: Callable[[], PolicyAPI],
    socket_path: Path,
    socket_group: int | None = None,
) -> SidecarEvents:
    """Open the feed: a new incarnation, the PUB and ROUTER sockets, the durable buffer."""
    pub_ep, replay_ep = default_endpoints(socket_path)
    endpoint = settings.endpoint or pub_ep
    replay = settings.replay_endpoint or replay_ep
    curve = None
    if endpoint.startswith("tcp://") or replay.startswith("tcp://"):
        if settings.curve_secret_key_file is not None:
            curve = _load_curve(settings.curve_secret_key_file)
        else:
            log.warning("events: TCP endpoints without CURVE: anyone who reaches them can read")
    topic = settings.topic or f"kv@{socket.gethostname()}@kvoffload"
    incarnation = next_incarnation(index)
    holder: list[SidecarEvents] = []

    def snapshot() -> list[Event]:
        return holder[0].snapshot() if holder else []

    try:
        publisher = KVEventPublisher(
            endpoint,
            replay_endpoint=replay,
            snapshot_endpoint=settings.snapshot_endpoint,
            topic=topic,
            incarnation=incarnation,
            buffer=IndexReplayBuffer(index, settings.buffer),
            snapshot=snapshot,
            ipc_group=socket_group,
            curve=curve,
        )
    except Exception as exc:  # zmq.ZMQError, OSError: a bad or busy endpoint
        raise ConfigError(f"[events] cannot bind {endpoint} / {replay}: {exc}") from exc
    events = SidecarEvents(index, publisher, policy, settings.locality)
    holder.append(events)
    log.info(
        "events: publishing %s on %s (replay %s), incarnation %d, pid %d",
        topic,
        endpoint,
        replay,
        incarnation,
        os.getpid(),
    )
    return events
