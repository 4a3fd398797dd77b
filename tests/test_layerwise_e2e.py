"""Layer-wise reuse with a real transformers model (random weights) through a real sidecar.

The suffix prefill starts at once over a cache whose layer i waits for layer i
of the prefix (``demo_model.reuse_prefill_layerwise``, what ``bench_ttft``
times): its logits are bit-identical to a whole-chunk reuse of the same
chunks and within the fp32 tolerance of a full recompute; a corrupt layer of
a stored chunk is never used, and the prompt is recomputed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvoffload.client import SidecarClient
from kvoffload.keys import chunk_keys
from kvoffload.layouts import v1
from kvoffload.store import Store
from tests.helpers.server import start
from tests.helpers.stores import make_store

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (pip install -e '.[demo]')",
)

TENANT = "acme"
CHUNK = 32


@pytest.fixture
def setup(tmp_path: Path, kek_file: Path) -> Iterator[tuple[Any, Any, SidecarClient, Store]]:
    from kvoffload.integrations import demo_model as kd

    torch.set_num_threads(1)
    shape = kd.ModelShape(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=97)
    config = kd.llama_config(shape)
    model = kd.build_model(config, seed=5)
    contract = kd.demo_contract(config, 5, tenant=TENANT, chunk_tokens=CHUNK)
    store = make_store(tmp_path / "root", kek_file, durability="none")
    sock_dir = Path(tempfile.mkdtemp(prefix="kvo-", dir="/tmp"))
    server = start(sock_dir, store)
    path = server.server.config.socket_path
    assert path is not None
    client = SidecarClient(path, TENANT, staging_bytes=1 << 20)
    try:
        yield model, contract, client, store
    finally:
        client.close()
        server.stop()
        store.close()
        shutil.rmtree(sock_dir, ignore_errors=True)


def save_prefix(model: Any, contract: Any, client: SidecarClient, tokens: list[int]) -> None:
    from kvoffload.integrations import demo_model as kd

    pre = kd.prefill(model, tokens)
    salt = client.salt
    assert salt is not None
    keys = chunk_keys(contract, salt, tokens)
    chunks = kd.pack_chunks(pre.keys, pre.values, CHUNK)
    fp = contract.fingerprint()
    assert all(client.save(fp, list(zip(keys, chunks, strict=True))))


def test_layerwise_reuse_is_bit_identical_to_whole_chunk_reuse(
    setup: tuple[Any, Any, SidecarClient, Store],
) -> None:
    from kvoffload.integrations import demo_model as kd

    model, contract, client, _ = setup
    tokens = kd.random_tokens(4 * CHUNK + 7, 97, seed=9)
    save_prefix(model, contract, client, tokens[: 4 * CHUNK])
    full = kd.prefill(model, tokens)
    whole = kd.reuse_prefill(model, client, contract, tokens)
    lw = kd.reuse_prefill_layerwise(model, client, contract, tokens)
    assert whole.reused_chunks == lw.reused_chunks == 4
    assert torch.equal(lw.logits, whole.logits)
    assert kd.max_abs_diff(lw.logits, full.logits) <= kd.logits_tolerance(full.logits)
    assert int(lw.logits.argmax()) == int(full.logits.argmax())


def test_corrupt_layer_is_never_used(setup: tuple[Any, Any, SidecarClient, Store]) -> None:
    from kvoffload.integrations import demo_model as kd

    model, contract, client, store = setup
    tokens = kd.random_tokens(3 * CHUNK + 3, 97, seed=10)
    save_prefix(model, contract, client, tokens[: 3 * CHUNK])
    salt = client.salt
    assert salt is not None
    key = chunk_keys(contract, salt, tokens)[1]
    path = store.root / v1.object_relpath(TENANT, key)
    h = v1.decode_header(path.read_bytes())
    os.chmod(path, 0o600)
    with open(path, "r+b") as f:
        f.seek(h.layers[2].offset + 5)
        b = f.read(1)
        f.seek(h.layers[2].offset + 5)
        f.write(bytes([b[0] ^ 0x80]))
    full = kd.prefill(model, tokens)
    r = kd.reuse_prefill_layerwise(model, client, contract, tokens)
    # The load came back short (chunk 1 failed at layer 2): the prefill that ran
    # over it is thrown away and the prompt recomputed, so the logits are a
    # full prefill's, bit for bit.
    assert r.reused_chunks == 0
    assert torch.equal(r.logits, full.logits)
    # The damaged chunk is gone from the index; chunk 0 still serves.
    assert client.lookup(chunk_keys(contract, salt, tokens)) == 1
