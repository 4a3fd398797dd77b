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
import hashlib
import json
import logging
import mmap
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from rich.console import Console
from rich.markup import escape
from rich.table import Table

# The shared method (scripts/bench_method.py) sits next to this file, which other
# benchmarks load by path.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_method import (  # the other benchmarks also use these through this module
    Mincore,
    Timing,
    cmd,
    drop_cache,
    interleaved,
    scratch_dir,
)
from bench_method import loadavg as loadavg  # for the other benchmarks

from kvoffload.layouts import v1
from kvoffload.store import Store, StoreConfig
from kvoffload.store.files import Durability
from kvoffload.store.keys.keyring import Kek

MiB = 1 << 20
KiB = 1 << 10
GB = 1e9
TENANT = "bench"
NAMESPACE = hashlib.blake2b(b"bench-namespace", digest_size=32).digest()


def settle_ram_tier(store: Store, layers: Sequence[memoryview]) -> None:
    """Where ``store`` keeps a RAM tier (sealed images of large objects), put one
    throwaway chunk of ``layers``, untimed, and wait until the tier has mapped its
    memory, as bench_sidecar does for a sidecar: a store does that once, at its
    first large object, and the rows measure the running state, not that
    start-up cost. Cold rows empty the tier (``Store.drop_cache``) as they drop
    the page cache."""
    if not store.has_ram_tier:
        return
    key = hashlib.blake2b(b"bench ram-tier fill", digest_size=32).digest()
    store.put(TENANT, NAMESPACE, key, layers)
    wait_ram_tier_filled(store.stats, "the store's")


