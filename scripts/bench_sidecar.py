"""Benchmark a real sidecar process, driven by SidecarClient, against the machine's ceilings.

For each chosen durability the benchmark starts ``python -m kvoffload.cli
--config <toml> serve`` (cwd: a temp dir under ``--dir``; durability through
``KVOFFLOAD_STORE_DURABILITY``; a policy that grants this uid every tenant,
makes tenant ``plain`` plaintext, tenant ``direct`` plaintext with ``direct =
true``, every other tenant AES-256-GCM) and measures, from this client process:

kvoffload
    ``SidecarClient.save`` (batches of ``--batch`` chunks per call) and
    ``SidecarClient.load`` (same batches, an ``into`` callback copying every
    layer into a pre-touched destination buffer), sealed (tenant ``bench``) and
    plain (tenant ``plain``), cold and warm, for a Llama-3-8B-shaped chunk and a
    small one; and the latency of ``lookup`` of 64 (and of 1) present keys.
direct
    the same saves, and cold loads, of tenant ``direct`` through
    ``SidecarClient(..., direct=True)`` (the script fails unless the client
    does take the direct path): the client leases the files, writes them
    itself (``kvoffload.client.direct``, ``KVOFFLOAD_DIRECT_IO``: posix pwritev with
    O_DIRECT where the file system takes it, kvikio where the node has it), the
    sidecar verifies and names them; loads are ``SidecarClient.load_to``
    straight into the pre-touched destination buffer (the worker reads and
    verifies each layer), no staging buffer either way.
sealed direct
    cold and warm loads of the sealed tenant's chunks through
    ``SidecarClient(..., sealed_direct=True)`` (protocol-v1.md §5.33): the sidecar
    hands each object's descriptor and its own key, the client verifies and
    decrypts it (mapped, or read if small) straight into ``load_to``'s
    destinations; rows ``load sealed direct cold/warm``, in the target table too.
ceilings (same run, same directory)
    memcpy, AES-256-GCM ``encrypt_into`` / ``decrypt_into`` per layer and
    XXH3-128 (one thread; ``benchlib.ceilings``); a raw write of the very
    object bytes at the row's durability (fsync + directory fsync at ``object``,
    none at ``none``), with O_DIRECT when the file system takes it and buffered;
    a raw cold read of them, O_DIRECT and buffered; a warm (buffered) read; and
    for ``lookup`` the round trip of a message of the same size between two
    Python processes over a Unix socket pair. A row's ratio is to the faster of
    the O_DIRECT and buffered ceilings, measured in the same interleaved loop.

LMCache (the peer)
    ``scripts/lmcache_peer.py`` (LMCache 0.5.6 ``LocalDiskBackend``, its
    buffered default and its O_DIRECT variant) in its own venv
    (``--lmcache-python``, default ``.venv-lmcache/bin/python``; a missing venv
    is one status line, ``--no-lmcache`` skips it), run after the sidecar rows
    on the same directory with the same chunk shapes, chunks per row, batch
    size and row budget.

Every kvoffload row runs interleaved op by op with its ceiling(s) (the direct
rows with ceilings of their own: the same plaintext object bytes as plain's).
The last table is issue 12's targets (printed, never asserted): every sealed
row (save at each durability, cold and warm load) >= 0.8x the best raw ceiling
of the same objects (the faster of one stream and min(streams, batch) streams)
and >= 1.2x LMCache's best unencrypted variant at equal durability (its
``put`` = our ``none``, its ``put+fsync`` = our ``object``); lookup of 64 keys
p99 < 0.15 ms and >= 200k keys/s per connection. ``--json`` holds them as
``targets``, ``lookup_targets`` and ``lmcache``.

Before it, "where the time goes" (``benchlib.cpu``): per kvoffload
row, the CPU seconds per GB of the sidecar (every thread) and of the client's
calls, and the cores they kept busy: a row with about every core busy is bound
by this machine's CPU. With ``--spy DIR`` py-spy samples the sidecar and this
process during every sealed row (raw stacks in DIR) and the table names the
frames where the samples fell; the rows' ``cpu`` and ``profiles`` in the JSON.

Usage::

    .venv/bin/python scripts/bench_sidecar.py                  # ~3 min on 2 cores
    .venv/bin/python scripts/bench_sidecar.py --quick          # seconds
    .venv/bin/python scripts/bench_sidecar.py --lmcache-python /path/.venv-lmcache/bin/python
    .venv/bin/python scripts/bench_sidecar.py --dir /mnt/nvme --json out.json
    .venv/bin/python scripts/bench_sidecar.py --quick --profile /tmp/prof   # cProfile both sides
    .venv/bin/python scripts/bench_sidecar.py --spy /tmp/spy   # py-spy: where each row's time goes

Nothing is left behind: sidecars are stopped and the temp dir removed on exit,
Ctrl-C and SIGTERM (and a sidecar dies with the benchmark even on SIGKILL).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import hashlib
import io
import json
import os
import pstats
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from benchlib.ceilings import (
    COLD_METHOD,
    Prepared,
    batched,
    batched_slots,
    direct_reader,
    direct_writer,
    fanned,
    prepare,
    raw_path,
    raw_reader,
    raw_writer,
    supports_o_direct,
)
from benchlib.chunks import (
    DEFAULT_DURABILITIES,
    DURABILITIES,
    NAMESPACE,
    MiB,
    Shape,
    chunk_key,
    make_shapes,
    mv,
    parse_durabilities,
    touched,
)
from benchlib.chunks import FORMATS as STORE_FORMATS
from benchlib.cpu import Profile, RowCpu, find_py_spy, leaf_frames, process_cpu_seconds, spied
from benchlib.events import bench_publisher, bench_saves, events_table
from benchlib.facts import git_state, machine_facts
from benchlib.lmcache import LMCACHE_HOWTO, LMCACHE_VENV, best_lmcache, run_lmcache_peer
from benchlib.method import Mincore, Timing, drop_cache, interleaved, loadavg, scratch_dir
from benchlib.results import Result, compare
from benchlib.sidecar import (
    DIRECT_TENANT,
    PLAIN_TENANT,
    SEALED_TENANT,
    TENANTS,
    Sidecar,
    run_sidecar,
    socket_echo,
)
from benchlib.tables import begin, cell, machine_table, warn_not_cold
from benchlib.targets import TARGET_CEIL, TARGET_PEER, Target, verdict
from kvoffload.client import SidecarClient
from kvoffload.client import direct as direct_io
from kvoffload.layouts import v1
from kvoffload.protocol import (
    Lookup,
    LookupReply,
    encode_frame,
    reply_message,
    request_message,
)
from kvoffload.store.config import default_io_streams

FORMATS = (*STORE_FORMATS, "direct")  # a direct object is a plaintext layout-v1 object
LOOKUP_KEYS = 64
TARGETS = {  # row name -> minimum x ceiling; printed next to the ratio, never asserted
    "save sealed": TARGET_CEIL,
    "load sealed cold": TARGET_CEIL,
    "load sealed warm": TARGET_CEIL,
    "load sealed direct cold": TARGET_CEIL,
    "load sealed direct warm": TARGET_CEIL,
}
#: The final target table's rows: (op, our row name, LMCache's row at each durability).
#: LMCache never fsyncs: its 'put' is our durability none, its 'put' + a timed fsync of its
#: files and directory ('put+fsync') our durability object; it has no 'batch'. Its gets do
#: not depend on durability: each of our loads (one sidecar per durability) meets the same.
FINAL_ROWS: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("save", "save sealed", {"none": "put", "object": "put+fsync"}),
    ("cold load", "load sealed cold", {d: "get cold" for d in DURABILITIES}),
    ("warm load", "load sealed warm", {d: "get warm" for d in DURABILITIES}),
    # Sealed direct reads (protocol §5.33): the worker decrypts the handed object itself.
    ("direct cold load", "load sealed direct cold", {d: "get cold" for d in DURABILITIES}),
    ("direct warm load", "load sealed direct warm", {d: "get warm" for d in DURABILITIES}),
)
#: Keys of the lookup-then-load rows: ``lookup`` + ``load`` (two round trips) against
#: ``lookup_load`` (one, protocol revision 15), of the same small present chunks.
FOLD_KEYS = 4
#: Issue 12's lookup targets: p99 < 0.15 ms and >= 200k keys/s per connection.
LOOKUP_TARGET_P99_US = 150.0
LOOKUP_TARGET_KEYS_PER_S = 200_000.0

METHOD = (
    "GB/s = payload bytes of the timed calls / sum of their wall times (1 GB = 1e9 B), after "
    "1 untimed warm-up call; one op = one save()/load() call of --batch chunks (and, for raw "
    "rows, the same chunks' object files); p50 = median latency of one op. Raw I/O rows are "
    "quoted in payload-equivalent GB/s, so x ceil is the ratio of times for the same objects; "
    "'file GB/s' counts object-file bytes. Each kvoffload row runs interleaved op by op with "
    "its ceilings (rotating which goes first). Client buffers are page-aligned mmaps."
)
SERIAL_BOUND = (
    "serial bound: 1 / sum(1/GB/s) of the raw I/O ceiling and the CPU stages the row must run "
    "one after the other (client and sidecar take turns): save sealed = client memcpy into "
    "staging + AES-GCM seal + write; save plain = memcpy + memcpy + XXH3 + write; load sealed = "
    "read + AES-GCM open + client memcpy out; load sealed direct = read + AES-GCM open (in the "
    "client, from the mapped page cache into the destination); load plain = read + memcpy + "
    "XXH3 + memcpy; "
    "save direct = XXH3 (client) + write + memcpy + XXH3 (the sidecar's re-read and check); "
    "load direct = read + XXH3 (client)."
)


# --------------------------------------------------------------------------- results


@dataclass
class Row(Result):
    """A throughput row (kvoffload or ceiling); ``payload_bytes`` is per op (a batch)."""

    chunks_per_op: int = 1
    method: str = ""
    target: float | None = None
    #: Of a load row's chunk hits, the share the sidecar served from its RAM
    #: tier (stats ``ram_tier.hits``), not from a file; None: not a load, or no tier.
    ram: float | None = None
    #: A kvoffload row's CPU seconds per GB, sidecar and client (benchlib.cpu.CpuSplit).
    cpu: dict[str, float] | None = None
    #: With --spy: where each process's samples fell during the row (sealed rows).
    profiles: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = super().to_json()
        d["meets_target"] = None if self.target is None else (self.ratio or 0) >= self.target
        return d


@dataclass
class Latency:
    kind: str  # "ceiling" | "kvoffload"
    name: str
    durability: str
    ops: int
    p50_us: float
    p99_us: float
    mean_us: float
    max_us: float
    ceiling: str | None = None
    ceiling_p50_us: float | None = None
    ceiling_p99_us: float | None = None
    target_p99_us: float | None = None
    #: Keys answered per second by one connection: keys per op / mean latency.
    keys_per_s: float | None = None
    target_keys_per_s: float | None = None

    @property
    def id(self) -> str:
        return f"{self.durability}/{self.name}"

    @classmethod
    def of(cls, kind: str, name: str, dur: str, lat: Sequence[float], keys: int = 0) -> Latency:
        a = np.asarray(lat, dtype=np.float64) * 1e6
        return cls(
            kind,
            name,
            dur,
            len(lat),
            float(np.percentile(a, 50)),
            float(np.percentile(a, 99)),
            float(a.mean()),
            float(a.max()),
            keys_per_s=keys / float(a.mean()) * 1e6 if keys else None,
        )

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["id"] = self.id
        if self.target_p99_us is not None:
            d["meets_target"] = self.p99_us < self.target_p99_us
        if self.target_keys_per_s is not None and self.keys_per_s is not None:
            d["meets_keys_target"] = self.keys_per_s >= self.target_keys_per_s
        return d


# --------------------------------------------------------------------------- per-shape data


# --------------------------------------------------------------------------- the run


@dataclass
class Bench:
    base: Path
    budget_s: float
    staging_bytes: int
    o_direct: bool
    lookups: int
    #: The sidecar's I/O streams; raw ceilings run with min(streams, batch) too.
    streams: int = 1
    results: list[Result] = field(default_factory=list)
    latencies: list[Latency] = field(default_factory=list)
    #: Issue 30: the sidecar's CPU µs per 1-key lookup, per durability.
    lookup_cpu_us: dict[str, float] = field(default_factory=dict)
    mincore: Mincore = field(default_factory=Mincore)
    progress: Callable[[str], None] = lambda _m: None
    #: --spy: py-spy's path and the directory of its recordings (sealed rows).
    spy_exe: str | None = None
    spy_dir: Path | None = None
    #: The client whose loads are sealed direct reads (protocol §5.33), per sidecar.
    sealed_direct: SidecarClient | None = None

    def add(self, r: Result) -> Result:
        self.results.append(r)
        self.progress(f"  {r.id:<46} {r.gbps:8.3f} GB/s  ({r.ops} ops)")
        return r

    def fan(self, batch: int) -> tuple[int, ThreadPoolExecutor | None]:
        """(streams of a raw ceiling beside the single-stream one, its pool); (1, None)
        when the sidecar runs a batch on one stream."""
        n = min(self.streams, batch)
        if n < 2:
            return 1, None
        return n, ThreadPoolExecutor(max_workers=n, thread_name_prefix="bench-raw")

    def add_cpu(self, data: Prepared) -> None:
        for r in data.cpu.values():
            self.add(r)

    @contextlib.contextmanager
    def observed(self, sc: Sidecar, fmt: str, stem: str) -> Iterator[tuple[RowCpu, list[Profile]]]:
        """The CPU of one row's kvoffload calls (wrap them with ``meter.wrap``) and,
        with --spy and a sealed row, py-spy of the sidecar and of this process; the
        profiles are in the list once the block has ended."""
        meter = RowCpu(sc.proc.pid)
        profiles: list[Profile] = []
        spies = spied(
            self.spy_exe if fmt == "sealed" else None,
            [("sidecar", sc.proc.pid), ("client", os.getpid())],
            self.spy_dir,
            stem,
        )
        with contextlib.ExitStack() as stack:
            for _name, spy in spies:
                stack.enter_context(spy)
            stack.enter_context(meter)
            yield meter, profiles
        for name, spy in spies:
            # This process also runs the raw ceilings: keep its calls into the client.
            only = "kvoffload/client/" if name == "client" else None
            profiles.append(Profile(name, str(spy.out), leaf_frames(spy.out, only=only)))

    @staticmethod
    def measured(row: Row, meter: RowCpu, profiles: Sequence[Profile], data: Prepared) -> Row:
        split = meter.split(data.batch * data.shape.payload)
        row.cpu = None if split is None else split.to_json()
        row.profiles = [p.to_json() for p in profiles]
        return row

    def write_methods(self, dur: str) -> tuple[str, str]:
        """(O_DIRECT method, buffered method) of a raw write at this durability."""
        if dur == "object":
            return "O_DIRECT+fsync", "buffered+fsync"
        return "O_DIRECT, no fsync", "buffered, no fsync"

    def run_durability(self, sc: Sidecar, dur: str, shapes: Sequence[Prepared]) -> None:
        with contextlib.ExitStack() as stack:
            clients = {
                fmt: stack.enter_context(
                    SidecarClient(
                        sc.socket,
                        tenant,
                        staging_bytes=self.staging_bytes,
                        timeout_s=120.0,
                        name=f"bench_sidecar {fmt}",
                        direct=fmt == "direct",
                    )
                )
                for fmt, tenant in TENANTS.items()
            }
            for fmt, c in clients.items():
                if c.salt is None or c.staging_bytes < self.staging_bytes:
                    raise RuntimeError(
                        f"client {fmt}: no session or a smaller staging buffer "
                        f"({c.staging_bytes} B):\n{sc.log_tail()}"
                    )
                # A correctness check, not a timing one: rows named direct must be direct.
                if c.uses_direct() != (fmt == "direct"):
                    raise RuntimeError(
                        f"client {fmt} (tenant {TENANTS[fmt]!r}): uses_direct() is "
                        f"{c.uses_direct()}, expected {fmt == 'direct'}: the sidecar does not "
                        f"offer the direct path as the policy says\n{sc.log_tail()}"
                    )
            # Loads of the sealed tenant as sealed direct reads (§5.33): rows of their own.
            self.sealed_direct = stack.enter_context(
                SidecarClient(
                    sc.socket,
                    TENANTS["sealed"],
                    staging_bytes=self.staging_bytes,
                    timeout_s=120.0,
                    name="bench_sidecar sealed direct",
                    sealed_direct=True,
                )
            )
            if not self.sealed_direct.uses_sealed_direct():
                raise RuntimeError(f"the sidecar offers no sealed_load:\n{sc.log_tail()}")
            for data in shapes:
                self.progress(f"{dur} / {data.shape.key}: {data.shape.describe()}")
                for fmt in FORMATS:
                    self._run(sc, dur, data, fmt, clients[fmt])
            self._lookup(sc, dur, shapes[-1], clients["sealed"])

    def _row(
        self,
        kind: str,
        name: str,
        data: Prepared,
        dur: str,
        fmt: str,
        timing: Timing,
        method: str,
        cached: float | None = None,
    ) -> Row:
        ops, wall, p50 = timing
        return Row(
            kind,
            name,
            data.shape.key,
            dur,
            ops,
            data.batch * data.shape.payload,
            data.batch * data.file_bytes(fmt),
            wall,
            p50 * 1e3,
            cached,
            chunks_per_op=data.batch,
            method=method,
        )

    def _run(self, sc: Sidecar, dur: str, data: Prepared, fmt: str, client: SidecarClient) -> None:
        shape, batch, budget = data.shape, data.batch, self.budget_s
        tenant = TENANTS[fmt]
        bdir = sc.work / f"raw-{fmt}-buffered"
        ddir = sc.work / f"raw-{fmt}-direct"
        dirs = [bdir, ddir]
        stack = contextlib.ExitStack()
        try:
            # -- save: raw write(s) and SidecarClient.save, interleaved op by op
            def save(i: int) -> None:
                chunks = [(chunk_key(shape, fmt, i * batch + j), data.layers) for j in range(batch)]
                ok = client.save(NAMESPACE, chunks)
                if not all(ok):
                    raise RuntimeError(
                        f"save {fmt}: {ok.count(False)} of {batch} chunks not stored\n"
                        + sc.log_tail()
                    )

            # (name, method, op); the row's ratio uses the fastest of them
            direct_m, buffered_m = self.write_methods(dur)
            buffered_w = batched(raw_writer(bdir, data.images[fmt], dur), batch)
            writers: list[tuple[str, str, Callable[[int], None]]] = []
            bdir.mkdir()
            if self.o_direct:
                ddir.mkdir()
                direct_w = direct_writer(ddir, data.images[fmt], data.padded[fmt], dur)
                writers.append((f"raw write {fmt}-obj", direct_m, batched(direct_w, batch)))
                writers.append((f"raw write buffered {fmt}-obj", buffered_m, buffered_w))
            else:
                writers.append((f"raw write {fmt}-obj", buffered_m, buffered_w))
            nstreams, pool = self.fan(batch)
            if pool is not None:
                stack.callback(pool.shutdown)
                pdir = sc.work / f"raw-{fmt}-streams"
                pdir.mkdir()
                dirs.append(pdir)
                if self.o_direct:
                    one: Callable[[int], None] = direct_writer(
                        pdir, data.images[fmt], data.padded[fmt], dur
                    )
                    method = direct_m
                else:
                    one, method = raw_writer(pdir, data.images[fmt], dur), buffered_m
                writers.append(
                    (
                        f"raw write {fmt}-obj x{nstreams}",
                        f"{method}, {nstreams} streams",
                        fanned([one] * batch, pool),
                    )
                )
            sc.fill_ram_tier(
                client, [(chunk_key(shape, f"{fmt}-fill", j), data.layers) for j in range(batch)]
            )
            stem = f"{dur}-{shape.key}-{fmt}"
            with self.observed(sc, fmt, f"{stem}-save") as (meter, profiles):
                timings = interleaved(
                    [w[2] for w in writers] + [meter.wrap(save)],
                    n=data.ops(3),
                    budget_s=budget,
                    min_ops=3,
                )
            os.sync()  # untimed: reads and the next rows start with no dirty pages
            ceils = [
                self.add(self._row("ceiling", name, data, dur, fmt, t, method))
                for (name, method, _op), t in zip(writers, timings, strict=False)
            ]
            row = self._row("kvoffload", f"save {fmt}", data, dur, fmt, timings[-1], "")
            self.measured(row, meter, profiles, data)
            self._finish(row, max(ceils, key=lambda c: c.gbps), data, fmt, "save")

            # -- load: cold, then warm; raw read(s) and SidecarClient.load, interleaved
            written = timings[-1][0] + 1  # the warm-up op wrote one more batch
            nfiles = written * batch
            bpaths = [raw_path(bdir, k) for k in range(nfiles)]
            dpaths = [raw_path(ddir, k) for k in range(nfiles)] if self.o_direct else []
            keys = [chunk_key(shape, fmt, k) for k in range(nfiles)]
            obj_paths = [sc.object_path(tenant, k) for k in keys]
            stride = v1.align_up(data.file_bytes(fmt), v1.ALIGN)
            rbuf = mv(touched(batch * stride))
            slots = [rbuf[j * stride : (j + 1) * stride] for j in range(batch)]
            buffered_r = batched_slots([raw_reader(bpaths, sl) for sl in slots])
            direct_r = batched_slots([direct_reader(dpaths, sl) for sl in slots])
            # The N-stream reads, each slot on its own thread: cold, of the files the
            # N-stream writer wrote (the others' are read by their own rows); warm,
            # of the buffered files, which the cold row leaves cached.
            fan_r: dict[str, tuple[str, Callable[[int], None], list[Path]]] = {}
            if pool is not None:
                ppaths = [raw_path(pdir, k) for k in range(nfiles)]
                read_one = direct_reader if self.o_direct else raw_reader
                fan_r["cold"] = (
                    "O_DIRECT read" if self.o_direct else "buffered read",
                    fanned([read_one(ppaths, sl) for sl in slots], pool),
                    ppaths,
                )
                fan_r["warm"] = (
                    "buffered read",
                    fanned([raw_reader(bpaths, sl) for sl in slots], pool),
                    bpaths,
                )

            payload = shape.payload
            dst_arr = touched(batch * payload)
            dst = mv(dst_arr)

            def into(idx: int, _key: bytes, layers: Sequence[memoryview]) -> None:
                at = idx * payload
                for v in layers:
                    n = v.nbytes
                    dst[at : at + n] = v
                    at += n

            lb = shape.layer_bytes
            dest_layers = [
                [
                    dst[j * payload + k * lb : j * payload + (k + 1) * lb]
                    for k in range(shape.layers)
                ]
                for j in range(batch)
            ]

            def dest_for(idx: int, _key: bytes, sizes: Sequence[int]) -> Sequence[memoryview]:
                if list(sizes) != [lb] * shape.layers:
                    raise RuntimeError(f"load {fmt}: layer sizes {list(sizes)} of a stored chunk")
                return dest_layers[idx]

            def load(i: int) -> None:
                ks = keys[i * batch : (i + 1) * batch]
                if fmt == "direct":  # the worker reads straight into the destinations
                    ok = client.load_to(ks, dest_for)
                else:
                    ok = [r.ok for r in client.load(ks, into=into)]
                if not all(ok):
                    raise RuntimeError(
                        f"load {fmt}: {ok.count(False)} of {batch} chunks missed\n{sc.log_tail()}"
                    )

            sealed_direct = self.sealed_direct

            def load_sealed_direct(i: int) -> None:  # decrypted straight into dest_for's views
                ks = keys[i * batch : (i + 1) * batch]
                ok = sealed_direct.load_to(ks, dest_for)
                if not all(ok):
                    raise RuntimeError(
                        f"load {fmt} direct: {ok.count(False)} of {batch} chunks missed\n"
                        + sc.log_tail()
                    )

            variants = [("", load)]
            if fmt == "sealed" and sealed_direct is not None:
                variants.append((" direct", load_sealed_direct))
            n = written - 1
            caches = ("cold", "warm") if fmt != "direct" else ("cold",)
            for suffix, load_op, cache in [(v, op, c) for v, op in variants for c in caches]:
                readers: list[tuple[str, str, Callable[[int], None], list[Path]]] = []
                if cache == "cold":
                    extra = fan_r["cold"][2] if "cold" in fan_r else []
                    drop_cache(bpaths + dpaths + extra + sc.object_files())
                    sc.drop_ram_tier()
                    if self.o_direct:
                        readers.append(
                            (f"raw read cold {fmt}-obj", "O_DIRECT read", direct_r, dpaths)
                        )
                        readers.append(
                            (
                                f"raw read cold buffered {fmt}-obj",
                                "buffered read",
                                buffered_r,
                                bpaths,
                            )
                        )
                    else:
                        readers.append(
                            (f"raw read cold {fmt}-obj", "buffered read", buffered_r, bpaths)
                        )
                else:
                    readers.append(
                        (f"raw read warm {fmt}-obj", "buffered read", buffered_r, bpaths)
                    )
                if cache in fan_r:
                    method, op, paths = fan_r[cache]
                    readers.append(
                        (
                            f"raw read {cache} {fmt}-obj x{nstreams}",
                            f"{method}, {nstreams} streams",
                            op,
                            paths,
                        )
                    )
                cached = [self.mincore.resident(r[3][batch : (n + 1) * batch]) for r in readers]
                obj_cached = self.mincore.resident(obj_paths[batch : (n + 1) * batch])
                hits0 = sc.ram_and_store_hits()
                with self.observed(sc, fmt, f"{stem}{suffix.strip()}-{cache}") as (
                    meter,
                    profiles,
                ):
                    timings = interleaved(
                        [r[2] for r in readers] + [meter.wrap(load_op)],
                        n=n,
                        budget_s=budget,
                        min_ops=min(3, n),
                    )
                hits1 = sc.ram_and_store_hits()
                n = min(n, *(t[0] for t in timings))  # warm rows read only what cold rows read
                ceils = [
                    self.add(self._row("ceiling", name, data, dur, fmt, t, method, c))
                    for (name, method, _op, _p), t, c in zip(readers, timings, cached, strict=False)
                ]
                row = self._row(
                    "kvoffload",
                    f"load {fmt}{suffix} {cache}",
                    data,
                    dur,
                    fmt,
                    timings[-1],
                    "",
                    obj_cached,
                )
                if hits0 is not None and hits1 is not None and hits1[1] > hits0[1]:
                    row.ram = (hits1[0] - hits0[0]) / (hits1[1] - hits0[1])
                self.measured(row, meter, profiles, data)
                self._finish(row, max(ceils, key=lambda c: c.gbps), data, fmt, "load")
            expect = np.tile(data.payload, batch)
            if not np.array_equal(dst_arr[: batch * payload], expect):
                raise AssertionError(f"load {fmt}: the bytes loaded differ from the bytes saved")
        finally:
            stack.close()
            for d in dirs:
                shutil.rmtree(d, ignore_errors=True)

    def _finish(self, row: Row, ceil: Result, data: Prepared, fmt: str, op: str) -> None:
        cpu = data.cpu
        if fmt == "direct":  # no staging copy in the client; the sidecar re-reads on save
            xxh = cpu["xxh3-128"]
            stages = [xxh, cpu["memcpy"], xxh] if op == "save" else [xxh]
        elif op == "save":
            stages = [cpu["memcpy"]] + (
                [cpu["aes-gcm encrypt_into"]]
                if fmt == "sealed"
                else [cpu["memcpy"], cpu["xxh3-128"]]
            )
        elif row.name.startswith("load sealed direct"):  # decrypted into the destination
            stages = [cpu["aes-gcm decrypt_into"]]
        else:
            stages = (
                [cpu["aes-gcm decrypt_into"]]
                if fmt == "sealed"
                else [cpu["memcpy"], cpu["xxh3-128"]]
            ) + [cpu["memcpy"]]
        compare(row, ceil, stages)
        row.target = next((t for p, t in TARGETS.items() if row.name == p), None)
        self.add(row)

    def _lookup(self, sc: Sidecar, dur: str, data: Prepared, client: SidecarClient) -> None:
        """Lookups of 64 (and of 1) present keys, interleaved with a socket round trip of
        the 64-key request's size."""
        keys = [
            hashlib.blake2b(f"lookup/{i}".encode(), digest_size=32).digest()
            for i in range(LOOKUP_KEYS)
        ]
        ok = client.save(NAMESPACE, [(k, data.layers) for k in keys])
        if not all(ok):
            raise RuntimeError(f"lookup keys not stored ({data.shape.key})\n{sc.log_tail()}")
        req = len(encode_frame(request_message(1 << 20, Lookup(SEALED_TENANT, tuple(keys)))))
        rep = len(encode_frame(reply_message(1 << 20, LookupReply(LOOKUP_KEYS))))
        lat: dict[str, list[float]] = {"echo": [], "64": [], "1": [], "two": [], "fold": []}

        def lookup(which: str, ks: list[bytes]) -> Callable[[int], None]:
            out = lat[which]

            def op(_i: int) -> None:
                s = time.perf_counter()
                found = client.lookup(ks)
                out.append(time.perf_counter() - s)
                if found != len(ks):
                    raise RuntimeError(f"lookup found {found} of {len(ks)}\n{sc.log_tail()}")

            return op

        batch = keys[:FOLD_KEYS]

        def drop(_i: int, _k: bytes, _v: object) -> None:
            pass

        def then_load(_i: int) -> None:  # lookup, then load what it found: 2 round trips
            s = time.perf_counter()
            found = client.lookup(batch)
            got = client.load(batch[:found], into=drop)
            lat["two"].append(time.perf_counter() - s)
            if found != len(batch) or not all(r.ok for r in got):
                raise RuntimeError(f"lookup+load found {found} of {len(batch)}\n{sc.log_tail()}")

        def folded(_i: int) -> None:  # lookup_load (revision 15, §5.32): 1 round trip
            s = time.perf_counter()
            found, got = client.lookup_load(batch, into=drop)
            lat["fold"].append(time.perf_counter() - s)
            if found != len(batch) or not all(r.ok for r in got):
                raise RuntimeError(f"lookup_load found {found} of {len(batch)}\n{sc.log_tail()}")

        with socket_echo(req, rep) as echo_op:

            def echo(_i: int) -> None:
                s = time.perf_counter()
                echo_op(0)
                lat["echo"].append(time.perf_counter() - s)

            interleaved(
                [echo, lookup("64", keys), lookup("1", keys[:1])],
                n=self.lookups,
                budget_s=1e9,
                min_ops=self.lookups,
            )
            # A loop of their own: a load's work (and its deferred complete)
            # must not land in the lookup rows above.
            interleaved([then_load, folded], n=self.lookups, budget_s=1e9, min_ops=self.lookups)
        # Issue 30: the sidecar's CPU (every thread) per 1-key lookup, over a loop of
        # nothing else (the interleaved rows above mix in the other ops' CPU).
        one = keys[:1]
        cpu0 = process_cpu_seconds(sc.proc.pid)
        for _ in range(self.lookups):
            client.lookup(one)
        cpu_us = (process_cpu_seconds(sc.proc.pid) - cpu0) / self.lookups * 1e6
        self.lookup_cpu_us[dur] = cpu_us
        self.progress(f"  {dur}/sidecar CPU per 1-key lookup {cpu_us:7.1f} us (goal <= 25)")
        # interleaved() ran one untimed warm-up op of each: drop it.
        ceil = Latency.of("ceiling", f"unix socket round trip {req}+{rep} B", dur, lat["echo"][1:])
        rows = [
            Latency.of("kvoffload", f"lookup {LOOKUP_KEYS} keys", dur, lat["64"][1:], LOOKUP_KEYS),
            Latency.of("kvoffload", "lookup 1 key", dur, lat["1"][1:], 1),
            Latency.of(
                "kvoffload", f"lookup+load {FOLD_KEYS} keys", dur, lat["two"][1:], FOLD_KEYS
            ),
            Latency.of(
                "kvoffload", f"lookup_load {FOLD_KEYS} keys", dur, lat["fold"][1:], FOLD_KEYS
            ),
        ]
        rows[0].target_p99_us = LOOKUP_TARGET_P99_US
        rows[0].target_keys_per_s = LOOKUP_TARGET_KEYS_PER_S
        for r in rows:
            r.ceiling = ceil.name
            r.ceiling_p50_us, r.ceiling_p99_us = ceil.p50_us, ceil.p99_us
        for r in (ceil, *rows):
            self.latencies.append(r)
            kps = f"  {r.keys_per_s:9.0f} keys/s" if r.keys_per_s else ""
            self.progress(f"  {r.id:<46} p50 {r.p50_us:7.1f} us  p99 {r.p99_us:7.1f} us{kps}")


