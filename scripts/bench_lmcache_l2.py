"""LMCache L2 adapters side by side: kvoffload's plugin (over a sidecar) and LMCache's ``fs``.

Runs in the LMCache venv (``make pytest-lmcache`` builds it), which holds both
LMCache 0.5.6 and kvoffload::

    .venv-lmcache/bin/python scripts/bench_lmcache_l2.py [--quick] [--dir DIR] [--json OUT]

Both adapters are driven the way LMCache's storage controllers drive them:
``submit_store_task`` / ``submit_load_task`` of a batch of objects, then wait
on the adapter's event fd until the task's result is there. The store rows
time a batch until its completion is popped; the load rows time
lookup-and-lock, then load, of a batch stored earlier (page cache warm: what
was just written). Each row runs interleaved batch by batch with its raw
ceiling in this process: the same bytes written to (read from) one file per
object in the same directory, open + write + close (open + readinto + close),
one stream, page cache only, as LMCache's ``fs`` does. ``x ceil`` is a row's
GB/s over its ceiling's.

What the rows do not do alike: kvoffload seals every object with AES-256-GCM
(the dev sidecar's tenants are encrypted), indexes it in LMDB and verifies it
before a load returns; LMCache's ``fs`` writes raw bytes (no checksum) and keeps
no index (it stats a file per lookup).
"""

from __future__ import annotations

import os

os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")

import argparse
import contextlib
import json
import platform
import select
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from benchlib.method import interleaved, scratch_dir
from benchlib.tables import begin, cell, machine_table

GB = 1e9
MiB = 1 << 20


class Obj:
    """The part of LMCache's ``MemoryObj`` an L2 adapter uses: ``byte_array``, a
    writable view of the object's bytes (page-aligned, like LMCache's allocator's)."""

    def __init__(self, size: int, fill: int | None = None) -> None:
        import mmap

        self._m = mmap.mmap(-1, size)
        if fill is not None:
            self._m.write(os.urandom(size) if fill < 0 else bytes([fill]) * size)
        self.byte_array = memoryview(self._m)


@dataclass
class Row:
    name: str
    adapter: str
    batches: int
    bytes: int
    seconds: float
    p50_ms: float
    ceiling: str = ""
    ceiling_gbps: float | None = None

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / GB if self.seconds > 0 else 0.0


def wait(adapter: Any, fd: int, done: Callable[[], Any]) -> Any:
    """Poll ``fd`` as LMCache's controllers do until ``done()`` returns a result."""
    while True:
        r = done()
        if r is not None:
            return r
        select.select([fd], [], [], 0.05)
        with contextlib.suppress(BlockingIOError, OSError):
            os.read(fd, 8)


class Driver:
    def __init__(self, name: str, adapter: Any, objs: list[Obj], dests: list[Obj]) -> None:
        self.name, self.a, self.objs, self.dests = name, adapter, objs, dests

    def keys(self, i: int) -> list[Any]:
        from lmcache.v1.distributed.api import ObjectKey

        return [
            ObjectKey(f"{self.name}-{i}-{j}".encode().ljust(32, b"."), "bench-model", 0x01000100)
            for j in range(len(self.objs))
        ]

    def store(self, i: int) -> None:
        tid = self.a.submit_store_task(self.keys(i), self.objs)
        res = wait(
            self.a,
            self.a.get_store_event_fd(),
            lambda: self.a.pop_completed_store_tasks().get(tid),
        )
        if not res.is_successful():
            raise RuntimeError(f"{self.name}: a store task failed")

    def load(self, i: int, verify: bool = False) -> None:
        keys = self.keys(i)
        tid = self.a.submit_lookup_and_lock_task(keys, {})
        bm = wait(
            self.a,
            self.a.get_lookup_and_lock_event_fd(),
            lambda: self.a.query_lookup_and_lock_result(tid),
        )
        if bm.popcount() != len(keys):
            raise RuntimeError(f"{self.name}: lookup missed what it stored")
        tid = self.a.submit_load_task(keys, self.dests)
        bm = wait(self.a, self.a.get_load_event_fd(), lambda: self.a.query_load_result(tid))
        self.a.submit_unlock(keys)
        if bm.popcount() != len(keys):
            raise RuntimeError(f"{self.name}: load missed what it stored")
        if verify and any(
            bytes(d.byte_array) != bytes(o.byte_array)
            for d, o in zip(self.dests, self.objs, strict=True)
        ):
            raise RuntimeError(f"{self.name}: load returned other bytes")


def raw_ops(d: Path, objs: Sequence[Obj]) -> tuple[Callable[[int], None], Callable[[int], None]]:
    d.mkdir()
    buf = Obj(len(objs[0].byte_array))

    def write(i: int) -> None:
        for j, o in enumerate(objs):
            with open(d / f"{i}-{j}.raw", "wb") as f:
                f.write(o.byte_array)

    def read(i: int) -> None:
        for j in range(len(objs)):
            with open(d / f"{i}-{j}.raw", "rb", buffering=0) as f:
                f.readinto(buf.byte_array)

    return write, read


