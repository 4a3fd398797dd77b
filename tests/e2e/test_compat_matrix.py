"""The compatibility matrix: change one contract input, and engine B must miss.

Engine A (one process) runs a 170-token prompt under contract C and saves its
five 32-token chunks to a real sidecar process; it does the same with a LoRA
adapter, with a multimodal item, and as a TP=2 engine. Engine B (one more
process, every variant with a fresh vLLM scheduler, fresh connectors and fresh
caches) then runs the same prompt with exactly one input changed:

================  ==========================================================
field             how B changes it (A's value → B's)
================  ==========================================================
model_revision    other weights (seed 0 → 1) under their own revision name
tokenizer_hash    ``kv_connector_extra_config.tokenizer_hash``
chat_template     ``kv_connector_extra_config.chat_template_version``
attention         another kernel (row-wise eager → transformers' SDPA) under
backend           its own ``extra_config.attention_backend`` name
kv_dtype          float32 → bfloat16 model and cache (vLLM's ``--dtype``)
block_size        16 → 32 tokens per block (vLLM's ``--block-size``)
layer_layout      2 KV heads × 32 → 1 KV head × 64 (same bytes per token,
                  so a hit would load without any shape error)
rope_config       rope_theta 1e4 → 5e5 (same weights; K is stored after RoPE)
lora_id           per request: ``LoRARequest`` "adapter-a" → "adapter-b"
                  (vLLM's request field; the stand-in applies no adapter
                  weights, the connector keys on the adapter's name)
multimodal hash   per request: an image item over tokens [8, 24) with
                  identifier "img-A" → "img-B" (vLLM's ``mm_features``; the
                  connector adds it as an extra key of the chunks it overlaps)
tenant            ``extra_config.tenant``
tp_rank           B is a TP=2 engine; A's TP=2 engine stored only rank 0's
                  shard, so B's rank 1 asks for a contract that differs from
                  the stored one in ``shard.tp_rank`` alone
================  ==========================================================

For each: B's recorded contract differs from A's in exactly that field (none
for the multimodal hash, which is a per-chunk extra key), the connector
offered vLLM nothing and vLLM's own accounting shows 0 external tokens, B
computed the whole prompt, and its tokens, logits and prompt KV equal B
recomputing without a connector, bit for bit (the stand-in's model is
batch-invariant; the SDPA variant recomputes with the same kernel and shapes).

The controls run the same prompt with nothing changed (plain, same LoRA
adapter, same image, same TP=2 shards): they hit all five chunks and still
match the recompute exactly. So each miss above is the changed field's doing,
and each test fails if that field stopped entering the chunk key: B would then
be offered A's 160 tokens. The TP variant carries its own control: its rank-0
lookup, under A's rank-0 contract, finds all five chunks.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ..sidecar_proc import DevSidecar, dev_sidecar
from .standin import TinyLlamaSpec, iter_layers, requires_transformers, requires_vllm
from .standin import write_model_dir as _write_model_dir
from .variants import contract_diff, request, run_engine, variant

pytestmark = [pytest.mark.vllm, pytest.mark.slow, requires_transformers, requires_vllm]

SPEC = TinyLlamaSpec()
CHUNK = 32
PROMPT_LEN = 170  # five full chunks and a partial one (never saved)
SHARED = 5 * CHUNK
REVISION = SPEC.model_revision
BACKEND = "STANDIN_CPU_EAGER"
MM_SPAN = (8, 16)  # the image's placeholder tokens: [8, 24), inside chunk 0
A_NEW_TOKENS = 4
B_NEW_TOKENS = 8

SEED1 = dataclasses.replace(SPEC, weight_seed=1)
SDPA = dataclasses.replace(SPEC, batch_invariant=False, attn_implementation="sdpa")
# Same bytes per token per layer as SPEC (1 × 64 == 2 × 32), another layout.
ONE_KV_HEAD = dataclasses.replace(SPEC, num_attention_heads=2, num_kv_heads=1, head_dim=64)
LONG_ROPE = dataclasses.replace(SPEC, rope_theta=500_000.0)


def tokens(seed: int, n: int = PROMPT_LEN) -> list[int]:
    gen = torch.Generator().manual_seed(3000 + seed)
    return torch.randint(0, SPEC.vocab_size, (n,), generator=gen).tolist()


PROMPT = tokens(0)
PROMPT_TP = tokens(1)  # the TP=2 control's prompt: A stores both of its shards


@dataclasses.dataclass(frozen=True)
class Env:
    sidecar: DevSidecar
    tenant: str
    other_tenant: str
    model_dirs: dict[str, Path]

    def extra(self, **over: Any) -> dict[str, Any]:
        """Contract C's settings (A's), with ``over`` changed."""
        base: dict[str, Any] = {
            "tenant": self.tenant,
            "socket_path": str(self.sidecar.socket_path),
            "chunk_tokens": CHUNK,
            "staging_bytes": 1 << 20,
            # The model folder holds no weights, so its path names no revision:
            # the seed does, as an operator would pin a checkpoint's hash.
            "model_revision": REVISION,
            "attention_backend": BACKEND,
            "tokenizer_hash": "tiny-vocab-512",
            "chat_template_version": "v1",
            "timeout_s": 30.0,
        }
        base.update(over)
        return base

    def v(
        self,
        name: str,
        reqs: list[dict[str, Any]],
        *,
        spec: TinyLlamaSpec = SPEC,
        model_dir: str = "base",
        recompute: bool = True,
        **kw: Any,
    ) -> dict[str, Any]:
        extra = self.extra(**kw.pop("extra", {}))
        return variant(
            name,
            spec=spec,
            model_dir=self.model_dirs[model_dir],
            extra_config=extra,
            requests=reqs,
            recompute=recompute,
            **kw,
        )


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    pytest.importorskip("kvoffload.integrations.vllm", reason="the vLLM connector is absent")
    dirs = {
        name: _write_model_dir(spec, tmp_path_factory.mktemp(f"model-{name}"))
        for name, spec in (("base", SPEC), ("one_kv_head", ONE_KV_HEAD), ("rope", LONG_ROPE))
    }
    with dev_sidecar() as sidecar:
        # Fresh tenants: fresh salts, so no earlier run's chunks can be found.
        yield Env(sidecar, f"t-{uuid.uuid4().hex[:12]}", f"t-{uuid.uuid4().hex[:12]}", dirs)


@pytest.fixture(scope="module")
def engine_a(env: Env, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """One process saves the prompt under C, with a LoRA adapter, with an image, and as
    TP=2 engines (one whose rank 1 loses every save, one storing both shards)."""
    a = A_NEW_TOKENS
    results = run_engine(
        "engine-a",
        [
            env.v("a", [request("a", PROMPT, a)], recompute=False),
            env.v("a_lora", [request("a", PROMPT, a, lora_name="adapter-a")], recompute=False),
            env.v("a_mm", [request("a", PROMPT, a, mm=[("img-A", *MM_SPAN)])], recompute=False),
            env.v("a_tp_rank0", [request("a", PROMPT, a)], tp=2, lost_save_ranks=[1],
                  recompute=False),
            env.v("a_tp_both", [request("a", PROMPT_TP, a)], tp=2, recompute=False),
        ],
        tmp_path_factory.mktemp("engine-a"),
    )  # fmt: skip
    for name, r in results.items():
        assert r["error"] is None, f"{name}:\n{r['error']}"
    # What the store holds now, before any B engine saves anything: leading
    # chunks found per (A variant, shard), with keys derived outside the connector.
    results["a"]["stored"] = {
        (name, shard): env.sidecar.lookup(env.tenant, env.sidecar.keys(contract, prompt))
        for name, prompt in (("a", PROMPT), ("a_tp_rank0", PROMPT), ("a_tp_both", PROMPT_TP))
        for shard, contract in enumerate(results[name]["contracts"]["a"])
    }
    return results


def b_variants(env: Env) -> list[dict[str, Any]]:
    n = B_NEW_TOKENS
    plain = [request("b", PROMPT, n)]
    return [
        # Controls: nothing changed.
        env.v("same_contract", plain),
        env.v("same_lora", [request("b", PROMPT, n, lora_name="adapter-a")]),
        env.v("same_mm_hash", [request("b", PROMPT, n, mm=[("img-A", *MM_SPAN)])]),
        env.v("same_tp_shards", [request("b", PROMPT_TP, n)], tp=2),
        # One field each.
        env.v("model_revision", plain, spec=SEED1, extra={"model_revision": SEED1.model_revision}),
        env.v("tokenizer_hash", plain, extra={"tokenizer_hash": "tiny-vocab-512-v2"}),
        env.v("chat_template_version", plain, extra={"chat_template_version": "v2"}),
        env.v("attention_backend", plain, spec=SDPA,
              extra={"attention_backend": "STANDIN_CPU_SDPA"}),
        env.v("kv_dtype", plain, dtype="bfloat16"),
        env.v("block_size", plain, block_size=32),
        env.v("layer_layout", plain, spec=ONE_KV_HEAD, model_dir="one_kv_head"),
        env.v("rope_config", plain, spec=LONG_ROPE, model_dir="rope"),
        env.v("lora_id", [request("b", PROMPT, n, lora_name="adapter-b")]),
        env.v("mm_hash", [request("b", PROMPT, n, mm=[("img-B", *MM_SPAN)])]),
        env.v("tenant", plain, extra={"tenant": env.other_tenant}),
        env.v("tp_rank", plain, tp=2),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def engine_b(
    env: Env, engine_a: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    """Every B variant, one after another, in one process (after A's saves are done)."""
    return run_engine("engine-b", b_variants(env), tmp_path_factory.mktemp("engine-b"))


def ok(results: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    r = results[name]
    assert r["error"] is None, f"{name} raised:\n{r['error']}"
    return r


def assert_same_output(run: dict[str, Any], recompute: dict[str, Any]) -> None:
    """Tokens, the logits they came from, and the prompt's KV: bit for bit."""
    start = run["prefill_start"]
    assert run["tokens"] == recompute["tokens"]
    assert torch.isfinite(run["sampled_logits"]).all()
    assert torch.equal(run["sampled_logits"], recompute["sampled_logits"])
    assert torch.equal(run["prefill_logits"], recompute["prefill_logits"][start:])
    pairs = zip(iter_layers(run["prompt_kv"]), iter_layers(recompute["prompt_kv"]), strict=True)
    assert all(torch.equal(x, y) for x, y in pairs)


# -- controls ----------------------------------------------------------------------

CONTROLS = {
    # B variant: the A variant whose chunks it must find
    "same_contract": "a",
    "same_lora": "a_lora",
    "same_mm_hash": "a_mm",
    "same_tp_shards": "a_tp_both",
}


@pytest.mark.parametrize("name", list(CONTROLS))
def test_same_contract_hits(
    engine_a: dict[str, dict[str, Any]], engine_b: dict[str, dict[str, Any]], name: str
) -> None:
    a, b = ok(engine_a, CONTROLS[name]), ok(engine_b, name)
    assert a["contracts"]["a"] == b["contracts"]["b"]  # every shard's contract
    assert [o[2] for o in b["offered"]] == [SHARED]
    # Every shard's lookup found all five chunks.
    assert b["lookups"] and all(found == 5 for _, found in b["lookups"])
    run, recompute = b["runs"]["b"], b["recompute"]["b"]
    assert run["num_external_cached_tokens"] == SHARED
    assert run["num_local_cached_tokens"] == 0
    assert run["prefill_start"] == SHARED  # only the last 10 tokens went through the model
    assert_same_output(run, recompute)


# -- the matrix --------------------------------------------------------------------

# B variant: (the A variant it is compared with, the contract field that differs
# or None when the difference is a per-chunk extra key).
FIELDS: dict[str, tuple[str, str | None]] = {
    "model_revision": ("a", "model_revision"),
    "tokenizer_hash": ("a", "tokenizer_hash"),
    "chat_template_version": ("a", "chat_template_version"),
    "attention_backend": ("a", "attention_backend"),
    "kv_dtype": ("a", "kv_dtype"),
    "block_size": ("a", "block_size"),
    "layer_layout": ("a", "layer_layout"),
    "rope_config": ("a", "rope_config"),
    "lora_id": ("a_lora", "lora_id"),
    "mm_hash": ("a_mm", None),
    "tenant": ("a", "tenant_namespace"),
}


def assert_full_recompute(b: dict[str, Any]) -> None:
    """No tokens offered or loaded; B computed every prompt position itself, and
    what it computed is what it computes without a connector."""
    assert b["offered"] and all(o[2] == 0 for o in b["offered"])
    run, recompute = b["runs"]["b"], b["recompute"]["b"]
    assert run["num_external_cached_tokens"] == 0
    assert run["num_local_cached_tokens"] == 0
    assert run["prefill_start"] == 0
    assert run["prefill_logits"].shape[0] == PROMPT_LEN
    assert_same_output(run, recompute)


@pytest.mark.parametrize("name", list(FIELDS))
def test_changed_field_misses_and_recomputes(
    engine_a: dict[str, dict[str, Any]], engine_b: dict[str, dict[str, Any]], name: str
) -> None:
    a_name, field = FIELDS[name]
    a, b = ok(engine_a, a_name), ok(engine_b, name)
    # Exactly one contract field differs from the contract A saved under.
    (a_contract,) = a["contracts"]["a"]
    (b_contract,) = b["contracts"]["b"]
    assert contract_diff(a_contract, b_contract) == ({field} if field else set())
    # The sidecar was asked and found nothing (it does hold A's chunks: see the controls).
    assert b["lookups"] == [(5, 0)]
    assert_full_recompute(b)


def test_other_tp_rank_misses_and_recomputes(
    engine_a: dict[str, dict[str, Any]], engine_b: dict[str, dict[str, Any]]
) -> None:
    """B (TP=2) needs both shards; A's TP=2 engine stored only rank 0's."""
    a, b = ok(engine_a, "a_tp_rank0"), ok(engine_b, "tp_rank")
    a0, a1 = a["contracts"]["a"]
    b0, b1 = b["contracts"]["b"]
    # Rank 0's contract is A's rank 0's; rank 1's differs from it in tp_rank alone.
    assert contract_diff(a0, b0) == set()
    assert contract_diff(a0, b1) == {"shard"}
    assert {k for k in a0["shard"] if a0["shard"][k] != b1["shard"][k]} == {"tp_rank"}
    assert a1 == b1
    # Rank 0's keys hit all five chunks, rank 1's none: no shard, no load.
    assert b["lookups"] == [(5, 5), (5, 0)]
    assert_full_recompute(b)


def test_a_stored_its_chunks_and_rank_1_none(engine_a: dict[str, dict[str, Any]]) -> None:
    """What the controls hit and the TP variant misses is really in (or absent from)
    the store, as A left it."""
    assert engine_a["a"]["stored"] == {
        ("a", 0): 5,
        ("a_tp_rank0", 0): 5,
        ("a_tp_rank0", 1): 0,  # rank 1's saves were refused
        ("a_tp_both", 0): 5,
        ("a_tp_both", 1): 5,
    }
