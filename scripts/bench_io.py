"""The issue-5 I/O table: kvoffload's I/O backends against the raw ceilings of the same run,
and against the peer a user would pick instead (LMCache's ``LocalDiskBackend``).

Every number comes from one run on one directory (default: a temp dir under
the current working directory; ``--dir`` picks another file system):

ceilings
    memcpy, AES-256-GCM ``encrypt_into`` / ``decrypt_into`` (one thread, per
    layer), XXH3-128 (the plaintext path's checksum), and raw file I/O of the
    very object bytes the store writes, one stream: buffered write (+ fsync of
    the file and its directory at durability ``object``), O_DIRECT write, cold
    read buffered and O_DIRECT, warm read buffered.
kvoffload
    for each I/O backend (``KVOFFLOAD_IO``): ``posix-buffered``,
    ``posix-direct`` (when the file system takes O_DIRECT), ``kvikio`` and
    ``cufile`` (rows that say "unavailable: <the probe's reason>" where they
    cannot run); sealed (AES-256-GCM) and plaintext (``encrypt=False``: the
    sidecar's path for ``encryption = none`` namespaces); save at each
    durability (``object``: fsync per object; ``none``: page cache), cold load
    and, where reads go through the page cache, warm load. Saves use
    ``Store.put_many`` and loads ``Store.get_many_into`` on batches of chunks
    (the pipelined paths: chunk n+1 seals or reads while chunk n is written or
    decrypted), so a row's ops are batches; throughput counts chunks.
direct (posix backends only)
    the direct path of ``encryption = "none"``, ``direct = true`` tenants
    (docs/spec/layout-v1.md §4.1), both halves in this process, minus the socket. Save
    of a batch: ``Store.lease_store`` per chunk (reserve, create + fallocate
    the temp file), then per chunk the worker's ``checks_of`` (XXH3-128 per
    layer) + ``plain_header_block`` + ``PosixDirectIO().write_object`` (one
    O_DIRECT write of the object image at durability ``object``, the page
    cache otherwise: the lease's durability hint), then per chunk
    ``Store.publish_lease`` (re-read and verify the whole object, fsync per
    durability, rename, index). Load of a batch: ``Store.pin`` +
    ``Store.lease_load`` (header check) per chunk, then the worker's
    ``PosixDirectIO().read_layers`` (preadv through the page cache + XXH3 per
    layer) into preallocated destination buffers, then ``Store.unpin``. The
    worker's I/O does not depend on ``KVOFFLOAD_IO`` (the sidecar's backend):
    the direct rows of ``posix-buffered`` and ``posix-direct`` run the same
    code against different raw ceilings. kvikio/cufile rows stay
    "unavailable" where they cannot run; where they can, they have no direct
    rows (the worker's kvikio path is not benchmarked here).
targets
    the best sealed path's ratio to the best raw ceiling, for save (at each
    durability) and cold load: target >= 0.8x.
LMCache
    ``scripts/lmcache_peer.py`` run in its own venv (``.venv-lmcache``) as a
    subprocess, on the same directory, shapes and batch sizes; compared at
    equal durability (its page-cache put vs our ``none``; its put + fsync of its
    files vs our ``object``). Target: kvoffload sealed >= LMCache unencrypted.
    Its index is in memory only and it has no encryption.

Each kvoffload save row runs interleaved batch by batch with its raw write
ceiling (and its sealed, plaintext and direct twins), alternating which goes
first; likewise each load row with its raw read. The shared method
(page-aligned buffers, cold = sync + POSIX_FADV_DONTNEED + mincore check and
the store's RAM tier emptied, untimed warm-up op) is the one every benchmark
here shares (scripts/benchlib).

Usage::

    .venv/bin/python scripts/bench_io.py                     # ~4 min on 2 cores
    .venv/bin/python scripts/bench_io.py --quick --no-lmcache
    .venv/bin/python scripts/bench_io.py --dir /mnt/nvme --json out.json

Nothing is left behind: the temp dir is removed on exit, Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from benchlib.ceilings import COLD_METHOD, Prepared, prepare, read_file, write_file
from benchlib.chunks import (
    DEFAULT_DURABILITIES,
    DURABILITIES,
    NAMESPACE,
    TENANT,
    MiB,
    Shape,
    chunk_key,
    fit_to_disk,
    make_shapes,
    mv,
    touched,
)
from benchlib.facts import machine_facts
from benchlib.lmcache import LMCACHE_HOWTO, LMCACHE_VENV, run_lmcache_peer
from benchlib.method import Mincore, Timing, choices, drop_cache, interleaved, loadavg, scratch_dir
from benchlib.results import Result
from benchlib.stores import new_kek, settle_ram_tier
from benchlib.tables import begin, cell, machine_table, warn_not_cold
from benchlib.targets import TARGET_CEIL, TARGET_PEER, Target, verdict
from kvoffload.client import direct as direct_io
from kvoffload.layouts import v1
from kvoffload.store import Store, StoreConfig, StoreLease
from kvoffload.store.config import default_io_streams
from kvoffload.store.files import Durability
from kvoffload.store.iobackend import IOMode, IOPlan, plan
from kvoffload.store.keys.keyring import Kek

BACKENDS = ("posix-buffered", "posix-direct", "posix", "auto", "kvikio", "cufile")
DEFAULT_BACKENDS = ("posix-buffered", "posix-direct", "kvikio", "cufile")
FORMATS = ("sealed", "plain", "direct")
STAGED = FORMATS[:2]  # the formats that go through Store.put_many / get_many_into
METHOD = (
    "GB/s = payload bytes of the timed chunks / sum of the timed batches' wall times (1 GB = "
    "1e9 B), after 1 untimed warm-up batch; p50 = median wall time of one batch. Raw rows are "
    "quoted in payload-equivalent GB/s (payload bytes / time for the object's bytes). Each "
    "kvoffload row runs interleaved batch by batch with its raw ceiling and its sealed, "
    "plain and direct twins (rotating which goes first). All buffers are page-aligned "
    "anonymous mmaps."
)
BOUNDS = (
    "serial bound = 1 / sum(1/GB/s) of the raw I/O ceiling and the CPU stages the row must "
    "run (sealed: AES-GCM one thread; plain: memcpy + XXH3-128; direct save: XXH3-128 in the "
    "worker + memcpy + XXH3-128 for the sidecar's re-read and check, direct load: XXH3-128), "
    "one after the other; "
    "overlap bound = the slowest of them (the I/O ceiling, or the CPU stages together), "
    "what a perfect two-stage pipeline could reach."
)


# --------------------------------------------------------------------------- rows


@dataclass
class Row(Result):
    """A benchlib Result with the backend it ran with and the batch size."""

    backend: str = ""
    batch: int = 1
    overlap_bound_gbps: float | None = None
    ratio_to_overlap: float | None = None

    @property
    def id(self) -> str:
        parts = (self.shape, self.durability, self.backend, self.name)
        return "/".join(x for x in parts if x)

    def to_json(self) -> dict[str, Any]:
        d = super().to_json()
        d["id"] = self.id
        return d


@dataclass
class BackendSpec:
    name: str  # the KVOFFLOAD_IO value
    available: bool
    reason: str
    summary: str = ""
    direct_write: bool = False
    direct_read: bool = False
    plan: dict[str, Any] = field(default_factory=dict)

    @property
    def write_io(self) -> str:
        return "O_DIRECT" if self.direct_write else "buffered"

    @property
    def read_io(self) -> str:
        return "O_DIRECT" if self.direct_read else "buffered"


def probe_backends(names: Sequence[str], d: Path) -> list[BackendSpec]:
    """What each requested backend would be here, from iobackend.plan (never raises)."""
    out: list[BackendSpec] = []
    for name in names:
        try:
            p: IOPlan = plan(IOMode(name), d)
        except Exception as exc:  # a probe that breaks is a finding, not a crash
            out.append(BackendSpec(name, False, f"probe failed: {exc!r}"))
            continue
        if p.error is not None:
            out.append(BackendSpec(name, False, p.error, p.describe(), plan=p.to_dict()))
        else:
            spec = BackendSpec(name, True, p.reason, p.describe(), p.direct_write, p.direct_read)
            spec.plan = p.to_dict()
            out.append(spec)
    return out


# --------------------------------------------------------------------------- raw I/O


def fan_out(pool: ThreadPoolExecutor | None, fn: Callable[[int], None], n: int) -> None:
    """``fn(j)`` for j in 0..n-1: in turn, or at once on ``pool`` (one I/O stream each)."""
    if pool is None:
        for j in range(n):
            fn(j)
        return
    for f in [pool.submit(fn, j) for j in range(n)]:
        f.result()


def raw_writer(
    d: Path,
    image: memoryview,
    durability: str,
    *,
    direct: bool,
    batch: int,
    tag: str,
    pool: ThreadPoolExecutor | None = None,
) -> Callable[[int], None]:
    """Op ``i`` writes ``batch`` copies of ``image`` the way the store does, minus its
    bookkeeping: open(O_EXCL[, O_DIRECT]) + write + [fsync] + close + rename + [fsync(dir)];
    with ``pool``, the files of a batch at once (the ceiling of as many streams)."""
    sync = durability == "object"

    def op(i: int) -> None:
        fan_out(pool, functools.partial(one, i), batch)

    def one(i: int, j: int) -> None:
        tmp = d / f".tmp-{tag}-{i}-{j}"
        write_file(tmp, raw_file(d, tag, i, j), image, sync=sync, direct=direct)

    return op


def raw_file(d: Path, tag: str, i: int, j: int) -> Path:
    return d / f"{tag}-{i:06d}-{j:03d}.obj"


def raw_reader(
    files: Sequence[Sequence[Path]],
    buf: memoryview,
    *,
    direct: bool,
    pool: ThreadPoolExecutor | None = None,
    slots: Sequence[memoryview] = (),
) -> Callable[[int], None]:
    """Op ``i`` reads every file of ``files[i]``: open[O_DIRECT] + fstat + readv + close.

    ``buf`` is page-aligned and at least the files' size rounded up to 4 KiB
    (layout v1 objects are 4 KiB-padded, so O_DIRECT reads them whole). With
    ``pool``, the files of a batch are read at once, file j into ``slots[j]``.
    """

    def op(i: int) -> None:
        fan_out(pool, functools.partial(one, i), len(files[i]))

    def one(i: int, j: int) -> None:
        read_file(files[i][j], slots[j] if pool is not None else buf, direct=direct)

    return op


# --------------------------------------------------------------------------- the run


@dataclass
class Bench:
    base: Path
    kek: Kek
    budget_s: float
    #: The stores' io_streams; raw ceilings also run with min(streams, batch).
    streams: int = 1
    results: list[Row] = field(default_factory=list)
    cpu_results: list[Result] = field(default_factory=list)
    open_stores: list[Store] = field(default_factory=list)
    mincore: Mincore = field(default_factory=Mincore)
    dio: direct_io.PosixDirectIO = field(default_factory=direct_io.PosixDirectIO)  # the worker's
    progress: Callable[[str], None] = lambda _m: None

    def add(self, r: Row) -> Row:
        self.results.append(r)
        self.progress(f"  {r.id:<52} {r.gbps:8.3f} GB/s  ({r.ops} chunks)")
        return r

    def prepare(self, shape: Shape, batch: int) -> Prepared:
        self.progress(f"{shape.key}: {shape.describe()}, batches of {batch}")
        sh = prepare(shape, batch, STAGED, self.budget_s)
        for r in sh.cpu.values():
            self.cpu_results.append(r)
            self.progress(f"  {r.id:<52} {r.gbps:8.3f} GB/s")
        return sh

    def row(
        self,
        kind: str,
        name: str,
        sh: Prepared,
        dur: str | None,
        backend: str,
        fmt: str,
        t: Timing,
        cached: float | None = None,
    ) -> Row:
        batches, wall, p50 = t
        s = sh.shape
        file_bytes = v1.object_size([s.layer_bytes] * s.layers, fmt == "sealed")
        return Row(
            kind, name, s.key, dur, batches * sh.batch, s.payload, file_bytes, wall, p50 * 1e3,
            cached, backend=backend, batch=sh.batch,
        )  # fmt: skip

    @staticmethod
    def compare(row: Row, ceiling: Row, stages: Sequence[Result]) -> None:
        row.ceiling = ceiling.name
        row.ceiling_gbps = ceiling.gbps
        row.ratio = row.gbps / ceiling.gbps if ceiling.gbps else None
        if ceiling.gbps > 0 and all(p.gbps > 0 for p in stages):
            cpu_s = sum(1.0 / p.gbps for p in stages)
            row.bound_gbps = 1.0 / (1.0 / ceiling.gbps + cpu_s)
            row.bound_of = [ceiling.name, *(p.name for p in stages)]
            row.ratio_to_bound = row.gbps / row.bound_gbps
            row.overlap_bound_gbps = min(ceiling.gbps, 1.0 / cpu_s)
            row.ratio_to_overlap = row.gbps / row.overlap_bound_gbps

    def unavailable(self, sh: Prepared, spec: BackendSpec) -> None:
        self.results.append(
            Row("unavailable", f"unavailable: {spec.reason}", sh.shape.key, None, 0,
                sh.shape.payload, 0, 0.0, 0.0, backend=spec.name, batch=sh.batch)
        )  # fmt: skip

    def run_backend(self, sh: Prepared, spec: BackendSpec, durabilities: Sequence[str]) -> None:
        s = sh.shape
        self.progress(f"{s.key} {spec.name}: {spec.summary}")
        work = self.base / f"{s.key}-{spec.name}"
        rdir = work / "raw"
        rdir.mkdir(parents=True)
        stores: dict[str, Store] = {}
        try:
            self._run(sh, spec, durabilities, work, rdir, stores)
        finally:
            for st in stores.values():
                self.open_stores.remove(st)
                st.close()
            shutil.rmtree(work, ignore_errors=True)

    def _keys(self, sh: Prepared, fmt: str, dur: str, i: int) -> list[bytes]:
        return [chunk_key(sh.shape, f"{fmt}/{dur}", i * sh.batch + j) for j in range(sh.batch)]

    def _run(
        self,
        sh: Prepared,
        spec: BackendSpec,
        durabilities: Sequence[str],
        work: Path,
        rdir: Path,
        stores: dict[str, Store],
    ) -> None:
        b = sh.batch
        # The worker's direct path is posix here: its rows run with the posix backends only.
        fmts = FORMATS if spec.plan.get("backend") == "posix" else STAGED
        written: list[tuple[str, int]] = []  # (durability, batch) of every batch written
        # The ceilings of as many I/O streams as the store runs a batch on.
        nst = min(self.streams, b)
        pool = ThreadPoolExecutor(nst, thread_name_prefix="bench-raw") if nst > 1 else None
        try:
            self._run_ops(sh, spec, durabilities, work, rdir, stores, fmts, written, nst, pool)
        finally:
            if pool is not None:
                pool.shutdown()

    def _run_ops(
        self,
        sh: Prepared,
        spec: BackendSpec,
        durabilities: Sequence[str],
        work: Path,
        rdir: Path,
        stores: dict[str, Store],
        fmts: Sequence[str],
        written: list[tuple[str, int]],
        nst: int,
        pool: ThreadPoolExecutor | None,
    ) -> None:
        s, b, budget = sh.shape, sh.batch, self.budget_s
        image = sh.images["sealed"]  # the raw ceilings move the sealed object's bytes
        for dur in durabilities:
            store = Store(
                StoreConfig(
                    root=work / dur / "store",
                    durability=Durability(dur),
                    capacity_bytes=None,
                    io=spec.name,
                    io_streams=self.streams,
                ),
                self.kek,
                create=True,
            )
            stores[dur] = store
            self.open_stores.append(store)
            settle_ram_tier(store, sh.layers)

            def save(i: int, fmt: str, dur: str = dur, store: Store = store) -> None:
                keys = self._keys(sh, fmt, dur, i)
                if fmt == "direct":
                    self._save_direct(store, keys, sh.layers)
                    return
                chunks = [(k, sh.layers) for k in keys]
                done = store.put_many(TENANT, NAMESPACE, chunks, encrypt=fmt == "sealed")
                if not all(done):
                    raise AssertionError("put_many found a chunk already present")

            raw = raw_writer(rdir, image, dur, direct=spec.direct_write, batch=b, tag=dur)
            raws = [raw]
            if pool is not None:
                raws.append(
                    raw_writer(rdir, image, dur, direct=spec.direct_write, batch=b,
                               tag=f"{dur}-x{nst}", pool=pool)
                )  # fmt: skip
            timings = interleaved(
                [*raws, *(functools.partial(save, fmt=fmt) for fmt in fmts)],
                n=sh.ops(1),
                budget_s=budget,
                min_ops=3,
            )
            raw_ts, fmt_t = timings[: len(raws)], timings[len(raws) :]
            os.sync()  # untimed: the next rows start with no dirty pages
            sync = "+fsync" if dur == "object" else ""
            ceils = [
                self.add(
                    self.row(
                        "ceiling",
                        f"raw write{sync} {spec.write_io}{sfx}",
                        sh,
                        dur,
                        spec.name,
                        "sealed",
                        t,
                    )
                )
                for sfx, t in zip(["", f" x{nst}"], raw_ts, strict=False)
            ]
            ceil = max(ceils, key=lambda c: c.gbps)
            for fmt, t in zip(fmts, fmt_t, strict=True):
                row = self.add(self.row("kvoffload", f"save {fmt}", sh, dur, spec.name, fmt, t))
                self.compare(row, ceil, self._stages(sh, fmt, "save"))
            written += [(dur, i) for i in range(raw_ts[0][0] + 1)]

        # -- loads: every batch written above (the files do not depend on durability)
        raw_files = [[raw_file(rdir, dur, i, j) for j in range(b)] for dur, i in written]
        keys = {fmt: [self._keys(sh, fmt, dur, i) for dur, i in written] for fmt in fmts}
        obj_files = {
            fmt: [
                [stores[dur].root / v1.object_relpath(TENANT, k) for k in ks]
                for (dur, _i), ks in zip(written, keys[fmt], strict=True)
            ]
            for fmt in fmts
        }
        store_of = [stores[dur] for dur, _i in written]
        rbuf = mv(touched(v1.align_up(len(image))))
        # The N-stream reads: cold, of the files the N-stream writer wrote; warm, of
        # the single-stream files, which the cold row leaves cached (buffered).
        par_files = [
            [raw_file(rdir, f"{dur}-x{nst}", i, j) for j in range(b)] for dur, i in written
        ]
        stride = v1.align_up(len(image))
        pbuf = mv(touched(stride * b)) if pool is not None else rbuf
        slots = [pbuf[j * stride : (j + 1) * stride] for j in range(b)]
        outs = [mv(touched(s.payload)) for _ in range(b)]
        lb = s.layer_bytes
        dests = [[o[k * lb : (k + 1) * lb] for k in range(s.layers)] for o in outs]

        def load(i: int, fmt: str) -> None:
            if fmt == "direct":
                self._load_direct(store_of[i], keys[fmt][i], dests)
            else:
                got = store_of[i].get_many_into(TENANT, keys[fmt][i], outs)
                if any(g is None for g in got):
                    raise AssertionError(f"get_many_into ({fmt}) missed a chunk it just stored")
            if i == 0:  # the untimed warm-up batch: check the bytes
                want = bytes(mv(sh.payload))
                if any(bytes(o) != want for o in outs):
                    raise AssertionError(f"load {fmt}: the bytes read differ from those saved")
                for o in outs:  # so that the next format's check sees its own bytes
                    o[:] = bytes(len(o))

        n = len(written) - 1
        flat = [p for batch in raw_files for p in batch]
        if pool is not None:
            flat += [p for batch in par_files for p in batch]
        for cache in ("cold", "warm") if not spec.direct_read else ("cold",):
            if cache == "cold":
                drop_cache(flat + [p for fmt in fmts for batch in obj_files[fmt] for p in batch])
                for st in stores.values():
                    st.drop_cache()  # and each store's RAM tier: a cold load reads files
            timed = [p for batch in raw_files[1 : n + 1] for p in batch]
            raw_cached = self.mincore.resident(timed)
            cached = {
                fmt: self.mincore.resident([p for bt in obj_files[fmt][1 : n + 1] for p in bt])
                for fmt in fmts
            }
            readers = [raw_reader(raw_files, rbuf, direct=spec.direct_read)]
            if pool is not None:
                readers.append(
                    raw_reader(par_files if cache == "cold" else raw_files, rbuf,
                               direct=spec.direct_read, pool=pool, slots=slots)
                )  # fmt: skip
            timings = interleaved(
                [*readers, *(functools.partial(load, fmt=fmt) for fmt in fmts)],
                n=n,
                budget_s=budget,
                min_ops=3,
            )
            raw_ts, fmt_t = timings[: len(readers)], timings[len(readers) :]
            n = min(n, *(t[0] for t in timings))
            ceil = max(
                (
                    self.add(
                        self.row(
                            "ceiling",
                            f"raw read {cache} {spec.read_io}{sfx}",
                            sh,
                            None,
                            spec.name,
                            "sealed",
                            t,
                            raw_cached,
                        )
                    )
                    for sfx, t in zip(["", f" x{nst}"], raw_ts, strict=False)
                ),
                key=lambda c: c.gbps,
            )
            for fmt, t in zip(fmts, fmt_t, strict=True):
                row = self.add(
                    self.row("kvoffload", f"load {fmt} {cache}", sh, None, spec.name, fmt, t,
                             cached[fmt])
                )  # fmt: skip
                self.compare(row, ceil, self._stages(sh, fmt, "load"))

    def _save_direct(
        self, store: Store, keys: Sequence[bytes], layers: Sequence[memoryview]
    ) -> None:
        """One batch the way lease_store / the worker / complete_store do it, minus the socket:
        lease every chunk, write every leased object, then verify and name each."""
        lengths = [len(x) for x in layers]
        leases: list[StoreLease] = []
        try:
            for k in keys:
                lease = store.lease_store(TENANT, NAMESPACE, k, lengths)
                if lease is None:
                    raise AssertionError("lease_store found a chunk already present")
                leases.append(lease)
            for lease in leases:  # the worker
                _data_offset, offsets = lease.offsets
                header = v1.plain_header_block(
                    tenant=TENANT,
                    namespace=NAMESPACE,
                    chunk_key=lease.chunk_key,
                    lengths=lengths,
                    checks=direct_io.checks_of(layers),
                    created_ns=time.time_ns(),
                )
                # The client's rule: O_DIRECT only for objects the sidecar fsyncs.
                self.dio.write_object(
                    str(lease.tmp),
                    header,
                    layers,
                    offsets,
                    o_direct=store.durability in ("object", ""),
                )
            for lease in leases:
                if not store.publish_lease(lease):
                    raise AssertionError("publish_lease did not store a chunk")
        finally:
            for lease in leases:
                store.cancel_lease(lease)  # a no-op for those published

    def _load_direct(
        self, store: Store, keys: Sequence[bytes], dests: Sequence[Sequence[memoryview]]
    ) -> None:
        """One batch the way lease_load / the worker / complete_load do it, minus the socket:
        pin and header-check every chunk, read every chunk's layers into its destinations
        (verifying each XXH3-128), unpin."""
        store.pin(TENANT, keys)
        try:
            leases = [store.lease_load(TENANT, k) for k in keys]
            for rl, d in zip(leases, dests, strict=True):  # the worker
                if rl is None:
                    raise AssertionError("lease_load missed a chunk it just stored")
                ext = [direct_io.Extent(x.offset, x.length, x.check) for x in rl.header.layers]
                if not self.dio.read_layers(str(rl.path), ext, d):
                    raise AssertionError("read_layers: a layer failed its checksum")
        finally:
            store.unpin(TENANT, keys)

    @staticmethod
    def _stages(sh: Prepared, fmt: str, op: str) -> list[Result]:
        """The CPU stages a row must run besides its I/O (see BOUNDS)."""
        cpu = sh.cpu
        if fmt == "sealed":
            return [cpu["aes-gcm encrypt_into" if op == "save" else "aes-gcm decrypt_into"]]
        if fmt == "direct":
            xxh = cpu["xxh3-128"]
            return [xxh, cpu["memcpy"], xxh] if op == "save" else [xxh]
        return [cpu["memcpy"], cpu["xxh3-128"]]


# --------------------------------------------------------------------------- targets


def _best(rows: Sequence[Row]) -> Row | None:
    return max(rows, key=lambda r: r.gbps) if rows else None


def ceiling_targets(
    results: Sequence[Row], shapes: Sequence[str], durs: Sequence[str]
) -> list[Target]:
    """Best sealed save/cold load against the best raw write/cold read of the run."""
    out: list[Target] = []

    def pick(kind: str, shape: str, dur: str | None, pred: Callable[[str], bool]) -> list[Row]:
        return [
            r
            for r in results
            if r.kind == kind and r.shape == shape and r.durability == dur and pred(r.name)
        ]

    for shape in shapes:
        for dur in durs:
            ours = _best(pick("kvoffload", shape, dur, lambda n: n == "save sealed"))
            raw = _best(pick("ceiling", shape, dur, lambda n: n.startswith("raw write")))
            out.append(
                Target(shape, "save", dur, ours, f"{raw.name} [{raw.backend}]" if raw else "-",
                       raw.gbps if raw else None, None, TARGET_CEIL)
            )  # fmt: skip
        ours = _best(pick("kvoffload", shape, None, lambda n: n == "load sealed cold"))
        raw = _best(pick("ceiling", shape, None, lambda n: n.startswith("raw read cold")))
        out.append(
            Target(shape, "cold load", None, ours, f"{raw.name} [{raw.backend}]" if raw else "-",
                   raw.gbps if raw else None, None, TARGET_CEIL)
        )  # fmt: skip
    return out


def peer_targets(
    results: Sequence[Row], peer: dict[str, Any], shapes: Sequence[str]
) -> list[Target]:
    """kvoffload's best sealed row against each LMCache variant at equal durability."""
    rows = peer.get("rows", [])
    out: list[Target] = []
    cases = (
        ("save", "none", "put", "save sealed"),
        ("save", "object", "put+fsync", "save sealed"),
        ("cold load", None, "get cold", "load sealed cold"),
        ("warm load", None, "get warm", "load sealed warm"),
    )
    for shape in shapes:
        for op, dur, lm_name, our_name in cases:
            ours = _best(
                [
                    r
                    for r in results
                    if r.kind == "kvoffload"
                    and r.shape == shape
                    and r.name == our_name
                    and r.durability == dur
                ]
            )
            for r in rows:
                if r["shape"] == shape and r["name"] == lm_name:
                    default = " (default)" if r["variant"] == "buffered" else ""
                    out.append(
                        Target(shape, op, dur, ours,
                               f"lmcache {r['variant']}{default} {lm_name}",
                               float(r["gbps"]), r.get("ratio"), TARGET_PEER)
                    )  # fmt: skip
    return out


