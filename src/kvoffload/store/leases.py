"""The direct path (docs/spec/layout-v1.md §4.1): a worker writes or reads a
plaintext object itself. The store leases the temp file and its reservation,
checks and publishes what the worker wrote (indexed as any save is,
writes.py), and hands out header-checked read leases; a reader's checksum
complaint is verified here before anything is dropped.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence

from ..errors import LeaseInvalid
from ..layouts import CorruptObject, LayoutError, v1
from . import files as fileio
from . import leasefiles
from .api import ChunkRecord, ReadLease, SealedLease, StoreLease
from .cancel import PutCancelled
from .capacity import Capacity
from .config import MAX_OBJECT_BYTES
from .files import Durability, read_prefix
from .reads import Reads
from .removal import Removal
from .state import StoreState
from .writes import Writes


class Leases:
    """The direct path's leases of one store (see the module docstring)."""

    def __init__(
        self,
        state: StoreState,
        capacity: Capacity,
        removal: Removal,
        reads: Reads,
        writes: Writes,
    ) -> None:
        self._state = state
        self._capacity = capacity
        self._removal = removal
        self._reads = reads
        self._writes = writes

    def lease_store(
        self,
        tenant: str,
        namespace: bytes,
        chunk_key: bytes,
        lengths: Sequence[int],
        *,
        ttl_s: float | None = None,
        gid: int | None = None,
        quota: int | None = None,
    ) -> StoreLease | None:
        """Reserve space and create the temp file a worker will fill (layout-v1.md §4.1).

        None if the chunk is already stored. ``gid``: the tenant's
        ``direct_group``, which gets the tenant's object tree shared with it.
        Raises StoreFull, or StoreIOError (a full disk: before any byte moves).
        """
        if len(chunk_key) != v1.KEY_SIZE or len(namespace) != v1.KEY_SIZE:
            raise ValueError("chunk key and namespace must be 32 bytes")
        if not 1 <= len(lengths) <= v1.MAX_LAYERS or any(n < 1 for n in lengths):
            raise ValueError(f"1..{v1.MAX_LAYERS} layers of at least one byte expected")
        if not v1.shape_ok(lengths, False):
            raise ValueError("padding would exceed the bound of layout-v1.md §3.2")
        have = self._state.index.get(tenant, chunk_key)
        if have is not None and self._state.is_expired(have, time.time_ns()):
            self._removal.drop(tenant, chunk_key, reason="expired")  # a save writes it afresh
            have = None
        if have is not None:
            self._state.counters.existed()
            return None
        size = v1.object_size(lengths, False)
        generation = self._state.load_gens.current(tenant)
        res = self._capacity.reserve(tenant, size, quota=quota)
        final = self._state.path(tenant, chunk_key)
        try:
            res.intend(chunk_key)  # a shared root's restart finds it if we crash
            tmp = leasefiles.create_lease_file(
                final,
                size,
                durable_dirs=self._state.config.durability is Durability.OBJECT,
                gid=gid,
                share_top=self._state.root / "objects" / tenant if gid is not None else None,
            )
        except BaseException:
            res.release()
            raise
        return StoreLease(
            tenant, namespace, chunk_key, tuple(lengths), size, tmp, final, res, ttl_s, generation
        )  # fmt: skip

    def cancel_lease(self, lease: StoreLease) -> None:
        """Drop a lease: its temp file and its reservation (idempotent)."""
        with contextlib.suppress(FileNotFoundError):
            lease.tmp.unlink()
        lease.reservation.release()
        self._capacity.persist_shared()

    def publish_lease(self, lease: StoreLease) -> bool:
        """Check the worker's object and give it its name; True once stored.

        Raises :class:`LeaseInvalid` (the object failed a check: it is
        deleted, nothing is indexed) or StoreIOError. Always ends the lease.
        """
        try:
            with self._state.tenant_writes.writing(lease.tenant):
                self._publish(lease)
        except PutCancelled as exc:  # a purge of the tenant is running
            raise LeaseInvalid(f"chunk {lease.chunk_key.hex()[:16]}: {exc}") from None
        finally:
            self.cancel_lease(lease)  # a no-op for the file once it has its name
        self._capacity.after_write()
        return True

    def _publish(self, lease: StoreLease) -> None:
        """:meth:`publish_lease` with the tenant's writes open."""
        if self._state.load_gens.current(lease.tenant) != lease.generation:
            # Purged or revoked since the lease: the worker's file is not published.
            raise LeaseInvalid(
                f"chunk {lease.chunk_key.hex()[:16]}: tenant purged or revoked while leased"
            )
        try:
            fd = leasefiles.open_lease_file(lease.tmp, lease.size)
        except OSError as exc:
            raise LeaseInvalid(f"leased file unusable: {exc}") from exc
        try:
            buf = self._state.scratch.get(lease.size)
            n = fileio.read_fd(fd, buf, lease.size)
            h = v1.verify_plain(
                buf[:n],
                tenant=lease.tenant,
                namespace=lease.namespace,
                chunk_key=lease.chunk_key,
            )
            if tuple(le.length for le in h.layers) != lease.lengths:
                raise CorruptObject("layer lengths differ from the lease")
        except (LayoutError, OSError) as exc:
            os.close(fd)
            self._state.counters.corrupted()
            raise LeaseInvalid(f"chunk {lease.chunk_key.hex()[:16]}: {exc}") from exc
        now = time.time_ns()
        expires = now + int(lease.ttl_s * 1e9) if lease.ttl_s else 0
        if expires:
            try:
                self._writes.retain(lease.tenant, lease.chunk_key, h.created_ns, expires)
            except BaseException:
                os.close(fd)
                raise
        leasefiles.publish_lease_file(lease.tmp, fd, lease.final, self._state.config.durability)
        rec = ChunkRecord(
            tenant=lease.tenant,
            chunk_key=lease.chunk_key,
            namespace=lease.namespace,
            key_epoch=0,
            size=lease.size,
            payload=h.payload_size,
            num_layers=len(h.layers),
            created_ns=h.created_ns,
            last_access_ns=now,
            expires_ns=expires,
        )
        # Compared where a purge bumps it: in before the purge looks, or never.
        if self._writes.index_published(rec, lease.reservation, lease.generation) is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lease.final)
            raise LeaseInvalid(
                f"chunk {lease.chunk_key.hex()[:16]}: tenant purged or revoked while published"
            )

    def lease_load(self, tenant: str, key: bytes) -> ReadLease | None:
        """Header-checked facts of a stored plaintext chunk for a worker to read itself.

        None (a miss, the entry dropped where the file is bad) if it is absent,
        expired, sealed, or its header, identity or size fail. The layer bytes
        are the reader's to verify against the header's checksums. The caller
        pins the key first.
        """
        rec = self._reads.record(tenant, key)
        if rec is None:
            self._state.counters.miss()
            return None
        if rec.key_epoch:
            return None  # sealed: only the sidecar reads it
        path = self._state.path(tenant, key)
        try:
            size = os.stat(path).st_size
            head = read_prefix(path, v1.header_length(rec.num_layers))
            h = v1.decode_header(head)
            if h.chunk_key != key or h.tenant != tenant or h.namespace != rec.namespace:
                raise CorruptObject("object belongs to another chunk key, tenant or namespace")
            if h.sealed or size != h.total_size:
                raise CorruptObject(f"object is {size} bytes or sealed, header says otherwise")
        except Exception as exc:  # every failure of a damaged file is a miss
            self._removal.read_failed(tenant, key, exc)
            return None
        self._reads.hit(tenant, key, h.payload_size)
        return ReadLease(path, size, h)

    def sealed_lease(self, tenant: str, key: bytes) -> SealedLease | None:
        """An open descriptor of a stored chunk and the key of that object alone,
        for a worker to verify and decrypt it itself (protocol-v1.md §5.32).

        None (a miss; the entry dropped where the file is bad) if it is absent,
        expired, its header, identity or size fail, or its tenant has no key
        (purged). A lease with ``fd`` None: stored, but sealed under the DEK
        itself (an older object), so only the store opens it. The caller pins
        the key first, and owns (closes) the descriptor.
        """
        # Read before the record: a purge or revocation that begins after this
        # line (it bumps the generation first) hands nothing out.
        gen = self._state.load_gens.current(tenant)
        rec = self._reads.record(tenant, key)
        if rec is None:
            self._state.counters.miss()
            return None
        path = self._state.path(tenant, key)
        fd = -1
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            size = os.fstat(fd).st_size
            h = v1.decode_header(os.pread(fd, v1.header_length(rec.num_layers), 0))
            if h.chunk_key != key or h.tenant != tenant or h.namespace != rec.namespace:
                raise CorruptObject("object belongs to another chunk key, tenant or namespace")
            if (size, len(h.layers), h.payload_size, h.key_epoch) != (
                rec.size, rec.num_layers, rec.payload, rec.key_epoch,
            ):  # fmt: skip
                raise CorruptObject("object differs from its index record (size or layers)")
            if h.sealed and not h.flags & v1.FLAG_OBJECT_KEY:
                os.close(fd)
                return SealedLease(None, size, b"", rec.namespace)
            okey = b""
            if h.sealed:
                got = self._state.keyring.object_key(tenant, self._state.keyring.get(tenant), h)
                if got is None:  # purged (or an unknown epoch): nothing to hand out
                    os.close(fd)
                    return None
                okey = got
        except Exception as exc:  # every failure of a damaged file is a miss
            if fd >= 0:
                os.close(fd)
            self._removal.read_failed(tenant, key, exc)
            return None
        if not self._state.load_gens.unchanged(tenant, gen)():
            os.close(fd)  # purged or revoked while it was opened: nothing handed out
            return None
        self._reads.hit(tenant, key, h.payload_size)
        return SealedLease(fd, size, okey, rec.namespace)

    def check_reported(self, tenant: str, key: bytes) -> bool:
        """A reader says the chunk failed its checksums: verify it fully here.

        True (and the chunk dropped) if it is corrupt; False if it verifies,
        so a confused or hostile reader cannot make the store delete good data.
        """
        rec = self._reads.record(tenant, key)
        if rec is None:
            return False
        try:
            buf = self._state.io.read_object(
                self._state.path(tenant, key), self._state.scratch.get, MAX_OBJECT_BYTES
            )
            if rec.key_epoch:  # handed by descriptor (§5.33): open it as a load would
                keyring = self._state.keyring
                tk = keyring.get(tenant)
                v1.open_into(
                    buf,
                    memoryview(bytearray(rec.payload)),
                    tenant=tenant,
                    namespace=rec.namespace,
                    chunk_key=key,
                    aead_for_epoch=keyring.aead_for(tenant, tk),
                    object_aead=keyring.object_aead_for(tenant, tk),
                )
            else:
                v1.verify_plain(buf, tenant=tenant, namespace=rec.namespace, chunk_key=key)
        except Exception as exc:
            self._removal.read_failed(tenant, key, exc)
            return True
        return False
