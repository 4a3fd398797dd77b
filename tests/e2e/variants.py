"""Many engine variants, one engine process: the runner behind the matrix and failure tests.

Importing vLLM costs an engine process about ten seconds on two cores, so the
compatibility-matrix and failure-mode tests do not start one process per
variant. A job lists variants; ``python -m tests.e2e.variants JOB.json`` runs
them one after another, each with a fresh vLLM scheduler, fresh connector
instances (built by vLLM from ``kv_transfer_config``, loaded by module path)
and fresh paged caches, and writes one ``torch.save`` file per variant. A
variant that raises is recorded as such (its traceback in ``error``) and the
next one still runs. Nothing but the sidecar links the variants: no connector,
client or cache survives from one to the next; only the (deterministic) model
weights and the connector-free recompute baselines are built once per process
and shared.

What a variant can change, beyond :class:`~tests.e2e.standin.VllmSchedulerDriver`:

* ``tp``: tensor parallelism. The stand-in still runs the whole model over
  full-head caches; each of the ``tp`` worker connectors (vLLM builds them
  with ``get_tp_group().rank_in_group`` as their rank; here it is patched in,
  as ``tests/vllm/engine.py`` does) registers views of its own KV heads of
  those caches, which is what a TP rank's cache holds. Their reports are
  merged as vLLM's ``KVOutputAggregator`` merges workers' outputs.
  ``lost_save_ranks`` makes the sidecar refuse every save of some ranks (their
  chunks are simply never stored, as after a store write error).
* ``kv_role`` and per-request ``lora_name`` (a ``LoRARequest``; the stand-in's
  model applies no adapter weights, the connector only reads the adapter's
  name), ``cache_salt`` and ``mm`` (multimodal features, see
  :class:`PlaceholderMMRequest`).
* ``unusable_loads``: the workers cannot use any chunk they load (every copy
  into the paged cache fails, as a persistent device error would), while the
  sidecar keeps serving it.
* ``pause_save_at_copy``: the process blocks, forever, inside its N-th copy of
  a chunk into the sidecar's staging buffer (after that save's
  ``prepare_store`` reserved space and before its ``complete_store``: this
  process saves in two steps, not with ``store``), having
  first read the sidecar's counters over a connection of its own and written
  them to ``pause_marker``: a client hung mid-save, for the test to kill.

Every variant records, besides tokens and logits: what the connector offered
vLLM (``get_num_new_matched_tokens``), each lookup its scheduler side sent to
the sidecar (keys asked, leading keys found) and the contract of every
(LoRA, shard) the requests used, as ``CompatContract.to_dict()``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from kvoffload.client import SidecarClient

from .standin import (
    KVLayout,
    StandInModelRunner,
    TinyLlamaSpec,
    VllmRequestResult,
    VllmSchedulerDriver,
    allocate_kv_layer,
    build_vllm_scheduler,
)

REPO = Path(__file__).resolve().parents[2]
#: A bound for one engine process (all its variants); a hang fails, never blocks.
ENGINE_TIMEOUT_S = 900
CONNECTOR = "KVOffloadConnector"
CONNECTOR_MODULE = "kvoffload.integrations.vllm"


# --------------------------------------------------------------------------
# Parent side: start engine processes, read their results
# --------------------------------------------------------------------------


def engine_env() -> dict[str, str]:
    """The test's environment without anything that would configure kvoffload."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}


@dataclasses.dataclass
class EngineProcess:
    """One ``python -m tests.e2e.variants`` process."""

    name: str
    proc: subprocess.Popen[bytes]
    out_dir: Path
    log_path: Path
    variants: tuple[str, ...]

    def log_tail(self, n: int = 8000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> int:
        """SIGKILL and reap; the exit status (-9 when the kill did it)."""
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait(30)

    def wait(self, timeout_s: float = ENGINE_TIMEOUT_S) -> dict[str, dict[str, Any]]:
        """Wait for a clean exit; every variant's result by name."""
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = -1
        if rc != 0:
            pytest.fail(f"engine process {self.name} exited {rc}:\n{self.log_tail()}")
        results = {}
        for v in self.variants:
            path = self.out_dir / f"{v}.pt"
            if not path.exists():
                pytest.fail(f"engine {self.name}: no result for {v}:\n{self.log_tail()}")
            results[v] = torch.load(path, weights_only=False)
        return results


def start_engine(name: str, variants: Sequence[Mapping[str, Any]], workdir: Path) -> EngineProcess:
    """Run ``variants`` in one new engine process (returns at once)."""
    out_dir = workdir / name
    out_dir.mkdir(parents=True, exist_ok=True)
    job_path = workdir / f"{name}.json"
    job_path.write_text(json.dumps({"out_dir": str(out_dir), "variants": list(variants)}))
    log_path = workdir / f"{name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.e2e.variants", str(job_path)],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=engine_env(),
        )
    return EngineProcess(name, proc, out_dir, log_path, tuple(v["name"] for v in variants))