# --------------------------------------------------------------------------- targets


@dataclass
class FinalRow:
    """A row of the final target table: a sealed row through the sidecar against the best
    raw ceiling of the very same objects (one stream or min(streams, batch) streams, the
    faster) and against LMCache's best unencrypted variant at equal durability."""

    shape: str
    op: str  # "save" | "cold load" | "warm load"
    durability: str
    vs_ceiling: Target
    vs_lmcache: Target | None  # None: not compared, ``note`` says why
    note: str = ""

    @property
    def id(self) -> str:
        return f"{self.shape}/{self.durability}/{self.op}"

    def to_json(self) -> dict[str, Any]:
        c, p = self.vs_ceiling, self.vs_lmcache
        return {
            "id": self.id,
            "shape": self.shape,
            "op": self.op,
            "durability": self.durability,
            "ours": c.ours.id if c.ours else None,
            "ours_gbps": c.ours.gbps if c.ours else None,
            "ceiling": c.theirs_name,
            "ceiling_gbps": c.theirs_gbps,
            "x_ceiling": c.ratio,
            "ceiling_target": c.target,
            "meets_ceiling": c.met,
            "lmcache": p.theirs_name if p else None,
            "lmcache_gbps": p.theirs_gbps if p else None,
            "lmcache_x_its_ceiling": p.theirs_ratio if p else None,
            "x_lmcache": p.ratio if p else None,
            "lmcache_target": TARGET_PEER,
            "meets_lmcache": p.met if p else None,
            "lmcache_note": self.note,
        }


