"""Fixtures of the vLLM tier: a tiny model folder and a real sidecar process.

Loaded by pytest in every environment, so nothing here imports vLLM (the
main venv has none); the test modules skip themselves without it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..sidecar_proc import DevSidecar, dev_sidecar


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local model folder: config.json of a 2-layer Llama, no weights, no tokenizer."""
    pytest.importorskip("transformers")
    from .engine import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


#: The sidecar's one tenant with ``encryption = "none"`` and ``direct = true``.
DIRECT_TENANT = "vllm-direct"


@pytest.fixture(scope="session")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevSidecar]:
    """``kvoffload --dev serve`` in a temp folder: embedded store under ./.kvoffload."""
    pytest.importorskip("kvoffload.sidecar.server")
    # The dev policy (this uid: every tenant, admin), plus one plaintext
    # tenant with the direct path for the tests of it.
    policy = tmp_path_factory.mktemp("policy") / "policy.toml"
    policy.write_text(
        "version = 1\n"
        f"[tenants.{DIRECT_TENANT}]\n"
        'encryption = "none"\n'
        "direct = true\n"
        "[[grants]]\n"
        f"uid = {os.getuid()}\n"
        'tenants = ["*"]\n'
        "admin = true\n"
    )
    policy.chmod(0o644)
    with dev_sidecar(env={"KVOFFLOAD_POLICY": str(policy)}) as s:
        yield s


@pytest.fixture
def tenant() -> str:
    """A fresh tenant per test: its own salt, so tests never see each other's chunks."""
    return f"t-{uuid.uuid4().hex[:12]}"
