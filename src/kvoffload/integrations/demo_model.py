"""Cross-process KV reuse through the sidecar, on a random-weight Llama on CPU.

A library of small steps, used by ``kvoffload demo`` and ``scripts/bench_ttft.py``:

* :func:`llama_config` / :func:`build_model`: a transformers Llama whose
  weights come from a seed; the seed stands for the model revision.
* :func:`demo_contract`: the :class:`~kvoffload.contract.CompatContract` of
  such a model (``model_revision = "demo-llama@seed<N>"``, tokenizer hash,
  layer layout, KV dtype, RoPE, ...).
* :func:`prefill`: KV and last-position logits of a whole prompt;
  :func:`prefill_suffix`: the same for the tokens after a cached prefix.
* :func:`pack_chunks` / :class:`PrefixBuffer`: between a model's KV and
  kvoffload chunks. A chunk holds one buffer per layer: K then V of the
  chunk's tokens, each ``[kv_heads, chunk_tokens, head_dim]`` (HND), contiguous.
* :func:`reuse_prefill`: what a worker does to serve a prompt with reuse:
  chunk keys, ``lookup``, ``load`` into a prefix buffer, a ``DynamicCache``
  from it, and a prefill of the suffix only.

The demo that runs these steps in worker processes sharing nothing but the
sidecar is :mod:`kvoffload.integrations.demo_run`.

This module imports torch (transformers only inside the functions that need it;
both come with ``pip install 'kvoffload[demo]'``). What needs neither, the
model's shape and the demo's settings (:class:`ModelShape`, :class:`DemoConfig`),
lives in :mod:`kvoffload.integrations.demo_config` and is re-exported here, so
that the CLI checks its options before importing torch. Everything runs in float32.

Exactness: "prefix loaded + suffix computed" attends to the very KV bytes a
full prefill computes, so the logits differ only where the BLAS kernels that
PyTorch picks by the *shape* of a GEMM (a 32-row suffix versus a 1056-row
prompt) round differently. :func:`logits_tolerance` is the bound used: 1e-4 of
the largest logit (at least 1e-4), a hundred times the ~1e-6 relative error
such re-associations produce over a dozen layers of fp32 sums of a few
thousand terms, while a wrong KV (another prefix, another revision) moves
logits by the order of their spread (~0.1-1). Measured on CPU, the difference
is usually exactly 0.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..contract import CompatContract, LayerLayout
from ..keys import chunk_keys
from ..protocol import ALIGNMENT, region_size
from .demo_config import (  # the torch-free part of the demo, re-exported
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_TENANT,
    ModelShape,
)
from .demo_config import TRANSFORMERS_MISSING as TRANSFORMERS_MISSING
from .demo_config import demo_deps_message as demo_deps_message
from .demo_config import demo_deps_missing as demo_deps_missing
from .demo_config import transformers_available as transformers_available

CACHE_LAYOUT = "HND"
#: Relative logits tolerance (see the module docstring and :func:`logits_tolerance`).
LOGITS_RTOL = 1e-4
#: Largest staging buffer a demo worker maps.
MAX_STAGING_BYTES = 512 << 20
WORKER_TIMEOUT_S = 900.0
SIDECAR_READY_TIMEOUT_S = 60.0

# --------------------------------------------------------------------------- the model


def llama_config(shape: ModelShape, *, attn_implementation: str = "sdpa") -> Any:
    """A ``transformers.LlamaConfig`` for ``shape``."""
    from transformers import LlamaConfig

    cls: Any = LlamaConfig
    return cls(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.ffn_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        # transformers 5 folds rope_theta into rope_parameters; 4.57 keeps it as is.
        rope_theta=shape.rope_theta,
        initializer_range=shape.initializer_range,
        tie_word_embeddings=False,
        attn_implementation=attn_implementation,
    )


def build_model(config: Any, seed: int, dtype: torch.dtype = torch.float32) -> Any:
    """A ``LlamaForCausalLM`` with random weights drawn from ``seed`` (the caller's RNG is
    left alone), in eval mode, without gradients."""
    from transformers import LlamaForCausalLM

    cls: Any = LlamaForCausalLM
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = cls(config)
    model = model.to(dtype).eval()
    model.requires_grad_(False)
    return model


def model_revision(seed: int) -> str:
    """What the contract says the model is: the seed stands for the checkpoint's revision."""
    return f"demo-llama@seed{seed}"


def tokenizer_hash(config: Any) -> str:
    """The demo has no tokenizer: prompts are random ids below ``vocab_size``."""
    ident = f"kvoffload-demo/random-token-ids/vocab={config.vocab_size}"
    return hashlib.blake2b(ident.encode(), digest_size=16).hexdigest()