@dataclass
class LookupTarget:
    """Issue 12's lookup targets, for one sidecar (durability): p99 of a 64-key lookup
    below 150 us, and at least 200k keys/s answered by one connection."""

    durability: str
    metric: str  # "p99" | "keys/s"
    value: float
    target: float
    ceiling: str  # what one connection could do at best, for context
    ceiling_value: float | None

    @property
    def met(self) -> bool:
        return self.value < self.target if self.metric == "p99" else self.value >= self.target

    @property
    def id(self) -> str:
        return f"{self.durability}/lookup {LOOKUP_KEYS} keys {self.metric}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"id": self.id, "met": self.met}


def _peer_mismatch(peer: dict[str, Any], shape: Shape, batch: int) -> str:
    """Why LMCache's rows of ``shape`` are not comparable with ours ("" when they are):
    another chunk (layers x layer bytes) or another batch size."""
    theirs = next(
        (s for s in peer.get("config", {}).get("shapes", []) if s["key"] == shape.key), None
    )
    if theirs is None:
        return f"LMCache ran no {shape.key} chunk"
    if (theirs["layers"], theirs["layer_bytes"]) != (shape.layers, shape.layer_bytes):
        return (
            f"not compared: LMCache's {shape.key} chunk is {theirs['layers']} x "
            f"{theirs['layer_bytes']} B, ours {shape.layers} x {shape.layer_bytes} B"
        )
    if theirs["batch"] != batch:
        return f"not compared: LMCache's batches are {theirs['batch']} chunks, ours {batch}"
    return ""


