"""The LMCache peer of bench_io.py and bench_sidecar.py: LMCache's ``LocalDiskBackend``, direct.

Runs in its own virtual environment, never in kvoffload's (LMCache pins numpy
and torch; this script never imports kvoffload)::

    python3 -m venv .venv-lmcache
    .venv-lmcache/bin/pip install torch==2.13.0 lmcache==0.5.6
    .venv-lmcache/bin/python scripts/lmcache_peer.py [--quick] [--json out.json] [--dir DIR]

What it drives: ``LocalDiskBackend(config, loop, local_cpu_backend)`` with an
asyncio loop on a thread of its own, a ``LocalCPUBackend`` over LMCache's own
default CPU allocator (``MixedMemoryAllocator``: page-aligned), and memory
objects in LMCache's ``KV_2LTD`` format holding the payloads of kvoffload's
benchmark: a Llama-3-8B chunk (32 layers x 1 MiB = 32 MiB: 256 tokens x 8 KV
heads x 128 dim x K,V x bf16) and a small 64 KiB chunk (4 layers x 16 KiB);
``--quick`` shrinks the large chunk's layers to 64 KiB, as the kvoffload
benchmarks do. The callers pass their own batch sizes (``--large-batch``,
``--small-batch``) and shapes (``--shapes``), so both sides move the same
payloads in the same batches.

Rows, per shape and per variant (``buffered``: LMCache's default;
``odirect``: its ``extra_config={"use_odirect": True}``):

``put``
    ``batched_submit_put_task`` of a batch of chunks, timed until every
    chunk's ``on_complete_callback`` has fired (the write has returned and the
    key is in its index). Page cache only, as LMCache runs: it never fsyncs.
    Durability "none"; ``os.sync()`` runs untimed after the row.
``put+fsync``
    the same, then ``fsync`` of each of its files and of its directory, timed:
    the row to compare with kvoffload's durability "object".
``get cold`` / ``get warm``
    ``batched_get_blocking`` of a batch (its concurrent read path: a thread
    pool of ``disk_io_threads``, default 4), after ``os.sync()`` and
    ``POSIX_FADV_DONTNEED`` of its files (cold; the page-cache residency left
    is measured with mincore(2)), or right after the cold pass (warm). Each
    returned memory object is released before the next batch.

Each row runs interleaved batch by batch (alternating which goes first) with
its raw ceiling in this process: the same bytes written, and read, the way
LMCache does it (open + write + close of one file per chunk, plus fsync where
the row has it; open + readinto + close), serially in one thread, through the
page cache or with O_DIRECT as the variant does. So ``x ceil`` compares with
the raw I/O of the same moment, and compares across processes with
bench_io.py's rows.

LMCache's index is in memory only (lost on restart) and it has no encryption
and no checksum. Its threads are not daemons: the script always leaves with
``os._exit`` (also on errors and Ctrl-C) after removing its temp directory.

Output: JSON on stdout (LMCache's log goes to stderr), or to ``--json PATH``.
"""

from __future__ import annotations

import os

# Before LMCache is imported: its INFO/WARNING lines are noise here.
os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")

import argparse
import asyncio
import contextlib
import json
import mmap
import platform
import shutil
import sys
import threading
import time
import traceback
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchlib.method import Mincore, Timing, choices, cmd, drop_cache, interleaved, scratch_dir

MiB = 1 << 20
KiB = 1 << 10
GB = 1e9
HEAD_DIM = 1024  # 8 KV heads x 128 dim: the last axis of a KV_2LTD tensor
BF16 = 2
VARIANTS = ("buffered", "odirect")
DURABILITIES = ("object", "none")
O_DIRECT: int = getattr(os, "O_DIRECT", 0)

NOTES = [
    "LMCache's index is in memory only: every chunk is lost on a restart (kvoffload's LMDB "
    "index survives one).",
    "LMCache has no encryption and no checksum: its rows compare with kvoffload's sealed rows "
    "(AES-256-GCM) and plaintext rows (XXH3-128 checksum) alike.",
    "LMCache never fsyncs: 'put' is page-cache durability (kvoffload 'none'); 'put+fsync' adds "
    "fsync of its files and directory, timed (kvoffload 'object').",
    "Concurrency: LMCache writes with its disk worker pool (disk_io_threads, default 4) and "
    "batched_get_blocking reads with a pool of the same size; raw ceilings run one stream.",
]


