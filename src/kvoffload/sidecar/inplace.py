"""The in-place verbs of a connection (protocol-v1.md §5.34, revision 17).

A client registers a file of its own (vLLM's ``SharedOffloadRegion`` under
/dev/shm) with ``register_region``; ``region_store`` then seals chunks read
straight from that file, and ``region_load`` writes verified plaintext
straight into it, so the worker copies nothing through the staging buffer.

The file is never mapped (region.py): every access is one ``preadv`` /
``pwritev`` inside the registered size, so a peer that truncates its file
gets a short read (that chunk not stored), never a ``SIGBUS`` in the daemon.

Verify before use: ``region_load`` decrypts into a bounded scratch buffer of
the pool thread (at most :data:`SCRATCH_BYTES` of chunks at a time, or one
larger chunk alone), and only once a chunk's every layer was checked does one
``pwritev`` put it into the region. A torn, flipped or foreign object is a
miss, and no byte of it reaches the client's file. Store, copy for copy:
the sidecar reads the row into scratch (the worker's copy into staging is
gone) and seals from there; a load decrypts into scratch and writes the row
(the worker's copy out of staging is gone).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

from kvoffload.errors import Reject, StoreFull, TransferCancelled
from kvoffload.protocol import (
    MAX_REGIONS,
    ErrorCode,
    ErrorReply,
    Op,
    RegionDest,
    RegionLoad,
    RegionLoadReply,
    RegionStore,
    RegionStoreReply,
    RegisterRegion,
    RegisterRegionReply,
    Reply,
    close_fds,
    packed_layout,
)

from ..errors import RegionError
from .handles import Access, WriteHandle
from .ports import Guard
from .region import RegionFile
from .service import DECOY_TENANT, Service

if TYPE_CHECKING:
    from ..store import ChunkRecord, Reservation
    from .peer import Peer
    from .writes import Writes


#: The revision that brought these verbs (§5.34): a client that names it or a
#: later one in ``hello`` may register a region.
REGION_REVISION = 17


class RegionAccess(Access, Protocol):
    """What the in-place verbs ask of their connection's session (session.py)."""

    peer: Peer
    client_revision: int
    writes: Writes


log = logging.getLogger("kvoffload.server")

#: Largest region file a connection registers (announced as ``max_region``).
MAX_REGION_BYTES = 1 << 40
#: Scratch one in-place request holds at a time: chunks are read or verified
#: in groups up to this size (a larger chunk alone).
SCRATCH_BYTES = 32 << 20


class _Scratch(threading.local):
    def __init__(self) -> None:
        self.buf = bytearray()


_SCRATCH = _Scratch()


def _scratch(nbytes: int) -> memoryview:
    """This thread's reused scratch buffer, at least ``nbytes`` long."""
    if len(_SCRATCH.buf) < nbytes:
        _SCRATCH.buf = bytearray(nbytes)
    return memoryview(_SCRATCH.buf)[:nbytes]


def _groups(sizes: Sequence[int], limit: int) -> Iterator[range]:
    """Consecutive index ranges of ``sizes``, each summing to at most ``limit``
    (or a single larger entry)."""
    start, total = 0, 0
    for i, n in enumerate(sizes):
        if i > start and total + n > limit:
            yield range(start, i)
            start, total = i, 0
        total += n
    if start < len(sizes):
        yield range(start, len(sizes))