def final_targets(
    results: Sequence[Result],
    latencies: Sequence[Latency],
    peer: dict[str, Any] | None,
    shapes: Sequence[Shape],
    durabilities: Sequence[str],
    batch: int,
) -> tuple[list[FinalRow], list[LookupTarget]]:
    """Issue 12's final table: every sealed row against its best raw ceiling and against
    LMCache's best variant (the fastest of buffered and O_DIRECT; its disk_io_threads as it
    ran) at equal durability; and the lookup targets."""
    ceilings = {(r.shape, r.durability, r.name): r for r in results if r.kind == "ceiling"}
    rows: list[FinalRow] = []
    for shape in shapes:
        mismatch = _peer_mismatch(peer, shape, batch) if peer is not None else ""
        for op, name, lm_rows in FINAL_ROWS:
            for dur in durabilities:
                ours = next(
                    (
                        r
                        for r in results
                        if r.kind == "kvoffload"
                        and (r.shape, r.durability, r.name) == (shape.key, dur, name)
                    ),
                    None,
                )
                ceil = ceilings.get((shape.key, dur, ours.ceiling or "")) if ours else None
                ceil_name = "-"
                if ceil is not None:
                    method = ceil.method if isinstance(ceil, Row) else ""
                    ceil_name = f"{ceil.name} ({method})" if method else ceil.name
                vs_ceiling = Target(
                    shape.key, op, dur, ours, ceil_name, ours.ceiling_gbps if ours else None,
                    None, TARGET_CEIL,
                )  # fmt: skip
                vs_lm: Target | None = None
                lm = lm_rows.get(dur)
                if peer is None:
                    note = "LMCache not run (see its status line)"
                elif lm is None:
                    note = f"LMCache has no durability {dur!r}"
                elif mismatch:
                    note = mismatch
                elif (best := best_lmcache(peer, shape.key, lm)) is None:
                    note = f"LMCache ran no {lm!r} row"
                else:
                    note = ""
                    vs_lm = Target(
                        shape.key, op, dur, ours, f"{best['variant']} {lm}", float(best["gbps"]),
                        best.get("ratio"), TARGET_PEER,
                    )  # fmt: skip
                rows.append(FinalRow(shape.key, op, dur, vs_ceiling, vs_lm, note))
    lookups: list[LookupTarget] = []
    for lt in latencies:
        if lt.kind != "kvoffload" or lt.name != f"lookup {LOOKUP_KEYS} keys":
            continue
        lookups.append(
            LookupTarget(lt.durability, "p99", lt.p99_us, LOOKUP_TARGET_P99_US,
                         "socket round trip p99", lt.ceiling_p99_us)
        )  # fmt: skip
        per_rt = LOOKUP_KEYS / lt.ceiling_p50_us * 1e6 if lt.ceiling_p50_us else None
        lookups.append(
            LookupTarget(lt.durability, "keys/s", lt.keys_per_s or 0.0, LOOKUP_TARGET_KEYS_PER_S,
                         f"{LOOKUP_KEYS} keys / socket round trip p50", per_rt)
        )  # fmt: skip
    return rows, lookups


