"""Benchmark the in-process store against the ceilings of the machine it runs on.

Every number comes from one run on one directory (default: a temp dir under
the current working directory; ``--dir`` picks another file system):

ceilings
    memcpy (numpy, pre-touched buffers), AES-256-GCM ``encrypt_into`` /
    ``decrypt_into`` per layer into preallocated buffers (one thread),
    XXH3-128 per layer (the plaintext path's checksum), and raw file I/O of
    the very object bytes the store writes: a write with the store row's
    durability, a cold read and a warm read.
kvoffload
    ``Store.put`` sealed / plaintext and ``Store.get_into`` sealed / plaintext,
    cold and warm, for a Llama-3-8B-shaped chunk and a small one, at each
    chosen durability.

Throughput is total throughput: payload bytes of the timed operations divided
by the sum of their wall times (``time.perf_counter`` around each op), after
one untimed warm-up operation; the median latency per operation is shown too.
Each kvoffload row is compared with its raw ceiling (put → raw write at the
same durability, cold get → raw cold read, warm get → raw warm read) and with
a *serial bound*: the stages the row cannot avoid (cipher or checksum+copy,
plus the raw I/O), run one after the other as the store does. A kvoffload row
and its raw ceiling run interleaved, op by op (alternating which goes first),
so that drift in the disk, the page cache or a noisy VM hits both alike.

Every buffer is page-aligned (anonymous mmap, as the store's scratch buffers):
on some CPUs the kernel's copy to or from a buffer that is not 64-byte aligned
runs several times slower, which would make the raw ceilings too low.

Usage::

    .venv/bin/python scripts/bench_store.py                 # ~1-2 min
    .venv/bin/python scripts/bench_store.py --quick         # a few seconds
    .venv/bin/python scripts/bench_store.py --dir /mnt/nvme --durability object --json out.json

Nothing is left behind: the temp dir is removed on exit, Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt
from rich.console import Console
from rich.table import Table

from benchlib.ceilings import COLD_METHOD, prepare, raw_path, raw_reader, raw_writer
from benchlib.chunks import (
    FORMATS,
    NAMESPACE,
    TENANT,
    MiB,
    Shape,
    chunk_key,
    fit_to_disk,
    make_shapes,
    mv,
    parse_durabilities,
    touched,
)
from benchlib.facts import machine_facts
from benchlib.method import Mincore, Timing, drop_cache, interleaved, scratch_dir
from benchlib.results import Result, compare
from benchlib.stores import new_kek, settle_ram_tier
from benchlib.tables import begin, cell, machine_table, warn_not_cold
from kvoffload.layouts import v1
from kvoffload.store import Store, StoreConfig
from kvoffload.store.files import Durability
from kvoffload.store.keys.keyring import Kek

METHOD = (
    "GB/s = payload bytes of the timed ops / sum of their wall times (total throughput, "
    "1 GB = 1e9 B), after 1 untimed warm-up op; p50 = median latency of one op. Raw I/O rows "
    "are quoted in payload-equivalent GB/s (payload bytes / time), so x ceil is the ratio "
    "of times for the same object; 'file GB/s' counts the object file's bytes. Each kvoffload "
    "I/O row runs interleaved op by op with its raw ceiling (alternating which goes first). "
    "All buffers are page-aligned anonymous mmaps, like the store's scratch buffers."
)


# --------------------------------------------------------------------------- the run


@dataclass
class Bench:
    base: Path
    kek: Kek
    budget_s: float
    results: list[Result] = field(default_factory=list)
    open_stores: list[Store] = field(default_factory=list)
    mincore: Mincore = field(default_factory=Mincore)
    progress: Callable[[str], None] = lambda _m: None

    def add(self, r: Result) -> Result:
        self.results.append(r)
        self.progress(f"  {r.id:<42} {r.gbps:8.3f} GB/s  ({r.ops} ops)")
        return r

    def run_shape(self, shape: Shape, durabilities: Sequence[str]) -> None:
        self.progress(f"{shape.key}: {shape.describe()}")
        sh = prepare(shape, 1, FORMATS, self.budget_s)
        for r in sh.cpu.values():
            self.add(r)
        for dur in durabilities:
            self.run_durability(shape, dur, sh.layers, sh.payload, sh.images, sh.cpu)

    def run_durability(
        self,
        shape: Shape,
        dur: str,
        layers: list[memoryview],
        payload: npt.NDArray[np.uint8],
        images: dict[str, memoryview],
        cpu: dict[str, Result],
    ) -> None:
        work = self.base / f"{shape.key}-{dur}"
        store = Store(
            StoreConfig(root=work / "store", durability=Durability(dur), capacity_bytes=None),
            self.kek,
            create=True,
        )
        self.open_stores.append(store)
        try:
            settle_ram_tier(store, layers)
            self._run(shape, dur, store, work, layers, payload, images, cpu)
        finally:
            self.open_stores.remove(store)
            store.close()
            shutil.rmtree(work, ignore_errors=True)

    def _row(
        self,
        kind: str,
        name: str,
        shape: Shape,
        dur: str,
        fmt: str,
        timing: Timing,
        cached: float | None = None,
    ) -> Result:
        ops, wall, p50 = timing
        file_bytes = v1.object_size([shape.layer_bytes] * shape.layers, fmt == "sealed")
        return Result(
            kind, name, shape.key, dur, ops, shape.payload, file_bytes, wall, p50 * 1e3, cached
        )

    def _run(
        self,
        shape: Shape,
        dur: str,
        store: Store,
        work: Path,
        layers: list[memoryview],
        payload: npt.NDArray[np.uint8],
        images: dict[str, memoryview],
        cpu: dict[str, Result],
    ) -> None:
        budget = self.budget_s
        for fmt in FORMATS:
            sealed = fmt == "sealed"
            rdir = work / f"raw-{fmt}"
            rdir.mkdir(parents=True)

            # -- write: raw ceiling and Store.put, interleaved op by op
            def put(i: int, fmt: str = fmt, encrypt: bool = sealed) -> None:
                key = chunk_key(shape, fmt, i)
                if not store.put(TENANT, NAMESPACE, key, layers, encrypt=encrypt):
                    raise AssertionError("put found the chunk already present")

            raw_t, put_t = interleaved(
                [raw_writer(rdir, images[fmt], dur), put],
                n=shape.chunks,
                budget_s=budget,
                min_ops=3,
            )
            os.sync()  # untimed: reads and the next format start with no dirty pages
            ceil = self.add(self._row("ceiling", f"raw write {fmt}-obj", shape, dur, fmt, raw_t))
            row = self.add(self._row("kvoffload", f"put {fmt}", shape, dur, fmt, put_t))
            cpu_stages = (
                [cpu["aes-gcm encrypt_into"]] if sealed else [cpu["memcpy"], cpu["xxh3-128"]]
            )
            compare(row, ceil, cpu_stages)

            # -- read: cold, then warm; raw ceiling and Store.get_into, interleaved
            written = raw_t[0] + 1  # the warm-up op wrote one more
            raw_paths = [raw_path(rdir, i) for i in range(written)]
            keys = [chunk_key(shape, fmt, i) for i in range(written)]
            obj_paths = [store.root / v1.object_relpath(TENANT, k) for k in keys]
            rbuf = mv(touched(len(images[fmt])))
            out = touched(shape.payload)
            out_mv = mv(out)

            def get(i: int, keys: list[bytes] = keys, out_mv: memoryview = out_mv) -> None:
                if store.get_into(TENANT, keys[i], out_mv) is None:
                    raise AssertionError("get_into missed a chunk it just stored")

            cpu_stages = (
                [cpu["aes-gcm decrypt_into"]] if sealed else [cpu["memcpy"], cpu["xxh3-128"]]
            )
            n = written - 1
            for cache in ("cold", "warm"):
                if cache == "cold":
                    drop_cache(raw_paths + obj_paths)
                    store.drop_cache()  # and the store's RAM tier: a cold get reads files
                raw_cached = self.mincore.resident(raw_paths[1 : n + 1])
                obj_cached = self.mincore.resident(obj_paths[1 : n + 1])
                raw_t, get_t = interleaved(
                    [raw_reader(raw_paths, rbuf), get], n=n, budget_s=budget, min_ops=3
                )
                n = min(n, raw_t[0], get_t[0])  # warm rows read only what cold rows read
                ceil = self.add(
                    self._row(
                        "ceiling", f"raw read {cache} {fmt}-obj", shape, dur, fmt, raw_t, raw_cached
                    )
                )
                row = self.add(
                    self._row("kvoffload", f"get {fmt} {cache}", shape, dur, fmt, get_t, obj_cached)
                )
                compare(row, ceil, cpu_stages)
            if not np.array_equal(out, payload):
                raise AssertionError(f"get {fmt}: the bytes read differ from the bytes put")
            shutil.rmtree(rdir)


# --------------------------------------------------------------------------- output


def render(
    console: Console, facts: dict[str, str], shapes: Sequence[Shape], results: list[Result]
) -> None:
    console.print(machine_table(facts, [s.fact() for s in shapes]))

    t = Table(title="ceilings (same run, same directory)")
    for col in ("shape", "dur", "ceiling", "ops", "MiB", "GB/s", "file GB/s", "p50 ms", "cached"):
        t.add_column(col, justify="left" if col in ("shape", "dur", "ceiling") else "right")
    for r in results:
        if r.kind == "ceiling":
            t.add_row(
                r.shape,
                r.durability or "",
                r.name,
                str(r.ops),
                f"{r.ops * r.payload_bytes / MiB:.1f}",
                f"{r.gbps:.3f}",
                cell(r.file_gbps),
                f"{r.p50_ms:.3f}",
                cell(r.cached, "{:.0%}"),
            )
    console.print(t)

    t = Table(title="kvoffload Store (in-process)")
    cols = ("shape", "dur", "row", "ops", "MiB", "GB/s", "p50 ms", "cached", "ceiling", "ceil GB/s")
    for col in (*cols, "x ceil", "serial bound", "x bound"):
        t.add_column(col, justify="left" if col in ("shape", "dur", "row", "ceiling") else "right")
    for r in results:
        if r.kind == "kvoffload":
            t.add_row(
                r.shape,
                r.durability or "",
                r.name,
                str(r.ops),
                f"{r.ops * r.payload_bytes / MiB:.1f}",
                f"{r.gbps:.3f}",
                f"{r.p50_ms:.3f}",
                cell(r.cached, "{:.0%}"),
                r.ceiling or "",
                cell(r.ceiling_gbps),
                cell(r.ratio, "{:.2f}"),
                cell(r.bound_gbps),
                cell(r.ratio_to_bound, "{:.2f}"),
            )
    console.print(t)
    console.print(f"[bold]method[/bold]: {METHOD}")
    console.print(
        "[bold]serial bound[/bold]: 1 / sum(1/GB/s) of the raw I/O ceiling and the CPU stages "
        "the row must run (sealed: AES-GCM; plain: memcpy + XXH3-128), i.e. no overlap."
    )
    console.print(f"[bold]cold reads[/bold]: {COLD_METHOD}")
    warm_durs = {r.durability for r in results if r.kind == "ceiling" and "write" in r.name}
    if "none" in warm_durs or "batch" in warm_durs:
        console.print(
            "[bold]durability none/batch[/bold]: put and raw write rows time page-cache writes "
            "only; os.sync() runs untimed after each write row. 'batch' also has the store's "
            "background syncfs() thread running during its put rows."
        )
    console.print(
        "[bold]fresh store[/bold]: each (shape, durability) gets a new store, so most puts "
        "also create their fan-out directories objects/<tenant>/ab/cd/ (raw writes go to one "
        "flat directory); a store holding >~65k chunks mostly finds them present."
    )
    warn_not_cold(console, results)


# --------------------------------------------------------------------------- main


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--dir", type=Path, default=None, help="file system to test (default: cwd)")
    p.add_argument(
        "--durability",
        action="append",
        default=None,
        help="object, batch, none; repeat or comma-separate (default: object,none)",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of seconds")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument(
        "--large-mib-per-row", type=int, default=1024, help="payload MiB per large-chunk row"
    )
    p.add_argument("--small-ops", type=int, default=1024, help="timed ops per small-chunk row")
    p.add_argument(
        "--row-budget-s",
        type=float,
        default=None,
        help="stop a row after this many seconds of its ops (>= 3 ops); default 4 (quick: 0.3)",
    )
    a = p.parse_args(argv)
    a.durability = parse_durabilities(p, a.durability)
    if a.row_budget_s is None:
        a.row_budget_s = 0.3 if a.quick else 4.0
    return a


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    console, err, parent = begin(args.dir, 170)
    if parent is None:
        return 2
    shapes = make_shapes(args.quick, args.large_mib_per_row, args.small_ops)
    try:
        with scratch_dir(parent, ".bench_store-") as base:
            shapes = fit_to_disk(shapes, base, 4, 1)  # raw + store, sealed + plain
            facts = machine_facts(base)
            bench = Bench(base, new_kek(base), args.row_budget_s)
            bench.progress = lambda m: err.print(m, highlight=False)
            t0 = time.perf_counter()
            try:
                for s in shapes:
                    bench.run_shape(s, args.durability)
            finally:
                for st in list(bench.open_stores):
                    with contextlib.suppress(Exception):
                        st.close()
            elapsed = time.perf_counter() - t0
    except KeyboardInterrupt:
        err.print("interrupted: temp files removed")
        return 130
    facts["run time"] = f"{elapsed:.1f} s"
    render(console, facts, shapes, bench.results)
    if args.json is not None:
        doc = {
            "machine": facts,
            "config": {
                "quick": args.quick,
                "durability": args.durability,
                "row_budget_s": args.row_budget_s,
                "shapes": [asdict(s) | {"payload": s.payload} for s in shapes],
            },
            "method": METHOD,
            "cold_method": COLD_METHOD,
            "ceilings": [r.to_json() for r in bench.results if r.kind == "ceiling"],
            "rows": [r.to_json() for r in bench.results if r.kind == "kvoffload"],
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
