"""Shared fixtures: real stores on real files, real LMDB, real AES-GCM."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvoffload.contract import CompatContract, LayerLayout, Shard

if TYPE_CHECKING:
    from .sidecar_proc import Procs


def make_contract(**overrides: object) -> CompatContract:
    base: dict[str, object] = {
        "model_revision": "llama-tiny@seed0",
        "tokenizer_hash": "tok-3f1c",
        "chat_template_version": "v1",
        "attention_backend": "FLASH_ATTN",
        "kv_dtype": "bfloat16",
        "block_size": 16,
        "layer_layout": LayerLayout(num_layers=4, num_kv_heads=2, head_dim=64),
        "rope_config": {"rope_theta": 10000.0, "rope_scaling": None},
        "lora_id": None,
        "tenant_namespace": "acme",
        "shard": Shard(),
        "chunk_tokens": 64,
    }
    base.update(overrides)
    return CompatContract(**base)  # type: ignore[arg-type]


@pytest.fixture
def contract() -> CompatContract:
    return make_contract()


@pytest.fixture
def kek_file(tmp_path: Path) -> Path:
    p = tmp_path / "kek"
    p.write_bytes(os.urandom(32))
    p.chmod(0o600)
    return p


@pytest.fixture
def store(tmp_path: Path, kek_file: Path) -> Iterator[object]:
    from .helpers.stores import open_store

    s = open_store(tmp_path, kek_file)
    yield s
    s.close()


# -- short directories for Unix sockets ---------------------------------------------


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A fresh directory under /tmp for a server's socket: AF_UNIX paths are limited
    to 107 bytes and pytest's tmp_path can be longer."""
    d = Path(tempfile.mkdtemp(prefix="kvo-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """Like ``sock_dir``, for a working directory whose socket path must fit sun_path
    whatever the test's name (a CLI's cwd, a sidecar's state)."""
    with tempfile.TemporaryDirectory(prefix="kvo-d-", dir="/tmp") as d:
        yield Path(d)


@pytest.fixture
def direct_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory whose file system takes O_DIRECT (see ``helpers.direct_reads``)."""
    from .helpers.direct_reads import direct_dirs

    yield from direct_dirs(tmp_path)


@pytest.fixture
def wired(tmp_path: Path, kek_file: Path) -> Iterator[object]:
    """A real store with the sidecar's events wired in and a consumer of its stream."""
    from .helpers.events import wired_store

    yield from wired_store(tmp_path, kek_file)


# -- real daemon and client processes (tests/sidecar_proc.py) -----------------------


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A fresh directory under /tmp: AF_UNIX paths are limited to 107 bytes and
    pytest's tmp_path can be longer."""
    d = Path(tempfile.mkdtemp(prefix="kvo-p-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def procs(workdir: Path) -> Iterator[Procs]:
    """Every process a test starts; killed (before ``workdir`` goes) at the end."""
    # Imported here: some tests load this file as a top-level module (no package).
    from .sidecar_proc import Procs

    registry = Procs()
    try:
        yield registry
    finally:
        registry.close()
        # Shown by pytest only when the test failed.
        for s in registry.sidecars:
            print(f"----- {s.log_path} -----\n{s.log_text()}")
        for c in registry.children:
            if c.stderr:
                print(f"----- child {c.pid} stderr -----\n{c.stderr}")