def rope_config(config: Any) -> dict[str, Any]:
    """RoPE parameters of ``config`` (transformers 5: ``rope_parameters``; 4.x: ``rope_theta``
    and ``rope_scaling``)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        return dict(params)
    out: dict[str, Any] = {"rope_type": "default", "rope_theta": float(config.rope_theta)}
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        out["rope_scaling"] = dict(scaling)
    return out


def layer_layout(config: Any) -> LayerLayout:
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads
    )
    return LayerLayout(
        num_layers=int(config.num_hidden_layers),
        num_kv_heads=int(config.num_key_value_heads),
        head_dim=int(head_dim),
        cache_layout=CACHE_LAYOUT,
    )


def demo_contract(
    config: Any,
    seed: int,
    *,
    tenant: str = DEFAULT_TENANT,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    block_size: int = DEFAULT_BLOCK_SIZE,
    dtype: torch.dtype = torch.float32,
) -> CompatContract:
    """The compatibility contract of ``build_model(config, seed)`` computing in ``dtype``."""
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    return CompatContract(
        model_revision=model_revision(seed),
        tokenizer_hash=tokenizer_hash(config),
        chat_template_version="none",
        attention_backend=f"TRANSFORMERS_{str(impl).upper()}_CPU",
        kv_dtype=str(dtype).removeprefix("torch."),
        block_size=block_size,
        chunk_tokens=chunk_tokens,
        layer_layout=layer_layout(config),
        rope_config=rope_config(config),
        tenant_namespace=tenant,
    )


def random_tokens(n: int, vocab_size: int, seed: int) -> list[int]:
    """``n`` token ids below ``vocab_size``, a pure function of ``seed``."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, vocab_size, n)]


# --------------------------------------------------------------------------- prefill


@dataclass
class Prefill:
    """Logits of the last position (float32 ``[vocab]``) and the KV of every position of
    every layer (``[kv_heads, tokens, head_dim]`` each, views of the model's cache)."""

    logits: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def num_tokens(self) -> int:
        return int(self.keys[0].shape[1]) if self.keys else 0


def new_cache(config: Any) -> Any:
    from transformers import DynamicCache

    cls: Any = DynamicCache
    try:
        return cls(config=config)
    except TypeError:  # transformers < 4.56
        return cls()


