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

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ...errors import StoreError
from ..index import Index
from .journal import (
    NODE_ID_FILE,
    JournalFollower,
    JournalRecord,
    JournalWriter,
    Op,
    Reason,
    is_node_id,
    load_or_create_node_id,
)
from .lease import EvictorLease

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
#: This node's own grant accounting (index meta, JSON): the bytes it wrote under
#: each recent grant epoch, its writes in flight and the directories a crashed
#: write may have left a temp file in. See :meth:`SharedRoot.persist_locked`.
ACCOUNTING_META = "grant_accounting"
#: Grant epochs whose written bytes are kept: the current one and those before
#: it that a node taking over still counts (shared-root-v1.md §4.1).
EPOCHS_KEPT = 4
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
    #: Writes a previous run of this node left in flight, settled at this start.
    crashed_writes: int = 0


@dataclass(frozen=True)
class CrashedWrite:
    """A write that was in flight when this node's previous run stopped: its
    object may or may not have reached its name, and a temp file may be left."""

    tenant: str
    key: bytes
    epoch: int  # the grant epoch it was written under
    nbytes: int


def check_unshared_open(root: Path, state_dir: Path) -> None:
    """Refuse to open, without ``shared``, a root that other nodes journal into.

    Such a node would walk the object tree into its index, journal nothing
    (the others never learn of its writes or removals) and, with a capacity,
    evict the other nodes' objects with no record: their indexes then name
    files that are gone. Joining silently is no better (a typo in one node's
    config would change how the whole root evicts), so the open is refused
    with what to do. This node's own journal does not count: a node that
    stops sharing a root nobody else uses may do so."""
    nodes = Path(root) / "journal" / "nodes"
    try:
        names = os.listdir(nodes)
    except (FileNotFoundError, NotADirectoryError):
        return
    own = ""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        own = (Path(state_dir) / NODE_ID_FILE).read_text(encoding="ascii").strip()
    others = sorted(n for n in names if is_node_id(n) and n != own)
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise StoreError(
            f"the store root {root} is shared: {len(others)} other node(s) journal into "
            f"{nodes} ({shown}); set [store] shared = true on this node (and the same "
            "capacity on every node), or, if no other node uses this root any more, "
            "remove their directories there"
        )


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
        index: Index,
    ) -> None:
        self.node_id = load_or_create_node_id(state_dir)
        self._index = index
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
        # Writes in flight: (tenant, key) -> (grant epoch, bytes reserved).
        self.inflight: dict[tuple[str, bytes], tuple[int, int]] = {}
        #: Writes in flight when the previous run stopped (settled at open).
        self.crashed: list[CrashedWrite] = []
        #: Object directories to clear of old temp files: (tenant, key) -> when
        #: (wall-clock seconds) their temp files are old enough.
        self.sweeps: dict[tuple[str, bytes], float] = {}
        self._dirty = False
        self._load_accounting()

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

    def committed_locked(self, nbytes: int, intent: tuple[str, bytes] | None = None) -> None:
        """A write took its name and its record: count it against the grant, and
        forget its intent (persisted at the caller's :meth:`persist_locked`)."""
        self.written[self.view_epoch] = self.written.get(self.view_epoch, 0) + nbytes
        if intent is not None:
            self.inflight.pop(intent, None)
        self._dirty = True

    def count_written_locked(self, epoch: int, nbytes: int) -> None:
        self.written[epoch] = self.written.get(epoch, 0) + nbytes
        self._dirty = True

    # -- this node's accounting, kept in its index across restarts ---------------

    def intend_locked(self, tenant: str, key: bytes, nbytes: int) -> None:
        """Record, durably, a write about to begin: if this run stops before the
        write is counted, the next start finds it (:attr:`crashed`), counts its
        object if it took its name, and clears its directory of the temp file."""
        self.inflight[(tenant, key)] = (self.view_epoch, nbytes)
        self._dirty = True
        self.persist_locked()

    def forget_locked(self, intent: tuple[str, bytes]) -> None:
        """A write that ended without being counted (failed, found present)."""
        if self.inflight.pop(intent, None) is not None:
            self._dirty = True

    def sweep_later(self, tenant: str, key: bytes, due: float) -> None:
        self.sweeps[(tenant, key)] = due
        self._dirty = True

    def due_sweeps(self, now: float) -> list[tuple[str, bytes]]:
        return [k for k, due in self.sweeps.items() if due <= now]

    def swept_locked(self, done: Sequence[tuple[str, bytes]]) -> None:
        for k in done:
            self.sweeps.pop(k, None)
        self._dirty = bool(done) or self._dirty

    def persist_locked(self) -> None:
        """Write the accounting into the index (one meta value) if it changed.

        The bytes written under each grant epoch live only in memory otherwise,
        and grants are cumulative: a restarted node would get its whole grant
        again. Written in the same order as the index records they count (a
        write's intent before its object, its count with its record), so a
        restart neither forgets a byte nor counts one twice."""
        if not self._dirty:
            return
        keep = sorted(self.written)[-EPOCHS_KEPT:]
        doc = {
            "written": {str(e): self.written[e] for e in keep},
            "inflight": [[t, k.hex(), e, n] for (t, k), (e, n) in sorted(self.inflight.items())]
            + [[c.tenant, c.key.hex(), c.epoch, c.nbytes] for c in self.crashed],
            "sweep": [[t, k.hex(), due] for (t, k), due in sorted(self.sweeps.items())],
        }
        self._index.set_meta(ACCOUNTING_META, json.dumps(doc, sort_keys=True).encode())
        self.written = {e: self.written[e] for e in keep}
        self._dirty = False

    def _load_accounting(self) -> None:
        blob = self._index.get_meta(ACCOUNTING_META)
        if blob is not None:
            try:
                doc = json.loads(blob)
                self.written = {int(e): int(n) for e, n in doc["written"].items()}
                self.crashed = [
                    CrashedWrite(str(t), bytes.fromhex(k), int(e), int(n))
                    for t, k, e, n in doc["inflight"]
                ]
                self.sweeps = {(str(t), bytes.fromhex(k)): float(d) for t, k, d in doc["sweep"]}
                return
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                log.warning("the grant accounting in the index is unreadable (%s)", exc)
        # None kept (an index of an earlier version, or one rebuilt): what this node's
        # own journal says it wrote under each epoch (writes of its last run in
        # flight at a crash are not there).
        self.written = {}
        for r in self.writer.own_records():
            if r.op is Op.STORE and r.grant_epoch:
                self.written[r.grant_epoch] = self.written.get(r.grant_epoch, 0) + r.size
        if self.written:
            log.info(
                "grant accounting taken from this node's journal: %s",
                ", ".join(f"epoch {e}: {n} bytes" for e, n in sorted(self.written.items())),
            )
        self._dirty = True

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

    def _unseen_locked(self, epoch: int, nodes: list[str], now: float, reserved: int) -> int:
        """Grants not yet seen used: this epoch's for every node and, for a settling
        time after this node took the role, the previous epoch's. Of this node's
        own previous grant only its writes still in flight (``reserved``) count:
        this run writes under the epoch it holds, and an earlier run of this node
        is gone (the index's lock keeps one per node), so a node restarted
        mid-epoch that takes the role does not evict for a grant nobody can use."""
        grants = self.lease.grants
        unseen = sum(max(0, grants.get(n, 0) - self._seen(n, epoch)) for n in nodes)
        prev = self.lease.previous
        if prev is not None and prev.epoch < epoch:
            if self._settle_epoch != epoch:
                self._settle_epoch, self._old_until = epoch, now + 3 * self.lease.ttl_s
            if now < self._old_until:
                for n, g in prev.grants.items():
                    left = max(0, g - self._seen(n, prev.epoch))
                    unseen += min(left, reserved) if n == self.node_id else left
        return unseen

    def _nodes(self) -> list[str]:
        return sorted({*self.follower.nodes(), self.node_id})

    def issue_locked(
        self, used: int, capacity: int, high: float, low: float, *, now: float, reserved: int = 0
    ) -> int:
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
        bound = used + self._unseen_locked(epoch, nodes, now, reserved)
        room = capacity - bound
        if room > 0:
            per = min(room // len(nodes), self.grant_max(capacity))
            for n in nodes:
                if grants.get(n, 0) - self._seen(n, epoch) < per:
                    grants[n] = self._seen(n, epoch) + per
        self.refresh_view_locked()
        return max(0, bound - int(capacity * low)) if bound > capacity * high else 0

    def refill_own_locked(self, used: int, capacity: int, reserved: int = 0) -> None:
        """The holder's own grant ran out between ticks: raise it from the room and
        publish it now (the others' grants are raised at the next tick, when they
        can see them)."""
        held = self.lease.held
        if held is None or not self.lease.fence():
            return
        now = time.monotonic()
        room = capacity - used - self._unseen_locked(held.epoch, self._nodes(), now, reserved)
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
        """The follower's positions and, with them, the bytes of the other nodes'
        STORE records read up to there per grant epoch (what a holder counts as
        used of their grants): one value, so a restart resumes both together."""
        pos = self.follower.positions()
        top = max([self.view_epoch, *(e for _n, e in self.seen)])
        seen = sorted((n, e, b) for (n, e), b in self.seen.items() if e > top - EPOCHS_KEPT)
        doc = {"positions": {n: list(p) for n, p in sorted(pos.items())}, "seen": seen}
        return json.dumps(doc).encode()

    def restore_positions(self, blob: bytes | None) -> None:
        if not blob:
            return
        try:
            raw = json.loads(blob)
            if "positions" not in raw:
                # Kept by a version that did not keep the bytes seen with them:
                # following from the start counts them again (records re-apply
                # idempotently, §3.3); else a takeover would count every grant
                # of the epoch as unused and evict the whole root.
                log.info("journal positions kept without the grants seen: following from the start")
                return
            pos = {str(n): (int(p[0]), int(p[1])) for n, p in raw["positions"].items()}
            seen = {(str(n), int(e)): int(b) for n, e, b in raw["seen"]}
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            log.warning("journal positions in the index are unreadable; following from the start")
            return
        self.follower.restore(pos)
        self.seen = seen

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
            "lease_renewals": self.lease.renewals,
            "writes_in_flight": len(self.inflight),
            "crashed_writes_settled": self.stats.crashed_writes,
        }

    def close(self, *, release: bool = True) -> None:
        if release:
            self.lease.release()
        with self._mu:
            self.writer.close()
