"""The data path: put / put_many (reserve, seal, write, index) and get /
get_many_into (read, verify, decrypt), with lookups.

Read rule: a chunk is returned only after every byte of its object has been
verified (structure, zero padding, every tag or checksum). Any failure —
missing file, torn or flipped bytes, another object's file, a purged key —
is a miss, and the index entry (and a corrupt file) is dropped.

``put_many`` and ``get_many_into`` run a batch on a pool of I/O threads
(``StoreConfig.io_streams``, default :func:`default_io_streams`): up to that
many chunks are sealed and written, or read, verified and decrypted, at once;
``os.pwrite``/``preadv``, AES-GCM and XXH3 release the GIL. The calling
thread looks chunks up and indexes saved ones, in chunk order, so the results
(and what a failure leaves stored) are those of a one-at-a-time batch; a
chunk that fails its read or its checks is dropped on the pool thread that
found it, exactly as :meth:`get_into` drops it.
"""

from __future__ import annotations

import contextlib
import mmap
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..errors import StoreError
from ..layouts import ObjectMismatch, v1
from . import files as fileio
from .base import (
    MAX_OBJECT_BYTES,
    SEAL_COUNT_BLOCK,
    SEAL_COUNTS_LOST,
    boundary,
    default_io_streams,
    log,
)
from .cancel import LoadCancelled, PutCancelled, may_wait_between_layers
from .capacity import Reservation
from .files import Durability, ScratchBuffers
from .index import ChunkRecord
from .maintenance import Maintenance
from .ramtier import RamTier, Slot
from .shared.root import SHARED_NONCE_SHARES

#: Each I/O thread's buffer for one layer slot of a streamed load
#: (:func:`fileio.streamed_object`), apart from the object-sized scratch the
#: saves use, so that neither shrinks the other.
_SLOTS = ScratchBuffers()

#: A batch saved without fsync (durability batch or none) of fewer bytes than
#: this runs in the caller's thread, chunk by chunk: writing small objects to
#: the page cache costs mostly Python (which holds the GIL), and the hop to a
#: pool thread and back costs more than the overlap gains. Loads (a cold read
#: waits on the device) and fsync'd saves always use the streams.
PARALLEL_MIN_BYTES = 1 << 20


def _small(nbytes: int) -> bool:
    return nbytes < PARALLEL_MIN_BYTES


def _repeated(key: bytes, seen: set[bytes], reservation: Reservation | None) -> bool:
    """A key already in this batch: indexed with the batch's one commit, so the
    repeat is "already present" (its reservation is released)."""
    if key in seen:
        if reservation is not None:
            reservation.release()
        return True
    seen.add(key)
    return False


class _Done:
    """A read finished in the calling thread, where a pool read has a Future:
    ``result()`` alike, without a Future's lock and condition (a small cached
    object's whole read costs a few times what a Future does)."""

    __slots__ = ("value",)

    def __init__(self, value: list[int] | None) -> None:
        self.value = value

    def result(self) -> list[int] | None:
        return self.value


class _Deferred:
    """A read to run in the calling thread when its turn comes (``result()``):
    its device read was started when it was queued, so the reads of a batch
    overlap on the device while one thread verifies them in order."""

    __slots__ = ("args", "fn")

    def __init__(self, fn: Callable[..., list[int] | None], *args: Any) -> None:
        self.fn, self.args = fn, args

    def result(self) -> list[int] | None:
        return self.fn(*self.args)


@dataclass
class _PutJob:
    """One chunk between reservation and index insert (put / put_many)."""

    tenant: str
    namespace: bytes
    chunk_key: bytes
    layers: Sequence[memoryview | bytes | bytearray]
    lengths: list[int]
    size: int
    res: Reservation
    aead: AESGCM | None
    epoch: int
    ttl_s: float | None
    now: int
    #: The tenant's generation (cancel.py) when the put began: a purge or
    #: revocation before the index insert discards the write.
    generation: int = 0


def _record_of(job: _PutJob) -> ChunkRecord:
    """The index record of a chunk the job wrote."""
    return ChunkRecord(
        tenant=job.tenant,
        chunk_key=job.chunk_key,
        namespace=job.namespace,
        key_epoch=job.epoch,
        size=job.size,
        payload=sum(job.lengths),
        num_layers=len(job.lengths),
        created_ns=job.now,
        last_access_ns=job.now,
        expires_ns=job.now + int(job.ttl_s * 1e9) if job.ttl_s else 0,
    )