def _k(x: float | None) -> float | None:
    return None if x is None else x / 1e3


def _short_ceiling(name: str) -> str:
    """'raw write sealed-obj x4 (O_DIRECT+fsync, 4 streams)' -> 'write O_DIRECT+fsync, 4
    streams' ('raw read ... (O_DIRECT read)' -> 'O_DIRECT read'): every ceiling of the
    table moves the sealed objects of its own row."""
    if " (" not in name:
        return name
    head, method = name.split(" (", 1)
    method = method.removesuffix(")")
    return f"write {method}" if head.startswith("raw write") else method


def render_targets(
    console: Console,
    rows: Sequence[FinalRow],
    lookups: Sequence[LookupTarget],
    shapes: Sequence[Shape],
    batch: int,
    streams: int,
    peer_status: str,
    peer: dict[str, Any] | None,
) -> None:
    """The final table: one line per sealed row and per lookup target, each with its verdicts."""
    sizes = "; ".join(f"{s.key} {s.describe()}" for s in shapes)
    t = Table(
        title=f"issue 12 targets: kvoffload sealed (AES-256-GCM) through the sidecar, batches of "
        f"{batch}, vs the best raw ceiling of the same objects (1 or {min(streams, batch)} "
        f"streams) >= {TARGET_CEIL:.1f}x, and vs LMCache's best unencrypted variant at equal "
        f"durability >= {TARGET_PEER:.1f}x; the same payloads and batches both sides ({sizes})"
    )
    left = ("shape", "row", "dur", "kvoffload", "best raw ceiling")
    for col in (*left, "ceiling", "x ceil", "target", "verdict"):
        t.add_column(col, justify="left" if col in left else "right")
    for col in ("LMCache best", "LMCache", "x LMCache", "target ", "verdict "):
        t.add_column(col, justify="left" if col == "LMCache best" else "right")
    for r in rows:
        c, p = r.vs_ceiling, r.vs_lmcache
        t.add_row(
            r.shape, r.op, r.durability, cell(c.ours.gbps if c.ours else None, "{:.3f} GB/s"),
            escape(_short_ceiling(c.theirs_name)), cell(c.theirs_gbps), cell(c.ratio, "{:.2f}x"),
            f">= {c.target:.1f}x", verdict(c),
            escape(p.theirs_name) if p else f"[dim]{escape(r.note)}[/dim]",
            cell(p.theirs_gbps if p else None), cell(p.ratio if p else None, "{:.2f}x"),
            f">= {TARGET_PEER:.1f}x", verdict(p) if p else "-",
        )  # fmt: skip
    for lk in lookups:
        us = lk.metric == "p99"
        t.add_row(
            "-", f"lookup {LOOKUP_KEYS} keys {lk.metric}", lk.durability,
            f"{lk.value:.1f} us" if us else f"{lk.value / 1e3:.0f}k keys/s",
            escape(lk.ceiling),
            cell(lk.ceiling_value, "{:.1f} us") if us else cell(_k(lk.ceiling_value), "{:.0f}k"),
            "-",
            f"< {lk.target:.0f} us" if us else f">= {lk.target / 1e3:.0f}k",
            "[green]meets[/green]" if lk.met else "[red]below[/red]",
            "[dim]- (in-process index)[/dim]", "-", "-", "", "",
        )  # fmt: skip
    console.print(t)
    console.print(f"[bold]LMCache peer[/bold]: {escape(peer_status)}")
    if peer is not None:
        m = peer.get("machine", {})
        console.print(
            f"[bold]LMCache[/bold]: {escape(str(m.get('lmcache', '?')))} LocalDiskBackend "
            f"(scripts/lmcache_peer.py, its own venv, its own process), disk_io_threads "
            f"{escape(str(m.get('lmcache disk_io_threads', '?')))}; best variant = the faster "
            "of buffered (its default) and O_DIRECT (use_odirect) per row. Its 'put' (page "
            "cache, it never fsyncs) meets our durability none, its 'put+fsync' (fsync of its "
            "files and directory after the batch, timed) our durability object; its gets meet "
            "our loads at every durability. It ran after the sidecar rows, not interleaved with "
            "them: on a shared machine the load averages above say how comparable the two are."
        )
        for note in peer.get("notes", []):
            console.print(f"[bold]LMCache[/bold]: {escape(note)}")


