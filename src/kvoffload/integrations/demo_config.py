"""What ``kvoffload demo`` runs, without torch: the model's shape, the demo's settings,
and whether this environment can run it.

The CLI checks its options here before anything imports torch or transformers
(both are big, and neither is a dependency of the sidecar: an operator's
torch-less install gets one line saying what to install, not a traceback).
:mod:`kvoffload.integrations.demo_model` re-exports everything.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import dataclass
from typing import Any

DEFAULT_TENANT = "demo"
DEFAULT_CHUNK_TOKENS = 256
DEFAULT_BLOCK_SIZE = 16

#: The demo's Python packages (the ``demo`` extra of pyproject.toml).
DEMO_MODULES = ("torch", "transformers")

TRANSFORMERS_MISSING = (
    "the demo needs transformers, in the environment kvoffload runs from: "
    f"{sys.executable} -m pip install 'kvoffload[demo]'"
)


def transformers_available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def demo_deps_missing() -> list[str]:
    """The demo's packages this environment lacks (found without importing them)."""
    missing = []
    for name in DEMO_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a broken or hidden module counts as missing
            found = False
        if not found:
            missing.append(name)
    return missing


def demo_deps_message(missing: list[str]) -> str:
    """The one line that says what to install for the demo, and into which Python."""
    return (
        f"the demo needs {' and '.join(missing or DEMO_MODULES)}, which this environment "
        f"lacks (the sidecar needs neither): {sys.executable} -m pip install "
        "'kvoffload[demo]' (a CPU build of torch first: README.md, \"Installing without make\"), "
        "or `make demo` in a checkout"
    )


@dataclass(frozen=True)
class ModelShape:
    """A Llama architecture, without weights (JSON-friendly, for worker jobs)."""

    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 32000
    #: None: Llama's 8/3 x hidden, rounded up to a multiple of 64.
    intermediate_size: int | None = None
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    #: Llama's own init scale: logits of a random model spread over ~0.3-1.
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "vocab_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden size {self.hidden_size} is not a multiple of {self.num_heads} heads"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.num_heads} heads are not a multiple of {self.num_kv_heads} KV heads"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def ffn_size(self) -> int:
        if self.intermediate_size is not None:
            return self.intermediate_size
        return 64 * math.ceil(8 * self.hidden_size / 3 / 64)

    def kv_bytes_per_token(self, dtype: Any = None) -> int:
        """K and V of one token in every layer (``dtype``: a torch dtype; None: float32)."""
        elem = 4 if dtype is None else int(dtype.itemsize)
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    def describe(self) -> str:
        return (
            f"Llama, {self.num_layers} layers, hidden {self.hidden_size}, {self.num_heads} heads / "
            f"{self.num_kv_heads} KV heads x {self.head_dim}, FFN {self.ffn_size}, "
            f"vocab {self.vocab_size}"
        )


@dataclass(frozen=True)
class DemoConfig:
    shape: ModelShape = ModelShape()
    prompt_tokens: int = 1024
    suffix_tokens: int = 32
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    seed: int = 0
    other_seed: int = 1
    tenant: str = DEFAULT_TENANT
    threads: int = 2
    token_seed: int = 1234
    #: Rounds of (reuse, recompute) in worker B; the medians are reported.
    repeats: int = 3

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.suffix_tokens < 1:
            raise ValueError("--prompt-tokens and --suffix-tokens must be at least 1")
        if self.chunk_tokens < DEFAULT_BLOCK_SIZE or self.chunk_tokens % DEFAULT_BLOCK_SIZE:
            raise ValueError(
                f"--chunk-tokens must be a positive multiple of {DEFAULT_BLOCK_SIZE} "
                f"(the block size), got {self.chunk_tokens}"
            )
        if self.prompt_tokens < self.chunk_tokens:
            raise ValueError(
                f"--prompt-tokens {self.prompt_tokens} is shorter than one chunk "
                f"({self.chunk_tokens} tokens): nothing could be saved or reused; "
                f"use at least {self.chunk_tokens}"
            )
        if self.repeats < 1 or self.threads < 1:
            raise ValueError("--repeats and --threads must be at least 1")
        if self.seed == self.other_seed:
            raise ValueError("the other revision needs another seed")
        if self.prompt_tokens + self.suffix_tokens > self.shape.max_position_embeddings:
            raise ValueError(
                f"prompt + suffix exceed {self.shape.max_position_embeddings} positions"
            )


__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_CHUNK_TOKENS",
    "DEFAULT_TENANT",
    "DEMO_MODULES",
    "TRANSFORMERS_MISSING",
    "DemoConfig",
    "ModelShape",
    "demo_deps_message",
    "demo_deps_missing",
    "transformers_available",
]
