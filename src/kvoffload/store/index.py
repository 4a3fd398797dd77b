"""The sidecar's LMDB index of stored chunks.

The index is a cache of what the object files say: every record can be rebuilt
from the self-describing objects (``fsck``), so it is opened with ``sync=False``
by default and a crash that loses its last transactions costs a rebuild, never
a wrong answer (every read verifies the object anyway).

One environment, opened by the sidecar process only, with named sub-databases:

``chunks``
    ``tenant (utf-8) || 0x00 || chunk key (32)`` → packed :class:`ChunkRecord`.
``lru``
    ``u64 BE last_access_ns || index key`` → ``b""``; iterates oldest first.
``expiry``
    ``u64 BE expires_ns || index key`` → ``b""``; only records that expire.
``tenants``
    ``tenant`` → ``u64 BE bytes || u64 BE count``.
``namespaces``
    ``tenant || 0x00 || namespace (32)`` → ``u64 BE bytes || u64 BE count``.
``meta``
    ``name (utf-8)`` → bytes (store id, index schema version, ...).

Usage ``bytes`` counts object file sizes (:attr:`ChunkRecord.size`): quotas and
eviction are about disk, not plaintext.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from itertools import repeat, takewhile
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Final, TypeAlias, TypeVar

import lmdb

from kvoffload.errors import IndexCorrupt, IndexFailure, IndexVersionError

from .api import ChunkRecord, Usage
from .index_records import (
    INDEX_SCHEMA,
    KEY_SIZE,
    RECORD,
    SCHEMA_META,
    U64,
    U64_MAX,
    USAGE,
    check_key,
    decode_record,
    decode_usage,
    encode_record,
    index_key,
    lmdb_failure,
    split_key,
    tenant_bytes,
    tenant_prefix,
)

__all__ = ["Index", "IndexCorrupt", "IndexFailure", "IndexVersionError"]

# A store that needs more than this is misconfigured; keep doubling from
# turning a runaway transaction into an address-space exhaustion.
MAX_MAP_SIZE: Final = 1 << 40

_BATCH: Final = 1024
#: Where a record's expires_ns starts (created_ns and last_access_ns precede it).
_EXPIRES_AT: Final = RECORD.size - U64.size
_DB_NAMES: Final = ("chunks", "lru", "expiry", "tenants", "namespaces", "meta", "blocks", "events")

_T = TypeVar("_T")
if TYPE_CHECKING:
    # lmdb's classes are generic in its stubs only, not at run time.
    _Txn: TypeAlias = lmdb.Transaction[bytes]


class _SharedHold:
    """``with lock.shared():`` of :class:`_SharedExclusiveLock`."""

    __slots__ = ("_lock",)

    def __init__(self, lock: _SharedExclusiveLock) -> None:
        self._lock = lock

    # Inline, one frame per side: every index read, lookups included, takes it.
    def __enter__(self) -> None:
        rw = self._lock
        with rw._lock:  # the condition's own lock
            while rw._exclusive or rw._waiting:
                rw._cond.wait()
            rw._shared += 1

    def __exit__(self, *_exc: object) -> None:
        rw = self._lock
        with rw._lock:
            rw._shared -= 1
            # Only an exclusive request waits for the shared holders to leave.
            if not rw._shared and rw._waiting:
                rw._cond.notify_all()


class _SharedExclusiveLock:
    """Many holders of the shared side, or one of the exclusive side.

    ``Environment.set_mapsize`` is only safe while no transaction is open in
    the process, so every transaction holds the shared side and growing the
    map takes the exclusive one. A waiting exclusive request blocks new
    shared ones so that a steady stream of readers cannot starve a resize.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._shared = 0
        self._exclusive = False
        self._waiting = 0
        self._hold = _SharedHold(self)

    def shared(self) -> _SharedHold:
        """The shared side, as a context manager (one reusable object, no generator:
        every index read takes it, lookups included)."""
        return self._hold

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            try:
                while self._exclusive or self._shared:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class Index:
    """LMDB index of the chunks in one store. Safe to share between threads.

    Iterators read in batches of short read transactions, so a long consumer
    never pins old pages or blocks a map resize; the price is that a record
    changed mid-iteration may be seen in its old or new place (an LRU entry
    touched during :meth:`lru` can come up again later in the same pass).
    """

    def __init__(self, path: Path, *, map_size: int = 64 << 20, sync: bool = False) -> None:
        self.path = Path(path)
        # Write transactions also serialise on LMDB's own mutex, but taking a
        # Python lock first means a thread never blocks inside LMDB while the
        # interpreter state it needs is held elsewhere, and a resize (which
        # only a writer triggers) has exactly one candidate at a time.
        self._write_mutex = threading.Lock()
        self._rw = _SharedExclusiveLock()
        self._reading = self._rw.shared()
        self._batch = _BATCH
        self._env: lmdb.Environment | None = None
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            self._env = lmdb.open(
                str(self.path),
                map_size=map_size,
                subdir=True,
                max_dbs=len(_DB_NAMES),
                lock=True,
                sync=sync,
                metasync=sync,
                # Lookups are random point reads: readahead only wastes page cache.
                readahead=False,
                mode=0o600,
            )
        except lmdb.Error as exc:
            raise lmdb_failure(exc) from exc
        try:
            self._write(self._open_tables)
        except BaseException:
            self._env.close()
            self._env = None
            raise

    def _open_tables(self, txn: _Txn) -> None:
        env = self._require_env()
        dbs = {name: env.open_db(name.encode(), txn=txn) for name in _DB_NAMES}
        self._chunks = dbs["chunks"]
        self._lru = dbs["lru"]
        self._expiry = dbs["expiry"]
        self._tenants = dbs["tenants"]
        self._namespaces = dbs["namespaces"]
        self._meta = dbs["meta"]
        # KV events (docs/spec/events-v1.md): engine block hashes per chunk
        # (same key as ``chunks``), and the durable replay buffer (u64 seq).
        self._blocks = dbs["blocks"]
        self._events = dbs["events"]
        raw = txn.get(SCHEMA_META.encode(), db=self._meta)
        if raw is None:
            if txn.stat(self._chunks)["entries"]:
                raise IndexCorrupt(f"index at {self.path} has records but no schema version")
            txn.put(SCHEMA_META.encode(), str(INDEX_SCHEMA).encode(), db=self._meta)
            return
        try:
            version = int(raw.decode("ascii"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise IndexCorrupt(f"index at {self.path} has schema version {raw!r}") from exc
        if version != INDEX_SCHEMA:
            raise IndexVersionError(
                f"index at {self.path} has schema version {version}; "
                f"this code reads version {INDEX_SCHEMA} only (rebuild it with fsck)"
            )

    # -- plumbing ---------------------------------------------------------

    def _require_env(self) -> lmdb.Environment:
        if self._env is None:
            raise IndexFailure(f"index at {self.path} is closed")
        return self._env

    def _read(self, fn: Callable[[_Txn], _T]) -> _T:
        try:
            with self._reading, self._require_env().begin() as txn:
                return fn(txn)
        except lmdb.Error as exc:
            raise lmdb_failure(exc) from exc

    def _write(self, fn: Callable[[_Txn], _T]) -> _T:
        """Run ``fn`` in a write transaction, growing the map until it fits.

        ``fn`` may run more than once, so it must not have effects outside the
        transaction.
        """
        with self._write_mutex:
            while True:
                try:
                    with self._reading, self._require_env().begin(write=True) as txn:
                        return fn(txn)
                except lmdb.MapFullError:
                    self._grow()
                except lmdb.Error as exc:
                    raise lmdb_failure(exc) from exc

    def _grow(self) -> None:
        with self._rw.exclusive():
            env = self._require_env()
            try:
                size = env.info()["map_size"]
                if size >= MAX_MAP_SIZE:
                    raise IndexFailure(f"index at {self.path} is full at {size} bytes")
                env.set_mapsize(min(size * 2, MAX_MAP_SIZE))
            except lmdb.Error as exc:
                raise lmdb_failure(exc) from exc

    def _scan(
        self,
        db: lmdb._Database,
        prefix: bytes,
        convert: Callable[[_Txn, bytes, bytes], _T | None],
        stop: Callable[[bytes], bool] | None = None,
        limit: int | None = None,
    ) -> Iterator[_T]:
        """Yield ``convert(txn, key, value)`` for keys under ``prefix``, in order.

        Each batch is read in its own transaction; the next one resumes after
        the last key seen. ``convert`` returning None skips an entry; ``stop``
        ends the scan at the first key it accepts; at most ``limit`` items.
        """
        after: bytes | None = None
        remaining = -1 if limit is None else limit
        while remaining:

            def batch(
                txn: _Txn, after: bytes | None = after, remaining: int = remaining
            ) -> tuple[list[_T], bytes | None]:
                out: list[_T] = []
                cur = txn.cursor(db=db)
                if not cur.set_range(prefix if after is None else after):
                    return out, None
                if after is not None and cur.key() == after and not cur.next():
                    return out, None
                for scanned, (key, value) in enumerate(cur, 1):
                    if not key.startswith(prefix) or (stop is not None and stop(key)):
                        return out, None
                    item = convert(txn, key, value)
                    if item is not None:
                        out.append(item)
                        if len(out) == remaining:
                            return out, None
                    # Count entries scanned, not kept, so that a selective
                    # filter cannot stretch one transaction over the table.
                    if scanned >= self._batch:
                        return out, key
                return out, None

            items, after = self._read(batch)
            remaining -= len(items)
            yield from items
            if after is None:
                return

    def _add_usage(self, txn: _Txn, db: lmdb._Database, key: bytes, nbytes: int, n: int) -> None:
        cur = decode_usage(txn.get(key, db=db))
        new_bytes, new_count = cur.bytes + nbytes, cur.count + n
        if new_bytes < 0 or new_count < 0:
            raise IndexCorrupt("usage accounting went negative; rebuild the index")
        if new_count == 0:
            # Dropping empty rows keeps tenants()/namespaces() to live entries.
            txn.delete(key, db=db)
        else:
            txn.put(key, USAGE.pack(new_bytes, new_count), db=db)

    def _account(self, txn: _Txn, rec: ChunkRecord, sign: int) -> None:
        tenant = tenant_bytes(rec.tenant)
        self._add_usage(txn, self._tenants, tenant, sign * rec.size, sign)
        self._add_usage(
            txn, self._namespaces, tenant + b"\x00" + rec.namespace, sign * rec.size, sign
        )

    def _put_txn(self, txn: _Txn, rec: ChunkRecord) -> bool:
        key = index_key(rec.tenant, rec.chunk_key)
        value = encode_record(rec)
        if not txn.put(key, value, overwrite=False, db=self._chunks):
            return False
        txn.put(U64.pack(rec.last_access_ns) + key, b"", db=self._lru)
        if rec.expires_ns:
            txn.put(U64.pack(rec.expires_ns) + key, b"", db=self._expiry)
        self._account(txn, rec, +1)
        return True

    def _remove_txn(self, txn: _Txn, key: bytes) -> ChunkRecord | None:
        value = txn.pop(key, db=self._chunks)
        if value is None:
            return None
        rec = decode_record(key, value)
        txn.delete(key, db=self._blocks)
        txn.delete(U64.pack(rec.last_access_ns) + key, db=self._lru)
        if rec.expires_ns:
            txn.delete(U64.pack(rec.expires_ns) + key, db=self._expiry)
        self._account(txn, rec, -1)
        return rec

    # -- lifecycle --------------------------------------------------------

    def close(self) -> None:
        """Close the environment; later calls raise :class:`IndexFailure`."""
        with self._write_mutex, self._rw.exclusive():
            if self._env is not None:
                env, self._env = self._env, None
                env.close()

    def __enter__(self) -> Index:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def flush(self) -> None:
        """Force committed transactions to disk (the index opens with sync off)."""
        with self._rw.shared():
            try:
                self._require_env().sync(True)
            except lmdb.Error as exc:
                raise lmdb_failure(exc) from exc

    # -- meta -------------------------------------------------------------

    def get_meta(self, name: str) -> bytes | None:
        return self._read(lambda txn: txn.get(name.encode("utf-8"), db=self._meta))

    def set_meta(self, name: str, value: bytes) -> None:
        if name == SCHEMA_META:
            raise ValueError(f"{SCHEMA_META!r} is managed by the index itself")
        key = name.encode("utf-8")
        self._write(lambda txn: txn.put(key, bytes(value), db=self._meta))

    # -- records ----------------------------------------------------------

    def put(self, rec: ChunkRecord) -> bool:
        """Insert ``rec``; False (and nothing changed) if the key is already present."""
        encode_record(rec)  # validate before taking the write lock
        return self._write(lambda txn: self._put_txn(txn, rec))

    def put_many(self, recs: Iterable[ChunkRecord]) -> int:
        """Insert records in one transaction (fsck rebuild); returns how many were new."""
        batch = list(recs)
        for rec in batch:
            encode_record(rec)
        return self._write(lambda txn: sum(self._put_txn(txn, rec) for rec in batch))

    def put_each(self, recs: Sequence[ChunkRecord]) -> list[bool]:
        """Insert records in one transaction; per record, whether it was new.

        A batch of saves commits its records together: one write transaction
        (and one commit) per batch instead of one per chunk. Either all the
        batch's records are committed or none is.
        """
        for rec in recs:
            encode_record(rec)
        if not recs:
            return []
        return self._write(lambda txn: [self._put_txn(txn, rec) for rec in recs])

    def get(self, tenant: str, chunk_key: bytes) -> ChunkRecord | None:
        key = index_key(tenant, chunk_key)

        def read(txn: _Txn) -> ChunkRecord | None:
            value = txn.get(key, db=self._chunks)
            return None if value is None else decode_record(key, value)

        return self._read(read)

    def lookup(
        self,
        tenant: str,
        keys: Sequence[bytes],
        now_ns: int | None = None,
        *,
        created_after_ns: int = 0,
        accessed_after_ns: int = 0,
    ) -> int:
        """Number of leading ``keys`` present for ``tenant``: the usable prefix.

        With ``now_ns``, a record whose expiry has passed ends the prefix too;
        so does one created at or before ``created_after_ns`` or last accessed
        at or before ``accessed_after_ns`` (the tenant's max_age and idle_ttl).
        One read transaction, and no Python code per key: the ``expiry``
        table's first entry says whether any record has expired yet (a cursor
        step, ~1k instructions: cheaper than any cache of it kept safe against
        other writers); if none has, the keys are looked up and counted up to
        the first miss by C iterators (one key: one ``set_key``). Only when
        some record is due, or the tenant has an age or idle cutoff, are the
        times of the records found read, key by key.
        """
        if not keys:
            return 0
        prefix = tenant_prefix(tenant)
        # The checks of check_key, in C over the batch (one key: directly).
        if len(keys) == 1:
            if not isinstance(keys[0], bytes) or len(keys[0]) != KEY_SIZE:
                raise ValueError(f"chunk_key must be {KEY_SIZE} bytes")
        elif set(map(len, keys)) != {KEY_SIZE} or not all(map(isinstance, keys, repeat(bytes))):
            raise ValueError(f"chunk_key must be {KEY_SIZE} bytes")
        env = self._env if self._env is not None else self._require_env()
        try:
            # Values as buffers into the map, not copies.
            with self._reading, env.begin(buffers=True) as txn:
                cur = txn.cursor(db=self._chunks)
                unpack, at = U64.unpack_from, _EXPIRES_AT
                due = False
                if now_ns is not None:  # the expiry table is ordered by time
                    exp = txn.cursor(db=self._expiry)
                    due = bool(created_after_ns or accessed_after_ns) or (
                        exp.first() and unpack(exp.key(), 0)[0] <= now_ns
                    )
                if not due:
                    if len(keys) == 1:
                        return 1 if cur.set_key(prefix + keys[0]) else 0
                    return len(list(takewhile(bool, map(cur.set_key, map(prefix.__add__, keys)))))
                n = 0
                for k in map(prefix.__add__, keys):
                    if not cur.set_key(k):
                        break
                    value = cur.value()
                    expires = unpack(value, at)[0]
                    if 0 < expires <= now_ns:
                        break
                    if created_after_ns and unpack(value, at - 16)[0] <= created_after_ns:
                        break
                    if accessed_after_ns and unpack(value, at - 8)[0] <= accessed_after_ns:
                        break
                    n += 1
                return n
        except lmdb.Error as exc:
            raise lmdb_failure(exc) from exc

    def touch(self, tenant: str, keys: Sequence[bytes], now_ns: int) -> None:
        """Mark ``keys`` as used at ``now_ns``; missing keys are ignored.

        Last access never moves backwards: batches from several threads may be
        applied out of order, and an older timestamp would misplace the entry
        in the LRU.
        """
        if not 0 <= now_ns <= U64_MAX:
            raise ValueError("now_ns out of range")
        index_keys = [index_key(tenant, k) for k in keys]
        if not index_keys:
            return

        def write(txn: _Txn) -> None:
            for key in index_keys:
                value = txn.get(key, db=self._chunks)
                if value is None:
                    continue
                rec = decode_record(key, value)
                if now_ns <= rec.last_access_ns:
                    continue
                txn.delete(U64.pack(rec.last_access_ns) + key, db=self._lru)
                txn.put(U64.pack(now_ns) + key, b"", db=self._lru)
                txn.put(key, encode_record(replace(rec, last_access_ns=now_ns)), db=self._chunks)

        self._write(write)

    def remove(self, tenant: str, chunk_key: bytes) -> ChunkRecord | None:
        """Drop one record; returns it, or None if it was not there."""
        key = index_key(tenant, chunk_key)
        return self._write(lambda txn: self._remove_txn(txn, key))

    def remove_many(self, items: Iterable[tuple[str, bytes]]) -> list[ChunkRecord]:
        """Drop several records in one transaction; returns those that were there."""
        keys = [index_key(tenant, chunk_key) for tenant, chunk_key in items]

        def write(txn: _Txn) -> list[ChunkRecord]:
            out: list[ChunkRecord] = []
            for key in keys:
                rec = self._remove_txn(txn, key)
                if rec is not None:
                    out.append(rec)
            return out

        return self._write(write)

    def clear(self) -> None:
        """Drop every record and all usage; ``meta`` is kept."""

        def write(txn: _Txn) -> None:
            for db in (
                self._chunks,
                self._lru,
                self._expiry,
                self._tenants,
                self._namespaces,
                self._blocks,
            ):
                txn.drop(db, delete=False)

        self._write(write)

    # -- KV events (events-v1) ------------------------------------------

    def set_blocks(self, tenant: str, chunk_key: bytes, blob: bytes) -> bool:
        """Keep the engine block hashes of a stored chunk; False if it is not
        stored or already has them (they are never replaced)."""
        key = index_key(tenant, chunk_key)

        def write(txn: _Txn) -> bool:
            if txn.get(key, db=self._chunks) is None:
                return False
            return bool(txn.put(key, bytes(blob), overwrite=False, db=self._blocks))

        return self._write(write)

    def get_blocks(self, tenant: str, chunk_key: bytes) -> bytes | None:
        key = index_key(tenant, chunk_key)
        return self._read(lambda txn: txn.get(key, db=self._blocks))

    def all_blocks(self, tenant: str | None = None) -> Iterator[tuple[str, bytes, bytes]]:
        """``(tenant, chunk_key, blob)`` of every chunk (of ``tenant``) stored with block hashes."""
        prefix = b"" if tenant is None else tenant_bytes(tenant) + b"\x00"
        return self._scan(self._blocks, prefix, lambda _t, k, v: (*split_key(k), bytes(v)))

    def drop_blocks(self, tenant: str, chunk_keys: Iterable[bytes]) -> None:
        """Forget the block hashes of chunks (their announcement was retracted)."""
        keys = [index_key(tenant, k) for k in chunk_keys]

        def write(txn: _Txn) -> None:
            for key in keys:
                txn.delete(key, db=self._blocks)

        self._write(write)

    def append_event(self, seq: int, payload: bytes, keep: int) -> None:
        """Add a published batch to the replay buffer; keep the newest ``keep``."""

        def write(txn: _Txn) -> None:
            txn.put(U64.pack(seq), bytes(payload), db=self._events)
            extra = txn.stat(self._events)["entries"] - keep
            if extra > 0:
                cur = txn.cursor(db=self._events)
                cur.first()
                for _ in range(extra):
                    cur.delete()

        self._write(write)

    def events_since(self, seq: int) -> list[tuple[int, bytes]]:
        """Buffered batches with a seq at or above ``seq``, in order."""
        start = U64.pack(seq)

        def read(txn: _Txn) -> list[tuple[int, bytes]]:
            cur = txn.cursor(db=self._events)
            if not cur.set_range(start):
                return []
            return [(U64.unpack(k)[0], bytes(v)) for k, v in cur]

        return self._read(read)

    def last_event_seq(self) -> int | None:
        def read(txn: _Txn) -> int | None:
            cur = txn.cursor(db=self._events)
            return U64.unpack(cur.key())[0] if cur.last() else None

        return self._read(read)

    # -- iteration and accounting ----------------------------------------

    def _record_at(self, txn: _Txn, key: bytes) -> ChunkRecord | None:
        value = txn.get(key, db=self._chunks)
        return None if value is None else decode_record(key, value)

    def lru(self, limit: int | None = None) -> Iterator[ChunkRecord]:
        """Records by last access, oldest first (eviction order)."""
        if limit is not None and limit <= 0:
            return iter(())
        return self._scan(
            self._lru, b"", lambda txn, key, _v: self._record_at(txn, key[8:]), limit=limit
        )

    def expired(self, now_ns: int, limit: int | None = None) -> list[ChunkRecord]:
        """Records whose ``expires_ns`` is at or before ``now_ns``, soonest first."""
        if limit is not None and limit <= 0:
            return []
        return list(
            self._scan(
                self._expiry,
                b"",
                lambda txn, key, _v: self._record_at(txn, key[8:]),
                stop=lambda key: U64.unpack_from(key)[0] > now_ns,
                limit=limit,
            )
        )

    def records(
        self, tenant: str | None = None, namespace: bytes | None = None
    ) -> Iterator[ChunkRecord]:
        """All records, or those of one tenant and/or namespace, in key order."""
        prefix = b"" if tenant is None else tenant_bytes(tenant) + b"\x00"
        if namespace is not None:
            check_key("namespace", namespace)

        def convert(_txn: _Txn, key: bytes, value: bytes) -> ChunkRecord | None:
            rec = decode_record(key, value)
            return rec if namespace is None or rec.namespace == namespace else None

        return self._scan(self._chunks, prefix, convert)

    def usage(self, tenant: str | None = None) -> Usage:
        """Usage of one tenant, or of the whole store."""
        if tenant is not None:
            key = tenant_bytes(tenant)
            return self._read(lambda txn: decode_usage(txn.get(key, db=self._tenants)))
        total = self.tenants().values()
        return Usage(sum(u.bytes for u in total), sum(u.count for u in total))

    def tenants(self) -> dict[str, Usage]:
        """Usage per tenant that has at least one record."""

        def read(txn: _Txn) -> dict[str, Usage]:
            out: dict[str, Usage] = {}
            for key, value in txn.cursor(db=self._tenants):
                try:
                    out[key.decode("utf-8")] = decode_usage(value)
                except UnicodeDecodeError as exc:
                    raise IndexCorrupt(f"malformed tenant {key!r} in usage table") from exc
            return out

        return self._read(read)

    def namespaces(self, tenant: str) -> dict[bytes, Usage]:
        """Usage per namespace of ``tenant`` that has at least one record."""
        prefix = tenant_bytes(tenant) + b"\x00"

        def read(txn: _Txn) -> dict[bytes, Usage]:
            out: dict[bytes, Usage] = {}
            cur = txn.cursor(db=self._namespaces)
            if not cur.set_range(prefix):
                return out
            for key, value in cur:
                if not key.startswith(prefix):
                    break
                out[key[len(prefix) :]] = decode_usage(value)
            return out

        return self._read(read)

    def count(self) -> int:
        """Number of records."""
        return self._read(lambda txn: int(txn.stat(self._chunks)["entries"]))