def _frames(profiles: Sequence[dict[str, Any]], process: str, top: int) -> str:
    prof = next((p for p in profiles if p["process"] == process), None)
    if prof is None:
        return "-"
    if not prof["samples"]:
        return "no samples"
    head = f"{prof['samples']} samples, {prof['waiting']:.0%} waiting; of the rest:"
    return "\n".join([head, *(f"{f['share']:.0%} {f['frame']}" for f in prof["top"][:top])])


def render_cpu(console: Console, results: Sequence[Result], frames: bool) -> None:
    """Where each kvoffload row's time goes: CPU seconds per GB of the sidecar
    (every thread) and of the client's calls, the cores they kept busy, and with
    --spy the frames where the samples of each process fell (sealed rows)."""
    rows = [r for r in results if isinstance(r, Row) and r.kind == "kvoffload" and r.cpu]
    if not rows:
        return
    cores = os.cpu_count() or 1
    t = Table(
        title=f"where the time goes: CPU seconds per GB of payload of each row's calls "
        f"(sidecar: every thread; client: the calling thread), cores busy of {cores}, and "
        f"the GB/s that CPU work allows spread over all {cores} cores"
    )
    for col in ("shape", "row", "dur", "GB/s", "wall s/GB", "sidecar CPU s/GB",
                "client CPU s/GB", "cores busy", "CPU-bound GB/s"):  # fmt: skip
        t.add_column(col, justify="left" if col in ("shape", "row", "dur") else "right")
    if frames:
        t.add_column("sidecar: where its samples fell")
        t.add_column("client: where its samples fell")
    for r in rows:
        c = r.cpu or {}
        cells = [
            r.shape, r.name, r.durability or "-", f"{r.gbps:.3f}",
            f"{c['wall_s_per_gb']:.3f}", f"{c['sidecar_cpu_s_per_gb']:.3f}",
            f"{c['client_cpu_s_per_gb']:.3f}", f"{c['cores_busy']:.2f}",
            f"{c['cpu_bound_gbps']:.3f}",
        ]  # fmt: skip
        if frames:
            cells += [escape(_frames(r.profiles, "sidecar", 4)),
                      escape(_frames(r.profiles, "client", 3))]  # fmt: skip
        t.add_row(*cells)
    console.print(t)
    console.print(
        "cpu: the sidecar's CPU is its process CPU-time clock over the whole row (every "
        "thread; it idles while the raw ceilings run), the client's time.thread_time() around "
        "each call; "
        "both per GB of the calls' payload, the untimed warm-up call included. Cores busy near "
        f"{cores} means the row is bound by this machine's CPU: no I/O lever makes it faster. "
        "Frames (--spy): py-spy --nonblocking (idle threads not sampled), the leaf frame of "
        "each sample; waiting = the event loop's poll, an idle pool thread, the client "
        "waiting for its reply; the frames' shares are of the other samples, the process's "
        "work; a line calling native code (AES-GCM, preadv) stands for that code."
    )


# --------------------------------------------------------------------------- output


def _cached(r: Row) -> str:
    text = cell(r.cached, "{:.0%}")
    return text if r.ram is None else f"{text}, ram {r.ram:.0%}"


def _target(r: Row) -> str:
    if r.target is None:
        return ""
    ok = (r.ratio or 0) >= r.target
    return f"[{'green' if ok else 'red'}]>= {r.target:.1f}x {'ok' if ok else 'MISS'}[/]"


