"""Purges: a whole tenant (a crypto-erase), one namespace of a tenant, a peer's
purge record (a shared root's journal), chunks older than an age, and the
namespaces whose contract matches a selector (``invalidate``).

A purge returns a :class:`~.api.PurgeReport` built by the very steps that
remove: each step reports the tier it worked on and how much of the tenant
it removed there (the RAM tier's images, the key file, the other nodes told
through the journal, the object files, the retention journal, the contract
records, the quarantined objects, the index entries; removal.py's ``drop``
reports its own three), so the report cannot name a tier the purge did not
reach, nor leave out one it did. The daemon adds the tiers it reaches itself
(loads in flight, leases, pending stores, the event feed: sidecar/admin.py).

A purge of a tenant must leave no index record without its file, and no
record of an object the destroyed key sealed. A save racing it either lands
wholly after it (a new key, its file, its record: readable) or is not
stored. So, for the length of the purge:

* the tenant's writes are **closed** (:class:`~.cancel.TenantWrites`): a put
  that starts is refused (:class:`~.cancel.PutCancelled`, "not stored"); the
  puts already in flight were started under the old load generation, which
  the purge bumps under the store's lock where their index insert compares
  it, so none of them is indexed (each removes its own file), and the purge
  waits for them to end before it goes on;
* the tenant counts as empty to every read (``lookup`` 0, every chunk a
  miss): its key is destroyed, nothing of it can be served, and a save finds
  no "already there" in a record about to go;
* the purge destroys the key file, moves ``objects/<tenant>/`` aside in one
  rename (to ``objects/.purged-<tenant>-<16 hex>``, which no reader, walk or
  sweep looks into), journals the purge on a shared root, removes the
  tenant's index records, retention records and contracts, and only then
  opens the writes again. The directory moved aside is removed after (in the
  background unless ``wait``); a purge interrupted by a crash leaves it, and
  the next open removes it (:meth:`Purges.finish_interrupted`).

A shared-root follower applies a peer's purge record the same way, its
writes of the tenant closed meanwhile (:meth:`Purges.peer_tenant`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..layouts import v1
from ..units import age_cutoff_ns
from .api import (
    TIER_CONTRACTS,
    TIER_KEYS,
    TIER_OBJECTS,
    TIER_QUARANTINE,
    TIER_RAM,
    TIER_RETENTION,
    TIER_SHARED,
    PurgeReport,
)
from .contracts import check_selector, contract_matches
from .removal import Removal
from .shared.journal import JournalRecord
from .state import StoreState, log
from .views import Views
from .writes import Writes


def purged_trees(objects: Path) -> list[Path]:
    """The purged tenants' trees left under ``objects/`` (being removed, or left by a crash)."""
    try:
        names = os.listdir(objects)
    except FileNotFoundError:
        return []
    return [objects / n for n in names if n.startswith(v1.PURGED_PREFIX)]


def remove_tree(top: Path) -> int:
    """Remove the directory ``top`` and everything below it, as far as it can
    (``shutil.rmtree(ignore_errors=True)`` alike); the number of files removed."""
    if os.path.islink(top):
        return 0  # as rmtree: never below a link
    removed = 0
    for dirpath, dirs, files in os.walk(top, topdown=False):
        for name in files:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(dirpath, name))
                removed += 1
        for name in dirs:
            path = os.path.join(dirpath, name)
            with contextlib.suppress(OSError):
                if os.path.islink(path):  # a link is removed, never followed
                    os.unlink(path)
                else:
                    os.rmdir(path)
    with contextlib.suppress(OSError):
        os.rmdir(top)
    return removed


