"""Maintenance: fsck (the files against the index, and the index rebuilt from
the files), the periodic sweep (orphaned temp files, unindexed objects, the
retention journal's compaction), expiry, and adopting an object another
writer put on disk.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..layouts import CorruptObject, v1
from .api import ChunkRecord, FsckReport
from .capacity import Capacity
from .config import MAX_OBJECT_BYTES
from .files import read_prefix
from .keys.budget import SEAL_COUNTS_LOST
from .removal import Removal
from .retention import Retention
from .state import StoreState, log

#: (tenant, chunk key) of an object.
_Ident = tuple[str, bytes]


@dataclass
class _Scan:
    """What fsck's walk of the object tree found."""

    #: Objects that verify, with the records their headers give.
    good: dict[_Ident, ChunkRecord] = field(default_factory=dict)
    #: Files a repair removes (old temp files, corrupt, purged or expired objects).
    to_remove: list[Path] = field(default_factory=list)
    #: Chunks whose object is there but bad or expired: not "missing".
    bad: set[_Ident | None] = field(default_factory=set)


def _shape(rec: ChunkRecord) -> tuple[int, bytes, int]:
    """What an index record and the object's header must agree on."""
    return rec.size, rec.namespace, rec.key_epoch


class Maintenance:
    """fsck, sweep, expiry and adoption of one store (see the module docstring)."""

    def __init__(self, state: StoreState, capacity: Capacity, removal: Removal) -> None:
        self._state = state
        self._capacity = capacity
        self._removal = removal

    def walk_objects(self) -> Iterator[Path]:
        """Every file under ``objects/`` (temp files included)."""
        objects = self._state.root / "objects"
        if not objects.is_dir():
            return
        for dirpath, dirs, files in os.walk(objects):
            if dirpath == str(objects):
                # A purged tenant's tree being removed (purge.py) holds no
                # object of this store any more.
                dirs[:] = [d for d in dirs if not d.startswith(v1.PURGED_PREFIX)]
            for name in files:
                yield Path(dirpath) / name

    # -------------------------------------------------------------------- fsck

    def fsck(
        self,
        repair: bool = False,
        *,
        verify_data: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> FsckReport:
        """Compare the files with the index; ``repair`` rebuilds the index from files.

        ``verify_data`` also decrypts/checksums every layer (slower). Objects
        of tenants without keys (purged) and old temp files are removed on repair.
        """
        st = self._state
        rep = FsckReport(repaired=repair)
        scan = self._scan(rep, verify_data, progress)
        indexed = {(r.tenant, r.chunk_key): r for r in st.index.records()}
        rep.index_records = len(indexed)
        fanout = st.layout.fanout
        for k, r in indexed.items():
            g = scan.good.get(k)
            if g is None:
                if k not in scan.bad:
                    rep.missing_files.append(v1.object_relpath(*k, fanout))
            elif _shape(g) != _shape(r):
                rep.mismatched_records.append(v1.object_relpath(*k, fanout))
            else:
                rep.ok += 1
        unindexed = [g for k, g in scan.good.items() if k not in indexed]
        rep.unindexed_files = [v1.object_relpath(g.tenant, g.chunk_key, fanout) for g in unindexed]
        if repair:
            self._repair(scan, indexed)
        elif unindexed:
            try:
                for rec in unindexed:
                    self._capacity.admit_one(rec)
            except Exception as exc:  # a full or failing index: fsck still reports
                log.warning("fsck: indexing %d unindexed objects failed: %s", len(unindexed), exc)
        return rep

    def _scan(
        self, rep: FsckReport, verify_data: bool, progress: Callable[[int], None] | None
    ) -> _Scan:
        """Walk the object tree, checking each object's header (and, with
        ``verify_data``, every layer), into ``rep`` and the returned scan."""
        st = self._state
        now = time.time()
        retention = st.retention.load()
        with_keys = set(st.keyring.tenants())
        key_problems = st.keyring.problems()
        rep.unreadable_key_files = [f"{t}: {why}" for t, why in sorted(key_problems.items())]
        scan = _Scan()
        for i, path in enumerate(self.walk_objects()):
            if progress is not None and i % 256 == 0:
                progress(i)
            rel = str(path.relative_to(st.root))
            if path.name.startswith(v1.TMP_PREFIX):
                if self._old_tmp(path, now):
                    rep.orphan_tmp_files.append(rel)
                    scan.to_remove.append(path)
                continue
            rep.objects_on_disk += 1
            try:
                found = self._check(path, rel, with_keys, key_problems, verify_data, retention)
            except Exception as exc:  # whatever a damaged file raises: it is corrupt
                rep.corrupt_files.append(f"{rel}: {exc}")
                scan.to_remove.append(path)
                scan.bad.add(_identity_from_path(rel, st.layout.fanout))
                continue
            if found is None:
                rep.purged_tenant_files.append(rel)
                scan.to_remove.append(path)
            elif found.expires_ns and found.expires_ns <= time.time_ns():
                scan.to_remove.append(path)  # past its TTL (§4.2): never revived
                scan.bad.add((found.tenant, found.chunk_key))  # not "missing" either
            else:
                scan.good[(found.tenant, found.chunk_key)] = found
        return scan

    def _old_tmp(self, path: Path, now: float) -> bool:
        """A temp file older than ``tmp_max_age_s`` (a cancelled or crashed writer's)."""
        try:
            return now - path.stat().st_mtime > self._state.config.tmp_max_age_s
        except FileNotFoundError:
            return False

    def _check(
        self,
        path: Path,
        rel: str,
        with_keys: set[str],
        key_problems: dict[str, str],
        verify_data: bool,
        retention: Retention,
    ) -> ChunkRecord | None:
        """The record of one object by its header; None if it is a purged
        tenant's (sealed, no keys). Raises whatever a damaged object raises."""
        st = self._state
        size = path.stat().st_size
        h = v1.decode_header(read_prefix(path, v1.ALIGN * 64))
        if rel != v1.object_relpath(h.tenant, h.chunk_key, st.layout.fanout):
            raise CorruptObject("object is not at its own path")
        if size != h.total_size:
            raise CorruptObject("size differs from header")
        if h.tenant not in with_keys and h.sealed:
            return None
        if verify_data and not (h.sealed and h.tenant in key_problems):
            tk = st.keyring.get(h.tenant) if h.sealed else None
            v1.open_into(
                st.io.read_object(path, st.scratch.get, MAX_OBJECT_BYTES),
                memoryview(bytearray(h.payload_size)),
                tenant=h.tenant,
                namespace=h.namespace,
                chunk_key=h.chunk_key,
                aead_for_epoch=st.keyring.aead_for(h.tenant, tk),
                object_aead=st.keyring.object_aead_for(h.tenant, tk),
            )
        return record_from_header(h, size, retention)

    def _repair(self, scan: _Scan, indexed: dict[_Ident, ChunkRecord]) -> None:
        """Remove what the scan found bad and rebuild the index from the files
        alone, keeping the access times the index still knows."""
        for p in scan.to_remove:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        merged: list[ChunkRecord] = []
        for k, g in scan.good.items():
            prev = indexed.get(k)
            merged.append(prev if prev is not None and _shape(prev) == _shape(g) else g)
        self._capacity.rebuilt(merged)
        self._state.index.flush()

    def rebuild(self, reason: str) -> None:
        """Rebuild the index from the files (a lost or unusable index, at open)."""
        log.warning("rebuilding the index from the files: %s", reason)
        # What only the index knew is gone: the count of nonces drawn per DEK epoch
        # (a fresh epoch per tenant bounds it again, keys/budget.py).
        self._state.index.set_meta(SEAL_COUNTS_LOST, b"1")
        rep = self.fsck(repair=True)
        indexed = len(rep.unindexed_files) + rep.ok
        log.warning("index rebuilt: %d objects, %d corrupt", indexed, len(rep.corrupt_files))

    # ------------------------------------------------------------- the sweep

    def collect_garbage(self) -> int:
        """Remove temp files older than ``tmp_max_age_s`` (cancelled or crashed writers)."""
        return self.sweep()["tmp_removed"]

    def sweep(self) -> dict[str, int]:
        """One walk of the object tree: remove temp files older than ``tmp_max_age_s``
        (cancelled or crashed writers) and index objects the index lacks (a crash
        between an object's rename and its index insert, another node's write),
        header-checked as on a miss. On a shared root, no walk: :meth:`_sweep_shared`."""
        st = self._state
        if st.shared is not None:
            return self._sweep_shared()
        removed = adopted = 0
        now = time.time()
        retention: Retention | None = None
        for path in self.walk_objects():
            if path.name.startswith(v1.TMP_PREFIX):
                removed += self._remove_if_old(path, now)
                continue
            ident = _identity_from_path(str(path.relative_to(st.root)), st.layout.fanout)
            if ident is None or st.index.get(*ident) is not None:
                continue
            if retention is None:
                retention = st.retention.load()
            with contextlib.suppress(ValueError):  # a name no tenant or key can have
                adopted += self.adopt(*ident, retention)
        self._compact_retention()
        return {"tmp_removed": removed, "adopted": adopted}

    def _remove_if_old(self, tmp: Path, now: float) -> bool:
        """Remove a temp file older than ``tmp_max_age_s``; whether it was removed."""
        try:
            if self._old_tmp(tmp, now):
                tmp.unlink()
                return True
        except FileNotFoundError:
            pass
        return False

    def _sweep_shared(self) -> dict[str, int]:
        """A shared root's sweep never walks the object tree (shared-root-v1.md: a
        walk of millions of objects, every 30 s, on every node). What the walk
        finds elsewhere comes by name here: other nodes' objects through their
        journals and existence checks, this node's crashed writes from the
        intents it kept (peers.py ``settle_crashed_writes``). Only those writes'
        directories are listed, once a temp file they left is old enough."""
        st = self._state
        sh = st.shared
        assert sh is not None
        now = time.time()
        removed = 0
        done: list[tuple[str, bytes]] = []
        for tenant, key in sh.due_sweeps(now):
            directory = st.path(tenant, key).parent
            try:
                names = os.listdir(directory)
            except FileNotFoundError:
                names = []
            for name in names:
                if name.startswith(v1.TMP_PREFIX):
                    removed += self._remove_if_old(directory / name, now)
            done.append((tenant, key))
        if done:
            with st.mu:
                sh.swept_locked(done)
                sh.persist_locked()
        self._compact_retention()
        return {"tmp_removed": removed, "adopted": 0}

    def _compact_retention(self) -> None:
        """Rewrite this node's retention files that have grown, keeping the
        records of chunks the index holds and whose TTL has not passed."""
        st = self._state
        now = time.time_ns()
        for tenant in st.retention.big_files():

            def keep(key: bytes, created: int, expires: int, tenant: str = tenant) -> bool:
                rec = st.index.get(tenant, key)
                return rec is not None and rec.created_ns == created and expires > now

            try:
                st.retention.compact(tenant, keep)
            except OSError as exc:
                log.warning("compacting the retention journal of %s failed: %s", tenant, exc)

    def expire_due(self, now_ns: int | None = None) -> int:
        """Drop every chunk past its stamped expiry: a walk of the expiry table up
        to now, as cheap as the chunks it finds (the KV-event feed runs it often)."""
        drop = self._removal.drop
        n = 0
        for rec in self._state.index.expired(time.time_ns() if now_ns is None else now_ns):
            n += drop(rec.tenant, rec.chunk_key, reason="expired")
        return n

    def expire(self) -> int:
        """Drop every chunk past its stamped expiry, or past its tenant's current
        ttl, max_age or idle_ttl (those scan the tenants that have one)."""
        st = self._state
        drop = self._removal.drop
        now = time.time_ns()
        n = self.expire_due(now)
        if st.retention_policy is None:
            return n
        for tenant in list(st.index.tenants()):
            if st.cutoffs(tenant, now) == (0, 0):
                continue
            stale = [r for r in st.index.records(tenant=tenant) if st.is_expired(r, now)]
            for rec in stale:
                n += drop(rec.tenant, rec.chunk_key, reason="expired")
        return n

    def maintain(self) -> dict[str, int]:
        """Periodic upkeep the server runs: TTL expiry, orphaned temp files and
        unindexed objects (:meth:`sweep`)."""
        self._state.access.flush()
        return {"expired": self.expire(), **self.sweep()}

    # -------------------------------------------------------------- adoption

    def adopt(
        self,
        tenant: str,
        key: bytes,
        retention: Retention | None = None,
        *,
        generation: int | None = None,
    ) -> bool:
        """Index an object another writer (node) put on disk, with its retention
        (§4.2). False if absent/invalid, or past its TTL, or if the tenant is
        purged (or revoked) since ``generation`` (default: this call's start):
        the object may be one the destroyed key sealed."""
        st = self._state
        if generation is None:
            generation = st.load_gens.current(tenant)
        if st.tenant_writes.purging(tenant):
            return False
        path = st.path(tenant, key)
        try:
            size = path.stat().st_size
            h = v1.decode_header(read_prefix(path, v1.ALIGN))
        except Exception:  # absent, unreadable or damaged: not adopted, a miss
            return False
        if h.chunk_key != key or h.tenant != tenant or size != h.total_size:
            return False
        if retention is None:
            try:
                retention = st.retention.load([tenant])
            except Exception:
                retention = {}
        rec = record_from_header(h, size, retention)
        if rec.expires_ns and rec.expires_ns <= time.time_ns():
            return False
        # Compared where a purge bumps it: in before the purge looks, or never.
        return self._capacity.admit_one(rec, generation=generation) is not None


def record_from_header(
    h: v1.ObjectHeader, size: int, retention: Retention | None = None
) -> ChunkRecord:
    """The index record of an object, from its header (and the retention journal)."""
    now = time.time_ns()
    return ChunkRecord(
        tenant=h.tenant,
        chunk_key=h.chunk_key,
        namespace=h.namespace,
        key_epoch=h.key_epoch,
        size=size,
        payload=h.payload_size,
        num_layers=len(h.layers),
        created_ns=h.created_ns,
        last_access_ns=now,
        expires_ns=(retention or {}).get((h.tenant, h.chunk_key, h.created_ns), 0),
    )


def _identity_from_path(rel: str, fanout: tuple[int, ...]) -> _Ident | None:
    """(tenant, chunk key) that a path under objects/ names, if it names one."""
    parts = rel.split("/")
    name = parts[-1]
    if len(parts) != 3 + len(fanout) or parts[0] != "objects":
        return None
    if not name.endswith(v1.OBJECT_SUFFIX):
        return None
    try:
        return parts[1], bytes.fromhex(name[: -len(v1.OBJECT_SUFFIX)])
    except ValueError:
        return None


__all__ = ["Maintenance", "record_from_header"]
