"""Whole-tenant purges and the tenant's writes (layout-v1.md §2, protocol-v1.md §5.11).

A purge of a tenant must leave no index record without its file, and no
record of an object the destroyed key sealed. A save racing it either lands
wholly after it (a new key, its file, its record: readable) or is not
stored. So, for the length of the purge:

* the tenant's writes are **closed** (:class:`~kvoffload.store.cancel.TenantWrites`): a put that
  starts is refused (:class:`~kvoffload.store.cancel.PutCancelled`, "not
  stored"); the puts already in flight were started under the old load
  generation, which the purge bumps, so none of them is indexed (each removes
  its own file), and the purge waits for them to end before it goes on;
* the tenant counts as empty to every read (``lookup`` 0, every chunk a miss):
  its key is destroyed, nothing of it can be served, and a save finds no
  "already there" in a record about to go;
* the purge destroys the key file, moves ``objects/<tenant>/`` aside in one
  rename (to ``objects/.purged-<tenant>-<16 hex>``, which no reader, walk or
  sweep looks into), journals the purge on a shared root, removes the
  tenant's index records, retention records and contracts, and only then
  opens the writes again. The directory moved aside is removed after (in
  the background unless ``wait``); a purge interrupted by a crash leaves it,
  and the next open removes it.

A write after the purge goes to a fresh ``objects/<tenant>/`` that nothing
of the purge touches any more.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from ..layouts import v1
from .base import boundary, log
from .cancel import TenantWrites
from .contracts import ContractRegistry
from .leases import Leases
from .shared.journal import JournalRecord


def purged_trees(objects: Path) -> list[Path]:
    """The purged tenants' trees left under ``objects/`` (being removed, or left by a crash)."""
    try:
        names = os.listdir(objects)
    except FileNotFoundError:
        return []
    return [objects / n for n in names if n.startswith(v1.PURGED_PREFIX)]


class Purges(Leases):
    """Whole-tenant purges (this module's docstring); the stack's layer above Leases."""

    _writes: TenantWrites
    _bg: list[threading.Thread]
    contracts: ContractRegistry

    @boundary
    def purge_tenant(self, tenant: str, *, wait: bool = False) -> int:
        """Crypto-erase a tenant: destroy its wrapped keys first, then remove its data.

        After the key file is destroyed (overwritten, fsync'd, unlinked) no
        object of the tenant decrypts anywhere. The index records, retention
        records and contracts are gone when this returns, and the objects are
        out of ``objects/<tenant>/``; the moved tree is removed in the
        background (``wait=True`` waits). Saves of the tenant meanwhile are
        refused or land wholly after (the module docstring). Returns the
        number of index records removed.
        """
        with self._writes.purge(tenant, lambda: self._stop_tenant(tenant)):
            existed = self.keyring.destroy(tenant)
            aside = self._move_tree_aside(tenant)
            if self._shared is not None:
                # After the move: a node that follows the record at once and
                # saves under the new key writes into the fresh directory.
                self._shared.journal([JournalRecord.purge_tenant(tenant)])
            self._retention.drop_tenant(tenant)
            self.contracts.drop_tenant(tenant)
            recs = list(self.index.records(tenant=tenant))
            for rec in recs:
                self._drop(rec.tenant, rec.chunk_key, reason="purge", remove_file=False)
        self._audit("purge_tenant", {"tenant": tenant, "had_keys": existed, "chunks": len(recs)})

        def work() -> None:
            if aside is not None:
                shutil.rmtree(aside, ignore_errors=True)
            self._purge_quarantine(tenant)

        self._in_background(work, f"purge-{tenant}", wait)
        return len(recs)

    def _move_tree_aside(self, tenant: str) -> Path | None:
        """Rename ``objects/<tenant>`` to a ``.purged-`` name; None if it had none."""
        objects = self.root / "objects"
        aside = objects / f"{v1.PURGED_PREFIX}{tenant}-{os.urandom(8).hex()}"
        self._leaves_ready.discard(tenant)
        try:
            os.rename(objects / tenant, aside)
        except FileNotFoundError:
            return None
        except OSError as exc:
            # Not moved: remove the files in place (the writes are closed, so
            # nothing new lands there until this purge is over).
            log.warning(
                "purge of %s: moving its objects aside failed (%s); removing them", tenant, exc
            )
            shutil.rmtree(objects / tenant, ignore_errors=True)
            return None
        return aside

    def _follow_purge(self, tenant: str) -> None:
        """Another node purged ``tenant`` (its journal's record): stop decrypting
        now, not at the key cache's bound, stop this node's loads, and drop the
        tenant's records, with this node's writes of it closed meanwhile."""
        with self._writes.purge(tenant, lambda: self._stop_tenant(tenant)):
            self.keyring.forget(tenant)
            self.contracts.drop_tenant(tenant)
            for old in list(self.index.records(tenant=tenant)):
                self._drop(old.tenant, old.chunk_key, reason="journal", remove_file=False)

    def _finish_interrupted_purges(self) -> None:
        """Remove the trees purges left moved aside (a crash before their removal)."""
        left = purged_trees(self.root / "objects")
        if left:
            log.info("removing %d purged tenant tree(s) left by an interrupted purge", len(left))

            def work() -> None:
                for p in left:
                    shutil.rmtree(p, ignore_errors=True)

            self._in_background(work, "purge-leftovers", False)

    def _in_background(self, work: Callable[[], None], name: str, wait: bool) -> None:
        t = threading.Thread(target=work, name=name, daemon=True)
        t.start()
        self._bg.append(t)
        if wait:
            t.join()


__all__ = ["Purges", "purged_trees"]
