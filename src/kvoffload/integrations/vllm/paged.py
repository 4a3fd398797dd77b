"""vLLM's paged KV cache as the worker side of the connector sees it (worker.py).

:class:`PagedCache` gathers a chunk's blocks of every layer into the layout a
chunk is stored in, and scatters a loaded chunk (or one layer of it) back into
the engine's blocks. It indexes the *logical* per-layer view vLLM hands
``register_kv_caches`` and lets the strides do the rest, so every physical
``KVCacheLayout`` of vLLM 0.33 is served the same way (the layouts are listed
in worker.py's docstring); :func:`build_paged_cache` checks the tensors
against the KV spec and refuses anything else with an error naming it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import common
from .common import ChunkRef, KVOffloadConfigError, ordered_layer_names


class _BadChunk(Exception):
    """A verified chunk whose shape does not fit this engine's cache."""


@dataclass(frozen=True)
class PagedCache:
    """One shard's registered caches, each as ``[block, kernel_block, head, token, K|V]``."""

    layer_names: tuple[str, ...]
    layers: tuple[torch.Tensor, ...]
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def blocks_per_chunk(self, chunk_tokens: int) -> int:
        return chunk_tokens // self.block_size

    @property
    def ratio(self) -> int:
        return int(self.layers[0].shape[1])

    def layer_nbytes(self, tokens: int) -> int:
        """Bytes of one layer entry of a chunk of ``tokens`` tokens (K then V)."""
        return tokens * self.num_kv_heads * 2 * self.head_dim * self.dtype.itemsize

    def gather(self, block_ids: Sequence[int], n_chunks: int) -> list[torch.Tensor]:
        """Per layer, ``[n_chunks, packed]``: row c is chunk c's layer entry."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        hd = self.head_dim
        out = []
        for layer in self.layers:
            # [blocks, ratio, H, Nk, C] -> tokens in position order, [n, T, H, C]
            x = layer[idx].permute(0, 1, 3, 2, 4).reshape(n_chunks, -1, self.num_kv_heads, 2 * hd)
            packed = torch.cat(
                (x[..., :hd].reshape(n_chunks, -1), x[..., hd:].reshape(n_chunks, -1)), 1
            )
            out.append(packed.cpu() if packed.device.type != "cpu" else packed)
        return out

    def scatter(self, chunk: ChunkRef, chunk_tokens: int, layers: Sequence[memoryview]) -> None:
        """Write blocks ``chunk.block_ids`` from a loaded chunk's layer entries."""
        if len(layers) != len(self.layers):
            raise _BadChunk(f"{len(layers)} layers, this shard has {len(self.layers)}")
        want = self.layer_nbytes(chunk_tokens)
        for i, mv in enumerate(layers):
            if mv.nbytes != want:
                raise _BadChunk(f"layer {i} holds {mv.nbytes} bytes, expected {want}")
        for i, mv in enumerate(layers):
            self.scatter_layer(chunk, chunk_tokens, i, mv)

    def scatter_layer(
        self, chunk: ChunkRef, chunk_tokens: int, i: int, mv: memoryview, non_blocking: bool = False
    ) -> None:
        """Write layer ``i`` of blocks ``chunk.block_ids`` from that layer's entry.

        ``non_blocking`` (pinned staging on a GPU): the copies are only queued on
        the current stream; the caller synchronizes it before ``mv`` goes away."""
        if not 0 <= i < len(self.layers):
            raise _BadChunk(f"layer {i}, this shard has {len(self.layers)}")
        want = self.layer_nbytes(chunk_tokens)
        if mv.nbytes != want:
            raise _BadChunk(f"layer {i} holds {mv.nbytes} bytes, expected {want}")
        n = len(chunk.block_ids)
        t0 = chunk.first_block * self.block_size
        t1 = t0 + n * self.block_size
        if n == 0 or t1 > chunk_tokens:
            raise _BadChunk(f"blocks {chunk.first_block}+{n} outside a {chunk_tokens}-token chunk")
        h, hd = self.num_kv_heads, self.head_dim
        idx = torch.tensor(chunk.block_ids, dtype=torch.long, device=self.device)
        half = chunk_tokens * h * hd
        # [tokens, H, D] of n blocks -> [n, ratio, H, Nk, D], vLLM's logical order
        shape = (n, self.ratio, -1, h, hd)
        layer = self.layers[i]
        # Staging memory is read-only to us; frombuffer's "not writable"
        # warning was consumed at registration (see _quiet_frombuffer).
        src = torch.frombuffer(mv, dtype=torch.uint8).view(self.dtype)
        k = src[:half].view(chunk_tokens, h, hd)[t0:t1].to(self.device, non_blocking=non_blocking)
        v = src[half:].view(chunk_tokens, h, hd)[t0:t1].to(self.device, non_blocking=non_blocking)
        # Index-assigning into the K and V halves of the view writes the
        # cache itself, with no intermediate K|V tensor.
        layer[..., :hd][idx] = k.view(shape).permute(0, 1, 3, 2, 4)
        layer[..., hd:][idx] = v.view(shape).permute(0, 1, 3, 2, 4)


