"""Saving chunks: put / put_many reserve capacity from the layer lengths, seal,
write and index.

``put_many`` runs a batch on the store's I/O streams (``StoreConfig.io_streams``,
default :func:`~.config.default_io_streams`): up to that many chunks are sealed
and written at once; ``os.pwrite``, AES-GCM and XXH3 release the GIL. The
calling thread reserves and indexes, in chunk order, so the results (and what
a failure leaves stored) are those of a one-at-a-time batch. A small batch
saved without fsync is written in the calling thread (:data:`PARALLEL_MIN_BYTES`).

Every chunk enters the index through :meth:`Writes.index_published` or the
batch commit of :meth:`Writes._finish_puts` (the capacity turns its
reservation into usage in the same step); both journal it on a shared root.
The writes own the set of tenants whose fan-out directories are made
(``_leaves_ready``) and, through :class:`~.keys.budget.NonceBudget`, the
nonce counts of each DEK epoch.
"""

from __future__ import annotations

import contextlib
import mmap
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import NamedTuple

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..errors import StoreError, StoreIOError
from ..layouts import v1
from ..layouts.objkey import derive_object_key
from . import files as fileio
from .api import ChunkRecord, Reservation
from .cancel import PutCancelled
from .capacity import Capacity
from .config import MAX_OBJECT_BYTES, PARALLEL_MIN_BYTES
from .files import Durability
from .keys.budget import NonceBudget
from .maintenance import Maintenance
from .removal import Removal
from .shared.journal import JournalRecord
from .state import StoreState, log

Layers = Sequence[memoryview | bytes | bytearray]


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


@dataclass
class _PutJob:
    """One chunk between reservation and index insert (put / put_many)."""

    tenant: str
    namespace: bytes
    chunk_key: bytes
    layers: Layers
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
    #: The epoch's DEK where the object is sealed under its own key (§3.3).
    dek: bytes | None = None


class _Batch(NamedTuple):
    """What every chunk of one put / put_many shares."""

    tenant: str
    namespace: bytes
    encrypt: bool
    ttl_s: float | None
    #: The tenant's load generation when the put or batch began (cancel.py).
    generation: int


def _object_aead(dek: bytes) -> v1.ObjectAead:
    """Seal under the object's own key (layout-v1.md §3.3), derived from ``dek``."""
    return lambda h: AESGCM(derive_object_key(dek, h))