class Purges:
    """The purges of one store (see the module docstring); the owner of the
    background threads that finish a whole-tenant purge."""

    def __init__(self, state: StoreState, removal: Removal, writes: Writes, views: Views) -> None:
        self._state = state
        self._removal = removal
        self._writes = writes
        self._views = views
        self._mu = threading.Lock()
        self._bg: list[threading.Thread] = []

    def tenant(self, tenant: str, *, wait: bool = False) -> PurgeReport:
        """Crypto-erase a tenant: destroy its wrapped keys first, then remove its data.

        After the key file is destroyed (overwritten, fsync'd, unlinked) no
        object of the tenant decrypts anywhere. The index records, retention
        records and contracts are gone when this returns, and the objects are
        out of ``objects/<tenant>/``; the moved tree is removed in the
        background (``wait=True`` waits: only then is the report complete).
        Saves of the tenant meanwhile are refused or land wholly after (the
        module docstring). ``removed``: the index records removed.
        """
        st = self._state
        report = PurgeReport(tenant)
        images: list[int] = []

        def stop() -> None:
            # Loads in flight stop before their next layer, then the RAM images
            # go; the generation bump is what the tenant's writes in flight compare.
            images.append(self._removal.stop_tenant(tenant))

        with st.tenant_writes.purge(tenant, stop):
            report.reach(TIER_RAM, sum(images))
            existed = st.keyring.destroy(tenant)
            report.reach(TIER_KEYS, int(existed))
            aside = self._move_tree_aside(tenant)
            if st.shared is not None:
                # After the move: a node that follows the record at once and
                # saves under the new key writes into the fresh directory.
                st.shared.journal([JournalRecord.purge_tenant(tenant)])
                report.reach(TIER_SHARED, 1)
            report.reach(TIER_RETENTION, st.retention.drop_tenant(tenant))
            report.reach(TIER_CONTRACTS, st.contracts.drop_tenant(tenant))
            recs = list(st.index.records(tenant=tenant))
            report.removed = len(recs)
            drop = self._removal.drop
            for rec in recs:
                drop(rec.tenant, rec.chunk_key, reason="purge", remove_file=False, tally=report)
        st.audit("purge_tenant", {"tenant": tenant, "had_keys": existed, "chunks": len(recs)})

        def work() -> None:
            if aside is not None:
                report.reach(TIER_OBJECTS, remove_tree(aside))
            report.reach(TIER_QUARANTINE, self._removal.purge_quarantine(tenant))

        self._in_background(work, f"purge-{tenant}", wait)
        return report

    def _move_tree_aside(self, tenant: str) -> Path | None:
        """Rename ``objects/<tenant>`` to a ``.purged-`` name in one step (never
        walked or read as objects: layout-v1.md §2.2); None if it had none."""
        objects = self._state.root / "objects"
        aside = objects / f"{v1.PURGED_PREFIX}{tenant}-{os.urandom(8).hex()}"
        self._writes.forget_leaves(tenant)
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
            remove_tree(objects / tenant)
            return None
        return aside

    def finish_interrupted(self) -> None:
        """Remove the trees purges left moved aside (a crash before their removal),
        in the background: at open."""
        left = purged_trees(self._state.root / "objects")
        if left:
            log.info("removing %d purged tenant tree(s) left by an interrupted purge", len(left))

            def work() -> None:
                for p in left:
                    remove_tree(p)

            self._in_background(work, "purge-leftovers", False)

    def _in_background(self, work: Callable[[], None], name: str, wait: bool) -> None:
        t = threading.Thread(target=work, name=name, daemon=True)
        t.start()
        with self._mu:
            self._bg.append(t)
        if wait:
            t.join()

    def namespace(self, tenant: str, namespace: bytes) -> PurgeReport:
        """Remove a namespace's chunks (file removal, not a crypto erase: keys are
        per tenant)."""
        st = self._state
        report = PurgeReport(tenant, namespace)
        # Loads in flight of the tenant stop before their next layer (those of
        # its other namespaces too: a miss is safe, and purges are rare).
        st.load_gens.cancel(tenant)
        recs = list(st.index.records(tenant=tenant, namespace=namespace))
        report.removed = len(recs)
        if st.shared is not None:
            st.shared.journal([JournalRecord.purge_namespace(tenant, namespace)])
            report.reach(TIER_SHARED, 1)
        drop = self._removal.drop
        for rec in recs:
            drop(rec.tenant, rec.chunk_key, reason="purge-namespace", tally=report)
        st.audit(
            "purge_namespace", {"tenant": tenant, "namespace": namespace.hex(), "chunks": len(recs)}
        )
        return report

    def peer_tenant(self, tenant: str) -> PurgeReport:
        """Another node of the shared root purged ``tenant`` (its journal's
        record): stop decrypting now, not at the key cache's bound, stop this
        node's loads of the tenant in flight, and drop its chunks from this
        node's index (the files are the purging node's to remove), with this
        node's writes of the tenant closed meanwhile."""
        st = self._state
        report = PurgeReport(tenant)
        images: list[int] = []
        # With this node's writes of the tenant closed meanwhile, as for a purge here.
        with st.tenant_writes.purge(
            tenant, lambda: images.append(self._removal.stop_tenant(tenant))
        ):
            report.reach(TIER_RAM, sum(images))
            st.keyring.forget(tenant)
            report.reach(TIER_CONTRACTS, st.contracts.drop_tenant(tenant))
            drop = self._removal.drop
            for old in list(st.index.records(tenant=tenant)):
                report.removed += 1
                drop(old.tenant, old.chunk_key, reason="journal", remove_file=False, tally=report)
        return report

    def peer_namespace(self, tenant: str, namespace: bytes) -> PurgeReport:
        """Another node purged a namespace of ``tenant``: its loads here stop, its
        chunks leave this node's index."""
        st = self._state
        report = PurgeReport(tenant, namespace)
        st.load_gens.cancel(tenant)
        drop = self._removal.drop
        for old in list(st.index.records(tenant=tenant, namespace=namespace)):
            report.removed += 1
            drop(old.tenant, old.chunk_key, reason="journal", remove_file=False, tally=report)
        return report

    def older_than(self, age_s: float, tenant: str | None = None) -> int:
        """Remove the chunks (of one tenant or all) created more than ``age_s`` ago."""
        cutoff = age_cutoff_ns(time.time_ns(), age_s)  # 1e300 s: nothing is older
        recs = [r for r in self._state.index.records(tenant=tenant) if r.created_ns < cutoff]
        drop = self._removal.drop
        for rec in recs:
            drop(rec.tenant, rec.chunk_key, reason="purge-age")
        return len(recs)

    def invalidate(
        self,
        selector: Mapping[str, str],
        *,
        tenant: str | None = None,
        dry_run: bool = False,
        actor: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Purge every namespace whose registered contract matches ``selector``
        (:func:`contract_matches`), on every node of a shared root (a namespace
        purge is journaled). Namespaces without registered fields are reported
        as ``unknown_contract`` and left. One audit record "invalidate"."""
        check_selector(selector)
        matched: list[dict[str, Any]] = []
        unknown: list[dict[str, Any]] = []
        for row in self._views.namespaces_report(tenant, ages=False):
            contract = row["contract"]
            if contract is None:
                unknown.append({k: row[k] for k in ("tenant", "namespace", "chunks", "bytes")})
            elif contract_matches(contract, selector):
                matched.append(row)
        removed_chunks = removed_bytes = 0
        for row in matched:
            if dry_run:
                removed_chunks += row["chunks"]
            else:
                ns = bytes.fromhex(row["namespace"])
                row["removed"] = self.namespace(row["tenant"], ns).removed
                removed_chunks += row["removed"]
            removed_bytes += row["bytes"]
        report: dict[str, Any] = {
            "dry_run": dry_run,
            "selector": dict(selector),
            "tenant": tenant,
            "namespaces": matched,
            "removed_namespaces": len(matched),
            "removed_chunks": removed_chunks,
            "removed_bytes": removed_bytes,
            "unknown_contract": unknown,
            "shared_root": self._state.shared is not None,
        }
        self._state.audit(
            "invalidate",
            {
                **dict(actor or {}),
                "selector": dict(selector),
                "tenant": tenant,
                "dry_run": dry_run,
                "result": "ok",
                "namespaces": [f"{r['tenant']}/{r['namespace']}" for r in matched],
                "chunks": removed_chunks,
                "bytes": removed_bytes,
                "unknown_contract": len(unknown),
            },
        )
        return report

    def wait_background(self) -> None:
        """Wait for background work (purge file removal) to finish."""
        with self._mu:
            threads = list(self._bg)
        for t in threads:
            t.join()
        with self._mu:
            self._bg = [t for t in self._bg if t.is_alive()]


__all__ = ["Purges", "purged_trees", "remove_tree"]
