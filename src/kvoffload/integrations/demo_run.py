"""The demo: two (then three) worker processes that share nothing but the sidecar.

:func:`run_demo` starts (or reuses) the embedded development sidecar
(:func:`dev_sidecar`), then workers (``python -m kvoffload.integrations.demo_run
worker``: a JSON :class:`WorkerJob` on stdin, a JSON result on stdout) that
prefill, save, and serve the same prompt again with reuse, each in its own
process, with the steps of :mod:`kvoffload.integrations.demo_model`. Imports
torch, as that module does.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..contract import CompatContract
from ..keys import chunk_keys
from ..testing import RunningSidecar
from ..testing import dev_sidecar as start_dev_sidecar
from .demo_config import DEFAULT_CHUNK_TOKENS, DemoConfig, ModelShape
from .demo_model import (
    SIDECAR_READY_TIMEOUT_S,
    WORKER_TIMEOUT_S,
    Prefill,
    ReuseResult,
    build_model,
    cache_from_kv,
    chunk_layer_bytes,
    demo_contract,
    llama_config,
    logits_tolerance,
    max_abs_diff,
    model_revision,
    pack_chunks,
    prefill,
    prefill_suffix,
    random_tokens,
    reuse_prefill,
    staging_bytes_for,
)

# --------------------------------------------------------------------------- the dev sidecar


@contextlib.contextmanager
def dev_sidecar(
    directory: Path | None = None, *, ready_timeout_s: float = SIDECAR_READY_TIMEOUT_S
) -> Iterator[RunningSidecar]:
    """The sidecar of ``directory``'s embedded store: the one already answering on its
    socket, or one started there and stopped on exit (:func:`kvoffload.testing.dev_sidecar`)."""
    with start_dev_sidecar(directory, reuse=True, ready_timeout_s=ready_timeout_s) as sc:
        yield sc


# --------------------------------------------------------------------------- workers


@dataclass(frozen=True)
class WorkerJob:
    """What one worker process does (``python -m kvoffload.integrations.demo_run worker``
    reads it as JSON).

    ``role`` "save": prefill ``tokens`` and save every full chunk. "reuse": serve
    ``tokens`` with reuse (:func:`reuse_prefill`), then, if ``recompute``, prefill them
    in full too and compare; ``repeats`` times, reporting the median. ``warmup`` runs
    both shapes once, untimed, first.
    """

    role: str
    socket_path: str
    tenant: str
    shape: ModelShape
    seed: int
    tokens: list[int]
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    threads: int = 2
    warmup: bool = True
    recompute: bool = True
    repeats: int = 3

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerJob:
        d = json.loads(text)
        d["shape"] = ModelShape(**d["shape"])
        return cls(**d)


def _warm_up(model: Any, tokens: Sequence[int], chunk_tokens: int) -> None:
    """One full prefill and one suffix prefill of the shapes to come (untimed): the first
    call of a GEMM shape pays one-off set-up costs that no later call does."""
    full = prefill(model, tokens)
    n = (len(tokens) - 1) // chunk_tokens * chunk_tokens
    if n:
        cache = cache_from_kv(
            model.config, [k[:, :n] for k in full.keys], [v[:, :n] for v in full.values]
        )
        prefill_suffix(model, tokens, cache, n)


def run_worker(job: WorkerJob) -> dict[str, Any]:
    """Run one worker's job in this process; a JSON-able report."""
    from ..client import SidecarClient

    torch.set_num_threads(job.threads)
    config = llama_config(job.shape)
    model = build_model(config, job.seed)
    contract = demo_contract(config, job.seed, tenant=job.tenant, chunk_tokens=job.chunk_tokens)
    full_chunks = len(job.tokens) // job.chunk_tokens
    staging = staging_bytes_for(contract.layer_layout, job.chunk_tokens, full_chunks)
    report: dict[str, Any] = {
        "role": job.role,
        "pid": os.getpid(),
        "model_revision": contract.model_revision,
        "namespace": contract.fingerprint().hex(),
        "tokens": len(job.tokens),
        "full_chunks": full_chunks,
        "torch_threads": torch.get_num_threads(),
    }
    with SidecarClient(
        job.socket_path, job.tenant, staging_bytes=staging, name=f"kvoffload demo {job.role}"
    ) as client:
        # Connecting (hello, staging registration) is a worker's start-up, not a request's.
        if client.salt is None:
            raise RuntimeError(f"no sidecar answered on {job.socket_path}")
        if job.role == "save":
            t0 = time.perf_counter()
            full = prefill(model, job.tokens)
            t1 = time.perf_counter()
            keys = chunk_keys(contract, client.salt, job.tokens)
            chunks = pack_chunks(full.keys, full.values, job.chunk_tokens)
            present = client.lookup(keys)  # an earlier run's chunks: not "saved" again
            saved = client.save(contract.fingerprint(), list(zip(keys, chunks, strict=True)))
            t2 = time.perf_counter()
            layer_bytes = chunk_layer_bytes(contract.layer_layout, job.chunk_tokens, torch.float32)
            report |= {
                "prefill_s": t1 - t0,
                "save_s": t2 - t1,
                "chunks_saved": sum(saved),
                "chunks_already_present": present,
                "chunks_new": max(0, sum(saved) - present),
                "bytes_saved": sum(saved) * layer_bytes * contract.layer_layout.num_layers,
                "next_token": int(full.logits.argmax()),
            }
            return report
        if job.role != "reuse":
            raise ValueError(f"unknown worker role {job.role!r}")
        if job.warmup:
            _warm_up(model, job.tokens, job.chunk_tokens)
        return report | _serve_with_reuse(job, model, client, contract)