class Writes:
    """put / put_many of one store (see the module docstring)."""

    def __init__(
        self,
        state: StoreState,
        capacity: Capacity,
        removal: Removal,
        maintenance: Maintenance,
    ) -> None:
        self._state = state
        self._capacity = capacity
        self._removal = removal
        self._maintenance = maintenance
        self._budget = NonceBudget(
            state.index,
            state.keyring,
            state.config.max_segments_per_epoch,
            shared=state.shared is not None,
        )
        #: Tenants whose fan-out directories this process has made sure of.
        self._leaves_ready: set[str] = set()

    def put(
        self,
        tenant: str,
        namespace: bytes,
        chunk_key: bytes,
        layers: Layers,
        *,
        encrypt: bool = True,
        ttl_s: float | None = None,
        reservation: Reservation | None = None,
    ) -> bool:
        """Store one chunk. True if written, False if it was already present.
        :class:`PutCancelled` if its tenant is purged (or revoked) meanwhile."""
        with self._open_writes(tenant, [reservation]) as generation:
            self.ensure_leaves(tenant)
            batch = _Batch(tenant, namespace, encrypt, ttl_s, generation)
            job = self._begin_put(batch, chunk_key, layers, reservation)
            if job is None:
                return False
            return self._finish_puts([(0, job, self._seal_and_write(job))])[0]

    @contextlib.contextmanager
    def _open_writes(self, tenant: str, held: Sequence[Reservation | None]) -> Iterator[int]:
        """One put or batch of ``tenant`` (cancel.TenantWrites): its load
        generation, or :class:`PutCancelled` while a purge of the tenant runs,
        and at its end if one began meanwhile (even a chunk found already there
        is then being purged); cancelled, the reservations ``held`` are released."""
        st = self._state
        try:
            with st.tenant_writes.writing(tenant) as generation:
                yield generation
                if st.load_gens.current(tenant) != generation:
                    raise PutCancelled(f"tenant {tenant!r} purged or revoked while saved")
        except PutCancelled:
            for r in held:
                if r is not None:
                    r.release()
            raise

    def put_many(
        self,
        tenant: str,
        namespace: bytes,
        chunks: Sequence[tuple[bytes, Layers]],
        *,
        encrypt: bool = True,
        ttl_s: float | None = None,
        reservations: Sequence[Reservation | None] | None = None,
    ) -> list[bool]:
        """Store several chunks ``(chunk_key, layers)``, sealing and writing up to
        ``io_streams`` of them at once. Per chunk: True if written, False if
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
            batch = _Batch(tenant, namespace, encrypt, ttl_s, generation)
            return self._put_batch(batch, chunks, held)

    def _put_batch(
        self,
        batch: _Batch,
        chunks: Sequence[tuple[bytes, Layers]],
        held: Sequence[Reservation | None],
    ) -> list[bool]:
        """:meth:`put_many` once the tenant's writes are open."""
        self.ensure_leaves(batch.tenant)
        # Chunks written (or found on disk), in chunk order, waiting for their
        # index records: the whole batch commits in one index transaction, after
        # every object of it is written (and fsync'd, at durability object).
        done: list[tuple[int, _PutJob, bool]] = []
        try:
            if len(chunks) < 2 or (
                self._state.config.durability is not Durability.OBJECT
                and _small(sum(memoryview(x).nbytes for _k, ls in chunks for x in ls))
            ):
                self._write_in_turn(batch, chunks, held, done)
            else:
                self._write_on_streams(batch, chunks, held, done)
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
        batch: _Batch,
        chunks: Sequence[tuple[bytes, Layers]],
        held: Sequence[Reservation | None],
        done: list[tuple[int, _PutJob, bool]],
    ) -> None:
        """Seal and write the chunks one after the other in this thread; ``done``
        gets each chunk written, for :meth:`_finish_puts`."""
        seen: set[bytes] = set()
        for i, (key, layers) in enumerate(chunks):
            if _repeated(key, seen, held[i]):
                continue
            job = self._begin_put(batch, key, layers, held[i])
            if job is None:
                continue
            done.append((i, job, self._seal_and_write(job)))

    def _write_on_streams(
        self,
        batch: _Batch,
        chunks: Sequence[tuple[bytes, Layers]],
        held: Sequence[Reservation | None],
        done: list[tuple[int, _PutJob, bool]],
    ) -> None:
        """Seal and write up to ``io_streams`` chunks at once on the pool;
        ``done`` gets each chunk written, in chunk order."""
        streams = self._state.streams
        pool = streams.executor()
        width = streams.streams
        # In order: (chunk index, job, its seal+write on the pool).
        window: deque[tuple[int, _PutJob, Future[bool]]] = deque()
        try:
            seen: set[bytes] = set()
            for i, (key, layers) in enumerate(chunks):
                if _repeated(key, seen, held[i]):
                    continue
                try:
                    job = self._begin_put(batch, key, layers, held[i])
                except BaseException:
                    while window:  # the chunks before this one are written
                        j, later, fut = window.popleft()
                        done.append((j, later, self._await_written(later, fut)))
                    raise
                if job is None:
                    continue
                window.append((i, job, pool.submit(self._seal_and_write, job)))
                while len(window) >= width:
                    j, first, fut = window.popleft()
                    done.append((j, first, self._await_written(first, fut)))
            while window:
                j, first, fut = window.popleft()
                done.append((j, first, self._await_written(first, fut)))
        finally:
            # An error: the writes still in flight are after the failing chunk.
            for _j, later, fut in window:
                self._discard_written(later, fut)

    def ensure_leaves(self, tenant: str) -> None:
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
        st = self._state
        if st.layout.fanout == v1.FANOUT_ONE_LEVEL:
            durable = st.config.durability is Durability.OBJECT
            try:
                fileio.make_fanout(st.root / "objects" / tenant, durable=durable)
            except OSError as exc:
                log.debug("tenant %s: making its directories ahead failed: %s", tenant, exc)
                return
        self._leaves_ready.add(tenant)

    def forget_leaves(self, tenant: str) -> None:
        """The tenant's object tree was removed (a purge): make it again on its next write."""
        self._leaves_ready.discard(tenant)

    def _seal_and_write(self, job: _PutJob) -> bool:
        """Seal into this thread's scratch buffer (a pool thread's, or the caller's
        for a batch written in turn) and write the file. True if written, False
        if the object was already on disk. Releases the reservation only on an
        error (the caller indexes and releases)."""
        st = self._state
        ram = st.ram
        slot = ram.lend(job.size) if ram is not None else None
        written = False
        try:
            # Sealed into a buffer of the RAM tier where one is ready: the image
            # written is then kept, and the next load of the chunk is warm.
            buf = slot.view[: job.size] if slot is not None else st.scratch.get(job.size)
            self._seal(job, buf)
            written = self._write_verified(job, buf)
            return written
        except BaseException:
            job.res.release()
            raise
        finally:
            if slot is not None and ram is not None:
                path = st.path_str(job.tenant, job.chunk_key)
                ram.settle(slot, job.tenant, job.chunk_key, job.size, path, written,
                           st.load_gens.unchanged(job.tenant, job.generation))  # fmt: skip

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
                self._removal.unpublish(job.tenant, job.chunk_key)
        except Exception as exc:
            log.warning("put_many: in-flight write failed too: %s", exc)
        finally:
            job.res.release()

    def _begin_put(
        self, batch: _Batch, chunk_key: bytes, layers: Layers, reservation: Reservation | None
    ) -> _PutJob | None:
        """Checks, capacity reservation and key for one chunk; None if already
        present. Its generation: the tenant's when its put or batch began."""
        st = self._state
        tenant, namespace, encrypt = batch.tenant, batch.namespace, batch.encrypt
        if len(chunk_key) != v1.KEY_SIZE or len(namespace) != v1.KEY_SIZE:
            raise ValueError("chunk key and namespace must be 32 bytes")
        lengths = [memoryview(x).nbytes for x in layers]
        have = st.index.get(tenant, chunk_key)
        if have is not None and st.is_expired(have, time.time_ns()):
            # Past its retention: a miss on every read, so a save writes it afresh.
            self._removal.drop(tenant, chunk_key, reason="expired")
            have = None
        if have is not None:
            if (have.num_layers, have.payload) == (len(lengths), sum(lengths)):
                st.counters.existed()
                if reservation is not None:
                    reservation.release()
                return None
            # Equal keys must mean equal content: a record of another shape is
            # wrong (or its object is), and this write replaces both (§4).
            self._removal.drop(tenant, chunk_key, reason="other-shape", remove_file=False)
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
            res = self._capacity.reserve(tenant, size)
        try:
            aead, epoch, dek = self._data_key(tenant, len(layers)) if encrypt else (None, 0, None)
            res.intend(chunk_key)  # a shared root's restart finds it if we crash
        except BaseException:
            res.release()
            raise
        return _PutJob(
            tenant, namespace, chunk_key, layers, lengths, size, res, aead, epoch, batch.ttl_s,
            time.time_ns(), batch.generation, dek if st.config.object_keys else None,
        )  # fmt: skip

    def _data_key(self, tenant: str, segments: int) -> tuple[AESGCM, int, bytes]:
        """The tenant's data key to seal ``segments`` layer segments under, its
        epoch and its bytes (for per-object keys): the tenant's keys made on its
        first save, the DEK rotated where the epoch's nonce budget is spent."""
        keyring = self._state.keyring
        tk = keyring.ensure_tenant(tenant)
        epoch = self._budget.draw(tenant, tk.current_epoch, segments)
        if epoch != tk.current_epoch:
            tk = keyring.ensure_tenant(tenant)
        aead = tk.aead(epoch)
        if aead is None:
            raise StoreError(f"tenant {tenant}: no data key for epoch {epoch}")
        return aead, epoch, tk.deks[epoch]

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
            object_aead=None if job.dek is None else _object_aead(job.dek),
        )

    def _write_verified(self, job: _PutJob, buf: memoryview) -> bool:
        """Write the object; True if written, False if a verifying one was there.

        "Exists" is success only for an object that verifies (layout §4): a
        damaged one leaves its name, and this write takes it. A chunk with a TTL
        has its expiry recorded first, where an index rebuild finds it (§4.2)."""
        st = self._state
        path = st.path(job.tenant, job.chunk_key)
        expires = job.now + int(job.ttl_s * 1e9) if job.ttl_s else 0
        if expires:
            self.retain(job.tenant, job.chunk_key, job.now, expires)
        written = st.io.write_object(path, buf, st.config.durability)
        if not written and not self._existing_serves(job):
            self._removal.quarantine(job.tenant, job.chunk_key, "publish")
            written = st.io.write_object(path, buf, st.config.durability)
        return written

    def _existing_serves(self, job: _PutJob) -> bool:
        """Whether the object already at a new chunk's name verifies in full and is
        that chunk (namespace, layer lengths): only then is "exists" success."""
        st = self._state
        try:
            buf = st.io.read_object(
                st.path(job.tenant, job.chunk_key),
                lambda n: memoryview(mmap.mmap(-1, v1.align_up(max(n, 1))))[:n],
                MAX_OBJECT_BYTES,
            )
            tk = st.keyring.get(job.tenant) if job.aead is not None else None
            h = v1.open_into(
                buf,
                memoryview(bytearray(sum(job.lengths))),
                tenant=job.tenant,
                namespace=job.namespace,
                chunk_key=job.chunk_key,
                aead_for_epoch=st.keyring.aead_for(job.tenant, tk),
                object_aead=st.keyring.object_aead_for(job.tenant, tk),
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

    def _finish_puts(self, done: Sequence[tuple[int, _PutJob, bool]]) -> list[bool]:
        """Index the written objects of a batch in one transaction (or adopt those
        another writer put there first); per entry, whether its record is new.
        Always releases every job's reservation.

        Every object is under its final name (and fsync'd, at durability
        object) before the transaction starts, so a crash in between leaves
        objects without records, which a rebuild adopts: never a record
        without its object.
        """
        st = self._state
        out = [False] * len(done)
        cancelled: list[bytes] = []
        recs: list[tuple[int, _PutJob, ChunkRecord]] = []
        try:
            for n, (_i, job, written) in enumerate(done):
                if not written:
                    # Another writer (another node on a shared FS) got there first.
                    if not self._adopt_existing(job):
                        cancelled.append(job.chunk_key)
                elif st.load_gens.current(job.tenant) != job.generation:
                    # Purged or revoked while being written: the object is not published.
                    self._removal.unpublish(job.tenant, job.chunk_key)
                    cancelled.append(job.chunk_key)
                else:
                    recs.append((n, job, _record_of(job)))
            if recs:
                cancelled += self._insert_batch(recs, out)
        finally:
            for _i, job, _w in done:
                job.res.release()
            self._capacity.persist_shared()
        if recs:
            self._capacity.after_write()
        return self._cancelled_puts(cancelled, out)

    def _adopt_existing(self, job: _PutJob) -> bool:
        """Index the object another writer put at the job's name; False if the
        tenant was purged or revoked since the job began (nothing indexed by it)."""
        gens = self._state.load_gens
        if gens.current(job.tenant) != job.generation:
            return False
        self._maintenance.adopt(job.tenant, job.chunk_key, generation=job.generation)
        self._state.counters.existed()
        return gens.current(job.tenant) == job.generation

    def _insert_batch(
        self, recs: Sequence[tuple[int, _PutJob, ChunkRecord]], out: list[bool]
    ) -> list[bytes]:
        """Insert the records in one transaction, ``out[n]`` True for each new one
        (the reservations turn into usage as they are indexed); the chunks whose
        tenant was purged or revoked since they began are left out, their files
        removed, and their keys returned. The generation is compared under the
        store's lock, where a purge bumps it (capacity.py ``admit``)."""
        st = self._state
        inserted = self._capacity.admit(
            [rec for _n, _j, rec in recs],
            [job.res for _n, job, _r in recs],
            [job.generation for _n, job, _r in recs],
        )
        late: list[bytes] = []
        for (n, job, rec), new in zip(recs, inserted, strict=True):
            if new is None:
                self._removal.unpublish(job.tenant, job.chunk_key)
                late.append(job.chunk_key)
                continue
            out[n] = new
            st.counters.stored(rec.payload)
            if new:
                self.journal_stored(rec)
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

    def index_published(
        self, rec: ChunkRecord, reservation: Reservation, generation: int | None = None
    ) -> bool | None:
        """Index an object published under its name by another path (a direct-path
        lease), its reservation turning into usage; whether its record is new
        (False: another writer indexed it meanwhile; None: its tenant was purged
        or revoked since ``generation``, nothing indexed)."""
        st = self._state
        inserted = self._capacity.admit_one(rec, reservation, generation)
        if inserted is None:
            return None
        if inserted:
            st.counters.stored(rec.payload)
            self.journal_stored(rec)
        else:
            st.counters.existed()
        return inserted

    def journal_stored(self, rec: ChunkRecord, grant_epoch: int | None = None) -> None:
        """Tell the other nodes of a shared root about a chunk this node published
        (under the grant epoch it knows now, unless told which)."""
        shared = self._state.shared
        if shared is not None:
            shared.journal(
                [
                    JournalRecord.store(
                        rec.tenant,
                        rec.chunk_key,
                        rec.namespace,
                        rec.size,
                        payload=rec.payload,
                        key_epoch=rec.key_epoch,
                        num_layers=rec.num_layers,
                        expires_ns=rec.expires_ns,
                        time_ns=rec.created_ns,
                        grant_epoch=(shared.view_epoch if grant_epoch is None else grant_epoch),
                    )
                ]
            )

    def retain(self, tenant: str, key: bytes, created_ns: int, expires_ns: int) -> None:
        """Record a chunk's expiry where an index rebuild finds it (layout-v1.md
        §4.2), before its object is written."""
        st = self._state
        try:
            st.retention.record(
                tenant, key, created_ns, expires_ns,
                durable=st.config.durability is Durability.OBJECT,
            )  # fmt: skip
        except OSError as exc:
            raise StoreIOError(
                f"recording the retention of a chunk failed: {exc}", exc.errno
            ) from exc


def _record_of(job: _PutJob) -> ChunkRecord:
    """The index record of a written chunk."""
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


__all__ = ["Writes"]
