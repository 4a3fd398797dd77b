"""Maintenance: fsck (the files against the index, and the index rebuilt from
the files), walking the object tree, adopting another writer's object, and
collecting orphaned temp files.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..layouts import CorruptObject, v1
from .base import MAX_OBJECT_BYTES, boundary, log
from .capacity import Capacity
from .files import read_prefix
from .index import ChunkRecord
from .retention import Retention


@dataclass
class FsckReport:
    objects_on_disk: int = 0
    index_records: int = 0
    ok: int = 0
    missing_files: list[str] = field(default_factory=list)  # index says present, no file
    unindexed_files: list[str] = field(default_factory=list)  # file, no index record
    corrupt_files: list[str] = field(default_factory=list)
    orphan_tmp_files: list[str] = field(default_factory=list)
    purged_tenant_files: list[str] = field(default_factory=list)
    mismatched_records: list[str] = field(default_factory=list)
    #: "tenant: why" for key files that cannot be read: those tenants' chunks
    #: miss, their objects are kept (the key file may be restored), others serve.
    unreadable_key_files: list[str] = field(default_factory=list)
    repaired: bool = False

    @property
    def clean(self) -> bool:
        # Unindexed objects are not a problem: a crash between an object's
        # rename and its index insert leaves one (layout-v1.md §4); fsck
        # indexes those that verify.
        return not (
            self.missing_files
            or self.corrupt_files
            or self.orphan_tmp_files
            or self.purged_tenant_files
            or self.mismatched_records
            or self.unreadable_key_files
        )

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items()}
        d["clean"] = self.clean
        return d


class Maintenance(Capacity):
    def _walk_objects(self) -> Iterator[Path]:
        objects = self.root / "objects"
        if not objects.is_dir():
            return
        for dirpath, dirs, files in os.walk(objects):
            if dirpath == str(objects):
                # A purged tenant's tree being removed (store/purges.py) holds
                # no object of this store any more.
                dirs[:] = [d for d in dirs if not d.startswith(v1.PURGED_PREFIX)]
            for name in files:
                yield Path(dirpath) / name

    @boundary
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
        rep = FsckReport(repaired=repair)
        now = time.time()
        retention = self._retention.load()
        good: dict[tuple[str, bytes], ChunkRecord] = {}
        to_remove: list[Path] = []
        tenants_with_keys = set(self.keyring.tenants())
        key_problems = self.keyring.problems()
        rep.unreadable_key_files = [f"{t}: {why}" for t, why in sorted(key_problems.items())]
        corrupt_ids: set[tuple[str, bytes] | None] = set()
        for i, path in enumerate(self._walk_objects()):
            if progress is not None and i % 256 == 0:
                progress(i)
            rel = str(path.relative_to(self.root))
            if path.name.startswith(v1.TMP_PREFIX):
                try:
                    old = now - path.stat().st_mtime > self.config.tmp_max_age_s
                except FileNotFoundError:
                    continue
                if old:
                    rep.orphan_tmp_files.append(rel)
                    to_remove.append(path)
                continue
            rep.objects_on_disk += 1
            try:
                st = path.stat()
                h = v1.decode_header(read_prefix(path, v1.ALIGN * 64))
                if rel != v1.object_relpath(h.tenant, h.chunk_key, self.layout.fanout):
                    raise CorruptObject("object is not at its own path")
                if st.st_size != h.total_size:
                    raise CorruptObject("size differs from header")
                if h.tenant not in tenants_with_keys and h.sealed:
                    rep.purged_tenant_files.append(rel)
                    to_remove.append(path)
                    continue
                if verify_data and not (h.sealed and h.tenant in key_problems):
                    tk = self.keyring.get(h.tenant) if h.sealed else None
                    scratch = bytearray(h.payload_size)
                    v1.open_into(
                        self.io.read_object(path, self._scratch.get, MAX_OBJECT_BYTES),
                        memoryview(scratch),
                        tenant=h.tenant,
                        namespace=h.namespace,
                        chunk_key=h.chunk_key,
                        aead_for_epoch=self._aead_for(h.tenant, tk),
                    )
            except Exception as exc:  # whatever a damaged file raises: it is corrupt
                rep.corrupt_files.append(f"{rel}: {exc}")
                to_remove.append(path)
                corrupt_ids.add(_identity_from_path(rel, self.layout.fanout))
                continue
            found = self._record_from_header(h, st.st_size, retention)
            if found.expires_ns and found.expires_ns <= time.time_ns():
                to_remove.append(path)  # past its TTL (§4.2): never revived
                corrupt_ids.add((h.tenant, h.chunk_key))  # not "missing" either
                continue
            good[(h.tenant, h.chunk_key)] = found
        indexed = {(r.tenant, r.chunk_key): r for r in self.index.records()}
        rep.index_records = len(indexed)
        for k, r in indexed.items():
            g = good.get(k)
            if g is None:
                if k not in corrupt_ids:
                    rep.missing_files.append(v1.object_relpath(*k, self.layout.fanout))
            elif (g.size, g.namespace, g.key_epoch) != (r.size, r.namespace, r.key_epoch):
                rep.mismatched_records.append(v1.object_relpath(*k, self.layout.fanout))
            else:
                rep.ok += 1
        unindexed = [g for k, g in good.items() if k not in indexed]
        rep.unindexed_files = [
            v1.object_relpath(g.tenant, g.chunk_key, self.layout.fanout) for g in unindexed
        ]
        if unindexed and not repair:
            try:
                self._index_adopted(unindexed)
            except Exception as exc:  # a full or failing index: fsck still reports
                log.warning("fsck: indexing %d unindexed objects failed: %s", len(unindexed), exc)
        if repair:
            for p in to_remove:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            # Rebuild from the files alone, keeping access times the index still knows.
            merged: list[ChunkRecord] = []
            for k, g in good.items():
                prev = indexed.get(k)
                same = prev is not None and (prev.size, prev.namespace, prev.key_epoch) == (
                    g.size,
                    g.namespace,
                    g.key_epoch,
                )
                if prev is not None and same:
                    merged.append(prev)
                else:
                    merged.append(g)
            with self._mu:
                self.index.clear()
                self.index.put_many(merged)
                self._used = self.index.usage().bytes
            self.index.flush()
        return rep

    @boundary
    def collect_garbage(self) -> int:
        """Remove temp files older than ``tmp_max_age_s`` (cancelled or crashed writers)."""
        return self.sweep()["tmp_removed"]

    @boundary
    def sweep(self) -> dict[str, int]:
        """One walk of the object tree: remove temp files older than ``tmp_max_age_s``
        (cancelled or crashed writers) and index objects the index lacks (a crash
        between an object's rename and its index insert, another node's write),
        header-checked as on a miss. On a shared root, no walk: :meth:`_sweep_shared`."""
        if self._shared is not None:
            return self._sweep_shared()
        removed = adopted = 0
        now = time.time()
        retention: Retention | None = None
        for path in self._walk_objects():
            if path.name.startswith(v1.TMP_PREFIX):
                removed += self._remove_if_old(path, now)
                continue
            ident = _identity_from_path(str(path.relative_to(self.root)), self.layout.fanout)
            if ident is None or self.index.get(*ident) is not None:
                continue
            if retention is None:
                retention = self._retention.load()
            with contextlib.suppress(ValueError):  # a name no tenant or key can have
                adopted += self._adopt(*ident, retention)
        self._compact_retention()
        return {"tmp_removed": removed, "adopted": adopted}

    def _remove_if_old(self, tmp: Path, now: float) -> bool:
        """Remove a temp file older than ``tmp_max_age_s``; whether it was removed."""
        try:
            if now - tmp.stat().st_mtime > self.config.tmp_max_age_s:
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
        intents it kept (:meth:`_settle_crashed_writes`). Only those writes'
        directories are listed, once a temp file they left is old enough."""
        sh = self._shared
        assert sh is not None
        now = time.time()
        removed = 0
        done: list[tuple[str, bytes]] = []
        for tenant, key in sh.due_sweeps(now):
            directory = self._path(tenant, key).parent
            try:
                names = os.listdir(directory)
            except FileNotFoundError:
                names = []
            for name in names:
                if name.startswith(v1.TMP_PREFIX):
                    removed += self._remove_if_old(directory / name, now)
            done.append((tenant, key))
        if done:
            with self._mu:
                sh.swept_locked(done)
                sh.persist_locked()
        self._compact_retention()
        return {"tmp_removed": removed, "adopted": 0}

    def _settle_crashed_writes(self) -> None:
        """At the open of a shared root: settle the writes this node's previous run
        left in flight (:attr:`SharedRoot.crashed`). Each is counted against the
        grant it was written under (else its bytes would be granted again while
        its object, or the temp file it left, still holds them); one whose object
        took its name is indexed and journaled, so the other nodes and the
        evictor learn of it; the directory of each is cleared of the temp file it
        may have left, once that file is old enough (:meth:`_sweep_shared`)."""
        sh = self._shared
        if sh is None or not sh.crashed:
            return
        due = time.time() + self.config.tmp_max_age_s
        published: list[tuple[ChunkRecord, int]] = []
        for c in sh.crashed:
            rec = self.index.get(c.tenant, c.key)
            if rec is None and self._adopt(c.tenant, c.key):
                rec = self.index.get(c.tenant, c.key)
            with self._mu:
                sh.count_written_locked(c.epoch, c.nbytes)
                sh.sweep_later(c.tenant, c.key, due)
            if rec is not None:
                published.append((rec, c.epoch))
        n, sh.crashed = len(sh.crashed), []
        sh.stats.crashed_writes = n
        # Counted before journaled: a crash in between leaves a record missing
        # from the journal (the holder counts it as grant not yet used), never a
        # write counted twice.
        self._persist_shared()
        for rec, epoch in published:
            self._journal_stored(rec, grant_epoch=epoch)
        log.info(
            "shared root: %d write(s) in flight when this node last stopped; %d had "
            "taken their name (indexed and journaled); all counted against the grant",
            n, len(published),
        )  # fmt: skip

    def _compact_retention(self) -> None:
        """Rewrite this node's retention files that have grown, keeping the
        records of chunks the index holds and whose TTL has not passed."""
        now = time.time_ns()
        for tenant in self._retention.big_files():

            def keep(key: bytes, created: int, expires: int, tenant: str = tenant) -> bool:
                rec = self.index.get(tenant, key)
                return rec is not None and rec.created_ns == created and expires > now

            try:
                self._retention.compact(tenant, keep)
            except OSError as exc:
                log.warning("compacting the retention journal of %s failed: %s", tenant, exc)

    def _index_adopted(self, recs: list[ChunkRecord]) -> None:
        with self._mu:
            for rec in recs:
                if self.index.put(rec):
                    self._used += rec.size

    def _adopt(
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
        if generation is None:
            generation = self._load_gens.current(tenant)
        if self._writes.purging(tenant):
            return False
        path = self._path(tenant, key)
        try:
            st = path.stat()
            head = read_prefix(path, v1.ALIGN)
            h = v1.decode_header(head)
        except Exception:  # absent, unreadable or damaged: not adopted, a miss
            return False
        if h.chunk_key != key or h.tenant != tenant or st.st_size != h.total_size:
            return False
        if retention is None:
            try:
                retention = self._retention.load([tenant])
            except Exception:
                retention = {}
        rec = self._record_from_header(h, st.st_size, retention)
        if rec.expires_ns and rec.expires_ns <= time.time_ns():
            return False
        with self._mu:
            # Compared where a purge bumps it: in before the purge looks, or never.
            if self._load_gens.current(tenant) != generation:
                return False
            if self.index.put(rec):
                self._used += rec.size
        return True

    @staticmethod
    def _record_from_header(
        h: v1.ObjectHeader, size: int, retention: Retention | None = None
    ) -> ChunkRecord:
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


def _identity_from_path(rel: str, fanout: tuple[int, ...]) -> tuple[str, bytes] | None:
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