def wait_ram_tier_filled(stats: Callable[[], dict[str, Any]], whose: str) -> None:
    """Poll ``stats()`` (a store's or a sidecar's) until its ``ram_tier`` no longer
    fills; RuntimeError naming ``whose`` tier after 120 s."""
    deadline = time.monotonic() + 120
    while (stats().get("ram_tier") or {}).get("filling"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{whose} RAM tier still fills after 120 s")
        time.sleep(0.05)


FORMATS = ("sealed", "plain")
DURABILITIES = ("object", "batch", "none")
DEFAULT_DURABILITIES = ("object", "none")

COLD_METHOD = (
    "cold = os.sync() (untimed), then posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) on every "
    "file of the row; the page-cache residency of the timed files is then measured with "
    "mincore(2) and shown as 'cached'. Only object files are dropped: the LMDB index, key "
    "files and directories stay cached (as in a running sidecar). The RAM tier (sealed "
    "images of large objects, ram_cache) is emptied too (Store.drop_cache; a sidecar's "
    "drop_cache verb), after it mapped its memory before the rows."
)
METHOD = (
    "GB/s = payload bytes of the timed ops / sum of their wall times (total throughput, "
    "1 GB = 1e9 B), after 1 untimed warm-up op; p50 = median latency of one op. Raw I/O rows "
    "are quoted in payload-equivalent GB/s (payload bytes / time), so x ceil is the ratio "
    "of times for the same object; 'file GB/s' counts the object file's bytes. Each kvoffload "
    "I/O row runs interleaved op by op with its raw ceiling (alternating which goes first). "
    "All buffers are page-aligned anonymous mmaps, like the store's scratch buffers."
)


# --------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Shape:
    key: str  # "large" | "small": the ids in the JSON
    layers: int
    layer_bytes: int
    note: str
    chunks: int  # timed ops per row (upper bound; the row budget may stop earlier)

    @property
    def payload(self) -> int:
        return self.layers * self.layer_bytes

    def describe(self) -> str:
        return f"{self.layers} layers x {_size(self.layer_bytes)} = {_size(self.payload)}/chunk"


def parse_durabilities(
    p: argparse.ArgumentParser, values: list[str] | None, default: Sequence[str] | None = None
) -> list[str]:
    """``--durability`` values (repeatable, comma-separated) in order, without repeats."""
    durs: list[str] = []
    for item in values or [",".join(default or DEFAULT_DURABILITIES)]:
        for d in item.split(","):
            d = d.strip()
            if d not in DURABILITIES:
                p.error(f"--durability: {d!r} is not one of {', '.join(DURABILITIES)}")
            if d not in durs:
                durs.append(d)
    return durs


def make_shapes(quick: bool, large_mib_per_row: int, small_ops: int) -> list[Shape]:
    if quick:
        return [
            Shape("large", 32, 64 * KiB, "Llama-3-8B layer count, layers shrunk (--quick)", 4),
            Shape("small", 4, 16 * KiB, "small chunk", 16),
        ]
    large = Shape(
        "large",
        32,
        1 * MiB,
        "Llama-3-8B: 256 tok x 8 KV heads x 128 dim x K,V x bf16 per layer",
        max(1, large_mib_per_row // 32),
    )
    return [large, Shape("small", 4, 16 * KiB, "small chunk", max(1, small_ops))]


def _size(n: int) -> str:
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    if n >= KiB and n % KiB == 0:
        return f"{n // KiB} KiB"
    return f"{n} B"


# --------------------------------------------------------------------------- results


@dataclass
class Result:
    kind: str  # "ceiling" | "kvoffload"
    name: str
    shape: str
    durability: str | None
    ops: int
    payload_bytes: int  # per op
    file_bytes: int  # per op (0 when no file is involved)
    seconds: float  # wall time of the timed loop
    p50_ms: float
    cached: float | None = None  # page-cache residency of the timed files before the loop
    ceiling: str | None = None
    ceiling_gbps: float | None = None
    ratio: float | None = None
    bound_gbps: float | None = None
    bound_of: list[str] = field(default_factory=list)
    ratio_to_bound: float | None = None

    @property
    def id(self) -> str:
        return "/".join(x for x in (self.shape, self.durability, self.name) if x)

    @property
    def gbps(self) -> float:
        return self.ops * self.payload_bytes / self.seconds / GB if self.seconds > 0 else 0.0

    @property
    def file_gbps(self) -> float | None:
        if not self.file_bytes or self.seconds <= 0:
            return None
        return self.ops * self.file_bytes / self.seconds / GB

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["id"] = self.id
        d["gbps"] = self.gbps
        d["file_gbps"] = self.file_gbps
        return d


def timed(op: Callable[[int], object], *, n: int, budget_s: float, min_ops: int) -> Timing:
    """Run ``op(0)`` untimed, then ``op(1..n)`` until ``budget_s`` is spent (>= min_ops)."""
    return interleaved([op], n=n, budget_s=budget_s, min_ops=min_ops)[0]


# --------------------------------------------------------------------------- page cache


# --------------------------------------------------------------------------- buffers


def touched(n: int) -> npt.NDArray[np.uint8]:
    """A page-aligned, fully faulted-in buffer (no page faults in timed loops).

    An anonymous mmap, like the store's ScratchBuffers: numpy's own allocations
    sit 16 bytes into a page, and the kernel's copy_to_user into such a buffer
    can be several times slower (measured 1-2 vs 7-9 GB/s on AMD EPYC).
    """
    a = np.frombuffer(mmap.mmap(-1, max(n, 1)), dtype=np.uint8)
    a.fill(0)
    return a


def _mv(a: npt.NDArray[np.uint8]) -> memoryview:
    """A flat byte view of a numpy buffer (numpy's stubs do not declare the buffer protocol)."""
    return a.data.cast("B")


def random_payload(n: int, seed: int) -> npt.NDArray[np.uint8]:
    a = touched(n)
    a[:] = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return a


def split_layers(payload: npt.NDArray[np.uint8], shape: Shape) -> list[memoryview]:
    mv = _mv(payload)
    return [mv[i * shape.layer_bytes : (i + 1) * shape.layer_bytes] for i in range(shape.layers)]


def object_image(shape: Shape, layers: Sequence[memoryview], fmt: str) -> memoryview:
    """The exact bytes of a stored object of this shape (a throwaway key for 'sealed')."""
    sealed = fmt == "sealed"
    size = v1.object_size([shape.layer_bytes] * shape.layers, sealed)
    buf = _mv(touched(size))[:size]
    v1.seal_into(
        buf,
        tenant=TENANT,
        namespace=NAMESPACE,
        chunk_key=chunk_key(shape, fmt, 0),
        layers=layers,
        aead=AESGCM(os.urandom(32)) if sealed else None,
        key_epoch=1 if sealed else 0,
        created_ns=time.time_ns(),
    )
    return buf


def chunk_key(shape: Shape, fmt: str, i: int) -> bytes:
    return hashlib.blake2b(f"{shape.key}/{fmt}/{i}".encode(), digest_size=32).digest()


# --------------------------------------------------------------------------- ceilings


def cpu_ceilings(shape: Shape, budget_s: float) -> dict[str, Result]:
    """memcpy of a whole chunk; AES-GCM and XXH3 per layer, one thread."""
    out: dict[str, Result] = {}
    n_cap = 1 << 30

    def record(name: str, nbytes: int, op: Callable[[int], object]) -> None:
        ops, wall, p50 = timed(op, n=n_cap, budget_s=budget_s, min_ops=8)
        out[name] = Result("ceiling", name, shape.key, None, ops, nbytes, 0, wall, p50 * 1e3)

    src = random_payload(shape.payload, 1)
    dst = touched(shape.payload)
    record("memcpy", shape.payload, lambda _i: np.copyto(dst, src))

    # A fixed nonce is fine here: a throwaway key, and nothing is kept.
    aead = AESGCM(os.urandom(32))
    nonce = os.urandom(v1.NONCE_SIZE)
    aad = os.urandom(160)  # about the size of a v1 layer AAD
    layer = _mv(src)[: shape.layer_bytes]
    sealed = _mv(touched(shape.layer_bytes + v1.TAG_SIZE))
    sealed = sealed[: shape.layer_bytes + v1.TAG_SIZE]
    plain = _mv(touched(shape.layer_bytes))[: shape.layer_bytes]
    record(
        "aes-gcm encrypt_into",
        shape.layer_bytes,
        lambda _i: aead.encrypt_into(nonce, layer, aad, sealed),
    )
    record(
        "aes-gcm decrypt_into",
        shape.layer_bytes,
        lambda _i: aead.decrypt_into(nonce, sealed, aad, plain),
    )
    if bytes(plain) != bytes(layer):
        raise AssertionError("AES-GCM round trip differs")
    record("xxh3-128", shape.layer_bytes, lambda _i: xxhash.xxh3_128_digest(layer))
    return out


def _write_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])