# --------------------------------------------------------------------------- LMCache


def run_lmcache(
    args: argparse.Namespace, base: Path, err: Console
) -> tuple[str, dict[str, Any] | None]:
    """Run lmcache_peer.py in its venv with this script's sizes; (status line, its JSON or None)."""
    if args.no_lmcache:
        return "skipped (--no-lmcache)", None
    return run_lmcache_peer(
        args.lmcache_python,
        base,
        err,
        quick=args.quick,
        row_budget_s=args.row_budget_s,
        large_mib_per_row=args.large_mib_per_row,
        small_ops=args.small_ops,
        large_batch=args.large_batch,
        small_batch=args.small_batch,
        durabilities=args.durability,
    )


# --------------------------------------------------------------------------- output


def render(
    console: Console,
    facts: dict[str, str],
    shapes: Sequence[Prepared],
    specs: Sequence[BackendSpec],
    bench: Bench,
    targets: Sequence[Target],
    peer_status: str,
    peer: dict[str, Any] | None,
    peer_cmp: Sequence[Target],
) -> None:
    more = [sh.shape.fact(f"; batches of {sh.batch} chunks") for sh in shapes]
    console.print(machine_table(facts, more))

    t = Table(title="I/O backends (KVOFFLOAD_IO)")
    for col in ("backend", "status", "what / why"):
        t.add_column(col)
    for spec in specs:
        status = "[green]runs[/green]" if spec.available else "[red]unavailable[/red]"
        t.add_row(spec.name, status, escape(spec.summary + ": " + spec.reason))
    console.print(t)

    t = Table(title="ceilings (same run, same directory; raw I/O: one stream)")
    cols = ("shape", "dur", "ceiling", "ran with", "chunks", "MiB", "GB/s", "file GB/s")
    for col in (*cols, "p50 ms", "cached"):
        t.add_column(col, justify="left" if col in cols[:4] else "right")
    for r in bench.cpu_results:
        t.add_row(r.shape, "", r.name, "", str(r.ops), f"{r.ops * r.payload_bytes / MiB:.1f}",
                  f"{r.gbps:.3f}", "", f"{r.p50_ms:.3f}", "")  # fmt: skip
    for r in bench.results:
        if r.kind == "ceiling":
            t.add_row(
                r.shape, r.durability or "", r.name, r.backend, str(r.ops),
                f"{r.ops * r.payload_bytes / MiB:.1f}", f"{r.gbps:.3f}", cell(r.file_gbps),
                f"{r.p50_ms:.1f}", cell(r.cached, "{:.0%}"),
            )  # fmt: skip
    console.print(t)

    t = Table(
        title="kvoffload Store (sealed, plain: put_many / get_many_into, pipelined; direct: "
        "lease_store + worker write + publish_lease / pin + lease_load + worker read)"
    )
    left = ("shape", "dur", "backend", "row")
    nums = ("chunks", "GB/s", "p50 ms", "cached", "ceil GB/s", "x ceil", "serial bd", "x serial")
    for col in (*left, *nums, "overlap bd", "x overlap"):
        t.add_column(col, justify="left" if col in left else "right")
    for r in bench.results:
        if r.kind == "unavailable":
            t.add_row(r.shape, "", r.backend, f"[red]{escape(r.name)}[/red]", *[""] * 10)
        elif r.kind == "kvoffload":
            t.add_row(
                r.shape, r.durability or "", r.backend, r.name, str(r.ops), f"{r.gbps:.3f}",
                f"{r.p50_ms:.1f}", cell(r.cached, "{:.0%}"), cell(r.ceiling_gbps),
                cell(r.ratio, "{:.2f}"), cell(r.bound_gbps), cell(r.ratio_to_bound, "{:.2f}"),
                cell(r.overlap_bound_gbps), cell(r.ratio_to_overlap, "{:.2f}"),
            )  # fmt: skip
    console.print(t)

    t = Table(title=f"target: best sealed path >= {TARGET_CEIL:.1f}x the raw ceiling")
    for col in ("shape", "op", "dur", "best sealed", "GB/s", "best raw ceiling", "GB/s"):
        t.add_column(col, justify="right" if col == "GB/s" else "left")
    for col in ("ratio", "target", ""):
        t.add_column(col, justify="right")
    for tg in targets:
        t.add_row(
            tg.shape, tg.op, tg.durability or "", tg.ours.id if tg.ours else "-",
            cell(tg.ours.gbps if tg.ours else None), escape(tg.theirs_name), cell(tg.theirs_gbps),
            cell(tg.ratio, "{:.2f}x"), f">= {tg.target:.2f}x", verdict(tg),
        )  # fmt: skip
    console.print(t)

    console.print(f"[bold]LMCache peer[/bold]: {escape(peer_status)}")
    if peer is not None:
        t = Table(title="LMCache LocalDiskBackend (scripts/lmcache_peer.py, its own venv)")
        lm_cols = ("shape", "variant", "row", "dur", "chunks", "GB/s", "p50 ms", "cached")
        for col in (*lm_cols, "ceiling (same process)", "ceil GB/s", "x ceil"):
            t.add_column(col, justify="left" if col in (*lm_cols[:4], "ceiling (same process)")
                         else "right")  # fmt: skip
        for r in peer.get("rows", []):
            t.add_row(
                r["shape"], r["variant"], r["name"], r["durability"] or "", str(r["chunks"]),
                f"{r['gbps']:.3f}", f"{r['p50_ms']:.1f}", cell(r.get("cached"), "{:.0%}"),
                r.get("ceiling") or "", cell(r.get("ceiling_gbps")), cell(r.get("ratio"), "{:.2f}"),
            )  # fmt: skip
        console.print(t)
        t = Table(
            title=f"target: kvoffload sealed >= {TARGET_PEER:.1f}x LMCache unencrypted "
            "(equal durability; each LMCache variant)"
        )
        cmp_cols = ("shape", "op", "dur", "kvoffload best sealed", "GB/s", "x ceil", "LMCache")
        for col in (*cmp_cols, "GB/s ", "x ceil ", "ratio", "target", ""):
            t.add_column(col, justify="left" if col in (*cmp_cols[:4], "LMCache") else "right")
        for tg in peer_cmp:
            t.add_row(
                tg.shape, tg.op, tg.durability or "", tg.ours.id if tg.ours else "-",
                cell(tg.ours.gbps if tg.ours else None), cell(tg.ours.ratio if tg.ours else None,
                "{:.2f}"), escape(tg.theirs_name), cell(tg.theirs_gbps),
                cell(tg.theirs_ratio, "{:.2f}"), cell(tg.ratio, "{:.2f}x"), f">= {tg.target:.2f}x",
                verdict(tg),
            )  # fmt: skip
        console.print(t)
        for note in peer.get("notes", []):
            console.print(f"[bold]LMCache[/bold]: {escape(note)}")
        console.print(
            "[bold]LMCache durability[/bold]: its 'put' (page cache, it never fsyncs) is "
            "compared with our 'none', its 'put+fsync' (fsync of its files and directory after "
            "the batch, timed) with our 'object' (fsync of each object and its directory)."
        )

    console.print(f"[bold]method[/bold]: {METHOD}")
    console.print(f"[bold]bounds[/bold]: {BOUNDS}")
    console.print(f"[bold]cold reads[/bold]: {COLD_METHOD}")
    console.print(
        "[bold]durability none[/bold]: save and raw write rows time page-cache writes only "
        "(O_DIRECT ones go to the device without a cache flush); os.sync() runs untimed after "
        "each save row."
    )
    console.print(
        "[bold]plain[/bold]: the sidecar's path for 'encryption = none' namespaces (XXH3-128 "
        "checksum, no cipher), through Store.put_many / get_many_into."
    )
    console.print(
        "[bold]direct[/bold]: the worker-side direct path of 'encryption = none', 'direct = true' "
        "tenants, both halves in this process minus the socket: save = lease_store per chunk, "
        "then the worker's checks_of + plain_header_block + PosixDirectIO().write_object "
        "(one O_DIRECT write at durability object, the page cache otherwise), then "
        "publish_lease (re-read, "
        "verify, fsync per durability, rename, index); load = pin + lease_load, then "
        "PosixDirectIO().read_layers (buffered preadv + XXH3-128) into preallocated buffers, "
        "then unpin. The worker's I/O does not follow KVOFFLOAD_IO: the direct rows of the posix "
        "backends run the same code against each backend's ceilings. No direct rows for "
        "kvikio/cufile (the worker's kvikio path is not benchmarked here)."
    )
    warn_not_cold(console, bench.results)


