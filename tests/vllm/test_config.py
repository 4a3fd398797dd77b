"""Settings validation and contract derivation from vLLM's real config objects."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

import torch
from vllm.config import AttentionConfig, ParallelConfig
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
)

from kvoffload.client import DEFAULT_SOCKET_PATH
from kvoffload.contract import DEFAULT_CHUNK_TOKENS
from kvoffload.integrations.vllm.common import (
    ChunkRef,
    EngineContracts,
    KVOffloadConfigError,
    KVOffloadMetadata,
    KVOffloadSettings,
    KVOffloadWorkerMetadata,
    LoadJob,
    SaveJob,
    kv_dtype_name,
    layer_index,
    model_revision,
    ordered_layer_names,
)
from kvoffload.integrations.vllm.scheduler import chunk_extra_keys

from .engine import HEAD_DIM, LAYER_NAMES, NUM_KV_HEADS, make_kv_cache_config, make_vllm_config

pytestmark = pytest.mark.vllm

BASE = {"tenant": "acme", "attention_backend": "FLASH_ATTN", "chunk_tokens": 32}


def contracts(tiny_model: Path, extra: dict[str, Any] | None = None, **kw: Any) -> EngineContracts:
    cfg = make_vllm_config(tiny_model, {**BASE, **(extra or {})}, **kw)
    settings = KVOffloadSettings.from_extra_config(cfg.kv_transfer_config.kv_connector_extra_config)
    return EngineContracts.from_vllm(cfg, make_kv_cache_config(cfg, 16), settings)


# -- settings ------------------------------------------------------------------------


def test_settings_defaults() -> None:
    s = KVOffloadSettings.from_extra_config({"tenant": "acme"})
    assert s.socket_path == DEFAULT_SOCKET_PATH
    assert s.chunk_tokens == DEFAULT_CHUNK_TOKENS
    assert (s.load_mode, s.save_mode) == ("async", "async")
    assert s.tokenizer_hash is None and s.ttl_s is None


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({}, "tenant is required"),
        ({"tenant": "no spaces"}, "kv_connector_extra_config.tenant"),
        ({"tenant": "a", "chunk_tokens": "256"}, "kv_connector_extra_config.chunk_tokens"),
        ({"tenant": "a", "chunk_tokens": True}, "kv_connector_extra_config.chunk_tokens"),
        ({"tenant": "a", "staging_bytes": 0}, "kv_connector_extra_config.staging_bytes"),
        ({"tenant": "a", "timeout_s": float("nan")}, "kv_connector_extra_config.timeout_s"),
        ({"tenant": "a", "ttl_s": -1}, "kv_connector_extra_config.ttl_s"),
        ({"tenant": "a", "load_mode": "fast"}, "kv_connector_extra_config.load_mode"),
        ({"tenant": "a", "save_mode": None}, "kv_connector_extra_config.save_mode"),
        ({"tenant": "a", "socket_path": ""}, "kv_connector_extra_config.socket_path"),
        ({"tenant": "a", "chunk_token": 32}, "unknown field(s) chunk_token"),
    ],
)
def test_settings_errors_name_the_field(extra: dict[str, Any], field: str) -> None:
    with pytest.raises(KVOffloadConfigError, match=field.replace("(", r"\(").replace(")", r"\)")):
        KVOffloadSettings.from_extra_config(extra)


def test_chunk_tokens_must_be_whole_blocks(tiny_model: Path) -> None:
    with pytest.raises(KVOffloadConfigError, match=r"chunk_tokens \(24\).*block size \(16\)"):
        contracts(tiny_model, {"chunk_tokens": 24})


# -- the contract --------------------------------------------------------------------


def test_contract_from_vllm_config(tiny_model: Path) -> None:
    ec = contracts(tiny_model, dtype="bfloat16")
    c = ec.contract(None, 0)
    assert c.model_revision == f"{tiny_model}@default"
    assert c.tokenizer_hash == f"{tiny_model}@default"
    assert c.chat_template_version == "none"
    assert c.attention_backend == "FLASH_ATTN"
    assert c.kv_dtype == "bfloat16"
    assert c.block_size == 16 and c.chunk_tokens == 32
    assert c.layer_layout.num_layers == len(LAYER_NAMES)
    assert c.layer_layout.num_kv_heads == NUM_KV_HEADS
    assert c.layer_layout.head_dim == HEAD_DIM
    assert c.layer_layout.cache_layout == "NHD"
    assert c.rope["rope_parameters"]["rope_theta"] == 10000.0
    assert c.tenant == "acme"
    assert (c.shard.tp_size, c.shard.pp_size) == (1, 1)


def test_every_input_changes_the_namespace(tiny_model: Path) -> None:
    ref = contracts(tiny_model).namespace(None, 0)
    variants = [
        contracts(tiny_model, {"tenant": "other"}),
        contracts(tiny_model, {"tokenizer_hash": "tok-2"}),
        contracts(tiny_model, {"chat_template_version": "v2"}),
        contracts(tiny_model, {"model_revision": "llama@abc"}),
        contracts(tiny_model, {"attention_backend": "FLASHINFER"}),
        contracts(tiny_model, {"chunk_tokens": 64}),
        contracts(tiny_model, dtype="bfloat16"),
        contracts(tiny_model, block_size=32),
    ]
    namespaces = {ec.namespace(None, 0) for ec in variants}
    assert ref not in namespaces and len(namespaces) == len(variants)
    # A LoRA adapter is a per-request variant of the same engine's contract.
    ec = contracts(tiny_model)
    assert len({ec.namespace(None, 0), ec.namespace("a", 0), ec.namespace("b", 0)}) == 3
    assert ec.contract("a", 0).lora_id == "a"


def test_attention_backend_from_vllm_flag(tiny_model: Path) -> None:
    cfg = make_vllm_config(tiny_model, {"tenant": "acme", "chunk_tokens": 32})
    cfg.attention_config = AttentionConfig(backend="FLASHINFER")
    s = KVOffloadSettings.from_extra_config(cfg.kv_transfer_config.kv_connector_extra_config)
    ec = EngineContracts.from_vllm(cfg, make_kv_cache_config(cfg, 16), s)
    assert ec.base.attention_backend == "FLASHINFER"


def test_backend_from_the_selector_or_a_clear_error(tiny_model: Path) -> None:
    from vllm.platforms import current_platform

    if current_platform.is_unspecified():
        # vLLM's Python code without a platform (this tier's CPU venv): the
        # selector cannot run, and the error says how to pin the backend.
        with pytest.raises(KVOffloadConfigError, match="attention_backend"):
            contracts(tiny_model, {"attention_backend": None})
    else:
        assert contracts(tiny_model, {"attention_backend": None}).base.attention_backend


def test_model_revision_names_weights_changes() -> None:
    mc = SimpleNamespace(model="org/m", revision="abc", quantization=None, hf_overrides={})
    assert model_revision(mc) == "org/m@abc"
    mc.quantization = "awq"
    mc.hf_overrides = {"num_hidden_layers": 1}
    rev = model_revision(mc)
    assert rev.startswith("org/m@abc+quantization=awq+hf_overrides=")
    mc.hf_overrides = {"num_hidden_layers": 2}
    assert model_revision(mc) != rev


def test_kv_dtype_name() -> None:
    mc = SimpleNamespace(dtype=torch.bfloat16)
    assert kv_dtype_name(mc, SimpleNamespace(cache_dtype="auto")) == "bfloat16"
    assert kv_dtype_name(mc, SimpleNamespace(cache_dtype="bfloat16")) == "bfloat16"
    assert kv_dtype_name(mc, SimpleNamespace(cache_dtype="fp8_e4m3")) == "fp8_e4m3/bfloat16"


def test_parallel_shards(tiny_model: Path) -> None:
    cfg = make_vllm_config(tiny_model, BASE)
    cfg.parallel_config = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=NUM_KV_HEADS // 2, head_size=HEAD_DIM, dtype=torch.float32
    )
    kvc = KVCacheConfig(16, [], [KVCacheGroupSpec(list(LAYER_NAMES), spec)])
    s = KVOffloadSettings.from_extra_config(BASE)
    ec = EngineContracts.from_vllm(cfg, kvc, s)
    assert ec.num_shards == 4
    assert ec.layers_per_stage == (1, 1)
    assert ec.base.layer_layout.num_kv_heads == 1  # per TP shard
    shards = [ec.contract(None, i).shard for i in range(4)]
    assert [(sh.tp_rank, sh.pp_rank) for sh in shards] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert ec.shard_index(1, 1) == 3
    assert len({ec.namespace(None, i) for i in range(4)}) == 4
    with pytest.raises(ValueError):
        ec.shard_index(2, 0)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (
            MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32),
            "MLAAttentionSpec",
        ),
        (
            FullAttentionSpec(
                block_size=16, num_kv_heads=2, head_size=16, head_size_v=8, dtype=torch.float32
            ),
            "equal K and V head sizes",
        ),
    ],
)
def test_unsupported_caches_are_refused(tiny_model: Path, spec: Any, match: str) -> None:
    cfg = make_vllm_config(tiny_model, BASE)
    kvc = KVCacheConfig(16, [], [KVCacheGroupSpec(list(LAYER_NAMES), spec)])
    with pytest.raises(KVOffloadConfigError, match=match):
        EngineContracts.from_vllm(cfg, kvc, KVOffloadSettings.from_extra_config(BASE))


def test_model_config_and_cache_spec_must_agree(tiny_model: Path) -> None:
    cfg = make_vllm_config(tiny_model, BASE)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=16, dtype=torch.float32)
    kvc = KVCacheConfig(16, [], [KVCacheGroupSpec(list(LAYER_NAMES), spec)])
    with pytest.raises(KVOffloadConfigError, match="2 KV heads"):
        EngineContracts.from_vllm(cfg, kvc, KVOffloadSettings.from_extra_config(BASE))


# -- keys and small pieces -----------------------------------------------------------


def test_extra_keys_cache_salt_first_chunk_and_multimodal() -> None:
    def feature(ident: str, offset: int, length: int) -> Any:
        return SimpleNamespace(
            identifier=ident, mm_position=SimpleNamespace(offset=offset, length=length)
        )

    req = SimpleNamespace(cache_salt="s", mm_features=[feature("img", 30, 40)])
    assert chunk_extra_keys(req, 0, 32) == [b"kvo-cache-salt\x00s", b"kvo-mm\x00img"]
    assert chunk_extra_keys(req, 1, 32) == [b"kvo-mm\x00img"]  # tokens 32..63
    assert chunk_extra_keys(req, 2, 32) == [b"kvo-mm\x00img"]  # 64..69 still inside
    assert chunk_extra_keys(req, 3, 32) == []


def test_layer_order_is_by_index() -> None:
    names = ["model.layers.10.attn", "model.layers.2.attn", "model.layers.1.attn"]
    assert ordered_layer_names(names) == [names[2], names[1], names[0]]
    assert layer_index("model.layers.7.self_attn.attn") == 7
    assert layer_index("decoder.attn") is None
    assert ordered_layer_names(["b", "a"]) == ["b", "a"]  # no indices: vLLM's order


def test_worker_metadata_aggregates_across_workers() -> None:
    a = KVOffloadWorkerMetadata({1: 1, 2: 1})
    b = KVOffloadWorkerMetadata({2: 1, 3: 1})
    assert a.aggregate(b).completed_saves == {1: 1, 2: 2, 3: 1}
    assert dataclasses.asdict(a) == {
        "completed_saves": {1: 1, 2: 1},
        "stored_chunks": {},
        "load_samples": [],
    }
    # Load timings (the recompute guard's samples) from every worker reach the scheduler.
    e = KVOffloadWorkerMetadata({}, {}, [(4, 0.01)])
    f = KVOffloadWorkerMetadata({}, {}, [(2, 0.02)])
    assert e.aggregate(f).load_samples == [(4, 0.01), (2, 0.02)]
    # Chunks the sidecar acknowledged, counted per worker (KV events need all of them).
    c = KVOffloadWorkerMetadata({2: 1}, {2: {0: 1, 1: 1}})
    d = KVOffloadWorkerMetadata({2: 1}, {2: {1: 1}})
    assert c.aggregate(d).stored_chunks == {2: {0: 1, 1: 2}}


def test_importing_kvoffload_does_not_import_vllm() -> None:
    """The worker-side package stays light: only the integration imports vLLM."""
    code = (
        "import sys, kvoffload, kvoffload.client, kvoffload.keys, kvoffload.integrations; "
        "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')], 'vllm'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_metadata_crosses_process_boundaries() -> None:
    """vLLM pickles the scheduler's metadata to the workers and their reports back."""
    meta = KVOffloadMetadata(
        loads=[LoadJob("r", (ChunkRef(0, (b"k" * 32,), (3, 4), 1),), True)],
        saves=[SaveJob(7, "r", (b"n" * 32,), (ChunkRef(1, (b"j" * 32,), (5, 6)),))],
        held_req_ids={"q"},
        preempted_req_ids={"p"},
    )
    assert pickle.loads(pickle.dumps(meta)) == meta
    report = KVOffloadWorkerMetadata({7: 1})
    assert pickle.loads(pickle.dumps(report)) == report
