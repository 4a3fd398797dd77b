"""The shared-memory staging buffer and the allocator that places chunks in it.

The client creates one :class:`StagingBuffer` per connection lifetime (it
survives reconnects), hands its descriptor to the sidecar once over
``SCM_RIGHTS``, and both sides map the same pages: payload bytes never cross
the socket. The buffer is a memfd sealed against shrinking, so the sidecar can
map it without risking ``SIGBUS`` if the worker truncated it later
(protocol-v1.md §5.2), and it is pre-faulted so the first save does not pay for
page faults inside a latency-sensitive copy.

:class:`RegionAllocator` is the server's bookkeeping of which byte ranges of
one client's buffer are held by open handles.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import mmap
import os
import stat

import numpy as np

from kvoffload.errors import StagingError

PAGE = 4096

#: MADV_POPULATE_WRITE (Linux 5.14): prefault writable pages in one call.
#: Python 3.11's mmap module has no name for it.
_MADV_POPULATE_WRITE = 23

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _prefault(mm: mmap.mmap, size: int) -> None:
    try:
        mm.madvise(_MADV_POPULATE_WRITE, 0, size)
        return
    except (OSError, ValueError):
        pass  # older kernel: touch one byte per page instead
    pages = np.frombuffer(mm, dtype=np.uint8)
    try:
        pages[::PAGE] = 0
    finally:
        # The array exports the mmap's buffer; keeping it would block mm.close().
        del pages


class StagingBuffer:
    """A memfd of ``size`` bytes (a multiple of 4096), mapped shared and read-write.

    ``view`` is a writable byte memoryview of the whole buffer. ``close()``
    unmaps it and closes the descriptor; callers must have released slices of
    ``view`` they still hold, or the unmap is left to garbage collection.
    """

    def __init__(self, size: int, *, name: str = "kvoffload-staging", prefault: bool = True):
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"staging size must be a positive int, got {size!r}")
        size = _round_up(size, PAGE)
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except OSError as exc:
            os.close(fd)
            raise StagingError(f"cannot create a {size}-byte staging buffer: {exc}") from exc
        if prefault:
            _prefault(mm, size)
        self._init(fd, size, mm)

    def _init(self, fd: int, size: int, mm: mmap.mmap) -> None:
        self._fd = fd
        self._size = size
        self._mmap = mm
        self._view: memoryview | None = memoryview(mm)

    @classmethod
    def from_fd(cls, fd: int, size: int, *, require_seals: bool = True) -> StagingBuffer:
        """Map a buffer received from a peer. Takes ownership of ``fd`` (closed on error too).

        Checks what the server's safety relies on: a regular (memfd) file of at
        least ``size`` bytes that can no longer shrink.
        """
        try:
            if size <= 0 or size % PAGE:
                raise StagingError(f"staging size {size} is not a positive multiple of {PAGE}")
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise StagingError("staging descriptor is not a regular file (memfd)")
            if st.st_size < size:
                raise StagingError(f"staging file has {st.st_size} bytes, {size} announced")
            if require_seals:
                try:
                    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
                except OSError as exc:
                    raise StagingError("staging descriptor does not support seals") from exc
                if not seals & fcntl.F_SEAL_SHRINK:
                    raise StagingError("staging memfd is not sealed against shrinking")
            try:
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            except OSError as exc:
                raise StagingError(f"cannot map the staging buffer: {exc}") from exc
        except BaseException:
            os.close(fd)
            raise
        self = cls.__new__(cls)
        self._init(fd, size, mm)
        return self

    @property
    def fd(self) -> int:
        return self._fd

    @property
    def size(self) -> int:
        return self._size

    @property
    def closed(self) -> bool:
        return self._view is None

    @property
    def view(self) -> memoryview:
        if self._view is None:
            raise ValueError("staging buffer is closed")
        return self._view

    def close(self) -> None:
        if self._view is None:
            return
        self._view.release()
        self._view = None
        # BufferError: a caller still holds a slice; the mapping then goes away
        # with the last reference instead of now.
        with contextlib.suppress(BufferError):
            self._mmap.close()
        os.close(self._fd)

    def __enter__(self) -> StagingBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"fd={self._fd}"
        return f"StagingBuffer(size={self._size}, {state})"


class RegionAllocator:
    """First-fit allocator of aligned byte ranges in ``[0, size)``.

    Free space is a sorted list of disjoint ranges, merged with its neighbours
    on ``free``. A staging buffer holds a few dozen regions at most, so linear
    first-fit is cheaper than anything cleverer.
    """

    def __init__(self, size: int, align: int = PAGE) -> None:
        if align <= 0 or align & (align - 1):
            raise ValueError(f"alignment must be a power of two, got {align}")
        if size < 0:
            raise ValueError(f"size must be ≥ 0, got {size}")
        self._align = align
        self._size = size - size % align
        self._free_starts: list[int] = []
        self._free_lens: list[int] = []
        self._used: dict[int, int] = {}
        self.reset()

    @property
    def size(self) -> int:
        return self._size

    @property
    def align(self) -> int:
        return self._align

    @property
    def free_bytes(self) -> int:
        return sum(self._free_lens)

    @property
    def largest_free(self) -> int:
        return max(self._free_lens, default=0)

    @property
    def allocations(self) -> dict[int, int]:
        """offset → length of every live region (a copy)."""
        return dict(self._used)

    def alloc(self, n: int) -> int | None:
        """Offset of a new region of at least ``n`` bytes, or None if none fits."""
        if n <= 0:
            raise ValueError(f"region size must be positive, got {n}")
        n = _round_up(n, self._align)
        for i, length in enumerate(self._free_lens):
            if length >= n:
                off = self._free_starts[i]
                if length == n:
                    del self._free_starts[i], self._free_lens[i]
                else:
                    self._free_starts[i] = off + n
                    self._free_lens[i] = length - n
                self._used[off] = n
                return off
        return None

    def claim(self, offset: int, n: int) -> bool:
        """Take the region ``[offset, offset + n)`` (rounded up to the alignment) if
        it is all free: a region the peer chose (``store``, protocol-v1.md §5.21).
        False, and nothing taken, if any byte of it is allocated or outside."""
        if n <= 0:
            raise ValueError(f"region size must be positive, got {n}")
        if offset < 0 or offset % self._align:
            return False
        n = _round_up(n, self._align)
        i = bisect.bisect_right(self._free_starts, offset) - 1
        if i < 0:
            return False
        start, length = self._free_starts[i], self._free_lens[i]
        if offset + n > start + length:
            return False
        del self._free_starts[i], self._free_lens[i]
        tail = start + length - (offset + n)
        if tail:
            self._free_starts.insert(i, offset + n)
            self._free_lens.insert(i, tail)
        if offset > start:
            self._free_starts.insert(i, start)
            self._free_lens.insert(i, offset - start)
        self._used[offset] = n
        return True

    def free(self, offset: int) -> None:
        try:
            n = self._used.pop(offset)
        except KeyError:
            raise ValueError(f"no region allocated at offset {offset}") from None
        i = bisect.bisect_left(self._free_starts, offset)
        end = offset + n
        merge_next = i < len(self._free_starts) and self._free_starts[i] == end
        merge_prev = i > 0 and self._free_starts[i - 1] + self._free_lens[i - 1] == offset
        if merge_prev and merge_next:
            self._free_lens[i - 1] += n + self._free_lens[i]
            del self._free_starts[i], self._free_lens[i]
        elif merge_prev:
            self._free_lens[i - 1] += n
        elif merge_next:
            self._free_starts[i] = offset
            self._free_lens[i] += n
        else:
            self._free_starts.insert(i, offset)
            self._free_lens.insert(i, n)

    def reset(self) -> None:
        """Free every region at once (e.g. when the connection that owned them closed)."""
        self._used.clear()
        self._free_starts[:] = [0] if self._size else []
        self._free_lens[:] = [self._size] if self._size else []


__all__ = ["PAGE", "RegionAllocator", "StagingBuffer", "StagingError"]
