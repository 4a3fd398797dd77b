"""The sidecar's KV-event feed (docs/spec/events-v1.md §4-§7).

:class:`SidecarEvents` keeps the engine block hashes a save carried
(protocol-v1 §5.4 ``blocks``) in the index beside the chunk, publishes
``BlockStored`` once the chunk is stored and ``BlockRemoved`` when it leaves
(eviction, TTL, purge, a failed verification: every path goes through the
store's ``_drop``, which calls :meth:`SidecarEvents.removed`), and answers
snapshots from the index. The replay buffer and the incarnation counter live
in the index too, so both survive restarts.

The index's ``blocks`` table is exactly what the feed announced and did not
withdraw: a row is written with its ``BlockStored``; a chunk that leaves with
a row is published as removed whatever its tenant's setting is now; a reload
(or a start) that finds a tenant with ``events = false`` and rows withdraws
them with ``BlockRemoved`` and drops the rows (:meth:`SidecarEvents.retract`).

Every change that is published happens under :attr:`SidecarEvents.lock`
(the publisher's), and a snapshot is read under it: a snapshot at seq S holds
exactly the effects of the batches up to S.

Who reads what (§7.1): :class:`SidecarFeedAccess` gives the full feed to
readers (root, the sidecar's own uid, ``[events] readers``) and each
tenant's channel to the peers the policy grants that tenant.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Container, Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import msgpack
import msgspec

from kvoffload.errors import ConfigError, ErrorCode, ProtocolError
from kvoffload.events.access import FeedPeer, Visibility
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
    "ExpiryWatch",
    "IndexReplayBuffer",
    "SidecarEvents",
    "SidecarFeedAccess",
    "decode_blocks",
    "encode_blocks",
    "next_incarnation",
    "start_events",
]

log = logging.getLogger("kvoffload.events")

_INCARNATION_META = "events_incarnation"
#: Events per batch of a retraction.
RETRACT_BATCH = 256


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


class SidecarFeedAccess:
    """Who may read the sidecar's feed (events-v1 §7.1), asked at every subscription
    and request, so a reload applies to the next one.

    The full feed: uid 0, the sidecar's own uid, and the uids and groups of
    ``readers`` (``"uid:N"``, ``"gid:N"``); a peer on a TCP endpoint has no
    credentials and reads it as anyone who reaches the port (CURVE, §7). A
    tenant's channel: the peers the policy grants that tenant (a revoked
    tenant: nobody), as on the sidecar's own socket.
    """

    def __init__(
        self,
        policy: Callable[[], PolicyAPI],
        revoked: Container[str] = frozenset(),
        readers: Iterable[str] = (),
    ) -> None:
        self._policy = policy
        self._revoked = revoked
        uids: set[int] = {0, os.geteuid()}
        gids: set[int] = set()
        for r in readers:
            kind, _, n = r.partition(":")
            (uids if kind == "uid" else gids).add(int(n))
        self._uids, self._gids = frozenset(uids), frozenset(gids)

    def visibility(self, peer: FeedPeer) -> Visibility:
        if peer.uid is None:
            return Visibility(full=True)
        full = peer.uid in self._uids or not self._gids.isdisjoint(peer.gids)
        tenants_for = getattr(self._policy(), "tenants_for", None)
        if tenants_for is None:
            return Visibility(full=full)
        granted = tenants_for(peer.uid, peer.gids)
        if not isinstance(granted, frozenset | set):  # ["*"]: every tenant
            return Visibility(full=full, every_tenant=True)
        visible = frozenset(t for t in granted if t not in self._revoked)
        return Visibility(full=full, tenants=visible)


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
        self._expiry: ExpiryWatch | None = None

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
        # No extra_keys: they hold what vLLM hashed besides the tokens, the
        # tenant's cache_salt among them, and without token ids (the sidecar
        # never has them) no reader can use them (§3.1).
        return BlockStored(
            block_hashes=blocks.hashes,
            parent_block_hash=blocks.parent,
            token_ids=(),
            block_size=blocks.block_size,
            lora_id=None,
            medium=MEDIUM_STORAGE,
            lora_name=blocks.lora_name,
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
        it has its hashes from an earlier save. The extra keys are not kept.
        """
        if not self.enabled_for(tenant):
            return False
        blob = encode_blocks(msgspec.structs.replace(blocks, extra_keys=None))
        with self._pub.lock:
            # Again under the lock: a reload that turned the tenant off retracts
            # under it, and nothing announced after that may survive it.
            if not self.enabled_for(tenant) or not self._index.set_blocks(tenant, chunk_key, blob):
                return False
            self._pub.publish([self._stored(blocks)], tenant=tenant)
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
        """The store dropped a chunk with hashes (called under :attr:`lock`).

        Published whatever the tenant's setting is now: its hashes were
        announced (a retraction would have dropped them).
        """
        try:
            blocks = decode_blocks(blob)
        except ProtocolError:
            log.warning("events: undecodable block hashes in the index (%s); not published", reason)
            return
        try:
            self._pub.publish([self._removed(blocks)], tenant=tenant)
        except Exception:  # the feed must never fail an eviction or a purge
            log.exception("events: publishing a removal (%s) failed", reason)

    def _events_of(self, tenant: str | None) -> list[Event]:
        out: list[Event] = []
        for _tenant, _key, blob in self._index.all_blocks(tenant):
            try:
                out.append(self._stored(decode_blocks(blob)))
            except ProtocolError:
                continue
        return out

    def snapshot(self) -> list[Event]:
        """Every announced chunk as a ``BlockStored`` (called under :attr:`lock`)."""
        return self._events_of(None)

    def tenant_snapshot(self, tenant: str) -> list[Event]:
        """``tenant``'s announced chunks, for its channel (called under :attr:`lock`)."""
        return self._events_of(tenant)

    def retract(self) -> int:
        """Withdraw what the feed announced of tenants whose ``events`` is now off:
        ``BlockRemoved`` for each such chunk, and its hashes forgotten. Returns
        the chunks withdrawn."""
        n = 0
        for tenant in sorted(self._index.tenants()):
            if not self.enabled_for(tenant):
                n += self._retract_tenant(tenant)
        return n

    def _retract_tenant(self, tenant: str) -> int:
        with self._pub.lock:
            if self.enabled_for(tenant):
                return 0
            rows = list(self._index.all_blocks(tenant))
            for i in range(0, len(rows), RETRACT_BATCH):
                part = rows[i : i + RETRACT_BATCH]
                events: list[Event] = []
                for _t, _key, blob in part:
                    try:
                        events.append(self._removed(decode_blocks(blob)))
                    except ProtocolError:
                        continue
                self._index.drop_blocks(tenant, [key for _t, key, _b in part])
                if events:
                    self._pub.publish(events, tenant=tenant)
        if rows:
            log.info("events: withdrew %d announced chunks of %s (events off)", len(rows), tenant)
        return len(rows)

    def policy_changed(self) -> None:
        """A new policy is in force: retract what it turned off, and check every
        subscriber anew (a grant it lost must not keep its channel)."""
        try:
            self.retract()
        except Exception:  # the feed must never fail a reload
            log.exception("events: retracting after a policy change failed")
        self._pub.refresh_access()

    def watch_expiry(self, expire: Callable[[], int], interval_s: float) -> None:
        """Run ``expire`` (the store's stamped expiries) every ``interval_s``, so an
        expired chunk leaves the feed within it even if nobody reads it."""
        if interval_s > 0 and self._expiry is None:
            self._expiry = ExpiryWatch(expire, interval_s)

    def close(self) -> None:
        if self._expiry is not None:
            self._expiry.stop()
        self._pub.close()