def raw_writer(d: Path, image: memoryview, durability: str) -> Callable[[int], None]:
    """Op ``i`` writes ``image`` as file i the way the store does, minus its bookkeeping.

    ``object``: open(O_EXCL) + write + fsync + close + rename + fsync(dir);
    ``batch``/``none``: open(O_EXCL) + write + close + rename.
    """
    sync = durability == "object"

    def op(i: int) -> None:
        tmp = d / f".tmp-{i}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o640)
        try:
            _write_all(fd, image)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, raw_path(d, i))
        if sync:
            dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    return op


def raw_path(d: Path, i: int) -> Path:
    return d / f"{i:06d}.obj"


def raw_reader(paths: Sequence[Path], buf: memoryview) -> Callable[[int], None]:
    """Op ``i``: open + fstat + readv into a pre-touched buffer + close (the store's read_file)."""

    def op(i: int) -> None:
        fd = os.open(paths[i], os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            done = 0
            while done < size:
                got = os.readv(fd, [buf[done:size]])
                if got == 0:
                    raise OSError(f"{paths[i]}: short read")
                done += got
        finally:
            os.close(fd)

    return op


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
        cpu = cpu_ceilings(shape, min(self.budget_s, 0.3))
        for r in cpu.values():
            self.add(r)
        payload = random_payload(shape.payload, 2)
        layers = split_layers(payload, shape)
        images = {fmt: object_image(shape, layers, fmt) for fmt in FORMATS}
        for dur in durabilities:
            self.run_durability(shape, dur, layers, payload, images, cpu)

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
            self._compare(row, ceil, cpu_stages)

            # -- read: cold, then warm; raw ceiling and Store.get_into, interleaved
            written = raw_t[0] + 1  # the warm-up op wrote one more
            raw_paths = [raw_path(rdir, i) for i in range(written)]
            keys = [chunk_key(shape, fmt, i) for i in range(written)]
            obj_paths = [store.root / v1.object_relpath(TENANT, k) for k in keys]
            rbuf = _mv(touched(len(images[fmt])))
            out = touched(shape.payload)
            out_mv = _mv(out)

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
                self._compare(row, ceil, cpu_stages)
            if not np.array_equal(out, payload):
                raise AssertionError(f"get {fmt}: the bytes read differ from the bytes put")
            shutil.rmtree(rdir)

    @staticmethod
    def _compare(row: Result, ceiling: Result, stages: Sequence[Result]) -> None:
        row.ceiling = ceiling.name
        row.ceiling_gbps = ceiling.gbps
        row.ratio = row.gbps / ceiling.gbps if ceiling.gbps else None
        parts = [ceiling, *stages]
        if all(p.gbps > 0 for p in parts):
            row.bound_gbps = 1.0 / sum(1.0 / p.gbps for p in parts)
            row.bound_of = [p.name for p in parts]
            row.ratio_to_bound = row.gbps / row.bound_gbps


# --------------------------------------------------------------------------- facts


def _proc_field(path: str, name: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k.strip() == name:
                    return v.strip()
    except OSError:
        return None
    return None


_CPU_FLAGS = ("aes", "vaes", "pclmulqdq", "vpclmulqdq", "avx2", "avx512f", "erms", "fsrm")


def machine_facts(d: Path) -> dict[str, str]:
    import cryptography
    from cryptography.hazmat.backends.openssl.backend import backend

    flags = (_proc_field("/proc/cpuinfo", "flags") or "").split()
    mem = _proc_field("/proc/meminfo", "MemTotal")
    return {
        "cores": f"{os.cpu_count()} (usable: {len(os.sched_getaffinity(0))})",
        "cpu": f"{_proc_field('/proc/cpuinfo', 'model name') or platform.processor() or '?'}"
        + " (flags: "
        + " ".join(f for f in _CPU_FLAGS if f in flags)
        + ")",
        "memory": f"{int(mem.split()[0]) / (1 << 20):.1f} GiB" if mem else "?",
        "kernel": platform.release(),
        "dir": str(d),
        "filesystem (stat -f -c %T)": cmd(["stat", "-f", "-c", "%T", str(d)]),
        "mount (findmnt)": cmd(["findmnt", "-no", "SOURCE,FSTYPE,OPTIONS", "--target", str(d)]),
        "python": sys.version.split()[0],
        "cryptography": cryptography.__version__,
        "openssl": backend.openssl_version_text(),
        "numpy": np.__version__,
    }


# --------------------------------------------------------------------------- output


def _f(x: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def render(
    console: Console, facts: dict[str, str], shapes: Sequence[Shape], results: list[Result]
) -> None:
    t = Table(title="machine", show_header=False)
    t.add_column("fact", style="bold")
    t.add_column("value")
    for k, v in facts.items():
        t.add_row(escape(k), escape(v))
    for s in shapes:
        t.add_row(f"shape {s.key}", f"{s.describe()} - {s.note}")
    console.print(t)

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
                _f(r.file_gbps),
                f"{r.p50_ms:.3f}",
                _f(r.cached, "{:.0%}"),
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
                _f(r.cached, "{:.0%}"),
                r.ceiling or "",
                _f(r.ceiling_gbps),
                _f(r.ratio, "{:.2f}"),
                _f(r.bound_gbps),
                _f(r.ratio_to_bound, "{:.2f}"),
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
    bad = [r for r in results if "cold" in r.name and r.cached is not None and r.cached > 0.05]
    if bad:
        console.print(
            f"[bold red]warning[/bold red]: {len(bad)} cold rows had >5% of their pages cached "
            "after DONTNEED (tmpfs or a file system that ignores fadvise?): they are not cold."
        )


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


def _fit_to_disk(shapes: list[Shape], d: Path) -> list[Shape]:
    """Shrink the large rows if the file system cannot hold one durability's files."""
    free = shutil.disk_usage(d).free
    fitted: list[Shape] = []
    for s in shapes:
        per_chunk = v1.object_size([s.layer_bytes] * s.layers, True)
        need = 4 * (s.chunks + 1) * per_chunk  # raw + store, sealed + plain
        if need > free // 2:
            chunks = max(3, (free // 2) // (4 * per_chunk) - 1)
            s = Shape(s.key, s.layers, s.layer_bytes, s.note + " (shrunk to fit disk)", chunks)
        fitted.append(s)
    return fitted


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    # The store logs each tenant creation as an audit warning; keep the progress lines readable.
    logging.getLogger("kvoffload").setLevel(logging.ERROR)
    console = Console()
    if not console.is_terminal:
        console = Console(width=170)
    err = Console(stderr=True)
    parent = (args.dir or Path.cwd()).resolve()
    if not parent.is_dir():
        err.print(f"--dir {parent}: not a directory")
        return 2
    shapes = make_shapes(args.quick, args.large_mib_per_row, args.small_ops)
    try:
        with scratch_dir(parent, ".bench_store-") as base:
            shapes = _fit_to_disk(shapes, base)
            facts = machine_facts(base)
            kek_path = base / "kek"
            fd = os.open(kek_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, os.urandom(32))
            finally:
                os.close(fd)
            bench = Bench(base, Kek.from_file(kek_path), args.row_budget_s)
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