def run_engine(
    name: str, variants: Sequence[Mapping[str, Any]], workdir: Path
) -> dict[str, dict[str, Any]]:
    return start_engine(name, variants, workdir).wait()


def variant(
    name: str,
    *,
    spec: TinyLlamaSpec,
    model_dir: Path,
    extra_config: Mapping[str, Any] | None,
    requests: Sequence[Mapping[str, Any]],
    dtype: str = "float32",
    layout: KVLayout = KVLayout.LBNHC,
    block_size: int = 16,
    num_blocks: int = 128,
    tp: int = 1,
    lost_save_ranks: Sequence[int] = (),
    kv_role: str = "kv_both",
    recompute: bool = True,
    pause_save_at_copy: int | None = None,
    pause_marker: Path | None = None,
    unusable_loads: bool = False,
) -> dict[str, Any]:
    """One variant of a job (JSON-ready)."""
    return {
        "name": name,
        "spec": dataclasses.asdict(spec),
        "model_dir": str(model_dir),
        "dtype": dtype,
        "layout": layout.name,
        "block_size": block_size,
        "num_blocks": num_blocks,
        "tp": tp,
        "lost_save_ranks": list(lost_save_ranks),
        "kv_role": kv_role,
        "extra_config": None if extra_config is None else dict(extra_config),
        "requests": [dict(r) for r in requests],
        "recompute": recompute,
        "unusable_loads": unusable_loads,
        "pause_save_at_copy": pause_save_at_copy,
        "pause_marker": None if pause_marker is None else str(pause_marker),
    }


def request(
    req_id: str,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    lora_name: str | None = None,
    mm: Sequence[tuple[str, int, int]] = (),
    cache_salt: str | None = None,
) -> dict[str, Any]:
    """One request of a variant; ``mm`` holds (identifier, offset, length) per feature."""
    return {
        "req_id": req_id,
        "prompt": list(prompt),
        "max_new_tokens": max_new_tokens,
        "lora_name": lora_name,
        "mm": [list(m) for m in mm],
        "cache_salt": cache_salt,
    }


def contract_diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> set[str]:
    """Top-level contract fields whose values differ."""
    return {k for k in set(a) | set(b) if a.get(k) != b.get(k)}


# --------------------------------------------------------------------------
# Engine side
# --------------------------------------------------------------------------


def _placeholder_mm_request_class() -> type:
    from vllm.v1.request import Request

    class PlaceholderMMRequest(Request):  # type: ignore[misc]
        """A request carrying multimodal features, for a text-only stand-in model.

        The features (identifier = the item's content hash, placeholder range)
        are exactly what a multimodal request carries and what the connector
        keys on. The stand-in has no encoder: vLLM's encoder scheduling is off
        for these requests (a text-only model's encoder budget is zero, so
        vLLM would never schedule their placeholder tokens), and the model
        reads the placeholder token ids as ordinary tokens.
        """

        @property
        def has_encoder_inputs(self) -> bool:
            return False

    return PlaceholderMMRequest