def render(
    console: Console,
    facts: dict[str, str],
    shapes: Sequence[Shape],
    results: Sequence[Result],
    latencies: Sequence[Latency],
) -> None:
    console.print(machine_table(facts, [s.fact() for s in shapes]))

    t = Table(title="ceilings (same run, same directory)")
    cols: tuple[str, ...] = (
        "shape",
        "dur",
        "ceiling",
        "method",
        "ops",
        "MiB",
        "GB/s",
        "file GB/s",
        "p50 ms",
    )
    for col in (*cols, "cached"):
        t.add_column(col, justify="left" if col in cols[:4] else "right")
    for r in results:
        if r.kind == "ceiling":
            method = r.method if isinstance(r, Row) else "1 thread, per layer"
            if r.name == "memcpy":
                method = "numpy copyto, whole chunk"
            t.add_row(
                r.shape,
                r.durability or "",
                r.name,
                method,
                str(r.ops),
                f"{r.ops * r.payload_bytes / MiB:.1f}",
                f"{r.gbps:.3f}",
                cell(r.file_gbps),
                f"{r.p50_ms:.3f}",
                cell(r.cached, "{:.0%}"),
            )
    console.print(t)

    t = Table(title="kvoffload sidecar: SidecarClient in this process -> sidecar process")
    cols = ("shape", "dur", "row", "ops", "MiB", "GB/s", "p50 ms", "cached", "ceiling")
    for col in (*cols, "ceil GB/s", "x ceil", "target", "serial bound", "x bound"):
        t.add_column(col, justify="left" if col in ("shape", "dur", "row", "ceiling") else "right")
    for r in results:
        if r.kind == "kvoffload" and isinstance(r, Row):
            t.add_row(
                r.shape,
                r.durability or "",
                r.name,
                str(r.ops),
                f"{r.ops * r.payload_bytes / MiB:.1f}",
                f"{r.gbps:.3f}",
                f"{r.p50_ms:.3f}",
                _cached(r),
                r.ceiling or "",
                cell(r.ceiling_gbps),
                cell(r.ratio, "{:.2f}"),
                _target(r),
                cell(r.bound_gbps),
                cell(r.ratio_to_bound, "{:.2f}"),
            )
    console.print(t)

    t = Table(title="latency (64 present keys per lookup; us)")
    cols = ("dur", "row", "ops", "p50", "p99", "mean", "max", "keys/s", "ceil p50", "ceil p99")
    for col in (*cols, "target p99", "target keys/s"):
        t.add_column(col, justify="left" if col in ("dur", "row") else "right")
    for lt in latencies:
        target = ""
        if lt.target_p99_us is not None:
            ok = lt.p99_us < lt.target_p99_us
            target = (
                f"[{'green' if ok else 'red'}]< {lt.target_p99_us:.0f} {'ok' if ok else 'MISS'}[/]"
            )
        kt = ""
        if lt.target_keys_per_s is not None and lt.keys_per_s is not None:
            ok = lt.keys_per_s >= lt.target_keys_per_s
            mark = "green]>=" if ok else "red]>="
            kt = f"[{mark} {lt.target_keys_per_s:.0f} {'ok' if ok else 'MISS'}[/]"
        t.add_row(
            lt.durability,
            escape(lt.name),
            str(lt.ops),
            f"{lt.p50_us:.1f}",
            f"{lt.p99_us:.1f}",
            f"{lt.mean_us:.1f}",
            f"{lt.max_us:.1f}",
            cell(lt.keys_per_s, "{:.0f}"),
            cell(lt.ceiling_p50_us, "{:.1f}"),
            cell(lt.ceiling_p99_us, "{:.1f}"),
            target,
            kt,
        )
    console.print(t)
    console.print(f"[bold]method[/bold]: {METHOD}")
    console.print(f"[bold]{SERIAL_BOUND.split(':')[0]}[/bold]:{SERIAL_BOUND.split(':', 1)[1]}")
    console.print(f"[bold]cold reads[/bold]: {COLD_METHOD}")
    console.print(
        "[bold]raw I/O[/bold]: 'raw write' and 'raw read cold' use O_DIRECT when the file "
        "system takes it (writes: open O_EXCL, the 4 KiB-padded image, ftruncate to the exact "
        "size, close, rename; + fsync and fsync(dir) at durability object), else buffered; the "
        "'buffered' rows beside them run the same through the page cache. Each kvoffload row's "
        "x ceil is to the faster of the two (its 'ceiling' column names it). 'raw read warm' is "
        "a buffered read of files the cold row just read. At durability none nothing is "
        "fsync'd; os.sync() runs untimed after every write row."
    )
    console.print(
        f"[bold]direct[/bold]: tenant {DIRECT_TENANT!r} (encryption = none, direct = true) "
        "through SidecarClient(direct=True): lease_store, the client writes the leased files "
        "itself (kvoffload.client.direct), complete_store (the sidecar re-reads, verifies, "
        "fsyncs per "
        "durability and names them); loads are lease_load + load_to straight into the "
        "destination buffer (the client reads and checks each layer) + complete_load. No "
        "staging buffer; its raw ceilings move the same plaintext object bytes as plain's."
    )
    console.print(
        "[bold]lookup[/bold]: SidecarClient.lookup of 64 present keys, one call per op, "
        "interleaved with a round trip of a message of the same size (request and reply "
        "frames) between this process and a Python echo process over a Unix socket pair."
    )
    console.print(
        "[bold]cached[/bold] (sidecar rows): the share of the row's object files in the page "
        "cache before it ran; 'ram N%': the share of its chunks the sidecar served from its "
        "RAM tier (sealed images of large objects, [store] ram_cache), emptied before each "
        "cold row with drop_cache as the page cache is with DONTNEED."
    )
    uncached = [
        r
        for r in results
        if r.kind == "kvoffload"
        and "warm" in r.name
        and r.cached is not None
        and r.cached + (getattr(r, "ram", None) or 0) < 0.5
    ]
    if uncached:
        console.print(
            f"[bold]warm loads[/bold]: {len(uncached)} warm rows found the sidecar's object "
            "files mostly neither in the page cache nor in its RAM tier after the cold row read "
            "them (O_DIRECT reads; a tier too small or off: see 'sidecar (...) reports' above), "
            "so those warm loads are cold loads."
        )
    warn_not_cold(console, results)


def print_profile(console: Console, path: Path, top: int) -> None:
    if not path.exists():
        console.print(f"[bold]profile[/bold] {path}: not written")
        return
    s = io.StringIO()
    pstats.Stats(str(path), stream=s).sort_stats("tottime").print_stats(top)
    lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    console.print(f"[bold]profile {escape(str(path))}[/bold] (top {top} by own time)")
    console.print(escape("\n".join(lines[max(0, start - 1) :])), highlight=False)


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
    p.add_argument(
        "--events",
        action="store_true",
        help="also the KV-event rows: save throughput with events on vs off (32 MiB chunks, "
        "same run) and the batches/s the publisher sustains (scripts/bench_events.py)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument(
        "--shapes", default="large,small", help="comma-separated: large, small (default both)"
    )
    p.add_argument(
        "--io",
        default=None,
        help="KVOFFLOAD_IO for the sidecar (default: unset, the sidecar's own default)",
    )
    p.add_argument("--batch", type=int, default=4, help="chunks per save()/load() call")
    p.add_argument(
        "--streams",
        type=int,
        default=default_io_streams(),
        help="the sidecar's [store] io_streams, and the raw ceilings' streams "
        "(min(streams, batch)); default: the sidecar's default here",
    )
    p.add_argument(
        "--ram-cache",
        default=None,
        help="the sidecar's [store] ram_cache (a size, auto or 0); default: the sidecar's",
    )
    p.add_argument("--staging-mib", type=int, default=256, help="client staging buffer, MiB")
    p.add_argument(
        "--large-mib-per-row", type=int, default=1024, help="payload MiB per large-chunk row"
    )
    p.add_argument("--small-ops", type=int, default=1024, help="chunks per small-chunk row")
    p.add_argument("--lookups", type=int, default=None, help="timed lookups (default 2000)")
    p.add_argument(
        "--row-budget-s",
        type=float,
        default=None,
        help="stop a row after this many seconds of its ops (>= 3 ops); default 1.5 (quick: 0.2)",
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="cProfile the sidecar (every thread) and this client into this dir; slows all rows",
    )
    p.add_argument(
        "--spy",
        type=Path,
        default=None,
        help="record py-spy of the sidecar and this client during every sealed row into "
        "this dir and print where the samples fell (needs py-spy: pip install py-spy)",
    )
    p.add_argument(
        "--no-lmcache", action="store_true", help="skip the LMCache peer (its target columns)"
    )
    p.add_argument(
        "--lmcache-python",
        type=Path,
        default=LMCACHE_VENV / "bin" / "python",
        help="the LMCache venv's python (default: .venv-lmcache/bin/python of this checkout)",
    )
    a = p.parse_args(argv)
    a.durability = parse_durabilities(p, a.durability, DEFAULT_DURABILITIES)
    a.shapes = [x.strip() for x in a.shapes.split(",") if x.strip()]
    if not a.shapes or any(x not in ("large", "small") for x in a.shapes):
        p.error("--shapes: a comma-separated list of large, small")
    if a.batch < 1:
        p.error("--batch must be at least 1")
    if a.streams < 1:
        p.error("--streams must be at least 1")
    if a.row_budget_s is None:
        a.row_budget_s = 0.2 if a.quick else 1.5
    if a.lookups is None:
        a.lookups = 200 if a.quick else 2000
    return a


