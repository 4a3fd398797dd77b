"""The sidecar's RAM tier: sealed images of large objects, bounded, kept warm.

Why. ``posix`` writes objects of at least 16 MiB with O_DIRECT and reads the
cold ones the same way (:data:`~..iobackend.DIRECT_WRITE_MIN`, ``[store]
direct_read_min``): at the device's speed, and a scan of cold KV does not evict
hot objects from the page cache. But then the page cache does not keep those
objects warm either, and the next load of the same chunk is cold again. This
tier does: the sealed image a save or a cold read already has in hand is kept
in the sidecar's memory, and the next load verifies and decrypts it from there.

Rules (each one a test in ``tests/store/test_ramtier.py``):

- **An image is the object, byte for byte, as on disk**: sealed (AES-GCM
  ciphertext and tags) or checksummed. A hit is verified and decrypted exactly
  as a read of the file is; every byte is checked before it is handed out. An
  image that fails is dropped here and the file is read instead: a failure of
  the tier never removes or quarantines an object.
- **Served only while the file is the one it was taken from**: device, inode,
  size and mtime, one ``stat`` per hit. A chunk removed by anything (this
  sidecar, another node of a shared root, fsck, an operator) is never served
  from memory. The store asks the tier only for chunks its index holds.
- **Dropped with the chunk**: a removal, a purge (whole tenant or namespace), a
  revocation and ``drop_cache`` (protocol-v1 §5.31) drop the images they
  concern before they return. An image is taken only if no purge or
  revocation of its tenant began since its read or save began (``still``).
- **Bounded**: every buffer the tier owns (images, spares, buffers lent to a
  read or a save in progress) counts against ``capacity``.
- **Faulted in off the load path, once.** A fresh anonymous mapping costs a
  page fault per 4 KiB (32 MiB took 23 ms here, more than reading it from
  the device), so a read or a save gets a buffer from the tier only if one
  is ready: a spare, or the least recently used image of the same size. Else
  it uses its scratch buffer as before (no image taken this time). The first
  such miss of a size starts a filler thread, at the lowest CPU priority,
  that maps spares of that size with ``MAP_POPULATE`` until the tier's
  capacity is mapped: the tier then holds its capacity for the life of the
  process (as an engine's preallocated CPU cache does), and reuses it
  without faulting. Dropping images (``drop_cache``, a removal) keeps their
  buffers as spares; a purge or revocation unmaps its tenant's.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..layouts import v1

log = logging.getLogger("kvoffload.store")

#: A buffer's length: the object's size rounded up for O_DIRECT.
_ALIGN = v1.ALIGN
#: mmap flags of a spare: private, anonymous, faulted in at once.
_POPULATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)

#: What identifies the file an image was taken from.
Identity = tuple[int, int, int, int]


def identity(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class Slot:
    """A page-aligned buffer of the tier, lent to one read or save at a time."""

    __slots__ = ("mm", "view")

    def __init__(self, mm: mmap.mmap) -> None:
        self.mm = mm
        self.view = memoryview(mm)

    @property
    def nbytes(self) -> int:
        return len(self.mm)

    def alloc(self, n: int) -> memoryview:
        """The first ``n`` bytes (an :data:`~..fileio.AllocFn` for a read)."""
        if n > len(self.mm):
            raise ValueError(f"{n} bytes asked of a {len(self.mm)}-byte slot")
        return self.view[:n]


@dataclass(eq=False)
class Image:
    """One chunk's sealed object, pinned while a load reads it."""

    tenant: str
    key: bytes
    slot: Slot
    size: int
    ident: Identity
    pins: int = 0
    #: Dropped while pinned: the last unpin frees the slot.
    gone: bool = False

    @property
    def data(self) -> memoryview:
        return self.slot.view[: self.size]


@dataclass
class TierCounters:
    hits: int = 0
    #: Images found but dropped: their file changed or went (identity check).
    stale: int = 0
    taken: int = 0
    evicted: int = 0
    dropped: int = 0
    #: Reads and saves that found no ready buffer (and took no image).
    no_buffer: int = 0
    failed: int = 0


