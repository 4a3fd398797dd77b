"""kvoffload's vLLM secondary tier beside vLLM's built-in ``fs`` tier, in one run.

Run in the vLLM venv from the repository root::

    PYTHONPATH=$PWD/src /work/main/.venv-vllm/bin/python scripts/bench_vllm_tier.py

One real ``TieringOffloadingSpec`` (vLLM's code: CPU primary tier on a
``SharedOffloadRegion`` in /dev/shm) holds both tiers. The same primary rows
are stored through each tier (``submit_store``, jobs of ``--job-chunks``
chunks, polled through ``get_finished_jobs`` as the tiering manager does)
and loaded back into the rows (``submit_load``), with the same durability:
no fsync on either side (the fs tier never syncs; the sidecar runs with
``durability = none``). Loads are timed warm (files in the page cache) and
cold (pages dropped with fadvise DONTNEED first). The kvoffload rows are the
sealed tenant (AES-256-GCM) through staging (``inplace = "off"``), the same
tenant in place (protocol-v1 §5.34: the sidecar reads and writes the
primary region's file itself) and the plaintext tenant with the direct path.
``--quick``: 16 chunks, one repeat.

The machine's ceilings of the same run: memcpy of the rows, and a buffered
write and read of the same bytes as plain files (benchlib.ceilings).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from benchlib.ceilings import raw_path, raw_reader, raw_writer
from benchlib.facts import git_state, machine_facts
from benchlib.method import drop_cache
from benchlib.sidecar import DIRECT_TENANT, SEALED_TENANT, run_sidecar
from benchlib.tables import begin, cell, machine_table

GB = 1e9
MiB = 1 << 20

#: The extra copies each tier makes per chunk, beyond vLLM's GPU<->row copy.
COPIES = {
    "fs": (
        "write(2) from the row: 1 kernel copy (0 with O_DIRECT)",
        "readv(2) into the row: 1 kernel copy (0 with O_DIRECT)",
    ),
    "kvoffload sealed": (
        "row->staging memcpy + AES-GCM seal pass + write(2)",
        "read(2) + AES-GCM open pass in staging + staging->row memcpy",
    ),
    "kvoffload in place": (
        "sidecar preadv(2) of the row (kernel copy) + AES-GCM seal pass + write(2); "
        "the worker copies nothing",
        "read(2) + AES-GCM open pass in sidecar scratch + pwritev(2) into the row "
        "(kernel copy) after verify; the worker copies nothing",
    ),
    "kvoffload direct": (
        "write(2) from the row into the leased file: 1 kernel copy",
        "read into the row: 1 kernel copy; the sidecar verifies the file",
    ),
}


def _spec(tiers: list[dict[str, Any]], chunks: int, block_bytes: int) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("model.layers.0.attn",), 0),),
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=False,
        extra_config={
            "cpu_bytes_to_use": 2 * block_bytes * chunks,
            "secondary_tiers": tiers,
            "tier_poll_interval_s": 0,
        },
        engine_id=f"kvo-bench-{uuid.uuid4().hex[:10]}",
        model=OffloadingModelConfig(name="bench", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=2),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
    )
    return TieringOffloadingSpec(config)


def _run_jobs(tier: Any, keys: list[Any], job_chunks: int, promote: bool) -> float:
    """Submit every chunk in jobs of ``job_chunks``; seconds until all finished ok."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    ctx = ReqContext("bench")
    jobs = {}
    t0 = time.perf_counter()
    for j, lo in enumerate(range(0, len(keys), job_chunks)):
        ids = np.arange(lo, min(lo + job_chunks, len(keys)), dtype=np.int32)
        job = TransferJob(j, keys[lo : lo + len(ids)], ids, promote, ctx)
        jobs[j] = job
        (tier.submit_load if promote else tier.submit_store)(job)
    failed = 0
    while jobs:
        for r in tier.get_finished_jobs():
            jobs.pop(r.job_id, None)
            failed += not r.success
        time.sleep(0.0005)
    took = time.perf_counter() - t0
    if failed:
        raise RuntimeError(f"{tier.tier_type}: {failed} jobs failed")
    return took


