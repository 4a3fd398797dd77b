"""A prefix computed by one engine process is reused by another, bit for bit.

Everything is real but the GPU: a ``kvoffload --dev serve`` sidecar process
with its store on disk (AES-GCM, LMDB), kvoffload's vLLM connector in both
roles, vLLM 0.33's own scheduler, KV caches allocated by vLLM in the layout it
resolved, and a transformers Llama computing real KV. Only vLLM's GPU model
runner is replaced, by the CPU stand-in of ``standin.py``; each engine is its
own Python process (``python -m tests.e2e.standin JOB.json``), so nothing
reaches B from A but what went through the sidecar.

Engine A runs a prompt and saves its chunks. Engine B runs a prompt sharing
A's first 160 tokens (five 32-token chunks): it must load those, compute only
the remaining 40 positions, and produce exactly what B produces recomputing
everything: tokens, every logit, every KV byte (the stand-in's model is
batch-invariant, so "exactly" is the honest bar). This is done twice: with the
connector's async loads and saves, and with sync ones; the two engines of each
pair keep their caches in opposite layouts (NHD, HND). Engines whose contract
differs (other weights under their own revision, another tenant) must miss;
an engine that lies about its revision hits and its output visibly changes,
which shows these comparisons can fail.

Engines start in two waves of concurrent processes (vLLM's import dominates
their run time): the two A's, then the two B's and the three contract engines.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from ..sidecar_proc import DevSidecar, dev_sidecar
from .standin import (
    KVLayout,
    TinyLlamaSpec,
    iter_layers,
    requires_transformers,
    requires_vllm,
    write_model_dir,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    requires_transformers,
    requires_vllm,
]

REPO = Path(__file__).resolve().parents[2]
SPEC = TinyLlamaSpec()
CHUNK = 32
SHARED = 160  # five chunks A saves and B loads
PROMPT_A = 170  # five full chunks and a partial one, which is never saved
SUFFIX_B = 40
ENGINE_TIMEOUT_S = 300


def tokens(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(2000 + seed)
    return torch.randint(0, SPEC.vocab_size, (n,), generator=gen).tolist()


PROMPT_A_TOKENS = tokens(0, PROMPT_A)
# B shares A's first SHARED tokens, then diverges; so does C, differently (B
# saves its own sixth chunk, which C must not find).
PROMPT_B_TOKENS = PROMPT_A_TOKENS[:SHARED] + tokens(1, SUFFIX_B)
PROMPT_C_TOKENS = PROMPT_A_TOKENS[:SHARED] + tokens(2, SUFFIX_B)


@pytest.fixture(scope="module")
def sidecar() -> Iterator[DevSidecar]:
    """``kvoffload --dev serve`` as its own process, on a fresh embedded store."""
    pytest.importorskip("kvoffload.integrations.vllm", reason="the vLLM connector is absent")
    with dev_sidecar() as s:
        yield s


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Weights never go to disk: each engine builds them from its spec's seed.
    return write_model_dir(SPEC, tmp_path_factory.mktemp("model"))


def connector(
    sidecar: DevSidecar, tenant: str, revision: str, *, load: str = "async", save: str = "async"
) -> dict[str, Any]:
    return {
        "name": "KVOffloadConnector",
        "module_path": "kvoffload.integrations.vllm",
        "extra_config": {
            "tenant": tenant,
            "socket_path": str(sidecar.socket_path),
            "chunk_tokens": CHUNK,
            # The model folder holds no weights, so its path names no revision:
            # the seed does, as an operator would pin a checkpoint's hash.
            "model_revision": revision,
            "attention_backend": "STANDIN_CPU_EAGER",
            "tokenizer_hash": "tiny-vocab-512",
            "load_mode": load,
            "save_mode": save,
            "timeout_s": 30.0,
        },
    }


def job(
    name: str,
    model_dir: Path,
    conn: dict[str, Any],
    prompt: Sequence[int],
    *,
    max_new_tokens: int,
    spec: TinyLlamaSpec = SPEC,
    layout: KVLayout = KVLayout.LBNHC,
) -> dict[str, Any]:
    return {
        "name": name,
        "spec": dataclasses.asdict(spec),
        "model_dir": str(model_dir),
        "layout": layout.name,
        "dtype": "float32",
        "connector": conn,
        "requests": [{"req_id": name, "prompt": list(prompt), "max_new_tokens": max_new_tokens}],
        "recompute": True,
    }


def run_engines(jobs: Sequence[dict[str, Any]], workdir: Path) -> dict[str, dict[str, Any]]:
    """Run each job as its own engine process, all at once; their results by name."""
    procs = []
    for j in jobs:
        out = workdir / f"{j['name']}.pt"
        job_path = workdir / f"{j['name']}.json"
        job_path.write_text(json.dumps({**j, "out": str(out)}))
        log_path = workdir / f"{j['name']}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.e2e.standin", str(job_path)],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")},
            )
        procs.append((j["name"], proc, out, log_path))
    results = {}
    for name, proc, out, log_path in procs:
        try:
            rc = proc.wait(timeout=ENGINE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = -1
        if rc != 0 or not out.exists():
            tail = log_path.read_text(errors="replace")[-6000:]
            pytest.fail(f"engine {name} exited {rc}:\n{tail}")
        results[name] = torch.load(out)
    return results


def assert_same_kv(a: dict[str, Any], b: dict[str, Any], upto: int | None = None) -> None:
    pairs = zip(iter_layers(a), iter_layers(b), strict=True)
    assert all(torch.equal(x[:upto], y[:upto]) for x, y in pairs)


def assert_reuse_is_exact(run: dict[str, Any], recompute: dict[str, Any], hit: int) -> None:
    """B loaded ``hit`` tokens, computed the rest, and matches B recomputing all."""
    assert run["num_external_cached_tokens"] == hit
    assert run["num_local_cached_tokens"] == 0
    # Only the suffix went through the model in the loading engine.
    assert run["prefill_start"] == hit
    assert torch.isfinite(run["sampled_logits"]).all()
    assert run["tokens"] == recompute["tokens"]
    # The KV in B's blocks, loaded prefix and computed suffix, is the KV B
    # computes itself: every byte of every layer.
    assert_same_kv(run["prompt_kv"], recompute["prompt_kv"])
    assert torch.equal(run["sampled_logits"], recompute["sampled_logits"])
    assert torch.equal(run["prefill_logits"], recompute["prefill_logits"][hit:])


@dataclasses.dataclass(frozen=True)
class Tenants:
    async_modes: str
    sync_modes: str
    other: str


@pytest.fixture(scope="module")
def tenants() -> Tenants:
    # Fresh tenants: fresh salts, so no earlier run's chunks can be found.
    return Tenants(*(f"t-{uuid.uuid4().hex[:12]}" for _ in range(3)))


@pytest.fixture(scope="module")
def engines_a(
    sidecar: DevSidecar,
    model_dir: Path,
    tenants: Tenants,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, dict[str, Any]]:
    """First wave, two engines at once: A with async loads and saves (the
    connector's defaults) and an NHD cache, A' with sync ones and an HND cache."""
    rev = SPEC.model_revision
    conn_sync = connector(sidecar, tenants.sync_modes, rev, load="sync", save="sync")
    return run_engines(
        [
            job("a", model_dir, connector(sidecar, tenants.async_modes, rev), PROMPT_A_TOKENS,
                max_new_tokens=4),
            job("a_sync", model_dir, conn_sync, PROMPT_A_TOKENS, max_new_tokens=4,
                layout=KVLayout.LBHNC),
        ],
        tmp_path_factory.mktemp("engines-a"),
    )  # fmt: skip


@pytest.fixture(scope="module")
def engines_b(
    sidecar: DevSidecar,
    model_dir: Path,
    tenants: Tenants,
    engines_a: dict[str, dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, dict[str, Any]]:
    """Second wave, once A's saves are done, five engines at once."""
    rev, seed1 = SPEC.model_revision, TinyLlamaSpec(weight_seed=1)
    conn_sync = connector(sidecar, tenants.sync_modes, rev, load="sync", save="sync")
    return run_engines(
        [
            # B keeps its cache head-major (HND), A token-major (NHD): chunk
            # objects have one layout whatever the engines' own. B' the reverse.
            job("b", model_dir, connector(sidecar, tenants.async_modes, rev), PROMPT_B_TOKENS,
                max_new_tokens=16, layout=KVLayout.LBHNC),
            job("b_sync", model_dir, conn_sync, PROMPT_B_TOKENS, max_new_tokens=16),
            # Other weights under their own revision: a different key, a miss.
            job("new_revision", model_dir,
                connector(sidecar, tenants.async_modes, seed1.model_revision),
                PROMPT_C_TOKENS, max_new_tokens=8, spec=seed1),
            # A's weights and revision, another tenant: another salt, other keys.
            job("other_tenant", model_dir, connector(sidecar, tenants.other, rev),
                PROMPT_C_TOKENS, max_new_tokens=8),
            # Other weights claiming A's revision: the store cannot tell, and the
            # output must show it, or the equalities here would prove little.
            job("lying_revision", model_dir, connector(sidecar, tenants.async_modes, rev),
                PROMPT_C_TOKENS, max_new_tokens=8, spec=seed1),
        ],
        tmp_path_factory.mktemp("engines-b"),
    )  # fmt: skip


def run_and_recompute(results: dict[str, dict[str, Any]], name: str) -> tuple[Any, Any]:
    return results[name]["runs"][name], results[name]["recompute"][name]


@pytest.mark.parametrize(("name", "tenant"), [("a", "async_modes"), ("a_sync", "sync_modes")])
def test_a_computes_everything_and_saves_its_full_chunks(
    sidecar: DevSidecar,
    tenants: Tenants,
    engines_a: dict[str, dict[str, Any]],
    name: str,
    tenant: str,
) -> None:
    run, recompute = run_and_recompute(engines_a, name)
    # A found nothing and computed everything, exactly as without a connector.
    assert run["num_external_cached_tokens"] == 0 and run["prefill_start"] == 0
    assert run["tokens"] == recompute["tokens"]
    assert torch.equal(run["sampled_logits"], recompute["sampled_logits"])
    # Five full chunks are on disk; the partial sixth never is.
    assert len(sidecar.objects(getattr(tenants, tenant))) == SHARED // CHUNK


@pytest.mark.parametrize(("name", "a_name"), [("b", "a"), ("b_sync", "a_sync")])
def test_b_loads_a_prefix_and_computes_only_the_suffix(
    engines_a: dict[str, dict[str, Any]],
    engines_b: dict[str, dict[str, Any]],
    name: str,
    a_name: str,
) -> None:
    run, recompute = run_and_recompute(engines_b, name)
    assert_reuse_is_exact(run, recompute, SHARED)
    # And the prefix B loaded is, byte for byte, what A computed in its own process.
    assert_same_kv(run["prompt_kv"], engines_a[a_name]["runs"][a_name]["prompt_kv"], SHARED)


@pytest.mark.parametrize("name", ["new_revision", "other_tenant"])
def test_another_contract_misses(engines_b: dict[str, dict[str, Any]], name: str) -> None:
    run, recompute = run_and_recompute(engines_b, name)
    assert run["num_external_cached_tokens"] == 0
    assert run["prefill_start"] == 0
    assert run["tokens"] == recompute["tokens"]
    assert torch.equal(run["sampled_logits"], recompute["sampled_logits"])


def test_a_lie_about_the_revision_is_caught(engines_b: dict[str, dict[str, Any]]) -> None:
    lie, honest = run_and_recompute(engines_b, "lying_revision")
    assert lie["num_external_cached_tokens"] == SHARED
    assert (lie["prefill_logits"] - honest["prefill_logits"][SHARED:]).abs().max() > 0.1
    assert lie["tokens"] != honest["tokens"]
