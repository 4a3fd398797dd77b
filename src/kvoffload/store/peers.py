"""The other nodes of a shared root (docs/spec/shared-root-v1.md): applying
what they journaled (stores, touches, removals, purges) to this node's index,
and the thread that follows their journals and keeps the evictor lease.

Of the shared root's :class:`~.shared.root.SharedStats`, the follower's counts
(``followed``, ``adopted``, ``dropped``, ``tenant_purges``) are written here
only; the journal writer's (``journaled``, ``journal_errors``) in shared/root.py.
"""

from __future__ import annotations

import threading
import time

from .api import ChunkRecord
from .capacity import Capacity
from .maintenance import Maintenance
from .purge import Purges
from .removal import Removal
from .shared.journal import JournalRecord, Op
from .shared.root import POSITIONS_META, SharedRoot
from .state import StoreState, log
from .writes import Writes

#: The follower compacts this node's journal every this many rounds.
COMPACT_EVERY_ROUNDS = 120


class Peers:
    """Following the other nodes of a shared root (see the module docstring)."""

    def __init__(
        self,
        state: StoreState,
        capacity: Capacity,
        removal: Removal,
        maintenance: Maintenance,
        writes: Writes,
        purges: Purges,
    ) -> None:
        self._state = state
        self._capacity = capacity
        self._removal = removal
        self._maintenance = maintenance
        self._writes = writes
        self._purges = purges
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """On a shared root: settle the writes this node's last run left in
        flight, catch up with the journals, take or renew the evictor lease (a
        lone node holds the role and its grant at once), and follow them from a
        thread until :meth:`close`."""
        if self._state.shared is None:
            return
        self.settle_crashed_writes()
        self.follow_journals()
        self._capacity.evictor_tick()
        self._thread = threading.Thread(target=self._loop, name="kvoffload-journal", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        """Follow the other nodes' journals and keep the evictor lease, until closed."""
        rounds = 0
        while not self._stop.wait(self._state.config.journal_poll_s):
            try:
                self.follow_journals()
                self._capacity.evictor_tick()
                rounds += 1
                if rounds % COMPACT_EVERY_ROUNDS == 0:
                    self.compact_journal()
            except Exception as exc:  # never let the follower die
                log.warning("following the shared root's journals: %s", exc)

    def settle_crashed_writes(self) -> None:
        """At the open of a shared root: settle the writes this node's previous run
        left in flight (:attr:`SharedRoot.crashed`). Each is counted against the
        grant it was written under (else its bytes would be granted again while
        its object, or the temp file it left, still holds them); one whose object
        took its name is indexed and journaled, so the other nodes and the
        evictor learn of it; the directory of each is cleared of the temp file it
        may have left, once that file is old enough (maintenance.py ``sweep``)."""
        st = self._state
        sh = st.shared
        if sh is None or not sh.crashed:
            return
        due = time.time() + st.config.tmp_max_age_s
        published: list[tuple[ChunkRecord, int]] = []
        for c in sh.crashed:
            rec = st.index.get(c.tenant, c.key)
            if rec is None and self._maintenance.adopt(c.tenant, c.key):
                rec = st.index.get(c.tenant, c.key)
            with st.mu:
                sh.count_written_locked(c.epoch, c.nbytes)
                sh.sweep_later(c.tenant, c.key, due)
            if rec is not None:
                published.append((rec, c.epoch))
        n, sh.crashed = len(sh.crashed), []
        sh.stats.crashed_writes = n
        # Counted before journaled: a crash in between leaves a record missing
        # from the journal (the holder counts it as grant not yet used), never a
        # write counted twice.
        self._capacity.persist_shared()
        for rec, epoch in published:
            self._writes.journal_stored(rec, grant_epoch=epoch)
        log.info(
            "shared root: %d write(s) in flight when this node last stopped; %d had "
            "taken their name (indexed and journaled); all counted against the grant",
            n, len(published),
        )  # fmt: skip

    def follow_journals(self) -> int:
        """Apply what the other nodes journaled since the last call; records applied."""
        st = self._state
        sh = st.shared
        if sh is None:
            return 0
        followed = sh.follower.poll()
        now = time.time_ns()
        for node, r in followed:
            if r.op is Op.STORE:
                self._stored(sh, node, r, now)
            elif r.op is Op.TOUCH:
                st.index.touch(r.tenant, [r.key], r.time_ns)
            elif r.op is Op.REMOVE:
                sh.stats.dropped += self._removal.drop(
                    r.tenant, r.key, reason="journal", remove_file=False
                )
            elif r.op is Op.PURGE_TENANT:
                self._purges.peer_tenant(r.tenant)
                sh.stats.tenant_purges += 1
            elif r.op is Op.PURGE_NAMESPACE:
                self._purges.peer_namespace(r.tenant, r.namespace)
        if followed:
            sh.stats.followed += len(followed)
            st.index.set_meta(POSITIONS_META, sh.positions_blob())
        return len(followed)

    def _stored(self, sh: SharedRoot, node: str, r: JournalRecord, now: int) -> None:
        """Another node stored a chunk: its grant is spent by it, and this node's
        index learns of it (unless it has expired already)."""
        with self._state.mu:
            sh.saw_store_locked(node, r.grant_epoch, r.size)
        if r.expires_ns and r.expires_ns <= now:
            return
        rec = ChunkRecord(
            tenant=r.tenant,
            chunk_key=r.key,
            namespace=r.namespace,
            key_epoch=r.key_epoch,
            size=r.size,
            payload=r.payload,
            num_layers=r.num_layers,
            created_ns=r.time_ns,
            last_access_ns=r.time_ns,
            expires_ns=r.expires_ns,
        )
        if self._capacity.admit_one(rec):
            sh.stats.adopted += 1

    def compact_journal(self, *, max_segments: int = 8) -> int | None:
        """Compact this node's journal when it has grown past ``max_segments``."""
        st = self._state
        sh = st.shared
        if sh is None:
            return None
        kept = sh.maybe_compact(
            lambda t, k: st.index.get(t, k) is not None, max_segments=max_segments
        )
        if kept is not None:
            log.info("journal compacted: %d chunks of this node still present", kept)
        return kept


__all__ = ["Peers"]
