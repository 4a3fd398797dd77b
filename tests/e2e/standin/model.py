"""The tiny transformers Llama the stand-in runs, made batch-invariant.

A test double (see the package docstring).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from .common import LAYER_NAME

if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM

ROW_ATTENTION = "kvoffload_standin_row_attention"


def _row_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention one query position at a time.

    ``query`` is ``[1, Hq, q, D]``, ``key``/``value`` ``[1, Hkv, kv, D]`` with the
    step's q tokens last (the runner never pads, so no mask is needed). Position
    ``p`` reduces over exactly keys ``0..p`` with the same shapes whatever else
    the step holds; GQA repeats KV heads as transformers' ``repeat_kv`` does.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    groups = query.shape[1] // key.shape[1]
    keys = key.repeat_interleave(groups, dim=1)
    values = value.repeat_interleave(groups, dim=1)
    out = query.new_empty(query.shape[0], q_len, query.shape[1], query.shape[3])
    for i in range(q_len):
        p = kv_len - q_len + i
        scores = torch.matmul(query[:, :, i : i + 1], keys[:, :, : p + 1].transpose(2, 3))
        probs = torch.softmax(scores * scaling, dim=-1, dtype=torch.float32).to(query.dtype)
        out[:, i] = torch.matmul(probs, values[:, :, : p + 1])[:, :, 0]
    return out, None


def _register_row_attention() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(ROW_ATTENTION, _row_attention)
    return ROW_ATTENTION


def _row_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    out = torch.cat([torch.nn.functional.linear(rows[i : i + 1], self.weight, self.bias)
                     for i in range(rows.shape[0])])  # fmt: skip
    return out.reshape(*x.shape[:-1], out.shape[-1])


def make_batch_invariant(model: torch.nn.Module) -> None:
    """Make every linear layer compute one row at a time.

    BLAS picks its kernels by the shape of the whole batch: the same token's
    row comes out with different low bits from a 200-row prefill, a 170-row
    prefill or a 1-row decode step (measured: up to ~5e-6 in the logits with
    MKL), so "prefix loaded + suffix computed" could never be compared bit for
    bit with "all computed". With every GEMM at one row, and attention one
    position at a time (:func:`_row_attention`), all that remains per row is
    the same shapes in the same order. vLLM has the same problem on GPUs and
    the same cure (``VLLM_BATCH_INVARIANT``).
    """
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = types.MethodType(_row_linear, module)  # type: ignore[method-assign]


@dataclass(frozen=True)
class TinyLlamaSpec:
    """A Llama small enough for two CPU cores, random weights from ``weight_seed``.

    ``weight_seed`` stands for the model revision: two specs that differ only
    in it are two revisions of one architecture, whose KV must never be mixed.
    ``initializer_range`` is 0.1 rather than Llama's 0.02 so that logits spread
    wide enough for greedy tokens to depend on the context (with 0.02 a wrong
    KV could still yield the same argmax).
    """

    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    initializer_range: float = 0.1
    weight_seed: int = 0
    #: Compute every token position by itself (see :func:`make_batch_invariant`):
    #: its KV and logits are then a function of the tokens up to it and of
    #: nothing else, so any difference between two runs is a difference in the
    #: KV they attended to.
    batch_invariant: bool = True
    #: transformers' attention when ``batch_invariant`` is off ("eager", "sdpa").
    attn_implementation: str = "eager"

    @property
    def model_revision(self) -> str:
        """What a compatibility contract's ``model_revision`` would say."""
        return (
            f"tiny-llama-l{self.num_layers}-h{self.hidden_size}-kv{self.num_kv_heads}"
            f"x{self.head_dim}-v{self.vocab_size}@seed{self.weight_seed}"
        )

    @property
    def rope_config(self) -> dict[str, Any]:
        return {"rope_type": "default", "rope_theta": self.rope_theta}

    def layer_names(self) -> list[str]:
        return [LAYER_NAME.format(i) for i in range(self.num_layers)]

    def hf_config(self) -> LlamaConfig:
        from transformers import LlamaConfig

        # Not a declared LlamaConfig field: PretrainedConfig takes it from kwargs.
        extra: dict[str, Any] = {
            "attn_implementation": (
                _register_row_attention() if self.batch_invariant else self.attn_implementation
            )
        }
        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=self.rope_config,
            initializer_range=self.initializer_range,
            tie_word_embeddings=False,
            **extra,
        )

    def build_model(self, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
        """The model, deterministic in ``weight_seed`` (the caller's RNG is left alone)."""
        from transformers import LlamaForCausalLM

        with torch.random.fork_rng():
            torch.manual_seed(self.weight_seed)
            model: Any = LlamaForCausalLM(self.hf_config())  # type: ignore[no-untyped-call]
        model = model.to(dtype).eval()
        model.requires_grad_(False)
        if self.batch_invariant:
            make_batch_invariant(model)
        return cast("LlamaForCausalLM", model)
