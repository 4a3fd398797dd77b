"""A SGLang host pool in shared memory, handed to the sidecar (protocol-v1 §5.34).

With ``"allocator": "shm"`` in ``--hicache-storage-backend-extra-config``,
SGLang's ``ShmHostTensorAllocator`` backs each host pool buffer with a memfd
(``allocator.fds``, mapped as ``allocator.mms``). :class:`PoolRegions`
registers those files with the client (``register_region``) and names each
chunk of a page by (region, offset, layer sizes): the sidecar then reads a
backup's bytes straight from the pool and writes a prefetch's verified bytes
straight into it, and this process copies nothing through staging.

A chunk moves in place only where its layers lie back to back in one file
(:func:`adjacent_runs`); anything else (another allocator, a pool of more
files than a connection may register, an older sidecar) answers None and the
caller stages.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from collections.abc import Sequence
from typing import Any

import torch

from ...client import SidecarClient
from ...protocol import MAX_REGIONS

log = logging.getLogger("kvoffload.sglang")

#: (local region id, offset, layer sizes) of one chunk: the client's span.
Span = tuple[int, int, Sequence[int]]


def adjacent_runs(parts: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``parts`` (contiguous views, in page order) grouped into runs whose memory
    follows on: each run is one chunk that can move in place."""
    runs: list[list[torch.Tensor]] = []
    end = -1
    for t in parts:
        ptr = t.data_ptr()
        if runs and ptr == end:
            runs[-1].append(t)
        else:
            runs.append([t])
        end = ptr + t.numel() * t.element_size()
    return runs


def _base(mm: mmap.mmap) -> int:
    """The address ``mm`` is mapped at (the export is released at once)."""
    c = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(c)
    finally:
        del c


class PoolRegions:
    """The memfds of one host pool, registered with a client, and where a tensor
    of the pool lies in them."""

    def __init__(self, client: SidecarClient, spans: list[tuple[int, int, int]]) -> None:
        self._client = client
        #: (address, size, local region id), one per file.
        self._spans = spans

    @classmethod
    def of(cls, client: SidecarClient, host: Any) -> PoolRegions | None:
        """The pool's files registered with ``client``, or None where the pool is not
        in shared memory (or in more files than a connection may register)."""
        alloc = getattr(host, "allocator", None)
        fds, mms = getattr(alloc, "fds", None), getattr(alloc, "mms", None)
        if not fds or not mms or len(fds) != len(mms) or len(fds) > MAX_REGIONS:
            return None
        spans = []
        for fd, mm in zip(fds, mms, strict=True):
            if not isinstance(fd, int) or not isinstance(mm, mmap.mmap):
                return None
            size = len(mm)
            try:
                if size % mmap.PAGESIZE or size % 4096 or os.fstat(fd).st_size < size:
                    return None
                local = client.register_region(fd, size)
            except (OSError, ValueError) as exc:
                log.info("kvoffload: the host pool's file cannot be used in place: %s", exc)
                return None
            spans.append((_base(mm), size, local))
        return cls(client, spans)

    def span(self, run: list[torch.Tensor]) -> Span | None:
        """Where one run of a page lies: (region, offset, layer sizes); None if its
        parts do not follow on in memory or it is not wholly inside one of the
        pool's files."""
        start = run[0].data_ptr()
        sizes = [t.numel() * t.element_size() for t in run]
        at = start
        for t, n in zip(run, sizes, strict=True):
            if t.data_ptr() != at:
                return None  # layers lie packed from the offset (§5): not these
            at += n
        for base, size, local in self._spans:
            if base <= start and start + sum(sizes) <= base + size:
                return local, start - base, sizes
        return None


__all__ = ["PoolRegions", "Span", "adjacent_runs"]