def _fit_to_disk(shapes: list[Shape], d: Path, batch: int) -> list[Shape]:
    """Shrink the large rows if the file system cannot hold one durability's files."""
    free = shutil.disk_usage(d).free
    fitted: list[Shape] = []
    # every format's store objects stay until the sidecar stops; one format's raw files
    # (buffered + O_DIRECT) at a time: for the timed ops and the warm-up op
    files = len(FORMATS) + 2
    for s in shapes:
        per_chunk = v1.object_size([s.layer_bytes] * s.layers, True)
        need = files * (max(3 * batch, s.chunks) + batch) * per_chunk + LOOKUP_KEYS * per_chunk
        if need > free // 2:
            s = s.shrunk(max(3 * batch, (free // 2) // (files * per_chunk) - 2 * batch))
        fitted.append(s)
    return fitted


def _events_rows(console: Console, quick: bool) -> dict[str, float]:
    """The KV-event rows (issue bound: events cost at most 5 % of saves of 32 MiB)."""
    chunk_mib, chunks, batches = (2, 4, 2000) if quick else (32, 16, 20_000)
    saves = bench_saves(chunk_mib, chunks, 16)
    pub = bench_publisher(batches, 16)
    title = f"KV events (same run; {chunk_mib} MiB chunks, 16 engine blocks each)"
    t, cost = events_table(title, "save", "events' cost on saves", "<= 5 %", saves, pub)
    console.print(t)
    return {
        "save_off_bps": saves["off"],
        "save_on_bps": saves["on"],
        "cost_pct": cost,
        "publisher_durable_bps": pub["index"],
        "publisher_memory_bps": pub["memory"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    console, err, parent = begin(args.dir, 200)
    if parent is None:
        return 2
    if args.profile is not None:
        args.profile = args.profile.resolve()
        args.profile.mkdir(parents=True, exist_ok=True)
    spy_exe = None
    if args.spy is not None:
        spy_exe = find_py_spy()
        if spy_exe is None:
            err.print("--spy: py-spy is not installed here (pip install py-spy)")
            return 2
        args.spy = args.spy.resolve()
        try:
            args.spy.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            err.print(f"--spy {args.spy}: {exc.strerror or exc}")
            return 2
    shapes = [
        s
        for s in make_shapes(args.quick, args.large_mib_per_row, args.small_ops)
        if s.key in args.shapes
    ]
    staging = args.staging_mib * MiB
    too_big = [s for s in shapes if args.batch * s.payload > staging]
    if too_big:
        err.print(
            f"--staging-mib {args.staging_mib} cannot hold a batch of {args.batch} "
            f"{too_big[0].key} chunks ({args.batch * too_big[0].payload // MiB} MiB)"
        )
        return 2
    pids: list[int] = []
    client_prof = None
    try:
        with scratch_dir(parent, ".bench_sidecar-") as base:
            shapes = _fit_to_disk(shapes, base, args.batch)
            facts = machine_facts(base)
            facts["kvoffload source"] = git_state()
            facts["load average 1/5/15 min (start)"] = loadavg()
            o_direct = supports_o_direct(base)
            bench = Bench(base, args.row_budget_s, staging, o_direct, args.lookups, args.streams)
            bench.progress = lambda m: err.print(m, highlight=False)
            bench.spy_exe, bench.spy_dir = spy_exe, args.spy
            t0 = time.perf_counter()
            bench.progress("CPU ceilings and object images")
            datas = [
                prepare(s, args.batch, FORMATS, args.row_budget_s, padded=True) for s in shapes
            ]
            for data in datas:
                bench.add_cpu(data)
            workers = max(2, os.cpu_count() or 2)
            command = ""
            for dur in args.durability:
                with run_sidecar(
                    base / dur,
                    dur,
                    args.profile,
                    args.io,
                    streams=args.streams,
                    ram_cache=args.ram_cache,
                ) as sc:
                    pids.append(sc.proc.pid)
                    facts[f"sidecar ({dur}) reports"] = sc.describe()
                    if sc.stats.get("durability", dur) != dur:
                        raise RuntimeError(f"asked for durability {dur}: {sc.describe()}")
                    command = " ".join(
                        "<profile bootstrap>" if "\n" in c else c for c in sc.command[1:]
                    )
                    bench.progress(f"sidecar pid {sc.proc.pid}, durability {dur}: {sc.socket}")
                    if args.profile is not None:
                        client_prof = client_prof or cProfile.Profile()
                        client_prof.enable()
                    try:
                        bench.run_durability(sc, dur, datas)
                    finally:
                        if client_prof is not None:
                            client_prof.disable()
                shutil.rmtree(base / dur, ignore_errors=True)
            elapsed = time.perf_counter() - t0
            facts["load average 1/5/15 min (end)"] = loadavg()
            peer: dict[str, Any] | None = None
            if args.no_lmcache:
                peer_status = "skipped (--no-lmcache)"
            else:
                bench.progress("LMCache peer (scripts/lmcache_peer.py, its own venv)")
                facts["load average 1/5/15 min (LMCache peer start)"] = loadavg()
                # The same shapes, chunks per row, batches and row budget as the sidecar rows.
                peer_status, peer = run_lmcache_peer(
                    args.lmcache_python,
                    base,
                    err,
                    quick=args.quick,
                    row_budget_s=args.row_budget_s,
                    large_mib_per_row=args.large_mib_per_row,
                    small_ops=args.small_ops,
                    large_batch=args.batch,
                    small_batch=args.batch,
                    durabilities=args.durability,
                    shapes=args.shapes,
                )
                facts["load average 1/5/15 min (LMCache peer end)"] = loadavg()
    except KeyboardInterrupt:
        err.print("interrupted: sidecars stopped, temp files removed")
        return 130
    facts["sidecar"] = (
        f"{command} (KVOFFLOAD_STORE_DURABILITY=<dur>; cwd = a temp dir under dir; "
        f"{workers} worker threads, the default: one per core, at least 2)"
    )
    facts["client"] = (
        f"SidecarClient, staging {args.staging_mib} MiB (memfd), batch {args.batch} chunks "
        "per save()/load() call, load into= a pre-touched buffer"
    )
    facts["tenants"] = (
        f"sealed: {SEALED_TENANT!r} (policy default, aes-256-gcm); "
        f"plain: {PLAIN_TENANT!r} (encryption = none); "
        f"direct: {DIRECT_TENANT!r} (encryption = none, direct = true; "
        "SidecarClient(direct=True), load_to into the destination buffer)"
    )
    facts["direct path I/O (client)"] = (
        f"{direct_io.select().name} (KVOFFLOAD_DIRECT_IO="
        f"{os.environ.get(direct_io.ENV_VAR, 'auto (unset)')})"
    )
    facts["raw I/O ceilings"] = (
        "O_DIRECT and buffered (writes: + fsync at durability object); ratios use the faster"
        if o_direct
        else "buffered (the file system refuses O_DIRECT); + fsync at durability object"
    )
    facts["run time"] = f"{elapsed:.1f} s"
    if args.profile is not None:
        facts["WARNING"] = "--profile: every row ran under cProfile; the numbers are not valid"
    render(console, facts, shapes, bench.results, bench.latencies)
    events_doc = _events_rows(console, args.quick) if args.events else None
    final, lookup_targets = final_targets(
        bench.results, bench.latencies, peer, shapes, args.durability, args.batch
    )
    render_cpu(console, bench.results, args.spy is not None)
    render_targets(
        console, final, lookup_targets, shapes, args.batch, args.streams, peer_status, peer
    )
    if args.profile is not None:
        if client_prof is not None:
            client_prof.dump_stats(str(args.profile / "client.prof"))
        for f in [args.profile / "client.prof"] + [
            args.profile / f"sidecar-{d}.prof" for d in args.durability
        ]:
            print_profile(console, f, 25)
    if args.json is not None:
        doc = {
            "machine": facts,
            "config": {
                "quick": args.quick,
                "durability": args.durability,
                "batch": args.batch,
                "streams": args.streams,
                "staging_bytes": staging,
                "row_budget_s": args.row_budget_s,
                "lookups": args.lookups,
                "o_direct": o_direct,
                "sidecar_pids": pids,
                "shapes": [asdict(s) | {"payload": s.payload} for s in shapes],
            },
            "method": METHOD,
            "serial_bound": SERIAL_BOUND,
            "cold_method": COLD_METHOD,
            "ceilings": [r.to_json() for r in bench.results if r.kind == "ceiling"],
            "rows": [r.to_json() for r in bench.results if r.kind == "kvoffload"],
            "latency": [lt.to_json() for lt in bench.latencies],
            "lookup_cpu_us": bench.lookup_cpu_us,
            "targets": [r.to_json() for r in final],
            "lookup_targets": [lk.to_json() for lk in lookup_targets],
            "lmcache": {
                "status": peer_status,
                "python": str(args.lmcache_python),
                "result": peer,
                "howto": LMCACHE_HOWTO,
            },
            "events": events_doc,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
