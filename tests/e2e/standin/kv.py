"""Paged KV caches laid out as vLLM lays them out, and their slot mappings.

A test double (see the package docstring).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    pass

# --------------------------------------------------------------------------
# Paged KV cache layouts
# --------------------------------------------------------------------------


class KVLayout(enum.Enum):
    """One layer's paged KV cache tensor, as a connector receives it.

    ``B`` blocks, ``N`` tokens per block, ``H`` KV heads, ``D`` head size.
    """

    #: vLLM >= 0.33 standardized view ``[B, H, N, 2D]``, physically
    #: ``[B, N, H, 2D]`` (NHD). FlashAttention's layout and vLLM's default.
    LBNHC = "LBNHC"
    #: vLLM >= 0.33 standardized view ``[B, H, N, 2D]``, contiguous (HND).
    LBHNC = "LBHNC"
    #: vLLM < 0.33 FlashAttention: ``[2, B, N, H, D]`` (NHD).
    SPLIT_NHD = "SPLIT_NHD"
    #: vLLM < 0.33 HND backends: ``[2, B, H, N, D]``.
    SPLIT_HND = "SPLIT_HND"

    @property
    def cache_layout(self) -> str:
        """The name the compatibility contract uses (``LayerLayout.cache_layout``)."""
        return "NHD" if self in (KVLayout.LBNHC, KVLayout.SPLIT_NHD) else "HND"


def allocate_kv_layer(
    layout: KVLayout,
    *,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    fill: float = math.nan,
) -> torch.Tensor:
    """One layer's paged cache in ``layout``, every slot set to ``fill``."""
    b, n, h, d = num_blocks, block_size, num_kv_heads, head_size
    if layout is KVLayout.LBNHC:
        # Allocated in physical order, handed out in the logical [B, H, N, 2D]
        # order: the same strides vLLM's create_kv_cache_views produces.
        return torch.full((b, n, h, 2 * d), fill, dtype=dtype).permute(0, 2, 1, 3)
    if layout is KVLayout.LBHNC:
        return torch.full((b, h, n, 2 * d), fill, dtype=dtype)
    if layout is KVLayout.SPLIT_NHD:
        return torch.full((2, b, n, h, d), fill, dtype=dtype)
    return torch.full((2, b, h, n, d), fill, dtype=dtype)


def kv_block_views(layout: KVLayout, kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer as ``[B, N, H, D]`` views sharing ``kv_layer``'s storage.

    For the standardized layouts this is exactly how vLLM 0.33's FlashAttention
    backend reads the cache: ``kv_cache.transpose(1, 2).split(head_size, -1)``.
    """
    if layout in (KVLayout.LBNHC, KVLayout.LBHNC):
        bnhc = kv_layer.transpose(1, 2)
        d = bnhc.shape[-1] // 2
        return bnhc[..., :d], bnhc[..., d:]
    if layout is KVLayout.SPLIT_NHD:
        return kv_layer[0], kv_layer[1]
    return kv_layer[0].transpose(1, 2), kv_layer[1].transpose(1, 2)


def slot_mapping(block_ids: Sequence[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """vLLM's slot of each token position in ``[start, end)``: block * block_size + offset."""
    if end > len(block_ids) * block_size:
        raise ValueError(f"positions up to {end} need more than {len(block_ids)} blocks")
    positions = torch.arange(start, end, dtype=torch.int64)
    table = torch.tensor(list(block_ids), dtype=torch.int64)
    return table[positions // block_size] * block_size + positions % block_size


def scatter_kv(
    layout: KVLayout,
    kv_layer: torch.Tensor,
    slots: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """Write ``keys``/``values`` (``[T, H, D]``) into the slots ``slots`` (``[T]``)."""
    k_view, v_view = kv_block_views(layout, kv_layer)
    block_size = k_view.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_view[blocks, offsets] = keys.to(k_view.dtype)
    v_view[blocks, offsets] = values.to(v_view.dtype)


def gather_kv(
    layout: KVLayout, kv_layer: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of K and V (``[T, H, D]``) held in the slots ``slots``."""
    k_view, v_view = kv_block_views(layout, kv_layer)
    block_size = k_view.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    return k_view[blocks, offsets].clone(), v_view[blocks, offsets].clone()


# --------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------


#: The name :func:`_row_attention` is registered under in transformers.