class Regions:
    """The region files of one connection and the verbs that address them."""

    def __init__(self, service: Service, session: RegionAccess) -> None:
        self.service = service
        self.session = session
        self._files: dict[int, RegionFile] = {}
        self._next = 1

    def __repr__(self) -> str:
        return repr(self.session)

    # -- registration ------------------------------------------------------------------

    def register(self, req: RegisterRegion, fds: list[int]) -> Reply:
        """§5.34: keep one descriptor of the peer's region file; every one not kept is
        closed. Refused for a client that did not say revision 17 in ``hello``."""
        op = Op.REGISTER_REGION.value
        problem = None
        if self.session.client_revision < REGION_REVISION:
            problem = (
                f"register_region needs a client of revision {REGION_REVISION} "
                f"(hello said {self.session.client_revision or 'none'})"
            )
        elif len(fds) != 1:
            problem = f"register_region takes exactly one fd, got {len(fds)}"
        elif len(self._files) >= MAX_REGIONS:
            problem = f"at most {MAX_REGIONS} regions per connection"
        if problem is not None:
            close_fds(fds)
            return ErrorReply(op, ErrorCode.BAD_REQUEST, problem)
        try:
            region = RegionFile.from_fd(
                fds[0], req.size, peer_uid=self.session.peer.uid, max_size=MAX_REGION_BYTES
            )
        except RegionError as exc:
            return ErrorReply(op, ErrorCode.BAD_REQUEST, str(exc))
        rid = self._next
        self._next += 1
        self._files[rid] = region
        return RegisterRegionReply(rid)

    def close(self) -> None:
        """§7: the connection closed: every region descriptor with it."""
        files, self._files = self._files, {}
        for f in files.values():
            f.close()

    def _span(self, region: int, offset: int, length: int, where: str) -> RegionFile:
        f = self._files.get(region)
        if f is None:
            raise Reject(ErrorCode.BAD_REQUEST, f"{where}: no region {region} on this connection")
        if offset + length > f.size:
            raise Reject(
                ErrorCode.BAD_REQUEST,
                f"{where}: range {offset}+{length} exceeds region {region} of {f.size} bytes",
            )
        return f

    # -- region_store ------------------------------------------------------------------

    def store(self, req: RegionStore) -> Reply:
        """§5.34: ``store`` (§5.21) with each chunk read from its region, sealed and
        written before the reply. Bounds are checked before anything else."""
        if self.service.draining:
            raise Reject(ErrorCode.SHUTTING_DOWN, "the sidecar is shutting down")
        files = [
            self._span(c.region, c.offset, c.payload, f"chunks[{i}]")
            for i, c in enumerate(req.chunks)
        ]
        s = self.session
        s.listed(req.tenant)
        if not s.may_use(req.tenant):
            raise Reject(
                ErrorCode.FORBIDDEN, f"this connection may not write tenant {req.tenant!r}"
            )
        if req.contract is not None:
            s.register_contract(req.tenant, req.namespace, req.contract)
        settings = self.service.policy.tenant(req.tenant)
        ttl_s = req.ttl_s if req.ttl_s is not None else settings.ttl_s
        store = self.service.store
        n = len(req.chunks)
        stored = [False] * n
        codes = [0] * n
        todo: list[int] = []
        for i, c in enumerate(req.chunks):
            if not store.shape_ok(c.layers, settings.encryption):
                codes[i] = int(ErrorCode.TOO_LARGE)
            elif store.lookup(req.tenant, [c.key]) == 1:
                stored[i] = True
            else:
                todo.append(i)
        h = WriteHandle(req.tenant, req.namespace, settings.encryption, ttl_s, (), [], [], 0.0)
        h.blocks = {i: c.blocks for i, c in enumerate(req.chunks) if c.blocks is not None}
        sizes = [req.chunks[i].payload for i in todo]
        for g in _groups(sizes, SCRATCH_BYTES):
            idx = [todo[j] for j in g]
            if self._store_group(req, h, files, idx, settings.quota_bytes, stored, codes):
                stored = [False] * n  # purged meanwhile: none of it stands
                codes = [int(ErrorCode.BUSY)] * n
                break
        for i in range(n):
            if not stored[i] and not codes[i]:
                codes[i] = int(ErrorCode.INTERNAL)
            elif stored[i]:
                codes[i] = 0
        written = [stored[i] and i in todo for i in range(n)]
        s.writes.record_blocks(
            h, written, {i: c.key for i, c in enumerate(req.chunks)}, completed=True
        )
        return RegionStoreReply(tuple(stored), tuple(codes))

    def _store_group(
        self,
        req: RegionStore,
        h: WriteHandle,
        files: list[RegionFile],
        idx: list[int],
        quota: int | None,
        stored: list[bool],
        codes: list[int],
    ) -> bool:
        """Reserve, read and seal the chunks ``idx``; True if a purge cancelled them."""
        store = self.service.store
        scratch = _scratch(sum(req.chunks[i].payload for i in idx))
        pos = 0
        batch: list[tuple[int, list[memoryview], Reservation]] = []
        try:
            for i in idx:
                c = req.chunks[i]
                try:
                    res = store.reserve_chunk(h.tenant, c.layers, encrypt=h.encrypt, quota=quota)
                except StoreFull:
                    codes[i] = int(ErrorCode.NO_SPACE)
                    continue
                offs, _ = packed_layout(c.layers)
                views = [
                    scratch[pos + lo : pos + lo + ln] for lo, ln in zip(offs, c.layers, strict=True)
                ]
                try:
                    files[i].read_into(c.offset, views)
                except RegionError as exc:
                    log.info("%r: chunk %d not stored: %s", self, i, exc)
                    codes[i] = int(ErrorCode.BAD_REQUEST)
                    res.release()
                    for v in views:
                        v.release()
                    continue
                pos += c.payload
                batch.append((i, views, res))
            if not batch:
                return False
            return self._put(req, h, batch, stored)
        finally:
            for _, views, res in batch:
                res.release()
                for v in views:
                    v.release()
            scratch.release()

    def _put(
        self,
        req: RegionStore,
        h: WriteHandle,
        batch: list[tuple[int, list[memoryview], Reservation]],
        stored: list[bool],
    ) -> bool:
        store = self.service.store
        try:
            with self.service.budget.hold(sum(req.chunks[i].payload for i, _, _ in batch)):
                store.put_many(
                    h.tenant,
                    h.namespace,
                    [(req.chunks[i].key, views) for i, views, _ in batch],
                    encrypt=h.encrypt,
                    ttl_s=h.ttl_s,
                    reservations=[res for _, _, res in batch],
                )
            for i, _, _ in batch:
                stored[i] = True
        except TransferCancelled as exc:
            log.info("%r: chunks not stored: %s", self, exc)
            return True
        except Exception as exc:
            if isinstance(exc, StoreFull):
                log.info("%r: chunks not stored: %s", self, exc)
            else:
                log.exception("%r: storing chunks failed", self)
            for i, _, _ in batch:
                stored[i] = store.payload_info(h.tenant, req.chunks[i].key) is not None
            return False
        self.service.inplace.add(
            stored_chunks=len(batch), stored_bytes=sum(req.chunks[i].payload for i, _, _ in batch)
        )
        return False

    # -- region_load -------------------------------------------------------------------

    def load(self, req: RegionLoad) -> Reply:
        """§5.34: verify the leading chunks and write each into its destination, in
        order; the prefix ends at the first that is not verified (nothing of it is
        written). A forbidden tenant does the empty tenant's work and loads 0."""
        if self.service.draining:
            raise Reject(ErrorCode.SHUTTING_DOWN, "the sidecar is shutting down")
        files = [
            self._span(d.region, d.offset, d.length, f"dests[{i}]") for i, d in enumerate(req.dests)
        ]
        s = self.session
        s.listed(req.tenant)
        allowed = s.may_use(req.tenant)
        tenant = req.tenant if allowed else DECOY_TENANT
        store = self.service.store
        guard = store.load_guard(tenant)
        loaded, stop = 0, ErrorCode.OK
        recs: list[ChunkRecord] = []
        for key, d in zip(req.keys, req.dests, strict=True):
            rec = store.payload_info(tenant, key)
            if rec is None or rec.payload != d.length:
                stop = ErrorCode.NOT_FOUND  # absent, or not a chunk of this shape
                break
            recs.append(rec)
        for g in _groups([r.payload for r in recs], SCRATCH_BYTES):
            done, why = self._load_group(tenant, req, files, recs, g, guard)
            loaded += done
            if why is not ErrorCode.OK:
                stop = why
                break
        if not allowed:
            return RegionLoadReply(0, int(ErrorCode.NOT_FOUND))
        if loaded:
            self.service.inplace.add(
                loaded_chunks=loaded, loaded_bytes=sum(d.length for d in req.dests[:loaded])
            )
        return RegionLoadReply(loaded, int(stop))

    def _load_group(
        self,
        tenant: str,
        req: RegionLoad,
        files: list[RegionFile],
        recs: list[ChunkRecord],
        g: range,
        guard: Guard,
    ) -> tuple[int, ErrorCode]:
        """Read and verify chunks ``g`` into scratch, then write the verified prefix;
        how many were written and why the group stopped early (OK: it did not)."""
        store = self.service.store
        keys = [req.keys[i] for i in g]
        sizes = [recs[i].payload for i in g]
        scratch = _scratch(sum(sizes))
        outs: list[memoryview] = []
        pos = 0
        for n in sizes:
            outs.append(scratch[pos : pos + n])
            pos += n
        store.pin(tenant, keys)  # eviction cannot remove a file under the read
        try:
            try:
                with self.service.budget.hold(sum(sizes)):
                    results = store.load_planned(tenant, [recs[i] for i in g], outs, guard)
            except Exception:
                log.exception("%r: reading chunks failed", self)
                return 0, ErrorCode.INTERNAL
            if tenant != DECOY_TENANT and not self.session.may_use(tenant):
                return 0, ErrorCode.NOT_FOUND  # revoked meanwhile: nothing leaves (§6.1)
            done = 0
            for j, i in enumerate(g):
                d: RegionDest = req.dests[i]
                if not results[j] or tuple(results[j] or ()) != d.layers:
                    return done, ErrorCode.NOT_FOUND  # not verified: nothing of it written
                try:
                    files[i].write_from(d.offset, [outs[j]])
                except RegionError as exc:
                    log.warning("%r: writing a loaded chunk failed: %s", self, exc)
                    return done, ErrorCode.INTERNAL
                done += 1
            return done, ErrorCode.OK
        finally:
            store.unpin(tenant, keys)
            for o in outs:
                o.release()
            scratch.release()


__all__ = ["MAX_REGION_BYTES", "SCRATCH_BYTES", "Regions"]
