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
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e.reuse import (
    CHUNK,
    PROMPT_A_TOKENS,
    PROMPT_B_TOKENS,
    PROMPT_C_TOKENS,
    SHARED,
    SPEC,
    assert_reuse_is_exact,
    assert_same_kv,
    connector,
    job,
    run_and_recompute,
    run_engines,
)

from ..sidecar_proc import DevSidecar, dev_sidecar
from .standin import (
    KVLayout,
    TinyLlamaSpec,
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