@contextlib.contextmanager
def adapters(base: Path, staging: int) -> Iterator[tuple[Any, Any, dict[str, Any]]]:
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import FSL2Adapter, FSL2AdapterConfig

    from kvoffload import testing
    from kvoffload.integrations.lmcache.adapter import KVOffloadL2Adapter

    with testing.dev_sidecar(base / "sidecar", log_path=base / "sidecar.log") as sc:
        kvo = KVOffloadL2Adapter({"socket": str(sc.socket_path), "staging_bytes": staging})
        fs = FSL2Adapter(FSL2AdapterConfig(base_path=str(base / "fs")))
        try:
            yield kvo, fs, {"sidecar socket": str(sc.socket_path)}
        finally:
            kvo.close()
            fs.close()


def run(args: argparse.Namespace) -> int:
    console, err, parent = begin(args.dir, 120)
    if parent is None:
        return 2
    size = (1 if args.quick else 4) * MiB
    batch = 4 if args.quick else 8
    budget = 0.5 if args.quick else args.row_budget_s
    rows: list[Row] = []
    with scratch_dir(parent, ".bench_lmcache_l2-") as base:
        (base / "sidecar").mkdir()
        objs = [Obj(size, -1) for _ in range(batch)]
        dests = [Obj(size, 0) for _ in range(batch)]
        with adapters(base, max(64 * MiB, 2 * size * batch)) as (kvo, fs, facts):
            drivers = [Driver("kvoffload", kvo, objs, dests), Driver("lmcache-fs", fs, objs, dests)]
            rwrite, rread = raw_ops(base / "raw", objs)
            n = 10_000
            err.print(f"store: {batch} x {size // MiB} MiB per batch")
            t = interleaved([rwrite] + [d.store for d in drivers], n=n, budget_s=budget, min_ops=3)
            stored = min(x[0] for x in t)
            ceil = Row("put", "raw write (page cache)", t[0][0], t[0][0] * batch * size, t[0][1],
                       t[0][2] * 1e3)  # fmt: skip
            rows.append(ceil)
            for d, (cnt, s, p50) in zip(drivers, t[1:], strict=True):
                rows.append(Row("put", d.name, cnt, cnt * batch * size, s, p50 * 1e3, "raw write",
                                ceil.gbps))  # fmt: skip
            for d in drivers:
                d.load(1, verify=True)
            err.print("load: lookup-and-lock + load of stored batches")
            t = interleaved(
                [rread] + [d.load for d in drivers], n=stored, budget_s=budget, min_ops=2
            )
            ceil = Row("get warm", "raw read (page cache)", t[0][0], t[0][0] * batch * size,
                       t[0][1], t[0][2] * 1e3)  # fmt: skip
            rows.append(ceil)
            for d, (cnt, s, p50) in zip(drivers, t[1:], strict=True):
                rows.append(Row("get warm", d.name, cnt, cnt * batch * size, s, p50 * 1e3,
                                "raw read", ceil.gbps))  # fmt: skip
    from importlib.metadata import version

    facts |= {
        "python": sys.version.split()[0],
        "lmcache": version("lmcache"),
        "kernel": platform.release(),
        "cores": f"{os.cpu_count()} (usable: {len(os.sched_getaffinity(0))})",
        "load average": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "dir": str(parent),
        "object": f"{size // MiB} MiB, {batch} per batch",
        "kvoffload": "dev sidecar: AES-256-GCM per tenant, LMDB index, verified loads",
        "lmcache fs": "raw bytes, no checksum, no index (a stat per lookup)",
    }
    console.print(machine_table(facts))
    tab = Table(title="LMCache L2 adapters (GB/s of object bytes; x ceil: over the raw row)")
    for c in ("op", "adapter", "batches", "GB/s", "p50 ms/batch", "x ceil"):
        tab.add_column(c, justify="left" if c in ("op", "adapter") else "right")
    for r in rows:
        ratio = r.gbps / r.ceiling_gbps if r.ceiling_gbps else None
        tab.add_row(r.name, r.adapter, str(r.batches), cell(r.gbps), cell(r.p50_ms, "{:.1f}"),
                    cell(ratio, "{:.2f}"))  # fmt: skip
    kv = {r.name: r.gbps for r in rows if r.adapter == "kvoffload"}
    fsr = {r.name: r.gbps for r in rows if r.adapter == "lmcache-fs"}
    console.print(tab)
    for op in kv:
        console.print(f"{op}: kvoffload / lmcache fs = {kv[op] / fsr[op]:.2f}" if fsr[op] else "")
    if args.json:
        doc = {"machine": facts, "rows": [asdict(r) | {"gbps": r.gbps} for r in rows]}
        args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=None, help="file system to test (default: cwd)")
    p.add_argument("--quick", action="store_true", help="1 MiB objects, short rows")
    p.add_argument("--row-budget-s", type=float, default=4.0)
    p.add_argument("--json", type=Path, default=None)
    code = 1
    try:
        code = run(p.parse_args(argv))
    except KeyboardInterrupt:
        print("interrupted: temp files removed", file=sys.stderr)
        code = 130
    except (ModuleNotFoundError, RuntimeError) as exc:
        print(f"bench_lmcache_l2: {exc}", file=sys.stderr)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # LMCache's threads are not all daemons


if __name__ == "__main__":
    main()
