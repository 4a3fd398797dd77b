"""Fixtures of the vLLM tier: a tiny model folder and a real sidecar process.

Loaded by pytest in every environment, so nothing here imports vLLM (the
main venv has none); the test modules skip themselves without it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local model folder: config.json of a 2-layer Llama, no weights, no tokenizer."""
    pytest.importorskip("transformers")
    from .engine import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@dataclass(frozen=True)
class Sidecar:
    socket_path: Path
    store_root: Path
    proc: subprocess.Popen[bytes]

    def object_path(self, tenant: str, key: bytes) -> Path:
        """Where layout v1 puts a chunk's object (layouts/v1.md §2)."""
        h = key.hex()
        return self.store_root / "objects" / tenant / h[:2] / h[2:4] / f"{h}.kvo"


#: The sidecar's one tenant with ``encryption = "none"`` and ``direct = true``.
DIRECT_TENANT = "vllm-direct"


@pytest.fixture(scope="session")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    """``kvoffload --dev serve`` in a temp folder: embedded store under ./.kvoffload."""
    pytest.importorskip("kvoffload.sidecar.server")
    cwd = tmp_path_factory.mktemp("sidecar")
    log = (cwd / "sidecar.log").open("wb")
    # The dev policy (this uid: every tenant, admin), plus one plaintext
    # tenant with the direct path for the tests of it.
    policy = cwd / "policy.toml"
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
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    env["KVOFFLOAD_POLICY"] = str(policy)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvoffload.cli", "--dev", "serve"],
        cwd=cwd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    sock = cwd / ".kvoffload" / "kvoffload.sock"
    deadline = time.monotonic() + 60
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.close()
            pytest.fail(f"sidecar did not start:\n{(cwd / 'sidecar.log').read_text()}")
        time.sleep(0.05)
    try:
        yield Sidecar(sock, cwd / ".kvoffload" / "store", proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def tenant() -> str:
    """A fresh tenant per test: its own salt, so tests never see each other's chunks."""
    return f"t-{uuid.uuid4().hex[:12]}"
