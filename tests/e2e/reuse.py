"""Helpers shared by the tests (moved out of test_reuse_across_processes.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e.standin import (
    KVLayout,
    TinyLlamaSpec,
    iter_layers,
)
from tests.sidecar_proc import DevSidecar

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


def run_and_recompute(results: dict[str, dict[str, Any]], name: str) -> tuple[Any, Any]:
    return results[name]["runs"][name], results[name]["recompute"][name]
