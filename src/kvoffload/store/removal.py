"""The one way a chunk leaves the store, and where a damaged object goes.

:meth:`Removal.drop` takes a chunk out, in this order: its RAM image (no
load is served it from here on), its file, its index entry with a
``BlockRemoved`` event (under the feed's lock), its bytes from the
accounting (capacity.py), and, on a shared root, a journal record for the
other nodes. Evictions, expiries, deletes, purges, journaled removals and
failed reads all come through it.

A read that fails (layout-v1.md §5) is a miss: :meth:`Removal.read_failed`
drops the entry and, where the file itself failed verification, moves it
into ``<root>/quarantine/`` (kept for forensics, the newest
:data:`QUARANTINE_KEEP`) so that a re-save can replace it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time

from ..errors import StoreKeyError
from ..layouts import UnknownKeyEpoch, UnknownLayoutVersion, v1
from .api import TIER_INDEX, TIER_OBJECTS, TIER_RAM, PurgeReport
from .capacity import Capacity
from .keys.keyring import KeyringError
from .shared.journal import JournalRecord, Reason
from .shared.root import REMOVE_REASONS
from .state import StoreState, log

#: Objects that failed verification go here (below the store root), not away:
#: the newest QUARANTINE_KEEP are kept for forensics.
QUARANTINE_DIR = "quarantine"
QUARANTINE_KEEP = 64


class Removal:
    """Removing chunks from every place that holds them (see the module docstring)."""

    def __init__(self, state: StoreState, capacity: Capacity) -> None:
        self._state = state
        self._capacity = capacity
        self.quarantine_dir = state.root / QUARANTINE_DIR

    def drop(
        self,
        tenant: str,
        key: bytes,
        *,
        reason: str,
        remove_file: bool = True,
        lease_epoch: int = 0,
        tally: PurgeReport | None = None,
    ) -> bool:
        """Remove a chunk: its file (unless ``remove_file`` is false), its index
        entry and its bytes from the accounting; journaled on a shared root.
        ``lease_epoch``: for an eviction, the evictor lease epoch its fence
        allowed it under (the record names it even if the lease lapsed since).
        ``tally``: a purge's report, told of each tier this removal took
        something from (RAM image, file, index entry). Whether the index held it."""
        st = self._state
        # The file goes first and the accounting after: the other order lets a
        # concurrent writer spend the freed bytes while the old file still
        # occupies them, so the disk would briefly hold more than the limit.
        # Its RAM image goes before either: no load is served it from here on.
        if st.ram is not None:
            imaged = st.ram.discard(tenant, key)
            if tally is not None:
                tally.reach(TIER_RAM, imaged)
        if remove_file:
            try:
                st.path(tenant, key).unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("removing %s (%s): %s", key.hex()[:16], reason, exc)
                return False
            else:
                if tally is not None:
                    tally.reach(TIER_OBJECTS, 1)
        hook = st.events_hook
        if hook is None:
            rec = st.index.remove(tenant, key)
        else:
            # Under the feed's lock: a snapshot sees the chunk and its hashes
            # either with their BlockStored or gone with their BlockRemoved.
            with hook.lock:
                blob = st.index.get_blocks(tenant, key)
                rec = st.index.remove(tenant, key)
                if rec is not None and blob is not None:
                    hook.removed(tenant, blob, reason)
        if rec is None:
            return False
        if tally is not None:
            tally.reach(TIER_INDEX, 1)
        self._capacity.removed(rec.size)
        if remove_file and st.shared is not None:
            jr = REMOVE_REASONS.get(reason)
            if jr is not None:
                epoch = 0
                if jr is Reason.EVICTED:
                    held = st.shared.lease.held
                    epoch = lease_epoch or (held.epoch if held is not None else 0)
                st.shared.journal([JournalRecord.remove(tenant, key, jr, lease_epoch=epoch)])
        return True

    def drop_quietly(
        self, tenant: str, key: bytes, reason: str, *, remove_file: bool = True
    ) -> None:
        """Bookkeeping on the read path (an expired entry): never fails the read."""
        try:
            self.drop(tenant, key, reason=reason, remove_file=remove_file)
        except Exception as exc:
            log.warning("chunk %s (%s): dropping it failed: %s", key.hex()[:16], reason, exc)

    def unpublish(self, tenant: str, key: bytes) -> None:
        """A written object that will not be indexed (a failed batch's, a purged
        tenant's): its RAM image, then its file."""
        st = self._state
        if st.ram is not None:
            st.ram.discard(tenant, key)
        with contextlib.suppress(FileNotFoundError):
            st.path(tenant, key).unlink()

    def stop_tenant(self, tenant: str) -> int:
        """A purge or revocation of ``tenant``: its loads in flight stop before
        their next layer (cancel.py), then its RAM images go; in that order, no
        load of it keeps an image again (ramtier.py, ``still``). The bump is
        under the store's lock, where a write's index insert compares it
        (capacity.py ``admit``). The number of images dropped."""
        st = self._state
        with st.mu:
            st.load_gens.cancel(tenant)
        return st.ram.drop_tenant(tenant) if st.ram is not None else 0

    # ------------------------------------------------------------ failed reads

    def read_failed(self, tenant: str, key: bytes, exc: BaseException) -> None:
        """A chunk that cannot be read or verified: a miss (layout-v1.md §5).

        Its index entry is dropped and, where the file itself failed
        verification, the file leaves its name (quarantined) so that a re-save
        can replace it. Not for an unknown version whose header checksum holds
        (a newer kvoffload's object: left in place), nor for a key file that
        cannot be read (the tenant's problem, not the object's: nothing dropped).
        Every exception a damaged file can raise comes here; none escapes.
        """
        if isinstance(exc, KeyringError | StoreKeyError):
            log.warning("chunk %s of %s: the tenant's keys: %s", key.hex()[:16], tenant, exc)
            self._state.counters.miss()
        elif isinstance(exc, UnknownLayoutVersion):
            log.warning("chunk %s: %s", key.hex()[:16], exc)
            self.miss(tenant, key, "unknown-version", remove_file=False)
        elif isinstance(exc, UnknownKeyEpoch):
            # Maybe only newer than the key file this node can see yet (a shared
            # root's client caches): never quarantine a possibly valid object.
            log.info("chunk %s of %s: %s", key.hex()[:16], tenant, exc)
            self.miss(tenant, key, "unknown-key-epoch", remove_file=False)
        elif isinstance(exc, OSError):
            # ENOENT (evicted/deleted elsewhere), ESTALE (NFS), EIO: all misses.
            log.info("chunk %s unreadable: %s", key.hex()[:16], exc)
            self.miss(tenant, key, errno.errorcode.get(exc.errno or 0, "oserror"), False)
        else:
            log.warning("chunk %s of %s failed verification: %s", key.hex()[:16], tenant, exc)
            self._state.counters.corrupted()
            self.miss(tenant, key, "corrupt", remove_file=True)

    def miss(self, tenant: str, key: bytes, reason: str, remove_file: bool) -> None:
        """Count a miss and drop the chunk's entry (quarantining its file first
        with ``remove_file``); a failing index makes it only a miss."""
        self._state.counters.miss()
        try:
            if remove_file:
                self.quarantine(tenant, key, reason)
            self.drop(tenant, key, reason=reason, remove_file=False)
        except Exception as exc:  # a full or failing index: still only a miss
            log.warning("chunk %s (%s): dropping its entry failed: %s", key.hex()[:16], reason, exc)

    # -------------------------------------------------------------- quarantine

    def quarantine(self, tenant: str, key: bytes, reason: str) -> None:
        """Move an object that failed verification out of its name, into
        ``<root>/quarantine/`` (kept for forensics, the newest
        :data:`QUARANTINE_KEEP`), or delete it where it cannot be moved."""
        path = self._state.path(tenant, key)
        qdir = self.quarantine_dir
        dest = qdir / f"{tenant}.{key.hex()}.{time.time_ns()}.{reason}{v1.OBJECT_SUFFIX}"
        try:
            qdir.mkdir(mode=0o700, exist_ok=True)
            os.rename(path, dest)
        except FileNotFoundError:
            if path.exists():  # the quarantine itself is missing: delete instead
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            return
        except OSError as exc:
            log.warning("quarantining %s failed (%s); deleting it", path, exc)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            return
        log.warning("chunk %s of %s quarantined as %s", key.hex()[:16], tenant, dest.name)
        try:
            kept = sorted(qdir.iterdir(), key=lambda p: p.name.rsplit(".", 3)[-3])
        except OSError:
            return
        for old in kept[:-QUARANTINE_KEEP]:
            with contextlib.suppress(OSError):
                old.unlink()

    def purge_quarantine(self, tenant: str) -> int:
        """A purged tenant's quarantined objects go with the rest (a plaintext
        tenant's hold its KV in the clear). The number removed."""
        removed = 0
        with contextlib.suppress(FileNotFoundError):
            for p in self.quarantine_dir.iterdir():
                parts = p.name.rsplit(".", 4)
                if len(parts) == 5 and parts[0] == tenant:
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()
                        removed += 1
        return removed


__all__ = ["QUARANTINE_DIR", "QUARANTINE_KEEP", "Removal"]
