"""KV-cache groups of a hybrid model, and vLLM 0.33's rule for a hit across them.

With vLLM's hybrid KV-cache manager (HMA) a model's layers fall into
KV-cache groups, each with a block table of its own: full attention,
sliding-window attention, Mamba state. kvoffload stores each group's chunks
as separate objects under a namespace of the group's own (the contract's
``kv_group``, contract-v1.md §7), so a chunk is named by (its tokens' key
chain, its group). A model with one group has no ``kv_group``: its
namespaces and keys are those kvoffload always derived.

The lookup (:func:`hit_boundary`) is vLLM's own rule
(``HybridKVCacheCoordinator.find_longest_cache_hit`` with the managers'
``find_longest_cache_hit``, as vLLM's ``OffloadingConnector`` applies it to
offloaded chunks), at chunk granularity:

- a full-attention group needs every chunk before the boundary (a prefix);
- a sliding-window group needs only the chunks of the window before the
  boundary (``ceil((sliding_window - 1 + extra_retained_tokens) /
  chunk_tokens)`` of them, fewer at the start of the sequence), found by a
  scan from the right;
- a Mamba group (``mamba_cache_mode = "align"``) needs the state at the
  boundary, and the boundary is a multiple of the Mamba block size.

Each group can only lower the boundary; the groups are asked again until it
stops moving. A boundary some group cannot serve is no hit at all: every
group (pool) a model needs is present at the boundary, or nothing is loaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload.contract import CompatContract, KVGroup, LayerLayout
from kvoffload.errors import KVOffloadConfigError

FULL = "full_attention"
SLIDING = "sliding_window"
MAMBA = "mamba"


@dataclass(frozen=True)
class KVSpec:
    """What one shard's paged cache looks like (from vLLM's KV-cache spec)."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: Any  # torch.dtype
    layer_names: tuple[str, ...]


def attention_spec(kv_cache_config: Any, *, quant_ok: bool = True) -> KVSpec:
    """The single full-attention group of a model without hybrid groups, or a clear refusal."""
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        raise KVOffloadConfigError(
            f"kvoffload supports models with one KV-cache group, this one has {len(groups)}"
        )
    return kv_spec_of(groups[0].kv_cache_spec, groups[0].layer_names, quant_ok=quant_ok)