def _quiet_frombuffer() -> None:
    """PyTorch warns once per process that a tensor over a read-only buffer could
    be written through. Loads only read staging memory; take that one warning
    here, on the main thread, where catching it is safe (catch_warnings is not
    thread-safe, and loads run on a background thread)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.frombuffer(memoryview(b"\0").toreadonly(), dtype=torch.uint8)


def build_paged_cache(
    kv_caches: dict[str, torch.Tensor], spec: common.KVSpec, num_blocks: int
) -> PagedCache:
    """Validate vLLM's per-layer views and regroup them by manager block."""
    names = [n for n in spec.layer_names if n in kv_caches]
    missing = [n for n in spec.layer_names if n not in kv_caches]
    if missing or not names:
        raise KVOffloadConfigError(
            f"register_kv_caches lacks layers of the KV-cache group: {missing or 'all'}"
        )
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    layers: list[torch.Tensor] = []
    kept: list[str] = []
    for name in ordered_layer_names(names):
        t = kv_caches[name]
        ident = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if ident in seen:
            continue  # a layer reusing another layer's cache (KV sharing) is stored once
        seen.add(ident)
        c = 2 * spec.head_dim
        if t.dim() != 4 or t.shape[1] != spec.num_kv_heads or t.shape[3] != c:
            raise KVOffloadConfigError(
                f"layer {name}: KV cache of shape {tuple(t.shape)} is not vLLM 0.33's "
                f"[blocks, {spec.num_kv_heads} kv heads, tokens, {c} (K|V)] view; "
                "kvoffload supports full attention with K and V of equal head size"
            )
        if t.shape[0] % num_blocks or t.shape[2] * (t.shape[0] // num_blocks) != spec.block_size:
            raise KVOffloadConfigError(
                f"layer {name}: {t.shape[0]} blocks of {t.shape[2]} tokens do not split "
                f"{num_blocks} blocks of {spec.block_size} tokens"
            )
        if t.dtype != spec.dtype:
            raise KVOffloadConfigError(f"layer {name}: dtype {t.dtype}, KV spec says {spec.dtype}")
        layers.append(t.view(num_blocks, t.shape[0] // num_blocks, *t.shape[1:]))
        kept.append(name)
    if len({(t.shape, t.device) for t in layers}) != 1:
        raise KVOffloadConfigError("the layers' KV caches differ in shape or device")
    _quiet_frombuffer()
    return PagedCache(
        layer_names=tuple(kept),
        layers=tuple(layers),
        block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        dtype=spec.dtype,
        device=layers[0].device,
    )


@dataclass(frozen=True)
class StatePages:
    """A Mamba group's state pages: per layer, the raw bytes of one block's state.

    A chunk object of a Mamba group holds, per layer in ascending layer index,
    the state page (``real_page_size_bytes``, its tensors back to back as vLLM
    lays them out) of the block that ends at the chunk's last token. Pages are
    addressed through vLLM's placement (``KVCacheTensor``: offset, layer and
    block strides into the backing allocation), whatever its layout.
    """

    layer_names: tuple[str, ...]
    raw: torch.Tensor  # uint8 over the whole backing allocation
    offsets: tuple[int, ...]  # per layer: byte offset of its block 0
    block_strides: tuple[int, ...]
    page_bytes: int
    device: torch.device
    block_size: int

    @property
    def layers(self) -> tuple[str, ...]:
        return self.layer_names

    def layer_nbytes(self, tokens: int) -> int:
        return self.page_bytes

    def blocks_per_chunk(self, chunk_tokens: int) -> int:
        return 1

    def _page(self, layer: int, block: int) -> torch.Tensor:
        at = self.offsets[layer] + block * self.block_strides[layer]
        return self.raw[at : at + self.page_bytes]

    def gather(self, block_ids: Sequence[int], n_chunks: int) -> list[torch.Tensor]:
        """Per layer, ``[n_chunks, page_bytes]`` (one state block per chunk)."""
        if len(block_ids) != n_chunks:
            raise ValueError(f"{len(block_ids)} state blocks for {n_chunks} chunks")
        return [
            torch.stack([self._page(i, b) for b in block_ids]).cpu()
            for i in range(len(self.layer_names))
        ]

    def scatter(self, chunk: ChunkRef, chunk_tokens: int, layers: Sequence[memoryview]) -> None:
        if len(layers) != len(self.layer_names):
            raise _BadChunk(f"{len(layers)} layers, this group has {len(self.layer_names)}")
        for i, mv in enumerate(layers):
            if mv.nbytes != self.page_bytes:
                raise _BadChunk(f"layer {i} holds {mv.nbytes} bytes, expected {self.page_bytes}")
        for i, mv in enumerate(layers):
            self.scatter_layer(chunk, chunk_tokens, i, mv)

    def scatter_layer(
        self, chunk: ChunkRef, chunk_tokens: int, i: int, mv: memoryview, non_blocking: bool = False
    ) -> None:
        if not 0 <= i < len(self.layer_names) or mv.nbytes != self.page_bytes:
            raise _BadChunk(f"layer {i} of {mv.nbytes} bytes does not fit this Mamba group")
        if len(chunk.block_ids) != 1:
            raise _BadChunk(f"{len(chunk.block_ids)} state blocks for one chunk")
        src = torch.frombuffer(mv, dtype=torch.uint8)
        self._page(i, chunk.block_ids[0]).copy_(src, non_blocking=non_blocking)


def build_state_pages(kv_caches: dict[str, Any], group: Any, kv_cache_config: Any) -> StatePages:
    """A Mamba group's pages, from vLLM's placement of its layers."""
    names = ordered_layer_names([n for n in group.layer_names if n in kv_caches])
    missing = [n for n in group.layer_names if n not in kv_caches]
    if missing or not names:
        raise KVOffloadConfigError(
            f"register_kv_caches lacks layers of Mamba KV-cache group {group.index}: "
            f"{missing or 'all'}"
        )
    place: dict[str, tuple[int, int]] = {}
    for t in kv_cache_config.kv_cache_tensors:
        for pos, name in enumerate(t.layers):
            place[name] = (t.offset + pos * t.layer_stride, t.block_stride)
    first = kv_caches[names[0]]
    first = first[0] if isinstance(first, list | tuple) else first
    storage = first.untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8, device=first.device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )
    if any(n not in place for n in names):
        raise KVOffloadConfigError(f"Mamba group {group.index}: a layer without a placement")
    _quiet_frombuffer()
    return StatePages(
        layer_names=tuple(names),
        raw=raw,
        offsets=tuple(place[n][0] for n in names),
        block_strides=tuple(place[n][1] for n in names),
        page_bytes=int(group.state_bytes),
        device=first.device,
        block_size=int(group.block_size),
    )


__all__ = ["PagedCache", "StatePages", "build_paged_cache", "build_state_pages"]