# --------------------------------------------------------------------------- main


def _split(p: argparse.ArgumentParser, values: list[str] | None, allowed: Sequence[str],
           default: Sequence[str], flag: str) -> list[str]:  # fmt: skip
    try:
        return choices(values, allowed, default)
    except ValueError as exc:
        p.error(f"{flag}: {exc}")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=None, help="file system to test (default: cwd)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of seconds")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument(
        "--backend",
        action="append",
        default=None,
        help=f"{', '.join(BACKENDS)}; repeat or comma-separate "
        f"(default: {','.join(DEFAULT_BACKENDS)})",
    )
    p.add_argument(
        "--durability",
        action="append",
        default=None,
        help="object, batch, none; repeat or comma-separate (default: object,none)",
    )
    p.add_argument("--large-mib-per-row", type=int, default=512, help="MiB per large save row")
    p.add_argument("--small-ops", type=int, default=1024, help="chunks per small save row")
    p.add_argument("--large-batch", type=int, default=None, help="chunks per batch (default 4)")
    p.add_argument("--small-batch", type=int, default=None, help="chunks per batch (default 32)")
    p.add_argument(
        "--streams",
        type=int,
        default=default_io_streams(),
        help="the stores' io_streams, and the raw ceilings' streams (min(streams, batch)); "
        "default: the store's default here",
    )
    p.add_argument(
        "--row-budget-s",
        type=float,
        default=None,
        help="stop a row after this many seconds of its batches (>= 3); default 3 (quick: 0.3)",
    )
    p.add_argument("--no-lmcache", action="store_true", help="skip the LMCache peer rows")
    p.add_argument(
        "--lmcache-python",
        type=Path,
        default=LMCACHE_VENV / "bin" / "python",
        help="the LMCache venv's python (default: .venv-lmcache/bin/python)",
    )
    a = p.parse_args(argv)
    a.backend = _split(p, a.backend, BACKENDS, DEFAULT_BACKENDS, "--backend")
    a.durability = _split(p, a.durability, DURABILITIES, DEFAULT_DURABILITIES,
                          "--durability")  # fmt: skip
    if a.row_budget_s is None:
        a.row_budget_s = 0.3 if a.quick else 3.0
    if a.large_batch is None:
        a.large_batch = 2 if a.quick else 4
    if a.small_batch is None:
        a.small_batch = 4 if a.quick else 32
    return a


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    console, err, parent = begin(args.dir, 200)
    if parent is None:
        return 2
    shapes = make_shapes(args.quick, args.large_mib_per_row, args.small_ops)
    batch = {"large": args.large_batch, "small": args.small_batch}
    load0 = loadavg()
    peer: dict[str, Any] | None = None
    try:
        with scratch_dir(parent, ".bench_io-") as base:
            # x4: raw, sealed, plain, direct; all durabilities' files stay until the loads
            shapes = fit_to_disk(shapes, base, 4 * len(args.durability), 8)
            facts = machine_facts(base)
            facts["load average at start (1/5/15 min)"] = load0
            specs = probe_backends(args.backend, base)
            auto = probe_backends(["auto"], base)[0]
            facts["KVOFFLOAD_IO=auto picks"] = f"{auto.summary}: {auto.reason}"
            facts["direct path (worker side)"] = (
                "PosixDirectIO: pwritev "
                + ("with O_DIRECT (else buffered, on EINVAL)" if direct_io.O_DIRECT else "buffered")
                + ", preadv buffered, XXH3-128 per layer; rows with the posix backends only"
            )
            bench = Bench(base, new_kek(base), args.row_budget_s, args.streams)
            bench.progress = lambda m: err.print(m, highlight=False)
            t0 = time.perf_counter()
            prepared: list[Prepared] = []
            try:
                for s in shapes:
                    sh = bench.prepare(s, batch[s.key])
                    prepared.append(sh)
                    for spec in specs:
                        if spec.available:
                            bench.run_backend(sh, spec, args.durability)
                        else:
                            bench.unavailable(sh, spec)
                    del sh
            finally:
                for st in list(bench.open_stores):
                    with contextlib.suppress(Exception):
                        st.close()
            t1 = time.perf_counter()
            peer_status, peer = run_lmcache(args, base, err)
            elapsed = time.perf_counter() - t0
    except KeyboardInterrupt:
        err.print("interrupted: temp files removed")
        return 130
    facts["run time"] = f"{elapsed:.1f} s (kvoffload rows {t1 - t0:.1f} s)"
    facts["load average at end (1/5/15 min)"] = loadavg()
    keys = [s.key for s in shapes]
    targets = ceiling_targets(bench.results, keys, args.durability)
    peer_cmp = peer_targets(bench.results, peer, keys) if peer is not None else []
    render(console, facts, prepared, specs, bench, targets, peer_status, peer, peer_cmp)
    if args.json is not None:
        doc = {
            "machine": facts,
            "config": {
                "quick": args.quick,
                "durability": args.durability,
                "backends": args.backend,
                "streams": args.streams,
                "row_budget_s": args.row_budget_s,
                "shapes": [
                    asdict(sh.shape) | {"payload": sh.shape.payload, "batch": sh.batch}
                    for sh in prepared
                ],
            },
            "backends": [asdict(s) for s in specs],
            "auto": asdict(auto),
            "method": METHOD,
            "bounds": BOUNDS,
            "cold_method": COLD_METHOD,
            "ceilings": [r.to_json() for r in bench.cpu_results]
            + [r.to_json() for r in bench.results if r.kind == "ceiling"],
            "rows": [r.to_json() for r in bench.results if r.kind == "kvoffload"],
            "unavailable": [
                {"backend": r.backend, "shape": r.shape, "reason": r.name}
                for r in bench.results
                if r.kind == "unavailable"
            ],
            "targets": [t.to_json() for t in targets],
            "lmcache": {
                "status": peer_status,
                "result": peer,
                "comparison": [t.to_json() for t in peer_cmp],
                "howto": LMCACHE_HOWTO,
            },
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