@dataclass
class RamTier:
    """Sealed images of objects of at least ``min_size`` bytes, at most
    ``capacity`` bytes of buffers in all."""

    capacity: int
    min_size: int
    counters: TierCounters = field(default_factory=TierCounters)

    def __post_init__(self) -> None:
        if self.capacity < 0 or self.min_size < 0:
            raise ValueError("capacity and min_size must be >= 0")
        self._mu = threading.Lock()
        self._want = threading.Condition(self._mu)
        self._images: OrderedDict[tuple[str, bytes], Image] = OrderedDict()
        self._free: dict[int, list[Slot]] = {}
        #: Sizes reads and saves asked for and found no ready buffer of.
        self._wanted: set[int] = set()
        #: Bytes of every buffer the tier owns: images, spares, lent.
        self._held = 0
        self._image_bytes = 0
        self._closed = False
        self._filler: threading.Thread | None = None

    # ------------------------------------------------------------ admission

    def admits(self, size: int) -> bool:
        """Whether an object of ``size`` bytes may have an image here."""
        return self.capacity > 0 and self.min_size <= size and _aligned(size) <= self.capacity

    # ---------------------------------------------------- lending buffers

    def lend(self, size: int) -> Slot | None:
        """A ready buffer for an object of ``size`` bytes, or None (use your
        scratch buffer; the filler makes spares of this size for the next ones).
        Give it back with :meth:`keep` or :meth:`give_back`."""
        if not self.admits(size):
            return None
        want = _aligned(size)
        with self._mu:
            if self._closed:
                return None
            free = self._free.get(want)
            if free:
                slot = free.pop()
                if self._held + want <= self.capacity:
                    self._ask_locked(want)  # room for more: the filler maps it
                return slot
            if self._held + want > self.capacity:
                # Full: the least recently used image of this size gives its
                # buffer; images of other sizes go if the filler needs room.
                for img in self._images.values():
                    if img.pins == 0 and img.slot.nbytes == want:
                        self._remove_locked(img, release=True)
                        self._held += want  # lent, not released
                        self.counters.evicted += 1
                        return img.slot
                self._evict_locked(self._held + want - self.capacity)
            self.counters.no_buffer += 1
            self._ask_locked(want)
            return None

    def give_back(self, slot: Slot) -> None:
        """A lent buffer not kept: a spare again."""
        with self._mu:
            self._spare_locked(slot)

    def settle(
        self, slot: Slot, tenant: str, key: bytes, size: int, path: str, verified: bool,
        still: Callable[[], bool],
    ) -> None:  # fmt: skip
        """A lent buffer after its read or save: kept as the chunk's image if the
        object in it was written or verified (``verified``) and ``still()`` holds
        (:meth:`keep`); else given back."""
        if not verified:
            self.give_back(slot)
            return
        self.keep(tenant, key, slot, size, path, still)

    def keep(
        self, tenant: str, key: bytes, slot: Slot, size: int, path: str, still: Callable[[], bool]
    ) -> bool:
        """Take ``slot`` (lent, holding the object at ``path`` just written or read
        and verified) as the image of (tenant, key). ``still()`` is asked under
        the tier's lock: False (a purge or revocation of the tenant began since
        the read or save did) gives the buffer back instead. True if taken."""
        try:
            ident = identity(os.stat(path))
        except OSError:
            self.give_back(slot)
            return False
        with self._mu:
            k = (tenant, key)
            have = self._images.get(k)
            if (
                self._closed
                or ident[2] != size
                or not still()
                or (have is not None and have.ident == ident)
            ):
                self._spare_locked(slot)
                return False
            if have is not None:  # taken from a file since replaced
                self._remove_locked(have)
            img = Image(tenant, key, slot, size, ident)
            self._images[k] = img
            self._image_bytes += slot.nbytes
            self.counters.taken += 1
            return True

    # ------------------------------------------------------------- hits

    def pinned(self, tenant: str, key: bytes, where: str | os.stat_result) -> Image | None:
        """The image of (tenant, key), pinned (:meth:`unpin` it), if the file
        ``where`` names (its path, or the stat of it the caller just took) is
        still the one it was taken from; else None (and a stale image is dropped)."""
        with self._mu:
            img = self._images.get((tenant, key))
            if img is None:
                return None
            img.pins += 1  # held across the stat: nothing reuses its buffer
        ident: Identity | None = None
        with contextlib.suppress(OSError):
            ident = identity(where if isinstance(where, os.stat_result) else os.stat(where))
        with self._mu:
            if ident == img.ident and not img.gone:
                self._images.move_to_end((tenant, key))
                self.counters.hits += 1
                return img
            if not img.gone:
                self.counters.stale += 1
                self._remove_locked(img)
            self._unpin_locked(img)
            return None

    def unpin(self, img: Image) -> None:
        with self._mu:
            self._unpin_locked(img)

    def failed(self, img: Image) -> None:
        """A pinned image that failed its checks: dropped (the caller reads the file)."""
        with self._mu:
            self.counters.failed += 1
            self.counters.hits -= 1  # counted when it was pinned: it served nothing
            if not img.gone:
                self._remove_locked(img)

    # ---------------------------------------------------------- dropping

    def discard(self, tenant: str, key: bytes) -> bool:
        """The chunk left the store: its image goes. Whether it had one."""
        with self._mu:
            img = self._images.get((tenant, key))
            if img is None:
                return False
            self.counters.dropped += 1
            self._remove_locked(img)
            return True

    def drop_tenant(self, tenant: str) -> int:
        """A purge or revocation: every image of ``tenant`` goes, and its memory
        is unmapped (not kept as spares). The number of images dropped."""
        with self._mu:
            gone = [img for img in self._images.values() if img.tenant == tenant]
            for img in gone:
                self._remove_locked(img, release=True)
            self.counters.dropped += len(gone)
            return len(gone)

    def clear(self) -> tuple[int, int]:
        """``drop_cache``: every image goes; their buffers stay mapped as spares,
        so the next reads do not fault them in again. (images dropped, bytes still mapped)."""
        with self._mu:
            gone = list(self._images.values())
            for img in gone:
                self._remove_locked(img)
            self.counters.dropped += len(gone)
            return len(gone), self._held

    def close(self) -> None:
        """Drop everything and stop the filler."""
        with self._mu:
            self._closed = True
            for img in list(self._images.values()):
                self._remove_locked(img, release=True)
            for free in self._free.values():
                self._held -= sum(s.nbytes for s in free)
            self._free.clear()
            self._want.notify_all()
        t = self._filler
        if t is not None:
            # A Ctrl-C inside ``start()`` leaves it never (or not yet) started, which
            # ``join`` refuses; a filler that starts late finds the tier closed.
            with contextlib.suppress(RuntimeError):
                t.join(timeout=5)

    # ------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        with self._mu:
            c = self.counters
            return {
                "capacity_bytes": self.capacity,
                "min_object_bytes": self.min_size,
                "held_bytes": self._held,
                "images": len(self._images),
                "image_bytes": self._image_bytes,
                "hits": c.hits,
                "stale": c.stale,
                "taken": c.taken,
                "evicted": c.evicted,
                "dropped": c.dropped,
                "no_buffer": c.no_buffer,
                "failed": c.failed,
                # The filler is mapping spares (once per process, up to the capacity).
                "filling": bool(self._wanted),
            }

    def holds(self, tenant: str, key: bytes) -> bool:
        with self._mu:
            return (tenant, key) in self._images

    # -------------------------------------------------------- internals

    def _remove_locked(self, img: Image, *, release: bool = False) -> None:
        del self._images[(img.tenant, img.key)]
        self._image_bytes -= img.slot.nbytes
        img.gone = True
        if img.pins == 0:
            self._free_slot_locked(img.slot, release)

    def _unpin_locked(self, img: Image) -> None:
        img.pins -= 1
        if img.pins == 0 and img.gone:
            self._free_slot_locked(img.slot, False)

    def _free_slot_locked(self, slot: Slot, release: bool) -> None:
        if release or self._closed:
            self._held -= slot.nbytes  # unmapped when its last view goes
        else:
            self._spare_locked(slot)

    def _spare_locked(self, slot: Slot) -> None:
        if self._closed:
            self._held -= slot.nbytes
        else:
            self._free.setdefault(slot.nbytes, []).append(slot)

    def _evict_locked(self, nbytes: int) -> None:
        """Unmap spares, then the least recently used unpinned images, until
        ``nbytes`` are freed (or nothing more can be)."""
        freed = 0
        for free in self._free.values():
            while free and freed < nbytes:
                slot = free.pop()
                self._held -= slot.nbytes
                freed += slot.nbytes
        for img in list(self._images.values()):
            if freed >= nbytes:
                break
            if img.pins == 0:
                self._remove_locked(img, release=True)
                self.counters.evicted += 1
                freed += img.slot.nbytes

    def _ask_locked(self, want: int) -> None:
        self._wanted.add(want)
        if self._filler is None:
            self._filler = threading.Thread(
                target=self._fill, name="kvoffload-ramtier", daemon=True
            )
            self._filler.start()
        self._want.notify()

    def _fill(self) -> None:
        """Map and fault in spares of the sizes asked for, up to the capacity, at
        the lowest CPU priority: loads and saves in flight come first."""
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while True:
            with self._mu:
                while not self._wanted and not self._closed:
                    self._want.wait()
                if self._closed:
                    return
                want = next(iter(self._wanted))
                if self._held + want > self.capacity:
                    self._wanted.discard(want)
                    continue
                self._held += want  # counted before it exists: never over the bound
            try:
                slot = Slot(mmap.mmap(-1, want, flags=_POPULATE))
            except (OSError, ValueError) as exc:
                log.warning("RAM tier: mapping a %d-byte buffer failed: %s", want, exc)
                with self._mu:
                    self._held -= want
                    self._wanted.discard(want)
                continue
            with self._mu:
                self._spare_locked(slot)  # already counted in _held


