"""Host-pool pages as the byte regions a chunk is made of (torch, no SGLang).

A page of a SGLang host pool (``HostKVCache.get_data_page(index, flat=False)``)
is a strided view: K and V, and in ``layer_first`` every layer, are separate
runs of memory. Splitting it along its leading dimensions until every part is
contiguous gives the chunk's layers: each is a view of the pool itself, so a
save copies straight from the pool into the sidecar's staging memory and a
load copies straight from staging into the pool (one copy each way, none
through a temporary page).
"""

from __future__ import annotations

from typing import Any

import torch

from ...protocol import MAX_LAYERS


def contiguous_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` as contiguous views of its own memory, in memory order of its leading dims."""
    if t.is_contiguous():
        return [t]
    if t.dim() <= 1:
        return []
    parts: list[torch.Tensor] = []
    for sub in t.unbind(0):
        got = contiguous_parts(sub)
        if not got:
            return []
        parts.extend(got)
        if len(parts) > MAX_LAYERS:
            return []
    return parts


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy)."""
    arr: Any = t.reshape(-1).view(torch.uint8).numpy()
    return memoryview(arr).cast("B")


def page_regions(host_pool: Any, index: int) -> list[torch.Tensor] | None:
    """The page at token ``index`` as views of the pool, or None where it cannot be
    split into at most MAX_LAYERS contiguous parts (the caller copies then)."""
    page = host_pool.get_data_page(index, flat=False)
    if page.device.type != "cpu":
        return None
    parts = contiguous_parts(page)
    return parts or None