class TPWorkers:
    """``tp`` worker connectors behind the stand-in runner's one connector slot.

    Every call goes to every rank, in rank order; rank ``r`` sees only its own
    KV heads of each cache (views, so what it loads lands in the runner's
    caches). Reports are merged as vLLM's ``KVOutputAggregator`` does: a
    request is finished sending (receiving) once every rank said so; invalid
    blocks are the union; worker metadata is aggregated.
    """

    def __init__(self, workers: Sequence[Any], heads_per_rank: int) -> None:
        self.workers = list(workers)
        self.heads = heads_per_rank
        self._sending: Counter[str] = Counter()
        self._recving: Counter[str] = Counter()

    def _mine(self, rank: int, kv: torch.Tensor) -> torch.Tensor:
        # Standardized [blocks, heads, tokens, K|V] view: a head slice is a view.
        return kv[:, rank * self.heads : (rank + 1) * self.heads]

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for r, w in enumerate(self.workers):
            w.register_kv_caches({n: self._mine(r, t) for n, t in kv_caches.items()})

    def handle_preemptions(self, meta: Any) -> None:
        for w in self.workers:
            w.handle_preemptions(meta)

    def bind_connector_metadata(self, meta: Any) -> None:
        for w in self.workers:
            w.bind_connector_metadata(meta)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        for w in self.workers:
            w.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for w in self.workers:
            w.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        for r, w in enumerate(self.workers):
            w.save_kv_layer(layer_name, self._mine(r, kv_layer), attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        for w in self.workers:
            w.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        done_sending: set[str] = set()
        done_recving: set[str] = set()
        for w in self.workers:
            sending, recving = w.get_finished(finished_req_ids)
            for counter, reported, done in (
                (self._sending, sending, done_sending),
                (self._recving, recving, done_recving),
            ):
                for req_id in reported or ():
                    counter[req_id] += 1
                    if counter[req_id] == len(self.workers):
                        del counter[req_id]
                        done.add(req_id)
        return done_sending, done_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        out: set[int] = set()
        for w in self.workers:
            out |= set(w.get_block_ids_with_load_errors())
        return out

    def build_connector_worker_meta(self) -> Any:
        metas = [m for w in self.workers if (m := w.build_connector_worker_meta()) is not None]
        if not metas:
            return None
        merged = metas[0]
        for m in metas[1:]:
            merged = merged.aggregate(m)
        return merged

    def clear_connector_metadata(self) -> None:
        for w in self.workers:
            w.clear_connector_metadata()

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()


class StandInEngine(VllmSchedulerDriver):
    """:class:`VllmSchedulerDriver` with tensor parallelism, a ``kv_role``, and
    requests with a LoRA adapter, a cache salt or multimodal features.

    The constructor follows ``VllmSchedulerDriver.__init__`` step for step and
    ends in the same ``_start`` (stepping, planning and recording are inherited
    unchanged); it adds ``ParallelConfig(tensor_parallel_size=tp)``, per-rank
    KV-cache specs and one worker connector per rank (:class:`TPWorkers`).
    """

    def __init__(
        self,
        spec: TinyLlamaSpec,
        model_dir: Path,
        *,
        extra_config: Mapping[str, Any] | None,
        model: Any,
        num_blocks: int = 128,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        layout: KVLayout = KVLayout.LBNHC,
        tp: int = 1,
        kv_role: str = "kv_both",
        lost_save_ranks: Sequence[int] = (),
        max_num_batched_tokens: int = 2048,
    ) -> None:
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        if spec.num_kv_heads % tp:
            raise ValueError(f"{spec.num_kv_heads} KV heads do not split over {tp} ranks")
        transfer = (
            None
            if extra_config is None
            else KVTransferConfig(
                kv_connector=CONNECTOR,
                kv_connector_module_path=CONNECTOR_MODULE,
                kv_role=kv_role,
                kv_connector_extra_config=dict(extra_config),
                kv_load_failure_policy="recompute",
            )
        )
        self.vllm_config, self.kv_cache_config, self.scheduler = build_vllm_scheduler(
            spec,
            model_dir,
            dtype=dtype,
            block_size=block_size,
            layout=layout,
            num_blocks=num_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            transfer=transfer,
            tp=tp,
        )
        heads = spec.num_kv_heads // tp
        workers = []
        if transfer is not None:
            for rank in range(tp):
                with mock.patch(
                    "kvoffload.integrations.vllm.worker.local_ranks", return_value=(rank, 0)
                ):
                    w = KVConnectorFactory.create_connector(
                        self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config
                    )
                if rank in lost_save_ranks:
                    w.worker_side._save_client.save = _refused_save
                workers.append(w)
        self.worker_connector: Any = TPWorkers(workers, heads) if workers else None
        # The runner's caches hold every head (it runs the whole model); rank r's
        # connector sees heads [r*heads, (r+1)*heads) of them.
        kv_caches = {
            name: allocate_kv_layer(
                layout,
                num_blocks=self.kv_cache_config.num_blocks,
                block_size=block_size,
                num_kv_heads=spec.num_kv_heads,
                head_size=spec.head_dim,
                dtype=dtype,
            )
            for name in spec.layer_names()
        }
        self._start(
            spec,
            block_size=block_size,
            layout=layout,
            dtype=dtype,
            model=model,
            kv_caches=kv_caches,
        )
        self._lora_ids: dict[str, int] = {}

    @property
    def connector(self) -> Any:
        """The scheduler-side ``KVOffloadConnector`` vLLM built (None without one)."""
        return self.scheduler.connector

    def add_request(
        self,
        req_id: str,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        lora_name: str | None = None,
        mm: Sequence[Sequence[Any]] = (),
        cache_salt: str | None = None,
    ) -> None:
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        params = SamplingParams(max_tokens=max_new_tokens, ignore_eos=True)
        params.update_from_generation_config({}, self.eos_token_id)
        lora = None
        if lora_name is not None:
            # lora_int_id is this engine's slot number; the name is the identity.
            slot = self._lora_ids.setdefault(lora_name, len(self._lora_ids) + 1)
            lora = LoRARequest(lora_name, slot, "/nonexistent-adapter")
        features = [
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=str(ident),
                mm_position=PlaceholderRange(offset=int(offset), length=int(length)),
                mm_hash=str(ident),
            )
            for ident, offset, length in mm
        ]
        cls = _placeholder_mm_request_class() if features else Request
        self.scheduler.add_request(
            cls(
                request_id=req_id,
                prompt_token_ids=list(prompt),
                sampling_params=params,
                pooling_params=None,
                mm_features=features or None,
                lora_request=lora,
                cache_salt=cache_salt,
                block_hasher=get_request_block_hasher(self.block_size, sha256),
            )
        )
        self.results[req_id] = VllmRequestResult(req_id, tuple(prompt))

    def generate_request(self, r: Mapping[str, Any]) -> VllmRequestResult:
        self.add_request(
            r["req_id"],
            r["prompt"],
            r["max_new_tokens"],
            lora_name=r.get("lora_name"),
            mm=r.get("mm") or (),
            cache_salt=r.get("cache_salt"),
        )
        self.run(timeout_s=120.0)
        return self.results[r["req_id"]]


