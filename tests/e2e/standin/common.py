"""Skip markers and the layer naming the stand-in modules share."""

from __future__ import annotations

import importlib.util

import pytest

#: Skip marker for modules that build models: transformers lives only in
#: ``.venv-vllm`` (the ``vllm`` test tier), not in the main ``.venv``.
requires_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is installed only in .venv-vllm (make pytest-vllm)",
)

#: Skip marker for tests that import vLLM itself.
requires_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is installed only in .venv-vllm (make pytest-vllm)",
)

#: vLLM's attention layer names for a Llama: what connectors key layers by.
LAYER_NAME = "model.layers.{}.self_attn.attn"