def _ceilings(rows: np.ndarray, d: Path) -> dict[str, float]:
    """memcpy, buffered write and read of the same bytes, GB/s."""
    total = rows.nbytes
    dst = np.empty_like(rows)
    np.copyto(dst, rows)  # pre-touched: the timed copy pays no page faults
    t0 = time.perf_counter()
    np.copyto(dst, rows)
    memcpy = total / (time.perf_counter() - t0) / GB
    d.mkdir()
    img = memoryview(rows[0]).cast("B")
    w = raw_writer(d, img, "none")
    t0 = time.perf_counter()
    for i in range(rows.shape[0]):
        w(i)
    write = total / (time.perf_counter() - t0) / GB
    paths = [raw_path(d, i) for i in range(rows.shape[0])]
    r = raw_reader(paths, memoryview(dst[0]).cast("B"))
    t0 = time.perf_counter()
    for i in range(rows.shape[0]):
        r(i)
    read = total / (time.perf_counter() - t0) / GB
    return {"memcpy": memcpy, "file write": write, "file read (warm)": read}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=64, help="chunks per run (default 64)")
    ap.add_argument("--chunk-mib", type=int, default=2, help="MiB per chunk row (default 2)")
    ap.add_argument("--job-chunks", type=int, default=8, help="chunks per job (default 8)")
    ap.add_argument("--threads", type=int, default=2, help="I/O threads per tier (default 2)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where files go (default: cwd)")
    ap.add_argument("--quick", action="store_true", help="16 chunks, one repeat")
    args = ap.parse_args(argv)
    if args.quick:
        args.chunks, args.repeats = min(args.chunks, 16), 1
    if min(args.chunks, args.chunk_mib, args.job_chunks, args.threads, args.repeats) < 1:
        print("bench_vllm_tier: every count must be at least 1", file=sys.stderr)
        return 2
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("bench_vllm_tier: needs vLLM (run it with the vLLM venv's python)", file=sys.stderr)
        return 2
    console, err, parent = begin(args.dir, 140)
    if parent is None:
        return 2
    block = args.chunk_mib * MiB // 2
    with tempfile.TemporaryDirectory(prefix="kvo-bench-tier-", dir=parent) as td:
        work = Path(td)
        err.print("starting the sidecar (durability none) ...")
        with run_sidecar(work / "sidecar", "none", None) as sc:
            common = {
                "type": "KVOffloadTier",
                "module_path": "kvoffload.integrations.vllm.tier",
                "socket_path": str(sc.socket),
                "model_revision": "bench@1",
                "tokenizer_hash": "bench",
                "io_threads": args.threads,
                "staging_bytes": args.job_chunks * args.chunk_mib * MiB,
            }
            tiers = [
                {
                    "type": "fs",
                    "root_dir": str(work / "fs"),
                    "n_read_threads": args.threads,
                    "n_write_threads": args.threads,
                },
                {**common, "tenant": SEALED_TENANT, "inplace": "off"},
                {**common, "tenant": SEALED_TENANT, "inplace": "auto"},
                {**common, "tenant": DIRECT_TENANT, "direct": True, "inplace": "off"},
            ]
            spec = _spec(tiers, args.chunks, block)
            mgr = spec.get_manager()
            try:
                rows = np.asarray(mgr.primary_tier.get_kv_memoryview()).view(np.uint8)
                rows[:] = np.random.default_rng(1).integers(0, 256, rows.shape, np.uint8)
                want = rows.copy()
                ceil = _ceilings(want, work / "raw")
                results = _measure(mgr, rows, want, args, err, [work / "fs", sc.store_root])
                del rows  # the region's buffer export, before vLLM unmaps it
            finally:
                mgr.shutdown()
            describe = sc.describe()
            fs_direct = bool(getattr(mgr.secondary_tiers[0], "_use_o_direct", False))
    total = args.chunks * args.chunk_mib * MiB
    facts = machine_facts(parent)
    facts["source"] = git_state()
    shape = [
        ("chunks", f"{args.chunks} × {args.chunk_mib} MiB = {total / MiB:.0f} MiB per pass"),
        ("jobs", f"{args.job_chunks} chunks each, {args.threads} I/O threads per tier"),
        ("fs tier", f"O_DIRECT {'on' if fs_direct else 'off'} (vLLM's probe of --dir)"),
        ("sidecar", describe),
        ("ceilings (GB/s)", ", ".join(f"{k} {v:.2f}" for k, v in ceil.items())),
    ]
    console.print(machine_table(facts, shape))
    t = Table(title="vLLM secondary tiers: store and load GB/s (median of repeats)")
    for col in ("tier", "store", "load warm", "load cold", "store/memcpy", "load warm/fs"):
        t.add_column(col, justify="right" if col != "tier" else "left")
    fs_warm = results["fs"][1]
    for name, (st, lw, lc) in results.items():
        t.add_row(
            name,
            cell(total / st / GB, "{:.2f}"),
            cell(total / lw / GB, "{:.2f}"),
            cell(total / lc / GB, "{:.2f}"),
            cell(total / st / GB / ceil["memcpy"], "{:.3f}"),
            cell(fs_warm / lw, "{:.2f}"),
        )
    console.print(t)
    c = Table(title="extra copies per chunk (besides vLLM's GPU <-> row copy)")
    c.add_column("tier")
    c.add_column("store")
    c.add_column("load")
    for name, (s, ld) in COPIES.items():
        c.add_row(name, s, ld)
    console.print(c)
    return 0