def _serve_with_reuse(
    job: WorkerJob, model: Any, client: Any, contract: CompatContract
) -> dict[str, Any]:
    """``job.repeats`` rounds of (reuse, recompute), interleaved so that a noisy machine
    slows both alike; the run with the median TTFT is reported, and every run is compared."""
    reuses: list[ReuseResult] = []
    recompute_s: list[float] = []
    full: Prefill | None = None
    diff = kv_diff = 0.0
    greedy = True
    for _ in range(job.repeats):
        r = reuse_prefill(model, client, contract, job.tokens)
        reuses.append(r)
        if not job.recompute:
            continue
        t0 = time.perf_counter()
        full = prefill(model, job.tokens)
        recompute_s.append(time.perf_counter() - t0)
        diff = max(diff, max_abs_diff(r.logits, full.logits))
        greedy = greedy and int(r.logits.argmax()) == int(full.logits.argmax())
        if r.prefix is not None and r.reused_chunks:
            t = r.reused_tokens
            kv_diff = max(
                kv_diff,
                *(
                    max(max_abs_diff(a[:, :t], b[:, :t]), max_abs_diff(c[:, :t], d[:, :t]))
                    for a, b, c, d in zip(
                        r.prefix.keys, full.keys, r.prefix.values, full.values, strict=True
                    )
                ),
            )
    r = sorted(reuses, key=lambda x: x.total_s)[(len(reuses) - 1) // 2]
    report: dict[str, Any] = {
        "repeats": job.repeats,
        "lookup_chunks": r.lookup_chunks,
        "chunks_reused": r.reused_chunks,
        "tokens_reused": r.reused_tokens,
        "tokens_computed": len(job.tokens) - r.reused_tokens,
        "bytes_loaded": r.loaded_bytes,
        "ttft_reuse_s": r.total_s,
        "ttft_reuse_runs_s": [x.total_s for x in reuses],
        "keys_s": r.keys_s,
        "lookup_s": r.lookup_s,
        "load_s": r.load_s,
        "cache_s": r.cache_s,
        "suffix_prefill_s": r.compute_s,
        "next_token": int(r.logits.argmax()),
    }
    if full is not None:
        tol = logits_tolerance(full.logits)
        report |= {
            "ttft_recompute_s": statistics.median(recompute_s),
            "ttft_recompute_runs_s": recompute_s,
            "recompute_next_token": int(full.logits.argmax()),
            "logits_max_abs_diff": diff,
            "logits_tolerance": tol,
            "logits_match": diff <= tol,
            "greedy_match": greedy,
            "prefix_kv_max_abs_diff": kv_diff,
            "logits_abs_max": float(full.logits.abs().max()),
        }
    return report


def spawn_worker(job: WorkerJob, *, timeout_s: float = WORKER_TIMEOUT_S) -> dict[str, Any]:
    """Run ``job`` in its own Python process; its report."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvoffload.integrations.demo_run", "worker"],
        input=job.to_json(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"worker {job.role} (seed {job.seed}) exited with {proc.returncode}:\n"
            f"{proc.stderr[-4000:]}"
        )
    lines = proc.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(f"worker {job.role} printed no report:\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# --------------------------------------------------------------------------- the demo


def demo_prompts(cfg: DemoConfig) -> tuple[list[int], list[int]]:
    """Worker A's and worker B's prompts: one shared document of ``prompt_tokens`` tokens,
    each followed by its own ``suffix_tokens``-token question."""
    vocab = cfg.shape.vocab_size
    doc = random_tokens(cfg.prompt_tokens, vocab, cfg.token_seed)
    qa = random_tokens(cfg.suffix_tokens, vocab, cfg.token_seed + 1)
    qb = random_tokens(cfg.suffix_tokens, vocab, cfg.token_seed + 2)
    return doc + qa, doc + qb


def run_demo(
    cfg: DemoConfig,
    directory: Path | None = None,
    progress: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    """Worker A saves, worker B reuses (and recomputes to compare), worker C (another
    revision) misses; each its own process, all through one dev sidecar."""
    prompt_a, prompt_b = demo_prompts(cfg)
    out: dict[str, Any] = {
        "model": asdict(cfg.shape) | {"head_dim": cfg.shape.head_dim, "ffn": cfg.shape.ffn_size},
        "model_description": cfg.shape.describe(),
        "dtype": "float32",
        "prompt_tokens": cfg.prompt_tokens,
        "suffix_tokens": cfg.suffix_tokens,
        "chunk_tokens": cfg.chunk_tokens,
        "tenant": cfg.tenant,
        "torch_threads": cfg.threads,
    }
    with dev_sidecar(directory) as sc:
        progress(
            f"sidecar {'started, pid ' + str(sc.pid) if sc.started else 'already running'} "
            f"on {sc.socket_path}"
        )
        out["sidecar"] = {
            "socket": str(sc.socket_path),
            "store": str(sc.store_root),
            "started": sc.started,
            "pid": sc.pid,
        }

        def job(role: str, seed: int, tokens: list[int], recompute: bool) -> WorkerJob:
            return WorkerJob(
                role=role,
                socket_path=str(sc.socket_path),
                tenant=cfg.tenant,
                shape=cfg.shape,
                seed=seed,
                tokens=tokens,
                chunk_tokens=cfg.chunk_tokens,
                threads=cfg.threads,
                recompute=recompute,
                repeats=cfg.repeats if recompute else 1,
            )

        progress(f"worker A ({model_revision(cfg.seed)}): prefill {len(prompt_a)} tokens, save")
        out["a"] = spawn_worker(job("save", cfg.seed, prompt_a, False))
        progress(f"worker B ({model_revision(cfg.seed)}): reuse, then recompute to compare")
        out["b"] = spawn_worker(job("reuse", cfg.seed, prompt_b, True))
        progress(f"worker C ({model_revision(cfg.other_seed)}): another revision, must miss")
        out["c"] = spawn_worker(job("reuse", cfg.other_seed, prompt_b, False))
    out["sidecar"]["stopped"] = sc.stopped
    b = out["b"]
    out["speedup"] = b["ttft_recompute_s"] / b["ttft_reuse_s"] if b["ttft_reuse_s"] > 0 else None
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args != ["worker"]:
        print(
            "usage: python -m kvoffload.integrations.demo_run worker (a JSON WorkerJob on stdin)",
            file=sys.stderr,
        )
        return 2
    job = WorkerJob.from_json(sys.stdin.read())
    report = run_worker(job)
    sys.stdout.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