def _refused_save(namespace: bytes, chunks: Sequence[Any], *, ttl_s: Any = None) -> list[bool]:
    """A save client whose every chunk the store refused (nothing is sent)."""
    return [False] * len(chunks)


def _unusable_scatter(self: Any, chunk: Any, chunk_tokens: int, layers: Any) -> None:
    raise RuntimeError("stand-in: copying a loaded chunk into the KV cache failed")


def _pause_in_copy(nth: int, marker: Path, socket_path: str) -> None:
    """Block forever inside the ``nth`` staging copy of a save (see the module docstring).

    Before blocking, it reads the sidecar's counters over a connection of its
    own, at the one moment a reservation is sure to be held (a handle TTL may
    release it any time later), and writes them to ``marker``.
    """
    from kvoffload.client import fetch_stats

    real = SidecarClient._copy_in
    calls = 0
    lock = threading.Lock()

    def copy_in(staging: Any, offset: int, layers: list[memoryview]) -> None:
        nonlocal calls
        with lock:
            calls += 1
            n = calls
        if n == nth:
            stats = fetch_stats(socket_path)
            marker.write_text(
                json.dumps(
                    {
                        "pid": os.getpid(),
                        "copy": n,
                        "reserved_bytes": stats["reserved_bytes"],
                        "connections": stats["server"]["connections"],
                    }
                )
            )
            while True:  # a hung client: only a signal ends it
                time.sleep(3600)
        real(staging, offset, layers)

    SidecarClient._copy_in = staticmethod(copy_in)  # type: ignore[method-assign]
    # The two-step save, as with a server before protocol revision 6: with
    # ``store`` (5.21) the copies come before the one request, so a client hung
    # in its copy holds nothing on the server, and the handle expiry this
    # variant exists to exercise would not be reached.
    from kvoffload.client.staged import StagedPath

    StagedPath._store_batch = lambda *_a, **_k: False  # type: ignore[method-assign]


def _record(r: VllmRequestResult) -> dict[str, Any]:
    return {
        "tokens": list(r.tokens),
        "sampled_logits": torch.stack(r.sampled_logits),
        "prefill_logits": r.prefill_logits(),
        "prefill_start": r.prefill_start,
        "prompt_kv": dict(r.prompt_kv),
        "num_local_cached_tokens": r.num_local_cached_tokens,
        "num_external_cached_tokens": r.num_external_cached_tokens,
    }