def kv_spec_of(spec: Any, layer_names: Sequence[str], *, quant_ok: bool = True) -> KVSpec:
    """An attention group's spec as the worker needs it, or a clear refusal."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVQuantMode,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    kind = type(spec).__name__
    if isinstance(spec, MLAAttentionSpec) or not isinstance(
        spec, FullAttentionSpec | SlidingWindowSpec
    ):
        raise KVOffloadConfigError(
            f"kvoffload supports full attention with separate K and V, not {kind}"
        )
    if spec.kv_quant_mode not in (KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR):
        raise KVOffloadConfigError(
            f"kvoffload does not support KV-cache quantization mode {spec.kv_quant_mode!r}: "
            "its pages hold scales or packed values besides K and V"
        )
    if spec.kv_quant_mode != KVQuantMode.NONE and not quant_ok:
        # Scales computed from the first batch differ between engines, so the
        # same fp8 bytes would mean different values in each.
        raise KVOffloadConfigError(
            "kvoffload does not support a quantized KV cache with calculate_kv_scales"
        )
    if spec.num_head_slots is not None or spec.state_content_bytes is not None:
        raise KVOffloadConfigError(f"kvoffload does not support packed KV pages ({kind})")
    if spec.tokens_per_state != 1:
        raise KVOffloadConfigError(
            f"kvoffload needs one KV state per token, {kind} has {spec.tokens_per_state}"
        )
    if spec.head_size_v != spec.head_size:
        raise KVOffloadConfigError(
            f"kvoffload needs equal K and V head sizes, got {spec.head_size} and {spec.head_size_v}"
        )
    return KVSpec(
        block_size=int(spec.block_size),
        num_kv_heads=int(spec.num_kv_heads),
        head_dim=int(spec.head_size),
        dtype=spec.dtype,
        layer_names=tuple(layer_names),
    )


def needs_groups(kv_cache_config: Any) -> bool:
    """Whether the model's chunks are stored per KV-cache group (contract-v1 §7):
    more than one group, or one group that is not full attention (its blocks
    outside the window or state are not kept, so it cannot be stored as one)."""
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    groups = kv_cache_config.kv_cache_groups
    return len(groups) != 1 or isinstance(groups[0].kv_cache_spec, SlidingWindowSpec | MambaSpec)


def _no_attention() -> KVSpec:
    raise KVOffloadConfigError("kvoffload needs at least one attention KV-cache group")


@dataclass(frozen=True)
class GroupSpec:
    """One KV-cache group as the connector uses it."""

    index: int
    kind: str
    block_size: int
    layer_names: tuple[str, ...]
    #: Attention groups: heads, head size, dtype (a ``common.KVSpec``).
    attn: Any = None
    sliding_window: int | None = None
    extra_retained_tokens: int = 0
    mamba_cache_mode: str | None = None
    #: Mamba groups: the bytes of one layer's state page (without padding),
    #: and a canonical description of its tensors (shapes, dtypes, type).
    state_bytes: int = 0
    state: str | None = None

    def window_chunks(self, chunk_tokens: int) -> int:
        """Chunks a sliding-window group needs before a hit boundary."""
        if self.sliding_window is None:
            raise ValueError("not a sliding-window group")
        need = self.sliding_window - 1 + self.extra_retained_tokens
        return max(1, -(-need // chunk_tokens))

    def kv_group(self, num_groups: int, layers: Sequence[int]) -> KVGroup:
        return KVGroup(
            index=self.index,
            num_groups=num_groups,
            kind=self.kind,
            layers=tuple(layers),
            sliding_window=self.sliding_window,
            mamba_cache_mode=self.mamba_cache_mode,
            extra_retained_tokens=self.extra_retained_tokens or None,
            state=self.state,
        )


def group_contract(
    one: CompatContract, group: GroupSpec, num_groups: int, layers: Sequence[int]
) -> CompatContract:
    """The contract of ``group``'s chunks: the engine's, with the group's own block
    size, layer layout and ``kv_group`` (contract-v1.md §7)."""
    if group.attn is not None:
        layout = LayerLayout(
            num_layers=len(layers),
            num_kv_heads=group.attn.num_kv_heads,
            head_dim=group.attn.head_dim,
            cache_layout=one.layer_layout.cache_layout,
        )
    else:
        # A Mamba page has no heads: kv_group.state describes its tensors.
        layout = LayerLayout(num_layers=len(layers), num_kv_heads=1, head_dim=1)
    return dataclasses.replace(
        one,
        block_size=group.block_size,
        layer_layout=layout,
        kv_group=group.kv_group(num_groups, layers),
    )


def describe_groups(
    kv_cache_config: Any, check_attention: Callable[[Any, Sequence[str]], Any]
) -> list[GroupSpec]:
    """Every group of a hybrid model, or a refusal naming what is not supported.

    ``check_attention`` turns an attention spec into a ``common.KVSpec`` (or
    refuses it, as it does for a one-group model).
    """
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    out: list[GroupSpec] = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        names = tuple(group.layer_names)
        kind = type(spec).__name__
        if isinstance(spec, UniformTypeKVCacheSpecs):
            raise KVOffloadConfigError(
                f"kvoffload does not support KV-cache group {i} of per-layer specs ({kind})"
            )
        if getattr(group, "is_eagle_group", False):
            raise KVOffloadConfigError(
                f"kvoffload does not support speculative-decoding draft KV-cache groups (group {i})"
            )
        if type(spec) is FullAttentionSpec:
            out.append(
                GroupSpec(i, FULL, int(spec.block_size), names, attn=check_attention(spec, names))
            )
        elif type(spec) is SlidingWindowSpec:
            out.append(
                GroupSpec(
                    i,
                    SLIDING,
                    int(spec.block_size),
                    names,
                    attn=check_attention(spec, names),
                    sliding_window=int(spec.sliding_window),
                    extra_retained_tokens=int(spec.extra_retained_tokens),
                )
            )
        elif type(spec) is MambaSpec:
            if spec.mamba_cache_mode != "align":
                raise KVOffloadConfigError(
                    f"kvoffload needs mamba_cache_mode='align' for Mamba KV-cache group {i} "
                    f"(got {spec.mamba_cache_mode!r}): only aligned states can be reused"
                )
            if spec.num_speculative_blocks:
                raise KVOffloadConfigError(
                    "kvoffload does not support Mamba groups with speculative blocks"
                )
            shapes = ";".join(
                f"{'x'.join(str(d) for d in shape)}:{str(dt).removeprefix('torch.')}"
                for shape, dt in zip(spec.shapes, spec.dtypes, strict=True)
            )
            out.append(
                GroupSpec(
                    i,
                    MAMBA,
                    int(spec.block_size),
                    names,
                    mamba_cache_mode=str(spec.mamba_cache_mode),
                    state_bytes=int(spec.real_page_size_bytes),
                    state=f"{spec.mamba_type.name}:{shapes}",
                )
            )
        else:
            raise KVOffloadConfigError(
                f"kvoffload supports full-attention, sliding-window and Mamba KV-cache groups, "
                f"not group {i} of {kind}"
            )
    return out


def check_chunking(groups: Sequence[GroupSpec], chunk_tokens: int) -> int | None:
    """Refuse chunking the groups cannot share; the Mamba alignment in chunks, if any."""
    align: int | None = None
    for g in groups:
        if g.kind == MAMBA:
            if g.block_size % chunk_tokens == 0:
                a = g.block_size // chunk_tokens
            elif chunk_tokens % g.block_size == 0:
                a = 1
            else:
                raise KVOffloadConfigError(
                    f"kv_connector_extra_config.chunk_tokens ({chunk_tokens}) and the Mamba "
                    f"block size ({g.block_size}) must divide one another"
                )
            align = a if align is None else max(align, a)
        elif chunk_tokens % g.block_size:
            raise KVOffloadConfigError(
                f"kv_connector_extra_config.chunk_tokens ({chunk_tokens}) must be a multiple "
                f"of every KV-cache group's block size (group {g.index}: {g.block_size})"
            )
    return align


#: ``present(group, lo, hi)``: how many leading chunks of ``[lo, hi)`` the
#: store holds for that group, on every shard.
Present = Callable[[int, int, int], int]


def _sliding_end(group: int, window: int, bound: int, present: Present) -> int:
    """The largest ``e <= bound`` whose window ``[e - window, e)`` is held."""
    end = bound
    while end > 0:
        lo = max(0, end - window)
        n = present(group, lo, end)
        if n >= end - lo:
            return end
        end = lo + n  # chunk lo + n is missing: every window over it fails
    return 0


def _mamba_end(group: int, align: int, bound: int, present: Present) -> int:
    """The largest aligned ``e <= bound`` whose state (chunk ``e - 1``) is held."""
    end = bound - bound % align
    while end > 0:
        if present(group, end - 1, end) >= 1:
            return end
        end -= align
    return 0


def hit_boundary(
    groups: Sequence[GroupSpec],
    chunk_tokens: int,
    bound: int,
    start_tokens: int,
    present: Present,
    mamba_align: int | None = None,
) -> int:
    """Chunks ``[0, result)`` form a hit every group can serve (0: none beyond
    ``start_tokens``, where vLLM's own cache ends)."""
    align = mamba_align or 1
    boundary = bound - bound % align
    while boundary * chunk_tokens > start_tokens:
        before = boundary
        for g in groups:
            if g.kind == FULL:
                boundary = min(boundary, present(g.index, 0, boundary))
            elif g.kind == SLIDING:
                boundary = _sliding_end(g.index, g.window_chunks(chunk_tokens), boundary, present)
            else:
                boundary = _mamba_end(g.index, align, boundary, present)
            boundary -= boundary % align
            if boundary * chunk_tokens <= start_tokens:
                return 0
        if boundary == before:
            return boundary
    return 0


__all__ = [
    "FULL",
    "MAMBA",
    "SLIDING",
    "GroupSpec",
    "KVSpec",
    "attention_spec",
    "check_chunking",
    "describe_groups",
    "group_contract",
    "hit_boundary",
    "kv_spec_of",
    "needs_groups",
]