class ExpiryWatch:
    """A thread that calls ``expire`` every ``interval_s`` until stopped."""

    def __init__(self, expire: Callable[[], int], interval_s: float) -> None:
        self._expire = expire
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvoffload-expiry", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._expire()
            except Exception:
                log.exception("events: the expiry pass failed")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


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
    revoked: Container[str] = frozenset(),
) -> SidecarEvents:
    """Open the feed: a new incarnation, the sockets, the durable buffer; its first
    batch (the incarnation's announcement, §4) goes out before any request is
    answered, then what the policy no longer publishes is withdrawn."""
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
    try:
        publisher = KVEventPublisher(
            endpoint,
            replay_endpoint=replay,
            snapshot_endpoint=settings.snapshot_endpoint,
            topic=topic,
            incarnation=incarnation,
            buffer=IndexReplayBuffer(index, settings.buffer),
            snapshot=lambda: holder[0].snapshot(),
            ipc_group=socket_group,
            curve=curve,
            access=SidecarFeedAccess(policy, revoked, settings.readers),
            tenant_snapshot=lambda tenant: holder[0].tenant_snapshot(tenant),
            tenant_buffer=settings.tenant_buffer,
            start=False,
        )
    except ValueError as exc:  # a topic that overlaps the tenant channels'
        raise ConfigError(f"[events] topic: {exc}") from exc
    except Exception as exc:  # zmq.ZMQError, OSError: a bad or busy endpoint
        raise ConfigError(f"[events] cannot bind {endpoint} / {replay}: {exc}") from exc
    events = SidecarEvents(index, publisher, policy, settings.locality)
    holder.append(events)
    try:
        publisher.announce(tenants=sorted(index.tenants()))
        events.retract()  # what a policy changed while the sidecar was down turned off
    except BaseException:
        publisher.close()
        raise
    publisher.start()
    log.info(
        "events: publishing %s on %s (replay %s), incarnation %d, pid %d",
        topic,
        endpoint,
        replay,
        incarnation,
        os.getpid(),
    )
    return events