class _Process:
    """What one engine process builds once: models and recompute baselines."""

    def __init__(self) -> None:
        self._models: dict[tuple[str, str], Any] = {}
        self._baselines: dict[str, dict[str, Any]] = {}

    def model(self, spec: TinyLlamaSpec, dtype: torch.dtype) -> Any:
        k = (json.dumps(dataclasses.asdict(spec), sort_keys=True), str(dtype))
        if k not in self._models:
            self._models[k] = spec.build_model(dtype)
        return self._models[k]

    def baseline(self, v: Mapping[str, Any], r: Mapping[str, Any]) -> dict[str, Any]:
        """The request on a plain runner: no connector, no scheduler, everything computed."""
        spec = TinyLlamaSpec(**v["spec"])
        dtype = getattr(torch, v["dtype"])
        k = json.dumps(
            [v["spec"], v["dtype"], v["layout"], v["block_size"], r["prompt"], r["max_new_tokens"]],
            sort_keys=True,
        )
        if k not in self._baselines:
            plain = StandInModelRunner(
                spec,
                layout=KVLayout[v["layout"]],
                dtype=dtype,
                block_size=v["block_size"],
                num_blocks=v["num_blocks"],
                model=self.model(spec, dtype),
            )
            g = plain.generate(r["req_id"], r["prompt"], r["max_new_tokens"])
            n = len(g.prompt)
            self._baselines[k] = {
                "tokens": list(g.tokens),
                "sampled_logits": g.sampled_logits,
                "prefill_logits": g.prefill_logits,
                "prefill_start": 0,
                "prompt_kv": {name: (kk[:n], vv[:n]) for name, (kk, vv) in g.kv.items()},
                "num_local_cached_tokens": 0,
                "num_external_cached_tokens": 0,
            }
        return self._baselines[k]

    def run_variant(self, v: Mapping[str, Any], out_dir: Path) -> None:
        spec = TinyLlamaSpec(**v["spec"])
        dtype = getattr(torch, v["dtype"])
        out: dict[str, Any] = {
            "error": None,
            "runs": {},
            "recompute": {},
            "offered": [],
            "lookups": [],
            "contracts": {},
        }
        t0 = time.monotonic()
        engine: StandInEngine | None = None
        broken = contextlib.ExitStack()
        if v.get("unusable_loads"):
            from kvoffload.integrations.vllm.paged import PagedCache

            broken.enter_context(mock.patch.object(PagedCache, "scatter", _unusable_scatter))
        try:
            engine = StandInEngine(
                spec,
                Path(v["model_dir"]),
                extra_config=v["extra_config"],
                model=self.model(spec, dtype),
                num_blocks=v["num_blocks"],
                block_size=v["block_size"],
                dtype=dtype,
                layout=KVLayout[v["layout"]],
                tp=v["tp"],
                kv_role=v["kv_role"],
                lost_save_ranks=v["lost_save_ranks"],
            )
            conn = engine.connector
            if conn is not None:
                self._watch(conn, out)
            if v["pause_save_at_copy"] is not None:
                _pause_in_copy(
                    v["pause_save_at_copy"],
                    Path(v["pause_marker"]),
                    v["extra_config"]["socket_path"],
                )
            for r in v["requests"]:
                if conn is not None:
                    lora = r.get("lora_name")
                    out["contracts"][r["req_id"]] = [
                        conn.contracts.contract(lora, s).to_dict()
                        for s in range(conn.contracts.num_shards)
                    ]
                out["runs"][r["req_id"]] = _record(engine.generate_request(r))
        except Exception:
            out["error"] = traceback.format_exc()
        finally:
            if engine is not None:
                with contextlib.suppress(Exception):
                    engine.close()
            broken.close()
        if v["recompute"] and out["error"] is None:
            for r in v["requests"]:
                out["recompute"][r["req_id"]] = self.baseline(v, r)
        out["seconds"] = time.monotonic() - t0
        torch.save(out, out_dir / f"{v['name']}.pt")
        print(f"variant {v['name']}: {out['seconds']:.1f} s", flush=True)
        if out["error"]:
            print(out["error"], flush=True)

    @staticmethod
    def _watch(conn: Any, out: dict[str, Any]) -> None:
        """Record what the connector offers vLLM and what its scheduler side asks the sidecar."""
        offer = conn.get_num_new_matched_tokens

        def offered(request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
            n, is_async = offer(request, num_computed_tokens)
            out["offered"].append((request.request_id, num_computed_tokens, n, is_async))
            return n, is_async

        conn.get_num_new_matched_tokens = offered
        client = conn.scheduler_side._client
        lookup = client.lookup

        def looked_up(keys: Sequence[bytes]) -> int:
            found = lookup(keys)
            out["lookups"].append((len(keys), found))
            return int(found)

        client.lookup = looked_up


def main(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    # One thread: engines share the machine, and results must not depend on
    # how many threads each got.
    torch.set_num_threads(1)
    out_dir = Path(job["out_dir"])
    proc = _Process()
    for v in job["variants"]:
        proc.run_variant(v, out_dir)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.e2e.variants JOB.json")
    sys.exit(main(sys.argv[1]))