class Pipeline(Maintenance):
    def _nonce_budget(self, tenant: str, epoch: int, segments: int) -> int:
        """Count sealed segments per (tenant, epoch); rotate the DEK before the bound.

        The persisted count runs ahead of the real one by up to a block, so a
        crash can only over-count, never under-count.
        """
        limit = self.config.max_segments_per_epoch
        if self._shared is not None:
            # Every node of a shared root seals under the same DEK epochs, and no
            # node sees the others' counts: each gets a share of the bound
            # (shared-root-v1.md §5).
            limit //= SHARED_NONCE_SHARES
        block = max(segments, min(SEAL_COUNT_BLOCK, limit // 4))
        with self._mu:
            while True:
                left = self._seal_budget.get((tenant, epoch), 0)
                if left >= segments:
                    self._seal_budget[(tenant, epoch)] = left - segments
                    return epoch
                name = f"seal_count/{tenant}/{epoch}"
                raw = self.index.get_meta(name)
                if raw is None and self.index.get_meta(SEAL_COUNTS_LOST) is not None:
                    # The index was rebuilt: this epoch's count is unknown. A fresh
                    # epoch's is not (it starts at 0).
                    epoch = self.keyring.rotate_dek(tenant)
                    self.index.set_meta(f"seal_count/{tenant}/{epoch}", b"0")
                    continue
                done = int(raw.decode()) if raw else 0
                if done + block > limit:
                    epoch = self.keyring.rotate_dek(tenant)
                    log.info("tenant %s: nonce budget spent, DEK epoch now %d", tenant, epoch)
                    continue
                self.index.set_meta(name, str(done + block).encode())
                self._seal_budget[(tenant, epoch)] = left + block

    @boundary
    def put(
        self,
        tenant: str,
        namespace: bytes,
        chunk_key: bytes,
        layers: Sequence[memoryview | bytes | bytearray],
        *,
        encrypt: bool = True,
        ttl_s: float | None = None,
        reservation: Reservation | None = None,
    ) -> bool:
        """Store one chunk. True if written, False if it was already present.
        :class:`PutCancelled` if its tenant is purged (or revoked) meanwhile."""
        with self._open_writes(tenant, [reservation]) as generation:
            self._ensure_leaves(tenant)
            job = self._begin_put(
                tenant, namespace, chunk_key, layers, encrypt, ttl_s, reservation, generation
            )
            if job is None:
                return False
            return self._finish_put(job, self._seal_and_write(job))

    @contextlib.contextmanager
    def _open_writes(self, tenant: str, held: Sequence[Reservation | None]) -> Iterator[int]:
        """One put or batch of ``tenant`` (cancel.TenantWrites): its load
        generation, or :class:`PutCancelled` while a purge of the tenant runs,
        and at its end if one began meanwhile (even a chunk found already there
        is then being purged); cancelled, the reservations ``held`` are released."""
        try:
            with self._writes.writing(tenant) as generation:
                yield generation
                if self._load_gens.current(tenant) != generation:
                    raise PutCancelled(f"tenant {tenant!r} purged or revoked while saved")
        except PutCancelled:
            for r in held:
                if r is not None:
                    r.release()
            raise

    @boundary
    def put_many(
        self,
        tenant: str,
        namespace: bytes,
        chunks: Sequence[tuple[bytes, Sequence[memoryview | bytes | bytearray]]],
        *,
        encrypt: bool = True,
        ttl_s: float | None = None,
        reservations: Sequence[Reservation | None] | None = None,
    ) -> list[bool]:
        """Store several chunks ``(chunk_key, layers)``, sealing and writing up to
        :attr:`io_streams` of them at once. Per chunk: True if written, False if
        already present.

        ``reservations[i]``, if given, is capacity already held for chunk i (the
        server reserves at prepare time); it is consumed or released.
        On an error (StoreFull, StoreIOError…) the chunks before the failing one
        are stored, nothing after it is (a later chunk's file already written
        is removed again), and the error is raised.
        """
        held = list(reservations) if reservations is not None else [None] * len(chunks)
        if len(held) != len(chunks):
            raise ValueError("one reservation (or None) per chunk")
        with self._open_writes(tenant, held) as generation:
            return self._put_batch(tenant, namespace, chunks, encrypt, ttl_s, held, generation)

    def _put_batch(
        self,
        tenant: str,
        namespace: bytes,
        chunks: Sequence[tuple[bytes, Sequence[memoryview | bytes | bytearray]]],
        encrypt: bool,
        ttl_s: float | None,
        held: Sequence[Reservation | None],
        generation: int,
    ) -> list[bool]:
        """:meth:`put_many` once the tenant's writes are open (``generation``)."""
        self._ensure_leaves(tenant)
        # Chunks written (or found on disk), in chunk order, waiting for their
        # index records: the whole batch commits in one index transaction, after
        # every object of it is written (and fsync'd, at durability object).
        done: list[tuple[int, _PutJob, bool]] = []
        try:
            if len(chunks) < 2 or (
                self.config.durability is not Durability.OBJECT
                and _small(sum(memoryview(x).nbytes for _k, ls in chunks for x in ls))
            ):
                self._write_in_turn(
                    tenant, namespace, chunks, encrypt, ttl_s, held, generation, done
                )
            else:
                self._write_on_streams(
                    tenant, namespace, chunks, encrypt, ttl_s, held, generation, done
                )
        except BaseException:
            # The chunks before the failing one are written: index them, then raise.
            try:
                self._finish_puts(done)
            except Exception as exc:
                log.warning("put_many: indexing the chunks before a failure failed: %s", exc)
            raise
        results = [False] * len(chunks)
        for i, ok in zip((i for i, _j, _w in done), self._finish_puts(done), strict=True):
            results[i] = ok
        return results

    def _write_in_turn(
        self,
        tenant: str,
        namespace: bytes,
        chunks: Sequence[tuple[bytes, Sequence[memoryview | bytes | bytearray]]],
        encrypt: bool,
        ttl_s: float | None,
        held: Sequence[Reservation | None],
        generation: int,
        done: list[tuple[int, _PutJob, bool]],
    ) -> None:
        """Seal and write the chunks one after the other in this thread; ``done``
        gets each chunk written, for :meth:`_finish_puts`."""
        seen: set[bytes] = set()
        for i, (key, layers) in enumerate(chunks):
            if _repeated(key, seen, held[i]):
                continue
            job = self._begin_put(
                tenant, namespace, key, layers, encrypt, ttl_s, held[i], generation
            )
            if job is None:
                continue
            done.append((i, job, self._seal_and_write(job)))

    def _write_on_streams(
        self,
        tenant: str,
        namespace: bytes,
        chunks: Sequence[tuple[bytes, Sequence[memoryview | bytes | bytearray]]],
        encrypt: bool,
        ttl_s: float | None,
        held: Sequence[Reservation | None],
        generation: int,
        done: list[tuple[int, _PutJob, bool]],
    ) -> None:
        """Seal and write up to :attr:`io_streams` chunks at once on the pool;
        ``done`` gets each chunk written, in chunk order."""
        pool = self._pipeline()
        streams = self.io_streams
        # In order: (chunk index, job, its seal+write on the pool).
        window: deque[tuple[int, _PutJob, Future[bool]]] = deque()
        try:
            seen: set[bytes] = set()
            for i, (key, layers) in enumerate(chunks):
                if _repeated(key, seen, held[i]):
                    continue
                try:
                    job = self._begin_put(
                        tenant, namespace, key, layers, encrypt, ttl_s, held[i], generation
                    )
                except BaseException:
                    while window:  # the chunks before this one are written
                        j, later, fut = window.popleft()
                        done.append((j, later, self._await_written(later, fut)))
                    raise
                if job is None:
                    continue
                window.append((i, job, pool.submit(self._seal_and_write, job)))
                while len(window) >= streams:
                    j, first, fut = window.popleft()
                    done.append((j, first, self._await_written(first, fut)))
            while window:
                j, first, fut = window.popleft()
                done.append((j, first, self._await_written(first, fut)))
        finally:
            # An error: the writes still in flight are after the failing chunk.
            for _j, later, fut in window:
                self._discard_written(later, fut)

    def _ensure_leaves(self, tenant: str) -> None:
        """Create all of a tenant's fan-out directories before its first write here.

        Made one at a time by the writes, each new leaf costs its write a
        ``mkdir`` and, at durability ``object``, an fsync of the tenant's
        directory (layout-v1.md §4): a fresh tenant's first few hundred saves
        paid that. A one-level fan-out has 256 leaves: they are made at once,
        with one fsync of the tenant's directory. A two-level store (65,536
        leaves) keeps making them as needed, and so does every write whose
        directory is missing anyway (a purge, a failure here): this is only a
        shortcut, never needed for a write to succeed."""
        if tenant in self._leaves_ready:
            return
        if self.layout.fanout == v1.FANOUT_ONE_LEVEL:
            durable = self.config.durability is Durability.OBJECT
            try:
                fileio.make_fanout(self.root / "objects" / tenant, durable=durable)
            except OSError as exc:
                log.debug("tenant %s: making its directories ahead failed: %s", tenant, exc)
                return
        self._leaves_ready.add(tenant)

    @property
    def io_streams(self) -> int:
        """Chunks of one batch sealed/read and written/verified at once."""
        return self.config.io_streams or default_io_streams()

    def _pipeline(self) -> ThreadPoolExecutor:
        with self._mu:
            if self._pipe is None:
                self._pipe = ThreadPoolExecutor(
                    max_workers=self.io_streams, thread_name_prefix="kvoffload-io"
                )
            return self._pipe

    def _part_reader(self) -> fileio.PartReader | None:
        """The store's :class:`fileio.PartReader`, io_streams threads; None with one stream."""
        if self.io_streams < 2:
            return None
        with self._mu:
            if self._parts is None:
                self._parts = fileio.PartReader(self.io_streams)
            return self._parts

    def _seal_and_write(self, job: _PutJob) -> bool:
        """Seal into this thread's scratch buffer (a pool thread's, or the caller's
        for a batch written in turn) and write the file. True if written, False
        if the object was already on disk. Releases the reservation only on an
        error (the caller indexes and releases)."""
        ram = self._ram
        slot = ram.lend(job.size) if ram is not None else None
        written = False
        try:
            # Sealed into a buffer of the RAM tier where one is ready: the image
            # written is then kept, and the next load of the chunk is warm.
            buf = slot.view[: job.size] if slot is not None else self._scratch.get(job.size)
            self._seal(job, buf)
            written = self._write_verified(job, buf)
            return written
        except BaseException:
            job.res.release()
            raise
        finally:
            if slot is not None and ram is not None:
                path = self._path_str(job.tenant, job.chunk_key)
                self._settle(ram, slot, job.tenant, job.chunk_key, job.size, path,
                             written, job.generation)  # fmt: skip

    @staticmethod
    def _await_written(job: _PutJob, fut: Future[bool]) -> bool:
        """Wait for a chunk's write (True: written, False: found on disk)."""
        try:
            return fut.result()
        except BaseException:
            job.res.release()
            raise

    def _discard_written(self, job: _PutJob, fut: Future[bool]) -> None:
        """A write after a failed chunk: let it finish, remove its file, free its space."""
        try:
            if fut.result():
                self._unpublish(job)
        except Exception as exc:
            log.warning("put_many: in-flight write failed too: %s", exc)
        finally:
            job.res.release()

    def _unpublish(self, job: _PutJob) -> None:
        """A written object that will not be indexed: its RAM image, then its file."""
        if self._ram is not None:
            self._ram.discard(job.tenant, job.chunk_key)
        with contextlib.suppress(FileNotFoundError):
            self._path(job.tenant, job.chunk_key).unlink()

    def _begin_put(
        self,
        tenant: str,
        namespace: bytes,
        chunk_key: bytes,
        layers: Sequence[memoryview | bytes | bytearray],
        encrypt: bool,
        ttl_s: float | None,
        reservation: Reservation | None,
        generation: int,
    ) -> _PutJob | None:
        """Checks, capacity reservation and key for one chunk; None if already
        present. ``generation``: the tenant's when its put or batch began."""
        if len(chunk_key) != v1.KEY_SIZE or len(namespace) != v1.KEY_SIZE:
            raise ValueError("chunk key and namespace must be 32 bytes")
        lengths = [memoryview(x).nbytes for x in layers]
        have = self.index.get(tenant, chunk_key)
        if have is not None and self._is_expired(have, time.time_ns()):
            # Past its retention: a miss on every read, so a save writes it afresh.
            self._drop(tenant, chunk_key, reason="expired")
            have = None
        if have is not None:
            if (have.num_layers, have.payload) == (len(lengths), sum(lengths)):
                self.counters.put_exists += 1
                if reservation is not None:
                    reservation.release()
                return None
            # Equal keys must mean equal content: a record of another shape is
            # wrong (or its object is), and this write replaces both (§4).
            self._drop(tenant, chunk_key, reason="other-shape", remove_file=False)
        if not v1.shape_ok(lengths, encrypt):
            raise ValueError(
                f"{len(lengths)} layers of {sum(lengths)} bytes: padding would exceed the "
                "bound of layout-v1.md §3.2"
            )
        size = v1.object_size(lengths, encrypt)
        res = reservation
        if res is None or res.released or res.nbytes < size:
            if res is not None:
                res.release()
            res = self.reserve(tenant, size)
        try:
            aead = None
            epoch = 0
            if encrypt:
                tk = self.keyring.ensure_tenant(tenant)
                epoch = self._nonce_budget(tenant, tk.current_epoch, len(layers))
                if epoch != tk.current_epoch:
                    tk = self.keyring.ensure_tenant(tenant)
                aead = tk.aead(epoch)
                if aead is None:
                    raise StoreError(f"tenant {tenant}: no data key for epoch {epoch}")
            res.intend(chunk_key)  # a shared root's restart finds it if we crash
        except BaseException:
            res.release()
            raise
        return _PutJob(
            tenant, namespace, chunk_key, layers, lengths, size, res, aead, epoch, ttl_s,
            time.time_ns(), generation,
        )  # fmt: skip

    @staticmethod
    def _seal(job: _PutJob, buf: memoryview) -> None:
        v1.seal_into(
            buf,
            tenant=job.tenant,
            namespace=job.namespace,
            chunk_key=job.chunk_key,
            layers=job.layers,
            aead=job.aead,
            key_epoch=job.epoch,
            created_ns=job.now,
        )

    def _write_verified(self, job: _PutJob, buf: memoryview) -> bool:
        """Write the object; True if written, False if a verifying one was there.

        "Exists" is success only for an object that verifies (layout §4): a
        damaged one leaves its name, and this write takes it. A chunk with a TTL
        has its expiry recorded first, where an index rebuild finds it (§4.2)."""
        path = self._path(job.tenant, job.chunk_key)
        expires = job.now + int(job.ttl_s * 1e9) if job.ttl_s else 0
        if expires:
            self._retain(job.tenant, job.chunk_key, job.now, expires)
        written = self.io.write_object(path, buf, self.config.durability)
        if not written and not self._existing_serves(job):
            self._quarantine(job.tenant, job.chunk_key, "publish")
            written = self.io.write_object(path, buf, self.config.durability)
        return written

    def _finish_put(self, job: _PutJob, written: bool) -> bool:
        """Index a written object (or adopt the one another writer put there);
        always releases the job's reservation."""
        return self._finish_puts([(0, job, written)])[0]

    def _finish_puts(self, done: Sequence[tuple[int, _PutJob, bool]]) -> list[bool]:
        """Index the written objects of a batch in one transaction (or adopt those
        another writer put there first); per entry, whether its record is new.
        Always releases every job's reservation.

        Every object is under its final name (and fsync'd, at durability
        object) before the transaction starts, so a crash in between leaves
        objects without records, which a rebuild adopts: never a record
        without its object.
        """
        out = [False] * len(done)
        cancelled: list[bytes] = []
        recs: list[tuple[int, _PutJob, ChunkRecord]] = []
        try:
            for n, (_i, job, written) in enumerate(done):
                if not written:
                    # Another writer (another node on a shared FS) got there first.
                    if not self._adopt_existing(job):
                        cancelled.append(job.chunk_key)
                elif self._load_gens.current(job.tenant) != job.generation:
                    # Purged or revoked while being written: the object is not published.
                    self._unpublish(job)
                    cancelled.append(job.chunk_key)
                else:
                    recs.append((n, job, _record_of(job)))
            for job in self._insert_batch(recs, out) if recs else ():
                self._unpublish(job)
                cancelled.append(job.chunk_key)
        finally:
            for _i, job, _w in done:
                job.res.release()
            self._persist_shared()
        if recs:
            self._after_write()
        return self._cancelled_puts(cancelled, out)

    def _adopt_existing(self, job: _PutJob) -> bool:
        """Index the object another writer put at the job's name; False if the
        tenant was purged or revoked since the job began (nothing indexed by it)."""
        if self._load_gens.current(job.tenant) != job.generation:
            return False
        self._adopt(job.tenant, job.chunk_key, generation=job.generation)
        self.counters.put_exists += 1
        return self._load_gens.current(job.tenant) == job.generation

    def _insert_batch(
        self, recs: Sequence[tuple[int, _PutJob, ChunkRecord]], out: list[bool]
    ) -> list[_PutJob]:
        """Insert the records in one transaction, ``out[n]`` True for each new one;
        the jobs whose tenant was purged or revoked since they began are left out
        and returned. The generation is compared under the store's lock, where a
        purge bumps it (base._stop_tenant): a record is in before a purge looks
        at the tenant's records, or never."""
        with self._mu:
            live: list[tuple[int, _PutJob, ChunkRecord]] = []
            late: list[_PutJob] = []
            for n, job, rec in recs:
                if self._load_gens.current(job.tenant) == job.generation:
                    live.append((n, job, rec))
                else:
                    late.append(job)
            # Turn the reservations into usage in one step: used + reserved
            # neither dips (letting another writer in) nor double counts.
            inserted = self.index.put_each([rec for _n, _j, rec in live]) if live else []
            for (n, job, _rec), new in zip(live, inserted, strict=True):
                if new:
                    self._used += job.size
                    job.res._commit_locked()
                    out[n] = True
            if self._shared is not None:
                self._shared.persist_locked()  # counted with their records
        for (_n, _job, rec), new in zip(live, inserted, strict=True):
            self.counters.puts += 1
            self.counters.bytes_in += rec.payload
            if new:
                self._journal_stored(rec)
        return late

    @staticmethod
    def _cancelled_puts(cancelled: Sequence[bytes], out: list[bool]) -> list[bool]:
        """``out``, unless a chunk of the batch was purged or revoked while it was
        written (its file removed, never indexed): then :class:`PutCancelled`, and
        the caller asks the index which chunks of the batch are stored."""
        if cancelled:
            raise PutCancelled(
                f"{len(cancelled)} chunk(s), first {cancelled[0].hex()[:16]}: purged or "
                "revoked while written; discarded"
            )
        return out

    def _record(self, tenant: str, key: bytes) -> ChunkRecord | None:
        if self._writes.purging(tenant):
            return None  # its key is gone and its records are going (purges.py)
        rec = self.index.get(tenant, key)
        if rec is None and self.config.probe_files_on_miss and self._adopt(tenant, key):
            rec = self.index.get(tenant, key)
        if rec is not None and self._is_expired(rec, time.time_ns()):
            self._drop_quietly(tenant, key, "expired")
            return None
        return rec

    def _drop_quietly(
        self, tenant: str, key: bytes, reason: str, *, remove_file: bool = True
    ) -> None:
        """Bookkeeping on the read path (an expired entry): never fails the read."""
        try:
            self._drop(tenant, key, reason=reason, remove_file=remove_file)
        except Exception as exc:
            log.warning("chunk %s (%s): dropping it failed: %s", key.hex()[:16], reason, exc)

    @boundary
    def lookup(self, tenant: str, keys: Sequence[bytes]) -> int:
        """How many leading keys are present (per the index, plus files on a miss).
        None of a tenant being purged: its key is gone and its records are going."""
        if self._writes.purging(tenant):
            return 0
        now = time.time_ns()
        created_after, accessed_after = self._cutoffs(tenant, now)
        n = self.index.lookup(
            tenant, keys, now, created_after_ns=created_after, accessed_after_ns=accessed_after
        )
        # The prefix ends at an absent or expired key; an absent one may be another
        # node's object (shared FS): adopt it and go on, which costs a stat per miss.
        while n < len(keys):
            rec = self.index.get(tenant, keys[n])
            if rec is not None:  # present but expired (or saved since the lookup began)
                if self._is_expired(rec, now):
                    self._drop_quietly(tenant, keys[n], "expired")
                return n
            if not (self.config.probe_files_on_miss and self._adopt(tenant, keys[n])):
                return n
            # An adopted chunk past its limits ends the prefix here, and goes next round.
            n += self.index.lookup(
                tenant, keys[n:], now,
                created_after_ns=created_after, accessed_after_ns=accessed_after,
            )  # fmt: skip
        return n

    @boundary
    def lookup_cached(self, tenant: str, keys: Sequence[bytes]) -> int | None:
        """:meth:`lookup` from the index alone, or None where that needs the disk
        (a miss that may be another node's file, or an expired entry to drop)."""
        if self._writes.purging(tenant):
            return 0
        now = time.time_ns()
        created_after, accessed_after = self._cutoffs(tenant, now)
        n = self.index.lookup(
            tenant, keys, now, created_after_ns=created_after, accessed_after_ns=accessed_after
        )
        if n == len(keys):
            return n
        if self.config.probe_files_on_miss or self.index.get(tenant, keys[n]) is not None:
            return None
        return n

    @boundary
    def contains(self, tenant: str, key: bytes) -> bool:
        return self.lookup(tenant, [key]) == 1

    @boundary
    def payload_info(self, tenant: str, key: bytes) -> ChunkRecord | None:
        """Index record of a chunk (sizes, layers), no data I/O."""
        return self._record(tenant, key)

    @boundary
    def get_into(self, tenant: str, key: bytes, out: memoryview) -> list[int] | None:
        """Verify the chunk and write its layers, packed, into ``out``.

        Returns the per-layer lengths, or None (a miss) if the chunk is absent
        or fails any check; then ``out`` holds garbage and the entry is dropped.
        """
        guard = self._load_gens.guard(tenant)
        rec = self._record(tenant, key)
        if rec is None:
            self.counters.misses += 1
            return None
        return self._load_one(tenant, rec, out, guard)

    @boundary
    def get_many_into(
        self,
        tenant: str,
        keys: Sequence[bytes],
        outs: Sequence[memoryview],
        *,
        stop_at_miss: bool = True,
    ) -> list[list[int] | None]:
        """:meth:`get_into` for several chunks, up to :attr:`io_streams` of them
        read, verified and decrypted at once, each on a pool thread straight into
        its ``outs[i]``. Per chunk: its layer lengths, or None (a miss).

        With ``stop_at_miss`` (the default: a prefix cache has no use for the
        chunks after a hole) every chunk after the first miss is None: none is
        started after it is known, and those already in flight (at most
        ``io_streams - 1``) are waited for and disowned (``outs`` of a None
        chunk hold garbage, as ever; a chunk that fails its checks there is
        dropped as any failed read is).
        """
        if len(outs) != len(keys):
            raise ValueError("one output buffer per key")
        if len(keys) < 2:
            return [self.get_into(tenant, k, o) for k, o in zip(keys, outs, strict=True)]
        guard = self._load_gens.guard(tenant)  # a purge or revocation from now on cancels
        return self._load_batch(
            tenant, len(keys), lambda i: self._record(tenant, keys[i]), outs, guard, stop_at_miss
        )

    def load_guard(self, tenant: str) -> Callable[[int], None]:
        """The cancel check of a load of ``tenant`` that starts now (cancel.py):
        take it before looking up the records :meth:`load_planned` is given, so
        a purge or revocation after the lookup still stops the load."""
        return self._load_gens.guard(tenant)

    @boundary
    def load_planned(
        self,
        tenant: str,
        recs: Sequence[ChunkRecord],
        outs: Sequence[memoryview],
        guard: Callable[[int], None],
        on_chunk: Callable[[int, list[int]], None] | None = None,
    ) -> list[list[int] | None]:
        """:meth:`get_many_into` of chunks whose index records the caller just
        looked up (``payload_info``, after :meth:`load_guard`): the same reads and
        checks, without a second index lookup per chunk. The object must still be
        the one its record describes, or the chunk is a miss.

        ``on_chunk(i, lengths)`` is called in order for each chunk of the leading
        verified prefix as soon as it is known (protocol-v1 §5.30: the caller
        hands it out while the later chunks are read); such a chunk is in the
        result whatever happens to the chunks after it."""
        if len(outs) != len(recs):
            raise ValueError("one output buffer per record")
        if len(recs) == 1:
            return [self._load_one(tenant, recs[0], outs[0], guard)]
        return self._load_batch(tenant, len(recs), recs.__getitem__, outs, guard, True, on_chunk)

    @boundary
    def payload_info_cached(self, tenant: str, key: bytes) -> tuple[bool, ChunkRecord | None]:
        """:meth:`payload_info` from the index alone: (True, the record or None),
        or (False, None) where the answer needs the disk (a miss that may be
        another node's file, or an expired entry to drop), which the caller then
        asks on a thread that may wait."""
        if self._writes.purging(tenant):
            return True, None
        rec = self.index.get(tenant, key)
        if rec is None:
            return (not self.config.probe_files_on_miss), None
        if self._is_expired(rec, time.time_ns()):
            return False, None
        return True, rec

    @boundary
    def load_planned_cached(
        self,
        tenant: str,
        recs: Sequence[ChunkRecord],
        outs: Sequence[memoryview],
        guard: Callable[[int], None],
    ) -> list[list[int] | None]:
        """:meth:`load_planned` of the leading chunks that need no wait on the
        device: small objects (under :data:`fileio.MAP_MIN_BYTES`) whose every byte
        is in the page cache, read with ``RWF_NOWAIT`` and verified in this thread
        exactly as on the pool. The result is shorter than ``recs`` where the next
        chunk would wait (large, cold, or a backend that does not map reads): the
        caller reads the rest the ordinary way. A miss ends it as ever (None)."""
        if len(outs) != len(recs):
            raise ValueError("one output buffer per record")
        results: list[list[int] | None] = []
        if not getattr(self.io, "map_reads", False) or may_wait_between_layers():
            return results
        for rec, out in zip(recs, outs, strict=True):
            if rec.size >= fileio.MAP_MIN_BYTES:
                break
            job = self._load_cached(tenant, rec, out, guard)
            if job is None:
                break
            got = job.value
            results.append(got)
            if got is None:
                break
        return results

    def _load_batch(
        self,
        tenant: str,
        n: int,
        record: Callable[[int], ChunkRecord | None],
        outs: Sequence[memoryview],
        guard: Callable[[int], None],
        stop_at_miss: bool,
        on_chunk: Callable[[int, list[int]], None] | None = None,
    ) -> list[list[int] | None]:
        """The loop of :meth:`get_many_into`: chunk ``i``'s record is ``record(i)``,
        asked in order. A small object is read and verified in this thread (a hop
        to a pool thread and back costs more than the work): at once where every
        byte of it is in the page cache, else in its turn, its device read
        started (readahead) when it joined the window, so that the reads of the
        window overlap on the device. A large object is read on the pool."""
        results: list[list[int] | None] = [None] * n
        pool = self._pipeline()
        streams = self.io_streams
        inline = getattr(self.io, "map_reads", False)
        # In order: (chunk index, its read+verify on the pool or here). The index
        # is consulted here, in order; each chunk is read, verified and decrypted
        # on a pool thread (or here), straight into its own ``outs[i]``.
        window: deque[tuple[int, Future[list[int] | None] | _Done | _Deferred]] = deque()
        nxt = 0
        missed = False
        try:
            while True:
                while not missed and nxt < n and len(window) < streams:
                    try:
                        rec = record(nxt)
                    except Exception as exc:
                        if nxt == 0:
                            raise
                        # A failing index after chunk 0: a miss here, never the loss
                        # of the chunks already verified (layout-v1.md §5).
                        log.warning("chunk %d: looking it up failed: %s", nxt, exc)
                        rec = None
                    if rec is None:
                        self.counters.misses += 1
                        missed = stop_at_miss
                    else:
                        job: Future[list[int] | None] | _Done | _Deferred | None = None
                        if inline and rec.size < fileio.MAP_MIN_BYTES:
                            # Cached: read here and now. Not cached: its read is
                            # started (readahead) and it is read here in its turn,
                            # the device working on the next ones meanwhile: a hop
                            # to a pool thread and back costs more than a small
                            # object's whole read and check.
                            job = self._load_cached(tenant, rec, outs[nxt], guard, prefetch=True)
                            if job is None:
                                job = _Deferred(self._load_one, tenant, rec, outs[nxt], guard)
                        if job is None:
                            job = pool.submit(self._load_one, tenant, rec, outs[nxt], guard)
                        window.append((nxt, job))
                    nxt += 1
                if not window:
                    break
                i, fut = window.popleft()
                got = results[i] = fut.result()
                if got is None:
                    if stop_at_miss:
                        missed = True
                        break
                elif on_chunk is not None:
                    on_chunk(i, got)
        finally:
            for i, fut in window:  # read past a miss (or an error): wait, then disown
                if isinstance(fut, _Deferred):
                    continue  # never read: nothing to disown
                try:
                    lengths = fut.result()
                except Exception as exc:
                    log.warning("get_many_into: read of a chunk past a miss failed: %s", exc)
                    continue
                if lengths is not None and missed:
                    # Verified, but after the hole: not handed out, so not a hit.
                    self.counters.hits -= 1
                    self.counters.bytes_out -= sum(lengths)
                results[i] = None
        return results

    def _load_cached(
        self,
        tenant: str,
        rec: ChunkRecord,
        out: memoryview,
        guard: Callable[[int], None],
        *,
        prefetch: bool = False,
    ) -> _Done | None:
        """:meth:`_load_one` in this thread, as a finished result, if the whole
        object is in the page cache (no wait on the device); None otherwise, and
        then the caller reads it the ordinary way (with ``prefetch``, its read
        from the device is already under way: :func:`fileio.read_cached`)."""
        key = rec.chunk_key
        try:
            buf = fileio.read_cached(
                self._path_str(tenant, key), self._scratch.get, MAX_OBJECT_BYTES, prefetch=prefetch
            )
        except Exception as exc:  # every failure of a damaged file is a miss (§5)
            self._read_failed(tenant, key, exc)
            buf = None
            got: list[int] | None = None
        else:
            if buf is None:
                return None
            got = self._open_into(tenant, key, rec, buf, out, guard)
        return _Done(got)

    def _load_one(
        self,
        tenant: str,
        rec: ChunkRecord,
        out: memoryview,
        guard: Callable[[int], None] | None = None,
    ) -> list[int] | None:
        """:meth:`get_into` of an indexed chunk (on a pool thread for a batch): from
        its image in the RAM tier where it has one (:meth:`_load_image`); else a
        large object mostly not in the page cache read whole with O_DIRECT where
        the backend asks for it (:func:`fileio.read_uncached`); else one layer
        slot at a time where reads go through the page cache of a local file
        system (:func:`fileio.streamed_object`); else read whole into the
        thread's scratch buffer. Its layer lengths, or None (a miss, handled)."""
        key = rec.chunk_key
        spath = self._path_str(tenant, key)
        ram = self._ram
        if ram is not None and ram.admits(rec.size):
            got = self._load_image(ram, tenant, rec, spath, out, guard)
            if not isinstance(got, _NoImage):
                return got
        path = Path(spath)
        try:
            direct_min = getattr(self.io, "direct_read_min", 0)
            if direct_min and rec.size >= direct_min:
                got = self._load_uncached(tenant, rec, spath, out, guard, direct_min)
                if not isinstance(got, _NoImage):
                    return got
            if getattr(self.io, "map_reads", False):
                # Layer by layer through the page cache, each slot verified and
                # decrypted into ``out`` while it is in the CPU cache.
                with fileio.streamed_object(path, MAX_OBJECT_BYTES) as reader:
                    if reader is not None:
                        return self._open_into(tenant, key, rec, reader, out, guard)
            buf = self.io.read_object(path, self._scratch.get, MAX_OBJECT_BYTES)
        except Exception as exc:  # every failure of a damaged file is a miss (§5)
            self._read_failed(tenant, key, exc)
            return None
        return self._open_into(tenant, key, rec, buf, out, guard)

    def _load_image(
        self,
        ram: RamTier,
        tenant: str,
        rec: ChunkRecord,
        path: str,
        out: memoryview,
        guard: Callable[[int], None] | None,
    ) -> list[int] | _NoImage | None:
        """The chunk from its RAM image, verified and decrypted as a read of its
        file would be; :data:`_NO_IMAGE` where there is none (or it failed its
        checks, and is dropped): then the caller reads the file."""
        key = rec.chunk_key
        img = ram.pinned(tenant, key, path)
        if img is None:
            return _NO_IMAGE
        try:
            return self._open_into(tenant, key, rec, img.data, out, guard, image=True)
        except _ImageFailed as exc:
            log.warning("chunk %s of %s: its RAM image %s; reading the file", key.hex()[:16],
                        tenant, exc.__cause__)  # fmt: skip
            ram.failed(img)
            return _NO_IMAGE
        finally:
            ram.unpin(img)

    def _load_uncached(
        self,
        tenant: str,
        rec: ChunkRecord,
        path: str,
        out: memoryview,
        guard: Callable[[int], None] | None,
        direct_min: int,
    ) -> list[int] | _NoImage | None:
        """:meth:`_load_one` of a large object mostly not in the page cache: read
        whole with O_DIRECT (:func:`fileio.read_uncached`), into a buffer of the
        RAM tier where one is ready (the image is then kept). :data:`_NO_IMAGE`
        where it was not read so (cached, or O_DIRECT refused): the caller reads
        it through the page cache. OSError as a read raises it."""
        key = rec.chunk_key
        ram = self._ram
        slot: Slot | None = None
        gen = self._load_gens.current(tenant)
        got: list[int] | None = None

        def alloc(n: int) -> memoryview:  # asked only once it is to be read so
            nonlocal slot
            slot = ram.lend(rec.size) if ram is not None else None
            return self._scratch.get(n) if slot is None else slot.alloc(n)

        try:
            buf = fileio.read_uncached(
                path, alloc, MAX_OBJECT_BYTES, direct_min, parts=self._part_reader()
            )
            if buf is not None:
                got = self._open_into(tenant, key, rec, buf, out, guard)
                return got
        finally:
            if slot is not None and ram is not None:
                self._settle(ram, slot, tenant, key, rec.size, path, got is not None, gen)
        return _NO_IMAGE

    def _settle(
        self, ram: RamTier, slot: Slot, tenant: str, key: bytes, size: int, path: str,
        verified: bool, generation: int,
    ) -> None:  # fmt: skip
        """A tier buffer after its read or save: kept as the chunk's image if the
        object in it was written or verified and no purge or revocation of the
        tenant began since ``generation`` (asked under the tier's lock); else
        given back."""
        if not verified:
            ram.give_back(slot)
            return

        def still() -> bool:
            return self._load_gens.current(tenant) == generation

        ram.keep(tenant, key, slot, size, path, still)

    def _open_into(
        self,
        tenant: str,
        key: bytes,
        rec: ChunkRecord,
        buf: memoryview | fileio.ObjectReader,
        out: memoryview,
        guard: Callable[[int], None] | None = None,
        *,
        image: bool = False,
    ) -> list[int] | None:
        """Verify and decrypt a read object (or one read layer by layer) into
        ``out``; None (and the entry dropped) if bad.

        The object must also be the one the index describes (size, layers,
        payload, key epoch): anything else is a relabelled or foreign object.
        Every exception here is a miss of this chunk alone (layout-v1.md §5).
        """
        try:
            tk = self.keyring.get(tenant) if rec.key_epoch else None
            if isinstance(buf, fileio.ObjectReader):
                h = v1.open_read_into(
                    buf.read_at,
                    buf.size,
                    _SLOTS.get,
                    out,
                    tenant=tenant,
                    namespace=rec.namespace,
                    chunk_key=key,
                    aead_for_epoch=self._aead_for(tenant, tk),
                    before_layer=guard,
                )
            else:
                h = v1.open_into(
                    buf,
                    out,
                    tenant=tenant,
                    namespace=rec.namespace,
                    chunk_key=key,
                    aead_for_epoch=self._aead_for(tenant, tk),
                    before_layer=guard,
                )
            if (h.total_size, len(h.layers), h.payload_size, h.key_epoch) != (
                rec.size, rec.num_layers, rec.payload, rec.key_epoch,
            ):  # fmt: skip
                raise _RecordMismatch("object differs from its index record (size or layers)")
        except LoadCancelled:
            # Purged or revoked while loading (cancel.py): a miss, the object untouched.
            self.counters.misses += 1
            return None
        except Exception as exc:
            if image:  # the RAM tier's failure, not the file's: the caller reads it
                raise _ImageFailed from exc
            if isinstance(exc, ObjectMismatch) and self._verifies_alone(tenant, key, rec, buf):
                # A whole, valid object that the index describes wrongly (a
                # damaged or stale record): the record goes, the object stays
                # and is indexed from its own header. This read is a miss.
                log.warning("chunk %s of %s: %s; re-indexed", key.hex()[:16], tenant, exc)
                self.counters.misses += 1
                self._drop_quietly(tenant, key, "record-mismatch", remove_file=False)
                with contextlib.suppress(Exception):
                    self._adopt(tenant, key)
                return None
            self._read_failed(tenant, key, exc)
            return None
        self._hit(tenant, key, h.payload_size)
        return [le.length for le in h.layers]

    def _verifies_alone(
        self, tenant: str, key: bytes, rec: ChunkRecord, buf: memoryview | fileio.ObjectReader
    ) -> bool:
        """Whether ``buf`` is a valid object of (tenant, key, the record's
        namespace) by its own header, whatever the index record says."""
        try:
            if isinstance(buf, fileio.ObjectReader):
                whole = memoryview(bytearray(buf.size))
                if buf.read_at(whole, 0) != buf.size:
                    return False
                buf = whole
            h = v1.decode_header(buf)
            tk = self.keyring.get(tenant) if h.sealed else None
            v1.open_into(
                buf,
                memoryview(bytearray(h.payload_size)),
                tenant=tenant,
                namespace=h.namespace,  # a damaged record may be what is wrong
                chunk_key=key,
                aead_for_epoch=self._aead_for(tenant, tk),
            )
            return True
        except Exception:
            return False

    def _existing_serves(self, job: _PutJob) -> bool:
        """Whether the object already at a new chunk's name verifies in full and is
        that chunk (namespace, layer lengths): only then is "exists" success."""
        try:
            buf = self.io.read_object(
                self._path(job.tenant, job.chunk_key),
                lambda n: memoryview(mmap.mmap(-1, v1.align_up(max(n, 1))))[:n],
                MAX_OBJECT_BYTES,
            )
            tk = self.keyring.get(job.tenant) if job.aead is not None else None
            h = v1.open_into(
                buf,
                memoryview(bytearray(sum(job.lengths))),
                tenant=job.tenant,
                namespace=job.namespace,
                chunk_key=job.chunk_key,
                aead_for_epoch=self._aead_for(job.tenant, tk),
            )
            return [le.length for le in h.layers] == job.lengths
        except FileNotFoundError:
            return False
        except Exception as exc:
            log.warning(
                "chunk %s of %s: the object at its name fails verification (%s); replacing it",
                job.chunk_key.hex()[:16], job.tenant, exc,
            )  # fmt: skip
            return False

    @boundary
    def get(self, tenant: str, key: bytes) -> list[bytes] | None:
        """Convenience: the verified layers as bytes, or None."""
        rec = self._record(tenant, key)
        if rec is None:
            self.counters.misses += 1
            return None
        out = bytearray(rec.payload)
        lengths = self.get_into(tenant, key, memoryview(out))
        if lengths is None:
            return None
        res, pos = [], 0
        for n in lengths:
            res.append(bytes(out[pos : pos + n]))
            pos += n
        return res

    @boundary
    def touch(self, tenant: str, keys: Sequence[bytes]) -> None:
        for k in keys:
            self._touch_later(tenant, k)  # the index ignores keys it does not hold


class _ImageFailed(Exception):
    """A RAM image that failed its checks (its cause): dropped, the file is read."""


class _NoImage:
    """Not served this way (no RAM image; not read with O_DIRECT): read the file
    the ordinary way."""


_NO_IMAGE = _NoImage()


class _RecordMismatch(ObjectMismatch):
    """A verified object whose header disagrees with its index record."""
