"""A store root shared by several nodes (shared-root-v1.md): this node's journal,
the follower of the others', and the evictor lease.

The :class:`~.facade.Store` owns one :class:`SharedRoot` when
``StoreConfig.shared`` is set. It journals what this node stores and removes
(a journal failure never fails a save: journals are hints), and a background
thread (:meth:`Store._journal_loop <.facade.Store>`) follows the other nodes'
journals into the local index, persists the positions in the index's
metadata, and keeps the evictor lease: only its holder evicts for the root's
one capacity, and only while :meth:`~..rootlease.EvictorLease.fence` allows.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..journal import (
    JournalFollower,
    JournalRecord,
    JournalWriter,
    Op,
    Reason,
    load_or_create_node_id,
)
from ..rootlease import EvictorLease

log = logging.getLogger("kvoffload.store")

#: ``_drop`` reasons → the journal's removal reasons.
REMOVE_REASONS: dict[str, Reason] = {
    "evict": Reason.EVICTED,
    "quota": Reason.EVICTED,
    "expired": Reason.EXPIRED,
    "purge": Reason.PURGED,
    "purge-namespace": Reason.PURGED,
    "purge-age": Reason.PURGED,
    "corrupt": Reason.FAILED_VERIFICATION,
    "delete": Reason.OTHER,
}

POSITIONS_META = "journal_positions"
#: Each node of a shared root may seal at most 1/64 of a DEK epoch's nonce bound
#: (so up to 64 nodes together stay within it); then it rotates the DEK.
SHARED_NONCE_SHARES = 64


@dataclass
class SharedStats:
    journaled: int = 0
    journal_errors: int = 0
    followed: int = 0
    adopted: int = 0
    dropped: int = 0
    tenant_purges: int = 0


class SharedRoot:
    """This node's part in a shared root: journal writer, follower, evictor lease."""

    def __init__(
        self,
        root: Path,
        state_dir: Path,
        *,
        durable: bool,
        lease_ttl_s: float,
        segment_bytes: int = 8 << 20,
    ) -> None:
        self.node_id = load_or_create_node_id(state_dir)
        self.writer = JournalWriter(
            root, self.node_id, durable=durable, segment_bytes=segment_bytes
        )
        self.writer.open()
        self.follower = JournalFollower(root, own_node_id=self.node_id)
        self.lease = EvictorLease(root, self.node_id, self.writer.incarnation, ttl_s=lease_ttl_s)
        self.stats = SharedStats()
        self._mu = threading.Lock()
        self._last_error = 0.0
        # Write grants (shared-root-v1.md §4.1). Guarded by the Store's lock.
        self.seen: dict[tuple[str, int], int] = {}  # (node, grant epoch) -> bytes journaled
        self.written: dict[int, int] = {}  # grant epoch -> bytes this node wrote
        self.view_epoch = 0
        self.view_grant = 0
        self.view_until = 0.0  # lease.valid_until() at the last refresh
        self._old_until = 0.0
        self._settle_epoch = 0

    def journal(self, records: Sequence[JournalRecord]) -> None:
        """Append to this node's journal; a failure is logged and counted, never raised."""
        if not records:
            return
        with self._mu:
            try:
                self.writer.append(records)
            except OSError as exc:
                self.stats.journal_errors += 1
                now = time.monotonic()
                if now - self._last_error > 60:
                    self._last_error = now
                    log.warning(
                        "cannot append to this node's journal (other nodes learn of "
                        "these chunks by existence checks instead): %s",
                        exc,
                    )
                return
            self.stats.journaled += len(records)

    # -- write grants (§4.1): one capacity for the root ---------------------------

    def remaining_locked(self) -> int:
        """Bytes this node may still write under the grant it knows of; none once
        that knowledge is older than the lease allows (a node resumed from a pause
        writes nothing until its loop has read the lease again)."""
        if self.lease.now() > self.view_until:
            return 0
        return self.view_grant - self.written.get(self.view_epoch, 0)

    def committed_locked(self, nbytes: int) -> None:
        self.written[self.view_epoch] = self.written.get(self.view_epoch, 0) + nbytes

    def saw_store_locked(self, node: str, grant_epoch: int, nbytes: int) -> None:
        k = (node, grant_epoch)
        self.seen[k] = self.seen.get(k, 0) + nbytes

    def _seen(self, node: str, epoch: int) -> int:
        if node == self.node_id:
            return self.written.get(epoch, 0)
        return self.seen.get((node, epoch), 0)

    def refresh_view_locked(self) -> None:
        """Take this node's grant from the lease file in force, as last read or, when
        held, as last written: a grant the holder raised in memory bounds its own
        writes only once published, so a node that takes over after a pause of the
        holder counts every byte the old holder may still write."""
        self.view_until = self.lease.valid_until()
        held = self.lease.held
        if held is not None:
            epoch, grant = held.epoch, held.grants.get(self.node_id, 0)
        elif self.lease.last_seen is not None and not self.lease.last_seen.released:
            cur = self.lease.last_seen
            epoch, grant = cur.epoch, cur.grants.get(self.node_id, 0)
        else:
            epoch, grant = self.view_epoch, 0  # no holder: write nothing more
        self.view_epoch, self.view_grant = epoch, grant

    def _unseen_locked(self, epoch: int, nodes: list[str], now: float) -> int:
        """Grants not yet seen used: this epoch's for every node and, for a settling
        time after this node took the role, the previous holder's."""
        grants = self.lease.grants
        unseen = sum(max(0, grants.get(n, 0) - self._seen(n, epoch)) for n in nodes)
        prev = self.lease.previous
        if prev is not None and prev.epoch < epoch:
            if self._settle_epoch != epoch:
                self._settle_epoch, self._old_until = epoch, now + 3 * self.lease.ttl_s
            if now < self._old_until:
                unseen += sum(max(0, g - self._seen(n, prev.epoch)) for n, g in prev.grants.items())
        return unseen

    def _nodes(self) -> list[str]:
        return sorted({*self.follower.nodes(), self.node_id})

    def issue_locked(self, used: int, capacity: int, high: float, low: float, *, now: float) -> int:
        """As the holder: raise the grants of every node from the room left under the
        capacity; the bytes to evict (above the high watermark: down to the low), or 0.

        The room is the capacity minus what this node's index holds (every node's
        journaled chunks) minus every grant not yet seen used (:meth:`_unseen_locked`)."""
        held = self.lease.held
        if held is None:
            return 0
        epoch = held.epoch
        nodes = self._nodes()
        grants = self.lease.grants
        bound = used + self._unseen_locked(epoch, nodes, now)
        room = capacity - bound
        if room > 0:
            per = min(room // len(nodes), self.grant_max(capacity))
            for n in nodes:
                # Topped up once half of it is used, not at every tick: each raise
                # is a rewrite of the lease file (an fsync and a rename on the
                # shared filesystem), so a trickle of writes does not cost one per
                # journal poll.
                if grants.get(n, 0) - self._seen(n, epoch) <= per // 2:
                    grants[n] = self._seen(n, epoch) + per
        self.refresh_view_locked()
        return max(0, bound - int(capacity * low)) if bound > capacity * high else 0

    def refill_own_locked(self, used: int, capacity: int) -> None:
        """The holder's own grant ran out between ticks: raise it from the room and
        publish it now (the others' grants are raised at the next tick, when they
        can see them)."""
        held = self.lease.held
        if held is None or not self.lease.fence():
            return
        room = capacity - used - self._unseen_locked(held.epoch, self._nodes(), time.monotonic())
        if room > 0:
            grants = self.lease.grants
            mine = self._seen(self.node_id, held.epoch)
            grants[self.node_id] = grants.get(self.node_id, mine) + min(
                room, self.grant_max(capacity)
            )
            self.lease.publish()  # on file before it is used; else it is not used
            self.refresh_view_locked()

    @staticmethod
    def grant_max(capacity: int) -> int:
        """At most this much unused grant per node: what a node that dies holding
        a grant keeps from the others until the next takeover."""
        return max(min(capacity // 16, 4 << 30), min(capacity // 4, 256 << 20))

    def maybe_compact(
        self, present: Callable[[str, bytes], bool], *, max_segments: int = 8
    ) -> int | None:
        """Compact this node's journal once it holds more than ``max_segments``
        segments: replay its own records, keep the chunks it stored that are still
        present, write them as a checkpoint, remove the older segments. The number
        of chunks kept, or None when nothing was done (shared-root-v1.md §3.4)."""
        with self._mu:
            if self.writer.segment_count() <= max_segments:
                return None
            live: dict[tuple[str, bytes], JournalRecord] = {}
            for r in self.writer.own_records():
                if r.op is Op.STORE:
                    live[(r.tenant, r.key)] = r
                elif r.op is Op.REMOVE:
                    live.pop((r.tenant, r.key), None)
                elif r.op is Op.PURGE_TENANT:
                    live = {k: v for k, v in live.items() if k[0] != r.tenant}
                elif r.op is Op.PURGE_NAMESPACE:
                    live = {
                        k: v
                        for k, v in live.items()
                        if not (k[0] == r.tenant and v.namespace == r.namespace)
                    }
            keep = [r for (t, k), r in live.items() if present(t, k)]
            self.writer.compact(keep)
            return len(keep)

    def positions_blob(self) -> bytes:
        pos = self.follower.positions()
        return json.dumps({n: list(p) for n, p in sorted(pos.items())}).encode()

    def restore_positions(self, blob: bytes | None) -> None:
        if not blob:
            return
        try:
            raw = json.loads(blob)
            self.follower.restore({str(n): (int(p[0]), int(p[1])) for n, p in raw.items()})
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            log.warning("journal positions in the index are unreadable; following from the start")

    def describe(self) -> dict[str, object]:
        held = self.lease.held
        cur = self.lease.current()
        return {
            "node_id": self.node_id,
            "incarnation": self.writer.incarnation,
            "journal_segment": self.writer.segment,
            "nodes_followed": {n: list(p) for n, p in self.follower.positions().items()},
            "evictor": None if cur is None else {"holder": cur.holder, "epoch": cur.epoch},
            "evictor_here": held is not None,
            "journaled": self.stats.journaled,
            "journal_errors": self.stats.journal_errors,
            "followed": self.stats.followed,
            "damaged_segments": self.follower.stats.damaged_segments,
            "grant": {
                "epoch": self.view_epoch,
                "bytes": self.view_grant,
                "written": self.written.get(self.view_epoch, 0),
            },
        }

    def close(self, *, release: bool = True) -> None:
        if release:
            self.lease.release()
        with self._mu:
            self.writer.close()