# --------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Shape:
    key: str  # "large" | "small", as in benchlib.chunks
    layers: int
    layer_bytes: int
    chunks: int  # chunks per row (upper bound; the row budget may stop earlier)
    batch: int  # chunks per timed batch
    note: str

    @property
    def payload(self) -> int:
        return self.layers * self.layer_bytes

    @property
    def tokens(self) -> int:
        return self.layer_bytes // (2 * HEAD_DIM * BF16)

    def kv_shape(self) -> tuple[int, int, int, int]:
        """KV_2LTD: [K/V, layers, tokens, heads x dim], bf16."""
        return (2, self.layers, self.tokens, HEAD_DIM)


def make_shapes(
    quick: bool, large_mib_per_row: int, small_ops: int, large_batch: int, small_batch: int
) -> list[Shape]:
    if quick:
        return [
            Shape(
                "large",
                32,
                64 * KiB,
                max(4, large_batch),
                large_batch,
                "Llama-3-8B layer count, layers shrunk (--quick)",
            ),
            Shape("small", 4, 16 * KiB, max(16, small_batch), small_batch, "small chunk"),
        ]
    large_chunks = max(large_batch, large_mib_per_row // 32)
    return [
        Shape(
            "large",
            32,
            1 * MiB,
            large_chunks,
            large_batch,
            "Llama-3-8B: 256 tok x 8 KV heads x 128 dim x K,V x bf16 per layer",
        ),
        Shape("small", 4, 16 * KiB, max(small_batch, small_ops), small_batch, "small chunk"),
    ]


# --------------------------------------------------------------------------- results


@dataclass
class Row:
    kind: str  # "lmcache" | "ceiling"
    variant: str  # "buffered" | "odirect"
    name: str
    shape: str
    durability: str | None
    batches: int
    chunks: int
    payload_bytes: int  # per chunk
    seconds: float
    p50_ms: float  # per batch
    cached: float | None = None
    ceiling: str | None = None
    ceiling_gbps: float | None = None
    ratio: float | None = None

    @property
    def id(self) -> str:
        return "/".join(x for x in (self.shape, self.variant, self.name) if x)

    @property
    def gbps(self) -> float:
        return self.chunks * self.payload_bytes / self.seconds / GB if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["id"] = self.id
        d["gbps"] = self.gbps
        return d


# --------------------------------------------------------------------------- page cache


def fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- raw I/O


def aligned(n: int) -> memoryview:
    """A page-aligned, touched buffer (anonymous mmap), like LMCache's allocator gives."""
    m = mmap.mmap(-1, max(n, 1))
    m.write(bytes(len(m)))
    return memoryview(m)[:n]


def raw_writer(
    d: Path, data: memoryview, batch: int, *, sync: bool, direct: bool
) -> Callable[[int], None]:
    """Op ``i`` writes ``batch`` files of ``data`` as LMCache does (open/write/close),
    one stream; ``sync``: fsync each file, then the directory."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | (O_DIRECT if direct else 0)

    def op(i: int) -> None:
        for j in range(batch):
            fd = os.open(d / f"{i:06d}-{j:04d}.raw", flags, 0o644)
            try:
                done = 0
                while done < len(data):
                    done += os.write(fd, data[done:])
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        if sync:
            fsync_path(str(d), directory=True)

    return op


def raw_paths(d: Path, i: int, batch: int) -> list[str]:
    return [str(d / f"{i:06d}-{j:04d}.raw") for j in range(batch)]


def raw_reader(d: Path, buf: memoryview, batch: int, *, direct: bool) -> Callable[[int], None]:
    """Op ``i`` reads back the files of write op ``i``: open + readinto + close, one stream."""
    flags = os.O_RDONLY | os.O_CLOEXEC | (O_DIRECT if direct else 0)

    def op(i: int) -> None:
        for p in raw_paths(d, i, batch):
            fd = os.open(p, flags)
            try:
                done = 0
                while done < len(buf):
                    got = os.readv(fd, [buf[done:]])
                    if got == 0:
                        raise OSError(f"{p}: short read")
                    done += got
            finally:
                os.close(fd)

    return op


# --------------------------------------------------------------------------- LMCache


class Peer:
    """One LocalDiskBackend on its own directory, its loop and its CPU allocator."""

    def __init__(self, d: Path, shape: Shape, variant: str, threads: int | None) -> None:
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        self._torch: Any = torch
        self._key_cls: Any = CacheEngineKey
        self.fmt: Any = MemoryFormat.KV_2LTD
        self.shape = shape
        self.dir = d
        extra: dict[str, Any] = {"use_odirect": variant == "odirect"}
        if threads is not None:
            extra["disk_io_threads"] = threads
        disk_gib = max(1.0, 4 * shape.chunks * shape.payload / (1 << 30))
        self.config: Any = LMCacheEngineConfig.from_defaults(
            chunk_size=shape.tokens,
            local_cpu=False,
            max_local_cpu_size=1.0,
            local_disk=str(d),
            max_local_disk_size=disk_gib,
            extra_config=extra,
        )
        # The put batch and one get batch, each chunk 4 KiB-aligned, plus slack.
        pool = 2 * shape.batch * shape.payload + 64 * MiB
        self.allocator: Any = MixedMemoryAllocator(pool)
        self.cpu: Any = LocalCPUBackend(self.config, memory_allocator=self.allocator)
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self.loop.run_forever, name="lmcache-peer-loop", daemon=True
        )
        self._loop_thread.start()
        self.disk: Any = LocalDiskBackend(self.config, self.loop, self.cpu, dst_device="cpu")
        self.threads = int(self.config.get_extra_config_value("disk_io_threads", 4))
        self.use_odirect = bool(self.disk.use_odirect)
        self.kv_shape = torch.Size(shape.kv_shape())
        self.dtype = torch.bfloat16
        # The chunks to put: one memory object per chunk of a batch, random bytes.
        gen = torch.Generator().manual_seed(7)
        self.objs: list[Any] = []
        for _ in range(shape.batch):
            obj = self.cpu.allocate(self.kv_shape, self.dtype, self.fmt)
            if obj is None:
                raise RuntimeError("LMCache's CPU allocator is full")
            flat = obj.tensor.view(torch.uint8).view(-1)
            flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))
            self.objs.append(obj)
        if len(self.objs[0].byte_array) != shape.payload:
            raise AssertionError("memory object size differs from the payload size")
        self._done = threading.Semaphore(0)

    def keys(self, tag: str, i: int) -> list[Any]:
        base = (zlib.crc32(tag.encode()) & 0xFFFF) << 32
        return [
            self._key_cls("bench", 1, 0, base + i * self.shape.batch + j, self.dtype)
            for j in range(self.shape.batch)
        ]

    def paths(self, keys: Sequence[Any]) -> list[str]:
        return [str(self.disk._key_to_path(k)) for k in keys]

    def put(self, keys: Sequence[Any], *, fsync: bool) -> None:
        self.disk.batched_submit_put_task(
            list(keys), self.objs, on_complete_callback=lambda _k: self._done.release()
        )
        for _ in keys:
            if not self._done.acquire(timeout=600):
                raise TimeoutError("LMCache put did not complete in 600 s")
        for k in keys:
            if not self.disk.contains(k):
                raise AssertionError("a completed LMCache put is not in its index")
        if fsync:
            for p in self.paths(keys):
                fsync_path(p)
            fsync_path(str(self.disk.path), directory=True)

    def get(self, keys: Sequence[Any], *, verify: bool) -> None:
        got = self.disk.batched_get_blocking(list(keys))
        try:
            if any(g is None for g in got):
                raise AssertionError("LMCache missed a chunk it stored")
            if verify:
                for g, src in zip(got, self.objs, strict=True):
                    # Compare bytes: random bits as bf16 hold NaNs, and NaN != NaN.
                    u8 = self._torch.uint8
                    if not self._torch.equal(g.tensor.view(u8), src.tensor.view(u8)):
                        raise AssertionError("LMCache returned other bytes than it was given")
        finally:
            for g in got:
                if g is not None:
                    g.ref_count_down()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.disk.close()
        with contextlib.suppress(Exception):
            self.cpu.close()
        self.loop.call_soon_threadsafe(self.loop.stop)


@dataclass
class Bench:
    base: Path
    budget_s: float
    threads: int | None
    rows: list[Row] = field(default_factory=list)
    mincore: Mincore = field(default_factory=Mincore)
    progress: Callable[[str], None] = lambda _m: None
    peers: list[Peer] = field(default_factory=list)
    facts: dict[str, str] = field(default_factory=dict)

    def add(self, r: Row) -> Row:
        self.rows.append(r)
        self.progress(f"  {r.id:<40} {r.gbps:8.3f} GB/s  ({r.chunks} chunks)")
        return r

    def row(
        self,
        kind: str,
        variant: str,
        name: str,
        shape: Shape,
        dur: str | None,
        t: Timing,
        cached: float | None = None,
    ) -> Row:
        n, wall, p50 = t
        return Row(
            kind, variant, name, shape.key, dur, n, n * shape.batch, shape.payload, wall,
            p50 * 1e3, cached,
        )  # fmt: skip

    @staticmethod
    def compare(row: Row, ceil: Row) -> None:
        row.ceiling, row.ceiling_gbps = ceil.name, ceil.gbps
        row.ratio = row.gbps / ceil.gbps if ceil.gbps else None

    def run(self, shape: Shape, variant: str, durs: Sequence[str]) -> None:
        direct = variant == "odirect"
        work = self.base / f"{shape.key}-{variant}"
        rdir = work / "raw"
        rdir.mkdir(parents=True)
        peer = Peer(work / "lmcache", shape, variant, self.threads)
        self.peers.append(peer)
        self.facts["lmcache disk_io_threads"] = str(peer.threads)
        if direct and not peer.use_odirect:
            raise RuntimeError("LMCache did not take use_odirect")
        data = aligned(shape.payload)
        data[:] = bytes(peer.objs[0].byte_array)
        budget = self.budget_s
        nb = max(1, shape.chunks // shape.batch)
        io = "O_DIRECT" if direct else "buffered"
        written: list[tuple[str, int, int]] = []  # (tag, raw op base, count)
        raw_base = 0
        try:
            for dur in durs:
                sync = dur == "object"
                tag = f"{dur}"
                name = "put+fsync" if sync else "put"

                def put(i: int, tag: str = tag, sync: bool = sync) -> None:
                    peer.put(peer.keys(tag, i), fsync=sync)

                rw = raw_writer(rdir, data, shape.batch, sync=sync, direct=direct)

                def raw(i: int, base: int = raw_base, rw: Callable[[int], None] = rw) -> None:
                    rw(base + i)

                raw_t, put_t = interleaved([raw, put], n=nb, budget_s=budget, min_ops=3)
                os.sync()  # untimed: the next row starts with no dirty pages
                ceil_name = f"raw write{'+fsync' if sync else ''} {io}"
                ceil = self.add(self.row("ceiling", variant, ceil_name, shape, dur, raw_t))
                self.compare(self.add(self.row("lmcache", variant, name, shape, dur, put_t)), ceil)
                count = put_t[0] + 1  # with the warm-up op
                written.append((tag, raw_base, count))
                raw_base += count

            # Reads: every batch written above (the files do not depend on durability).
            batches = [(tag, base + i, i) for tag, base, count in written for i in range(count)]
            lm_keys = [peer.keys(tag, i) for tag, _b, i in batches]
            lm_paths = [p for ks in lm_keys for p in peer.paths(ks)]
            r_paths = [p for _t, b, _i in batches for p in raw_paths(rdir, b, shape.batch)]
            rbuf = aligned(shape.payload)
            rr = raw_reader(rdir, rbuf, shape.batch, direct=direct)

            def raw_read(i: int) -> None:
                rr(batches[i][1])

            def get(i: int) -> None:
                peer.get(lm_keys[i], verify=i == 0)

            n = len(batches) - 1
            for cache in ("cold", "warm") if not direct else ("cold",):
                if cache == "cold":
                    drop_cache(lm_paths + r_paths)
                per = shape.batch
                raw_cached = self.mincore.resident(r_paths[per : (n + 1) * per])
                lm_cached = self.mincore.resident(lm_paths[per : (n + 1) * per])
                raw_t, get_t = interleaved([raw_read, get], n=n, budget_s=budget, min_ops=3)
                n = min(n, raw_t[0], get_t[0])  # warm rows read only what cold rows read
                ceil = self.add(
                    self.row("ceiling", variant, f"raw read {cache} {io}", shape, None, raw_t,
                             raw_cached)
                )  # fmt: skip
                row = self.row("lmcache", variant, f"get {cache}", shape, None, get_t, lm_cached)
                self.compare(self.add(row), ceil)
            if bytes(rbuf) != bytes(data):
                raise AssertionError("raw read returned other bytes")
        finally:
            self.peers.remove(peer)
            peer.close()
            shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------- facts


def machine_facts(d: Path) -> dict[str, str]:
    from importlib.metadata import version

    import numpy
    import torch

    return {
        "python": sys.version.split()[0],
        "lmcache": version("lmcache"),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "cores": f"{os.cpu_count()} (usable: {len(os.sched_getaffinity(0))})",
        "kernel": platform.release(),
        "dir": str(d),
        "filesystem (stat -f -c %T)": cmd(["stat", "-f", "-c", "%T", str(d)]),
        "lmcache allocator": "MixedMemoryAllocator (LMCache's default CPU allocator)",
        "lmcache index": "in memory only (lost on restart)",
        "lmcache encryption": "none",
    }


# --------------------------------------------------------------------------- main


def _split(values: list[str] | None, allowed: Sequence[str], default: Sequence[str]) -> list[str]:
    try:
        return choices(values, allowed, default)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=None, help="file system to test (default: cwd)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of seconds")
    p.add_argument("--json", type=Path, default=None, help="write the JSON here, not stdout")
    p.add_argument("--variant", action="append", help="buffered, odirect (default: both)")
    p.add_argument("--durability", action="append", help="object, none (default: both)")
    p.add_argument("--large-mib-per-row", type=int, default=1024)
    p.add_argument("--small-ops", type=int, default=1024, help="chunks per small-chunk row")
    p.add_argument(
        "--large-batch", type=int, default=None, help="large chunks per timed batch (4; quick: 2)"
    )
    p.add_argument(
        "--small-batch", type=int, default=None, help="64 KiB chunks per timed batch (32; quick: 4)"
    )
    p.add_argument("--shapes", default="large,small", help="comma-separated: large, small")
    p.add_argument("--threads", type=int, default=None, help="LMCache disk_io_threads")
    p.add_argument("--row-budget-s", type=float, default=None, help="default 4 (quick: 0.3)")
    a = p.parse_args(argv)
    a.variant = _split(a.variant, VARIANTS, VARIANTS)
    a.durability = _split(a.durability, DURABILITIES, DURABILITIES)
    if a.row_budget_s is None:
        a.row_budget_s = 0.3 if a.quick else 4.0
    if a.large_batch is None:
        a.large_batch = 2 if a.quick else 4
    if a.small_batch is None:
        a.small_batch = 4 if a.quick else 32
    if a.large_batch < 1 or a.small_batch < 1:
        raise SystemExit("--large-batch and --small-batch must be at least 1")
    a.shapes = _split([a.shapes], ("large", "small"), ("large", "small"))
    if not O_DIRECT and "odirect" in a.variant:
        a.variant.remove("odirect")
    return a


def run(argv: Sequence[str] | None) -> int:
    args = _parse(argv)
    parent = (args.dir or Path.cwd()).resolve()
    if not parent.is_dir():
        print(f"--dir {parent}: not a directory", file=sys.stderr)
        return 2
    shapes = [
        s
        for s in make_shapes(
            args.quick, args.large_mib_per_row, args.small_ops, args.large_batch, args.small_batch
        )
        if s.key in args.shapes
    ]
    t0 = time.perf_counter()
    with scratch_dir(parent, ".lmcache_peer-") as base:
        bench = Bench(base, args.row_budget_s, args.threads)
        bench.facts = machine_facts(base)
        bench.progress = lambda m: print(m, file=sys.stderr, flush=True)
        try:
            for s in shapes:
                for v in args.variant:
                    bench.progress(f"lmcache {s.key} {v}: {s.layers} x {s.layer_bytes} B")
                    bench.run(s, v, args.durability)
        finally:
            for peer in list(bench.peers):
                peer.close()
    bench.facts["run time"] = f"{time.perf_counter() - t0:.1f} s"
    doc = {
        "tool": "lmcache LocalDiskBackend",
        "machine": bench.facts,
        "config": {
            "quick": args.quick,
            "variants": args.variant,
            "durability": args.durability,
            "row_budget_s": args.row_budget_s,
            "shapes": [
                asdict(s) | {"payload": s.payload, "kv_shape": s.kv_shape()} for s in shapes
            ],
        },
        "notes": NOTES,
        "rows": [r.to_json() for r in bench.rows if r.kind == "lmcache"],
        "ceilings": [r.to_json() for r in bench.rows if r.kind == "ceiling"],
    }
    text = json.dumps(doc, indent=2) + "\n"
    if args.json is not None:
        args.json.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    """Run, then leave with os._exit: LMCache's worker threads are not daemons."""
    code = 1
    try:
        code = run(argv)
    except KeyboardInterrupt:
        print("interrupted: temp files removed", file=sys.stderr)
        code = 130
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
