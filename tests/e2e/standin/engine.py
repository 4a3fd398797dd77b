"""One engine as its own process: ``python -m tests.e2e.standin JOB.json``.

A test double (see the package docstring).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .driver import VllmSchedulerDriver
from .kv import KVLayout
from .model import TinyLlamaSpec
from .runner import StandInModelRunner

if TYPE_CHECKING:
    pass

# --------------------------------------------------------------------------
# One engine as its own process: python -m tests.e2e.standin JOB.json
# --------------------------------------------------------------------------


def _result_record(
    *,
    tokens: Sequence[int],
    sampled_logits: torch.Tensor,
    prefill_logits: torch.Tensor,
    prefill_start: int,
    prompt_kv: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    num_local: int,
    num_external: int,
) -> dict[str, Any]:
    return {
        "tokens": list(tokens),
        "sampled_logits": sampled_logits,
        "prefill_logits": prefill_logits,
        "prefill_start": prefill_start,
        "prompt_kv": {name: (k, v) for name, (k, v) in prompt_kv.items()},
        "num_local_cached_tokens": num_local,
        "num_external_cached_tokens": num_external,
    }


def engine_main(job_path: str) -> int:
    """Run one engine process from a JSON job; write its results with ``torch.save``.

    Job keys: ``spec`` (:class:`TinyLlamaSpec` fields), ``model_dir``,
    ``layout``, ``dtype``, ``connector`` (None, or ``name``, ``module_path``,
    ``extra_config``), ``requests`` (``req_id``, ``prompt``,
    ``max_new_tokens``; run one after another under vLLM's scheduler),
    ``recompute`` (also run every request on a plain runner without
    connector or scheduler: the "recompute everything" baseline), ``out``.
    """
    job = json.loads(Path(job_path).read_text())
    # One thread: several engines share the machine, and GEMM results must
    # not depend on how many threads each one got.
    torch.set_num_threads(1)
    spec = TinyLlamaSpec(**job["spec"])
    dtype = getattr(torch, job.get("dtype", "float32"))
    layout = KVLayout[job.get("layout", "LBNHC")]
    model = spec.build_model(dtype)
    conn = job.get("connector")
    driver = VllmSchedulerDriver(
        spec,
        Path(job["model_dir"]),
        kv_connector=conn["name"] if conn else None,
        kv_connector_module_path=conn["module_path"] if conn else None,
        kv_connector_extra_config=conn["extra_config"] if conn else None,
        num_blocks=job.get("num_blocks", 128),
        dtype=dtype,
        layout=layout,
        model=model,
    )
    out: dict[str, Any] = {"runs": {}, "recompute": {}}
    try:
        for req in job["requests"]:
            r = driver.generate(req["req_id"], req["prompt"], req["max_new_tokens"])
            out["runs"][req["req_id"]] = _result_record(
                tokens=r.tokens,
                sampled_logits=torch.stack(r.sampled_logits),
                prefill_logits=r.prefill_logits(),
                prefill_start=r.prefill_start,
                prompt_kv=r.prompt_kv,
                num_local=r.num_local_cached_tokens,
                num_external=r.num_external_cached_tokens,
            )
    finally:
        driver.close()
    if job.get("recompute"):
        plain = StandInModelRunner(spec, layout=layout, dtype=dtype, model=model)
        for req in job["requests"]:
            g = plain.generate(req["req_id"], req["prompt"], req["max_new_tokens"])
            n = len(g.prompt)
            out["recompute"][req["req_id"]] = _result_record(
                tokens=g.tokens,
                sampled_logits=g.sampled_logits,
                prefill_logits=g.prefill_logits,
                prefill_start=0,
                prompt_kv={name: (k[:n], v[:n]) for name, (k, v) in g.kv.items()},
                num_local=0,
                num_external=0,
            )
    torch.save(out, job["out"])
    return 0
