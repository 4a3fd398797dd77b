from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from kvoffload.contract import (
    CompatContract,
    ContractError,
    KVGroup,
    LayerLayout,
    Shard,
    canonical_json,
)
from kvoffload.keys import KeyDerivationError, chunk_keys, next_key, root_key

from .conftest import make_contract

SALT = bytes(range(32))

# One changed value per contract field: every one must change the fingerprint.
FIELD_CHANGES: dict[str, object] = {
    "model_revision": "llama-tiny@seed1",
    "tokenizer_hash": "tok-3f1d",
    "chat_template_version": "v2",
    "attention_backend": "FLASHINFER",
    "kv_dtype": "float16",
    "block_size": 32,
    "layer_layout": LayerLayout(num_layers=4, num_kv_heads=2, head_dim=64, cache_layout="HND"),
    "rope_config": {"rope_theta": 500000.0, "rope_scaling": None},
    "lora_id": "sql-adapter",
    "tenant_namespace": "beta",
    "shard": Shard(tp_rank=1, tp_size=2),
    "chunk_tokens": 128,
    "kv_group": KVGroup(index=0, num_groups=2, kind="full_attention", layers=(0, 2)),
}


def test_every_contract_field_is_covered() -> None:
    fields = {f.name for f in dataclasses.fields(CompatContract)}
    assert fields == set(FIELD_CHANGES)


@pytest.mark.parametrize("name", sorted(FIELD_CHANGES))
def test_each_field_changes_fingerprint_and_keys(name: str) -> None:
    a = make_contract()
    b = make_contract(**{name: FIELD_CHANGES[name]})
    assert a.fingerprint() != b.fingerprint()
    tokens = np.arange(256) % 1000
    assert set(chunk_keys(a, SALT, tokens)).isdisjoint(chunk_keys(b, SALT, tokens))


@pytest.mark.parametrize(
    "attr,value",
    [
        ("num_layers", 5),
        ("num_kv_heads", 4),
        ("head_dim", 128),
    ],
)
def test_layer_layout_fields_change_fingerprint(attr: str, value: int) -> None:
    base = LayerLayout(num_layers=4, num_kv_heads=2, head_dim=64)
    other = dataclasses.replace(base, **{attr: value})
    assert (
        make_contract(layer_layout=base).fingerprint()
        != make_contract(layer_layout=other).fingerprint()
    )


def test_canonical_form_ignores_float_formatting_and_dict_order() -> None:
    a = make_contract(rope_config={"rope_theta": 10000, "scaling": {"factor": 8, "type": "llama3"}})
    b = make_contract(rope_config={"scaling": {"type": "llama3", "factor": 8.0}, "rope_theta": 1e4})
    assert a.fingerprint() == b.fingerprint()
    c = make_contract(rope_config={"rope_theta": 10000.5})
    assert c.fingerprint() != a.fingerprint()


def test_canonical_json_is_documented_form() -> None:
    assert (
        canonical_json({"b": 1, "a": [1.5, None, True, "é"]})
        == ('{"a":["0x1.8000000000000p+0",null,true,"é"],"b":"0x1.0000000000000p+0"}').encode()
    )


def test_roundtrip_dict() -> None:
    c = make_contract(rope_config={"rope_theta": 10000.0, "nested": {"x": [1, 2]}})
    assert CompatContract.from_dict(c.to_dict()).fingerprint() == c.fingerprint()


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"block_size": 0}, "block_size"),
        ({"chunk_tokens": 100}, "multiple of block_size"),
        ({"tenant_namespace": "../etc"}, "tenant"),
        ({"model_revision": ""}, "model_revision"),
        ({"rope_config": {"rope_theta": float("nan")}}, "non-finite"),
    ],
)
def test_invalid_contracts_are_refused(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ContractError, match=match):
        make_contract(**overrides)


def test_unknown_contract_version_refused() -> None:
    d = make_contract().to_dict()
    d["contract"] = 3
    with pytest.raises(ContractError, match="unknown contract encoding version"):
        CompatContract.from_dict(d)


def test_chain_commits_to_whole_prefix() -> None:
    c = make_contract()
    t1 = np.arange(192)
    t2 = t1.copy()
    t2[3] += 1  # differs only in chunk 0
    k1, k2 = chunk_keys(c, SALT, t1), chunk_keys(c, SALT, t2)
    assert len(k1) == 3
    assert all(a != b for a, b in zip(k1, k2, strict=True))
    # A trailing partial chunk has no key; a prefix gives a prefix of keys.
    assert chunk_keys(c, SALT, t1[:150]) == k1[:2]


def test_salt_and_extra_keys_change_keys() -> None:
    c = make_contract()
    t = np.arange(64)
    base = chunk_keys(c, SALT, t)
    assert chunk_keys(c, bytes(32), t) != base
    assert chunk_keys(c, SALT, t, extra_keys=[[b"image-hash-1"]]) != base
    assert chunk_keys(c, SALT, t, extra_keys=[[b"image-hash-1"]]) != chunk_keys(
        c, SALT, t, extra_keys=[[b"image-hash-2"]]
    )
    # Extra key framing is unambiguous: ["ab"] differs from ["a", "b"].
    p = root_key(c.fingerprint(), SALT)
    assert next_key(p, SALT, t, [b"ab"]) != next_key(p, SALT, t, [b"a", b"b"])


def test_bad_key_inputs() -> None:
    c = make_contract()
    with pytest.raises(KeyDerivationError):
        chunk_keys(c, b"short", np.arange(64))
    with pytest.raises(KeyDerivationError):
        chunk_keys(c, SALT, np.array([-1] * 64))


_SCRIPT = """
import numpy as np, sys
sys.path.insert(0, {tests!r})
from conftest import make_contract
from kvoffload.keys import chunk_keys
ks = chunk_keys(make_contract(), bytes(range(32)), np.arange(640) * 7 % 32000)
print(make_contract().fingerprint().hex(), *[k.hex() for k in ks])
"""


def test_keys_identical_across_processes_and_hash_seeds() -> None:
    import os
    from pathlib import Path

    script = _SCRIPT.format(tests=str(Path(__file__).parent))
    outs = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        ).stdout
        outs.add(out)
    assert len(outs) == 1
    here = [make_contract().fingerprint().hex()] + [
        k.hex() for k in chunk_keys(make_contract(), SALT, np.arange(640) * 7 % 32000)
    ]
    assert outs.pop().split() == here


def test_pinned_fingerprint() -> None:
    # Pins the canonical encoding and hash: a change here breaks every store.
    assert make_contract().fingerprint().hex() == PINNED_FP


PINNED_FP = "acd4dfca95e83ff772fdac0eab12f48bbc554b494b6d4f0a7b6034aa21211232"