def _layer_kv(cache: Any, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[i].keys, layers[i].values
    return cache.key_cache[i], cache.value_cache[i]


def _forward(model: Any, token_ids: Sequence[int], start: int, cache: Any) -> torch.Tensor:
    """Run positions ``start..start+len(token_ids)`` over ``cache`` (which holds ``start``
    positions); float32 logits of the last one."""
    ids = torch.tensor([list(token_ids)], dtype=torch.int64)
    positions = torch.arange(start, start + len(token_ids), dtype=torch.int64).unsqueeze(0)
    with torch.inference_mode():
        out = model(
            input_ids=ids,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
    logits: torch.Tensor = out.logits[0, -1].float()
    return logits


def prefill(model: Any, token_ids: Sequence[int]) -> Prefill:
    """A full prefill of ``token_ids``: what a worker without reuse computes."""
    if not token_ids:
        raise ValueError("nothing to prefill")
    cache = new_cache(model.config)
    logits = _forward(model, token_ids, 0, cache)
    kv = [_layer_kv(cache, i) for i in range(model.config.num_hidden_layers)]
    return Prefill(logits, [k[0] for k, _ in kv], [v[0] for _, v in kv])


def prefill_suffix(
    model: Any, token_ids: Sequence[int], cache: Any, start: int | None = None
) -> torch.Tensor:
    """Prefill ``token_ids[start:]`` over ``cache``, which holds the KV of
    ``token_ids[:start]`` (default: however many positions it holds); last logits."""
    cached = int(cache.get_seq_length())
    start = cached if start is None else start
    if start != cached:
        raise ValueError(f"the cache holds {cached} positions, the suffix starts at {start}")
    if start >= len(token_ids):
        raise ValueError(f"no suffix: {start} of {len(token_ids)} tokens are cached")
    return _forward(model, token_ids[start:], start, cache)


def cache_from_kv(config: Any, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> Any:
    """A ``DynamicCache`` holding ``keys``/``values`` (``[kv_heads, tokens, head_dim]`` per
    layer), as transformers lays them out: ``[batch=1, kv_heads, tokens, head_dim]``."""
    cache = new_cache(config)
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        cache.update(k.unsqueeze(0), v.unsqueeze(0), i)
    return cache


# --------------------------------------------------------------------------- chunks


def chunk_layer_bytes(layout: LayerLayout, chunk_tokens: int, dtype: torch.dtype) -> int:
    """Bytes of one layer of one chunk: K then V, ``[kv_heads, chunk_tokens, head_dim]`` each."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * layout.num_kv_heads * chunk_tokens * layout.head_dim * elem


def pack_chunks(
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    chunk_tokens: int,
    num_chunks: int | None = None,
) -> list[list[torch.Tensor]]:
    """The first ``num_chunks`` (default: every full) chunks of a prefill's KV, as kvoffload
    chunks: per chunk, one contiguous tensor per layer, ``[2, kv_heads, chunk_tokens,
    head_dim]`` (K then V)."""
    total = int(keys[0].shape[1])
    full = total // chunk_tokens
    n = full if num_chunks is None else num_chunks
    if not 0 <= n <= full:
        raise ValueError(f"{total} tokens hold {full} full chunks, not {n}")
    chunks: list[list[torch.Tensor]] = []
    for c in range(n):
        s, e = c * chunk_tokens, (c + 1) * chunk_tokens
        chunks.append(
            [torch.stack((k[:, s:e], v[:, s:e])) for k, v in zip(keys, values, strict=True)]
        )
    return chunks


class PrefixBuffer:
    """KV of ``num_chunks`` chunks, filled chunk by chunk from loaded layer buffers.

    :meth:`fill` has the signature of ``SidecarClient.load``'s ``into`` callback,
    so a load copies each layer straight from the staging buffer into place.
    """

    def __init__(
        self,
        layout: LayerLayout,
        chunk_tokens: int,
        num_chunks: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if layout.cache_layout != CACHE_LAYOUT:
            raise ValueError(f"chunks are packed {CACHE_LAYOUT}, not {layout.cache_layout}")
        self.layout = layout
        self.chunk_tokens = chunk_tokens
        self.num_chunks = num_chunks
        self.dtype = dtype
        self.layer_bytes = chunk_layer_bytes(layout, chunk_tokens, dtype)
        shape = (layout.num_kv_heads, num_chunks * chunk_tokens, layout.head_dim)
        self.keys = [torch.empty(shape, dtype=dtype) for _ in range(layout.num_layers)]
        self.values = [torch.empty(shape, dtype=dtype) for _ in range(layout.num_layers)]
        # Byte views ([H, T, D * elem] uint8) that numpy can copy into, for any dtype.
        self._k = [t.view(torch.uint8).numpy() for t in self.keys]
        self._v = [t.view(torch.uint8).numpy() for t in self.values]
        self.filled = [False] * num_chunks

    def fill(self, index: int, _key: bytes, layers: Sequence[memoryview]) -> None:
        """Copy chunk ``index``'s layers (K then V each) into place."""
        if not 0 <= index < self.num_chunks:
            raise IndexError(f"chunk {index} of {self.num_chunks}")
        if len(layers) != self.layout.num_layers:
            raise ValueError(
                f"chunk {index}: {len(layers)} layers, expected {self.layout.num_layers}"
            )
        h, c = self.layout.num_kv_heads, self.chunk_tokens
        s, e = index * c, (index + 1) * c
        for i, view in enumerate(layers):
            if view.nbytes != self.layer_bytes:
                raise ValueError(
                    f"chunk {index} layer {i}: {view.nbytes} bytes, expected {self.layer_bytes}"
                )
            src = np.frombuffer(view, dtype=np.uint8).reshape(2, h, c, -1)
            np.copyto(self._k[i][:, s:e], src[0])
            np.copyto(self._v[i][:, s:e], src[1])
        self.filled[index] = True

    def leading(self) -> int:
        """How many leading chunks are filled."""
        n = 0
        while n < self.num_chunks and self.filled[n]:
            n += 1
        return n

    def to_cache(self, config: Any, num_chunks: int | None = None) -> Any:
        """A ``DynamicCache`` of the first ``num_chunks`` (default: the leading filled) chunks."""
        n = self.leading() if num_chunks is None else num_chunks
        t = n * self.chunk_tokens
        return cache_from_kv(config, [k[:, :t] for k in self.keys], [v[:, :t] for v in self.values])


def unpack_chunks(
    config: Any,
    chunks: Sequence[Sequence[Any]],
    chunk_tokens: int,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """A ``DynamicCache`` prefix from loaded chunks (each: one bytes-like per layer)."""
    buf = PrefixBuffer(layer_layout(config), chunk_tokens, len(chunks), dtype)
    for i, layers in enumerate(chunks):
        buf.fill(i, b"", [memoryview(x).cast("B") for x in layers])
    return buf.to_cache(config)


def staging_bytes_for(
    layout: LayerLayout, chunk_tokens: int, num_chunks: int, dtype: torch.dtype = torch.float32
) -> int:
    """A staging buffer that holds ``num_chunks`` chunks at once (capped)."""
    per_chunk = region_size([chunk_layer_bytes(layout, chunk_tokens, dtype)] * layout.num_layers)
    want = max(1, num_chunks) * per_chunk
    return max(ALIGNMENT, min(want, max(per_chunk, MAX_STAGING_BYTES)))


# --------------------------------------------------------------------------- reuse


@dataclass
class ReuseResult:
    """One prompt served with reuse: what was found, loaded and computed, and how long each
    step took (seconds)."""

    logits: torch.Tensor
    lookup_chunks: int
    reused_chunks: int
    reused_tokens: int
    loaded_bytes: int
    prefix: PrefixBuffer | None
    keys_s: float
    lookup_s: float
    load_s: float
    cache_s: float
    compute_s: float

    @property
    def total_s(self) -> float:
        return self.keys_s + self.lookup_s + self.load_s + self.cache_s + self.compute_s


def reuse_prefill(
    model: Any,
    client: Any,
    contract: CompatContract,
    token_ids: Sequence[int],
    *,
    dtype: torch.dtype = torch.float32,
    clock: Callable[[], float] = time.perf_counter,
) -> ReuseResult:
    """Serve ``token_ids`` as a worker with kvoffload does: chunk keys, lookup, load the
    leading chunks found (at most all but the last token, so one position is computed),
    and prefill only the rest. ``client`` is a connected ``SidecarClient``."""
    t0 = clock()
    salt = client.salt
    if salt is None:
        raise RuntimeError("the sidecar is not reachable")
    keys = chunk_keys(contract, salt, token_ids)
    t1 = clock()
    found = client.lookup(keys)
    # A full hit still computes one position: the first token needs its logits.
    n = min(found, (len(token_ids) - 1) // contract.chunk_tokens)
    t2 = clock()
    prefix: PrefixBuffer | None = None
    reused = 0
    if n:
        prefix = PrefixBuffer(contract.layer_layout, contract.chunk_tokens, n, dtype)
        client.load(keys[:n], into=prefix.fill)
        reused = prefix.leading()
    t3 = clock()
    if prefix is not None and reused:
        cache = prefix.to_cache(model.config, reused)
    else:
        cache = new_cache(model.config)
    t4 = clock()
    logits = prefill_suffix(model, token_ids, cache, reused * contract.chunk_tokens)
    t5 = clock()
    loaded = reused * (prefix.layer_bytes * contract.layer_layout.num_layers if prefix else 0)
    return ReuseResult(
        logits=logits,
        lookup_chunks=found,
        reused_chunks=reused,
        reused_tokens=reused * contract.chunk_tokens,
        loaded_bytes=loaded,
        prefix=prefix,
        keys_s=t1 - t0,
        lookup_s=t2 - t1,
        load_s=t3 - t2,
        cache_s=t4 - t3,
        compute_s=t5 - t4,
    )


class StreamedPrefix:
    """A :class:`PrefixBuffer` filled layer by layer by ``SidecarClient.load_layerwise``,
    with one event per layer: set when that layer of every chunk is in place, or
    when the load ended (then :attr:`complete` says whether all of it arrived)."""

    def __init__(
        self, layout: LayerLayout, chunk_tokens: int, num_chunks: int, dtype: torch.dtype
    ) -> None:
        self.buf = PrefixBuffer(layout, chunk_tokens, num_chunks, dtype)
        self.ready = [threading.Event() for _ in range(layout.num_layers)]
        self._count = [0] * layout.num_layers
        self.complete = False
        self.error: BaseException | None = None

    def on_layer(self, layer: int, first: int, views: Sequence[memoryview]) -> None:
        b = self.buf
        h, c = b.layout.num_kv_heads, b.chunk_tokens
        for j, view in enumerate(views):
            if view.nbytes != b.layer_bytes:
                raise ValueError(f"layer {layer}: {view.nbytes} bytes, expected {b.layer_bytes}")
            s, e = (first + j) * c, (first + j + 1) * c
            src = np.frombuffer(view, dtype=np.uint8).reshape(2, h, c, -1)
            np.copyto(b._k[layer][:, s:e], src[0])
            np.copyto(b._v[layer][:, s:e], src[1])
        self._count[layer] += len(views)
        if self._count[layer] >= b.num_chunks:
            self.ready[layer].set()

    def load(self, client: Any, keys: Sequence[bytes]) -> None:
        """Run the load (on a thread of its own); every event is set when it ends."""
        try:
            results = client.load_layerwise(keys, self.on_layer)
            self.complete = all(r.ok for r in results)
        except BaseException as exc:
            self.error = exc
        finally:
            for ev in self.ready:
                ev.set()


def streamed_cache(config: Any, prefix: StreamedPrefix, tokens: int) -> Any:
    """A ``DynamicCache`` that says it holds ``tokens`` positions and takes each layer's
    prefix from ``prefix`` when the model's attention first reaches that layer,
    waiting for it there: the model computes layer i while layer i+1 loads."""
    from transformers.cache_utils import DynamicLayer

    class _Streamed(DynamicLayer):  # type: ignore[no-untyped-call]
        def __init__(self, index: int) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self._index = index

        def get_seq_length(self) -> int:
            return tokens if not self.is_initialized else int(super().get_seq_length())

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *a: Any, **kw: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                # Set once this layer of every chunk is in place, or the load
                # ended short (the caller then throws this prefill away).
                prefix.ready[self._index].wait()
                self.lazy_initialization(key_states, value_states)
                b = prefix.buf
                self.keys = b.keys[self._index][:, :tokens].unsqueeze(0)
                self.values = b.values[self._index][:, :tokens].unsqueeze(0)
            out: tuple[torch.Tensor, torch.Tensor] = super().update(key_states, value_states)
            return out

    cache = new_cache(config)
    cache.layers = [_Streamed(i) for i in range(config.num_hidden_layers)]
    cache.layer_class_to_replicate = None
    return cache


def reuse_prefill_layerwise(
    model: Any,
    client: Any,
    contract: CompatContract,
    token_ids: Sequence[int],
    *,
    dtype: torch.dtype = torch.float32,
    clock: Callable[[], float] = time.perf_counter,
) -> ReuseResult:
    """:func:`reuse_prefill` with a layer-wise load (protocol §5.26) overlapping the
    suffix prefill: the prefill starts at once and waits, per layer, for that layer's
    prefix KV. A load that does not deliver every chunk is thrown away and the
    prompt recomputed (the prefill ran on a prefix it did not fully have).

    ``load_s`` is the time from the start of the load to its end, ``compute_s`` the
    rest of the prefill after the load ended (0 when the load finished last)."""
    t0 = clock()
    salt = client.salt
    if salt is None:
        raise RuntimeError("the sidecar is not reachable")
    keys = chunk_keys(contract, salt, token_ids)
    t1 = clock()
    found = client.lookup(keys)
    n = min(found, (len(token_ids) - 1) // contract.chunk_tokens)
    t2 = clock()
    if not n:
        r = reuse_prefill(model, client, contract, token_ids, dtype=dtype, clock=clock)
        return r
    prefix = StreamedPrefix(contract.layer_layout, contract.chunk_tokens, n, dtype)
    ended: list[float] = []

    def run() -> None:
        prefix.load(client, keys[:n])
        ended.append(clock())

    loader = threading.Thread(target=run, name="kvoffload-demo-load")
    loader.start()
    tokens = n * contract.chunk_tokens
    cache = streamed_cache(model.config, prefix, tokens)
    try:
        logits = prefill_suffix(model, token_ids, cache, tokens)
    finally:
        loader.join()
    t5 = clock()
    if prefix.error is not None:
        raise prefix.error
    if not prefix.complete:
        # Some layer of some chunk never came: what the prefill used is not the
        # prefix. Recompute (a real engine recomputes from the failed chunk).
        full = prefill(model, token_ids)
        t6 = clock()
        return ReuseResult(full.logits, found, 0, 0, 0, None, t1 - t0, t2 - t1, 0.0, 0.0, t6 - t2)
    t_load = ended[0]
    return ReuseResult(
        logits=logits,
        lookup_chunks=found,
        reused_chunks=n,
        reused_tokens=tokens,
        loaded_bytes=n * prefix.buf.layer_bytes * contract.layer_layout.num_layers,
        prefix=prefix.buf,
        keys_s=t1 - t0,
        lookup_s=t2 - t1,
        load_s=t_load - t2,
        cache_s=0.0,
        compute_s=max(0.0, t5 - t_load),
    )


def logits_tolerance(reference: torch.Tensor) -> float:
    """Largest |difference| accepted between reuse and recompute logits (module docstring)."""
    return LOGITS_RTOL * max(1.0, float(reference.abs().max()))


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
