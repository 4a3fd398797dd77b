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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..journal import (
    JournalFollower,
    JournalRecord,
    JournalWriter,
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
    ) -> None:
        self.node_id = load_or_create_node_id(state_dir)
        self.writer = JournalWriter(root, self.node_id, durable=durable)
        self.writer.open()
        self.follower = JournalFollower(root, own_node_id=self.node_id)
        self.lease = EvictorLease(root, self.node_id, self.writer.incarnation, ttl_s=lease_ttl_s)
        self.stats = SharedStats()
        self._mu = threading.Lock()
        self._last_error = 0.0

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
        }

    def close(self, *, release: bool = True) -> None:
        if release:
            self.lease.release()
        with self._mu:
            self.writer.close()