#: ``[store] ram_cache = "auto"``: this share of the memory the sidecar may use
#: (the machine's, or its cgroup's limit where lower), at most :data:`AUTO_MAX`.
AUTO_SHARE = 16
AUTO_MAX = 8 << 30


def memory_limit() -> int | None:
    """The memory this process may use: the machine's, or its cgroup v2 limit
    where that is lower; None if neither can be read."""
    limits: list[int] = []
    with contextlib.suppress(OSError, ValueError):
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    try:
        with open("/proc/self/cgroup", encoding="ascii") as f:
            group = next((ln.split(":", 2)[2].strip() for ln in f if ln.startswith("0::")), None)
        if group is not None:
            with open(f"/sys/fs/cgroup{group.rstrip('/')}/memory.max", encoding="ascii") as f:
                raw = f.read().strip()
            if raw.isdigit():
                limits.append(int(raw))
    except (OSError, ValueError):
        pass
    return min(limits) if limits else None


def auto_capacity() -> int:
    """``ram_cache = "auto"``: 1/16 of :func:`memory_limit`, at most 8 GiB (0 if unknown)."""
    mem = memory_limit()
    return 0 if mem is None else min(AUTO_MAX, mem // AUTO_SHARE // _ALIGN * _ALIGN)


def _aligned(size: int) -> int:
    """The buffer length for an object of ``size`` bytes: rounded up to a
    power-of-two grain of about 1/32 of it (at least 4 KiB), so that objects
    of nearly equal size (a sealed chunk and a plaintext one of the same
    shape) share buffers; at most about 6 % more than the object."""
    grain = 1 << max(_ALIGN.bit_length() - 1, max(size, 1).bit_length() - 5)
    return v1.align_up(max(size, 1), grain)


__all__ = ["Image", "RamTier", "Slot", "TierCounters", "auto_capacity", "identity", "memory_limit"]
