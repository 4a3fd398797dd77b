"""The client's buffer helpers: layer views, argument checks, staging regions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from ..protocol import KEY_SIZE, ErrorCode, ProtocolError, packed_layout
from ..staging import StagingBuffer
from . import direct as direct_io

#: A layer argument: anything with the buffer protocol (bytes, bytearray,
#: memoryview, numpy array), or a contiguous CPU torch tensor.
BufferLike = Any
LoadCallback = Callable[[int, bytes, Sequence[memoryview]], None]
#: ``dest_for(index, key, layer_sizes)``: where ``load_to`` puts a chunk's
#: layers: writable host buffers or GPU tensors, one per layer, each at least
#: its layer's size.
DestCallback = Callable[[int, bytes, Sequence[int]], Sequence[Any]]
#: ``on_layer(layer, first, views)`` of a layer-wise load: ``views[j]`` is layer
#: ``layer`` of chunk ``first + j``, verified, a read-only view of staging valid
#: only during the call (chunks of one batch with fewer layers split a layer's
#: chunks into several calls, one per run of consecutive chunks that have it).
LayerCallback = Callable[[int, int, Sequence[memoryview]], None]
#: ``copy_in(staging, offset, layers)``: packs a chunk's layers into staging.
CopyInFn = Callable[[StagingBuffer, int, list[memoryview]], None]


@dataclass
class LoadedChunk:
    """One requested key's outcome. ``layers`` holds copies, unless an ``into``
    callback received the data, in which case it is empty."""

    key: bytes
    ok: bool
    layers: list[memoryview] = field(default_factory=list)


def check_keys(keys: Sequence[bytes]) -> list[bytes]:
    out = list(keys)
    # The whole batch in C (lookups are on the scheduler's path); per key only
    # to name the bad one.
    if all(map(isinstance, out, repeat(bytes))) and set(map(len, out)) <= {KEY_SIZE}:
        return out
    for i, k in enumerate(out):
        if not isinstance(k, bytes) or len(k) != KEY_SIZE:
            raise ValueError(f"keys[{i}] must be {KEY_SIZE} bytes")
    return out


def check_dests(dests: Sequence[Any], sizes: Sequence[int]) -> list[Any]:
    """``dest_for``'s answer: one destination per layer, each big enough."""
    out = list(dests)
    if len(out) != len(sizes):
        raise ValueError(f"dest_for returned {len(out)} destinations for {len(sizes)} layers")
    for i, (d, n) in enumerate(zip(out, sizes, strict=True)):
        if direct_io.nbytes(d) < n:
            raise ValueError(f"destination of layer {i} holds fewer than {n} bytes")
    return out


def check_regions(regions: list[tuple[int, int]], size: int) -> None:
    """The server's offsets must stay inside the buffer and apart: a slice past
    the end of a memoryview would silently truncate instead of failing."""
    end = 0
    for off, n in sorted(regions):
        if off < end or off + n > size:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"bad staging region {off}+{n}")
        end = off + n


def copy_in(staging: StagingBuffer, offset: int, layers: list[memoryview]) -> None:
    """Copy a chunk's layers into staging at ``offset``, packed as the protocol lays them."""
    dst = staging.view
    offs, _ = packed_layout([v.nbytes for v in layers])
    for lo, v in zip(offs, layers, strict=True):
        start = offset + lo
        dst[start : start + v.nbytes] = v