def _measure(
    mgr: Any, rows: np.ndarray, want: np.ndarray, args: Any, err: Any, roots: list[Path]
) -> dict[str, tuple[float, float, float]]:
    from vllm.v1.kv_offload.base import make_offload_key

    out: dict[str, tuple[float, float, float]] = {}
    names = ["fs", "kvoffload sealed", "kvoffload in place", "kvoffload direct"]
    for name, tier in zip(names, mgr.secondary_tiers, strict=True):
        # Untimed warm-up: connections, staging registration, the tenant's keys.
        warm_keys = [make_offload_key(os.urandom(32), 0)]
        _run_jobs(tier, warm_keys, 1, promote=False)
        _run_jobs(tier, warm_keys, 1, promote=True)
        rows[:] = want
        stores, warm, cold = [], [], []
        for rep in range(args.repeats):
            keys = [
                make_offload_key(os.urandom(32), 0) for _ in range(args.chunks)
            ]  # fresh chunks each repeat: every store writes
            err.print(f"{name}: repeat {rep + 1}/{args.repeats}")
            stores.append(_run_jobs(tier, keys, args.job_chunks, promote=False))
            rows[:] = 0
            warm.append(_run_jobs(tier, keys, args.job_chunks, promote=True))
            if not np.array_equal(rows, want):
                raise RuntimeError(f"{name}: loaded rows differ from the stored ones")
            rows[:] = 0
            drop_cache([p for r in roots for p in r.rglob("*") if p.is_file()])
            cold.append(_run_jobs(tier, keys, args.job_chunks, promote=True))
            if not np.array_equal(rows, want):
                raise RuntimeError(f"{name}: cold-loaded rows differ from the stored ones")
            rows[:] = want
        if name == "kvoffload in place" and getattr(tier, "_region", None) is None:
            raise RuntimeError("kvoffload in place: the primary region was not reachable")
        out[name] = (statistics.median(stores), statistics.median(warm), statistics.median(cold))
    return out


if __name__ == "__main__":
    sys.exit(main())
