"""kvoffload as SGLang's HiCache L3 beside SGLang's own HiCacheFile, in one run.

HiCacheFile and kvoffload get the same pages of SGLang's real host pool
(``MHATokenToKVPoolHost``, CPU, in SGLang's shared-memory allocator: a memfd)
through SGLang's own cache-controller methods
(the controller stand-in of benchlib.sglang): a backup is ``_page_backup``
(HiCacheFile: ``batch_set`` of flat pages; kvoffload: ``batch_set_v1`` over
host indices, ``interface_v1``), a prefetch is ``_page_transfer`` of pages the
hit query found. kvoffload runs twice: staged (``"inplace": "off"``) and in
place (the pool's memfd handed to the sidecar, protocol-v1 §5.34, which reads
and writes the pages itself). Rows are interleaved (benchlib.method), so load on the
machine falls on every row alike.

HiCacheFile writes raw bytes to files without fsync or checksum; kvoffload's
sidecar (durability ``none`` here, the same promise) seals each page with
AES-GCM and verifies it before it says "loaded". The ceilings of the same run:
``memcpy`` of a batch, and a raw buffered write / read of the batch's bytes as
one file per page (what HiCacheFile does, without torch).

Run in the SGLang venv, from the repository root::

    .venv-sglang/bin/python scripts/bench_sglang.py            # ~1 min on 2 cores
    .venv-sglang/bin/python scripts/bench_sglang.py --quick    # seconds
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchlib.method import interleaved, raise_interrupt, scratch_dir
from benchlib.sglang import controller_stand_in, dynamic_extra, host_pool, import_sglang
from benchlib.sidecar import run_sidecar
from benchlib.tables import begin, cell, machine_table

GB = 1e9
STAGED = "kvoffload staged"
#: The host pool's memfd handed to the sidecar (protocol-v1 §5.34).
IN_PLACE = "kvoffload in place"


def _pages_of(pool: Any, idx: Any, page: int) -> list[int]:
    return [int(idx[i * page]) for i in range(idx.numel() // page)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, help="where files go (default: the working directory)")
    ap.add_argument("--quick", action="store_true", help="a few ops per row")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="pages per backup / prefetch")
    a = ap.parse_args(argv)
    console, err, parent = begin(a.dir, 120)
    if parent is None:
        return 2
    signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        import_sglang()
    except ImportError as exc:
        err.print(
            f"SGLang is not importable here ({exc}): run in .venv-sglang (make pytest-sglang)"
        )
        return 2
    import torch
    from sglang.srt.managers.cache_controller import PrefetchOperation, StorageOperation
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from benchlib.sglang import storage_config

    ps, batch = a.page_size, a.batch
    n_ops = 6 if a.quick else 40
    budget = 0.5 if a.quick else 5.0
    rounds = n_ops + 1
    # SGLang's shared-memory host allocator ("allocator": "shm"): a memfd, which the
    # in-place row hands to the sidecar; the other rows use the pool as any memory.
    pool = host_pool(
        "page_first", layers=a.layers, heads=8, head_dim=128, page_size=ps,
        tokens=ps * batch * 2, allocator="shm",
    )  # fmt: skip
    page_bytes = pool.get_dummy_flat_data_page().numel() * 2
    src = pool.alloc(ps * batch)
    dst = pool.alloc(ps * batch)
    g = torch.Generator().manual_seed(0)
    for i in _pages_of(pool, src, ps):
        flat = pool.get_data_page(i, flat=True)
        pool.set_from_flat_data_page(i, torch.randn(flat.shape, generator=g).to(flat.dtype))
    batch_bytes = page_bytes * batch

    def keys(tag: str, r: int) -> list[str]:
        return [f"{tag}{r:08x}{p:08x}".ljust(64, "0") for p in range(batch)]

    with contextlib.ExitStack() as stack:
        work = stack.enter_context(scratch_dir(parent, "bench-sglang-"))
        sc = stack.enter_context(run_sidecar(work / "sidecar", "none", None))
        file_dir = work / "hicache-file"
        file_dir.mkdir()
        cfg_file = storage_config({"file_storage_path": str(file_dir)}, model_name="bench/model")
        hf = HiCacheFile(cfg_file, file_path=str(file_dir))
        hf.register_mem_pool_host(pool)

        def kvoffload(tenant: str, inplace: str) -> Any:
            b = StorageBackendFactory.create_backend(
                "dynamic",
                storage_config(
                    dynamic_extra(
                        str(sc.socket), tenant, staging_bytes=2 * batch_bytes + (1 << 20),
                        allocator="shm", inplace=inplace,
                    ),
                    model_name="bench/model",
                ),
                pool,
            )  # fmt: skip
            b.register_mem_pool_host(pool)
            stack.callback(b.close)
            return b

        # HiCacheFile is not a v1 backend: the controller uses its generic calls.
        # The two kvoffload rows are two tenants, so neither finds the other's pages.
        ctrls = {
            "HiCacheFile": controller_stand_in(hf, pool, v1=False),
            STAGED: controller_stand_in(kvoffload("bench", "off"), pool),
            IN_PLACE: controller_stand_in(kvoffload("bench-ip", "auto"), pool),
        }

        def backup(name: str) -> Callable[[int], None]:
            c = ctrls[name]

            def op(r: int) -> None:
                o = StorageOperation(src, [], hash_value=keys("b", r), prefix_keys=[])
                c._page_backup(o)
                assert o.completed_tokens == ps * batch, (name, "backup", o.completed_tokens)

            return op

        for c in ctrls.values():  # the pages every prefetch reads
            c._page_backup(StorageOperation(src, [], hash_value=keys("p", 0), prefix_keys=[]))

        def prefetch(name: str) -> Callable[[int], None]:
            c = ctrls[name]

            def op(_r: int) -> None:
                o = PrefetchOperation("bench", [], prefix_keys=[])
                o.hash_value, o.host_indices = keys("p", 0), dst
                assert c.storage_backend.batch_exists(o.hash_value) == batch
                assert c._page_transfer(o) == batch, (name, "prefetch")

            return op

        flat = torch.cat([pool.get_data_page(i, flat=True) for i in _pages_of(pool, src, ps)])
        raw = flat.view(torch.uint8).numpy()
        out = bytearray(len(raw))
        ceil_dir = work / "raw"
        ceil_dir.mkdir()

        def memcpy(_r: int) -> None:
            memoryview(out)[:] = memoryview(raw).cast("B")

        def raw_write(r: int) -> None:
            view = memoryview(raw).cast("B")
            for p in range(batch):
                path = ceil_dir / f"{r % 4}-{p}.bin"
                with open(path, "wb", buffering=0) as f:
                    f.write(view[p * page_bytes : (p + 1) * page_bytes])

        def raw_read(_r: int) -> None:
            view = memoryview(out)
            for p in range(batch):
                with open(ceil_dir / f"0-{p}.bin", "rb", buffering=0) as f:
                    f.readinto(view[p * page_bytes : (p + 1) * page_bytes])

        raw_write(0)
        rows: list[tuple[str, str, Callable[[int], None], str | None]] = [
            ("ceiling", "memcpy", memcpy, None),
            ("ceiling", "raw write (files, no fsync)", raw_write, None),
            ("ceiling", "raw read (page cache)", raw_read, None),
            ("backup", "HiCacheFile", backup("HiCacheFile"), "raw write (files, no fsync)"),
            ("backup", STAGED, backup(STAGED), "raw write (files, no fsync)"),
            ("backup", IN_PLACE, backup(IN_PLACE), "raw write (files, no fsync)"),
            ("prefetch", "HiCacheFile", prefetch("HiCacheFile"), "raw read (page cache)"),
            ("prefetch", STAGED, prefetch(STAGED), "raw read (page cache)"),
            ("prefetch", IN_PLACE, prefetch(IN_PLACE), "raw read (page cache)"),
        ]
        err.print(f"{len(rows)} rows, {batch} pages of {page_bytes / 1e6:.2f} MB per op ...")
        timings = interleaved([r[2] for r in rows], n=rounds, budget_s=budget, min_ops=n_ops // 2)
        gbps = {
            (kind, name): t[0] * batch_bytes / t[1] / GB
            for (kind, name, _, _), t in zip(rows, timings, strict=True)
        }
        from rich.table import Table

        t = Table(title=f"SGLang HiCache L3: {batch} pages x {page_bytes / 1e6:.2f} MB per call")
        for col in (
            "op",
            "backend",
            "ops",
            "GB/s",
            "p50 ms",
            "ceiling",
            "x ceiling",
            "x HiCacheFile",
        ):
            t.add_column(col)
        for (kind, name, _, ceiling), (n, _s, p50) in zip(rows, timings, strict=True):
            g_row = gbps[(kind, name)]
            ceil = gbps[("ceiling", ceiling)] if ceiling else None
            peer = gbps.get((kind, "HiCacheFile")) if kind != "ceiling" else None
            t.add_row(
                kind, name, str(n), cell(g_row, "{:.2f}"), cell(p50 * 1e3, "{:.1f}"),
                ceiling or "-", cell(g_row / ceil if ceil else None, "{:.2f}"),
                cell(g_row / peer if peer else None, "{:.2f}"),
            )  # fmt: skip
        facts = {
            "cores": f"{os.cpu_count()} (usable: {len(os.sched_getaffinity(0))})",
            "load average": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "dir": str(parent),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "sidecar": "; ".join(
                p for p in sc.describe().split("; ") if p.startswith(("durability", "ram_tier"))
            ),
        }
        from kvoffload.client import fetch_stats

        st = fetch_stats(sc.socket).get("inplace", {})
        facts["moved in place"] = (
            f"{st.get('stored_chunks', 0)} chunks stored, {st.get('loaded_chunks', 0)} loaded"
        )
        console.print(machine_table(facts))
        console.print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
