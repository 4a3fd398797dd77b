"""Time to first token on CPU: prefix KV reused through a real sidecar vs recomputed.

A transformers Llama with random weights (12 layers, hidden 768, 12 heads, 4 KV
heads, vocab 32000, fp32: big enough that a 4096-token prefill takes seconds)
serves a prompt of a 4096-token prefix and a 32-token suffix two ways:

recompute
    a full prefill of the prompt (logits of the last position only, as an
    engine computes for its first token);
reuse
    chunk keys + ``lookup`` + ``load`` of the prefix's 16 chunks from a
    ``kvoffload --dev serve`` sidecar process (AES-256-GCM, the dev policy's
    default) into a prefix buffer + a ``DynamicCache`` from it + a prefill of
    the suffix only; with the store's object files dropped from the page
    cache first (cold) or left there (warm).

reuse layer-wise
    the same, but the load is layer-wise (protocol §5.26): the suffix prefill
    starts at once and each attention layer waits only for its own layer of the
    prefix (a ``DynamicCache`` whose layers fill as the sidecar reports them),
    so layer i+1 is read and verified while layer i computes. Whole-chunk and
    layer-wise runs alternate back to back (A/B, then B/A the next round).

The prefix was computed and saved once, untimed, by this process. Each round
runs, in this order: recompute, reuse cold (whole-chunk and layer-wise), reuse
warm (both), and the ceilings of the
same run: a raw cold and a warm read of the very object files a load reads
(``benchlib.ceilings.raw_reader``), a memcpy of the KV bytes, and the suffix prefill
with the prefix already in memory (the compute a reuse cannot avoid). Every
operation runs once untimed before the rounds (the first call of a GEMM shape
pays one-off costs). Times are medians over the rounds.

The logits of reuse and recompute are compared: max |difference| against
``kvoffload.integrations.demo_model.logits_tolerance`` (1e-4 of the largest logit: what BLAS kernels
chosen by GEMM shape may change in fp32; a wrong KV moves logits by ~0.1-1).

Usage::

    .venv/bin/python scripts/bench_ttft.py               # a few minutes on 2 cores
    .venv/bin/python scripts/bench_ttft.py --quick       # a smoke run, tiny model
    .venv/bin/python scripts/bench_ttft.py --rounds 5 --json out.json --dir /mnt/nvme

The sidecar is stopped and the temp dir removed on exit, Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from benchlib.ceilings import COLD_METHOD, raw_reader
from benchlib.chunks import MiB, mv, random_payload, touched
from benchlib.facts import machine_facts
from benchlib.method import Mincore, drop_cache, loadavg, scratch_dir
from benchlib.tables import begin, machine_table
from kvoffload.cli.admin import SidecarTarget
from kvoffload.client import SidecarClient
from kvoffload.integrations import demo_model as kd
from kvoffload.integrations.demo_run import dev_sidecar
from kvoffload.integrations.payoff import Offer, RecomputeGuard, plan_seconds
from kvoffload.integrations.sealed_loads import SealedLoader
from kvoffload.keys import chunk_keys
from kvoffload.layouts import v1

TENANT = "bench"
TARGET_RATIO = 0.2  # TTFT with reuse / TTFT recompute, cold load
SEED = 0
TOKEN_SEED = 4321

FULL_SHAPE = kd.ModelShape(
    num_layers=12, hidden_size=768, num_heads=12, num_kv_heads=4, vocab_size=32000
)
QUICK_SHAPE = kd.ModelShape(
    num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, vocab_size=1024
)

METHOD = (
    "TTFT = wall time (time.perf_counter) from having the prompt's token ids to having the "
    "logits of its last position. recompute: one forward over the whole prompt. reuse: "
    "chunk_keys + SidecarClient.lookup + load(into=) the leading chunks into a prefix buffer "
    "+ DynamicCache from it + forward over the suffix; the client was connected (hello, salt, "
    "staging registration) before, as a worker is at start-up. Medians over the rounds, after "
    "one untimed run of each operation; one round = recompute, reuse cold, reuse warm, raw "
    "cold read, raw warm read, memcpy, suffix prefill alone, in that order. reuse layer-wise: "
    "the same keys and lookup, then load_layerwise on a thread while the suffix forward runs "
    "over a cache whose layer i waits for layer i of the prefix; runs next to the whole-chunk "
    "reuse of the same cache state, the order of the two swapped every round."
)


# --------------------------------------------------------------------------- results


@dataclass
class Row:
    kind: str  # "ttft" | "stage" | "ceiling"
    name: str
    runs: list[float] = field(default_factory=list)  # seconds
    cached: list[float | None] = field(default_factory=list)
    nbytes: int = 0  # bytes moved per run (ceilings)
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.runs) if self.runs else 0.0

    @property
    def gbps(self) -> float | None:
        return self.nbytes / self.median / 1e9 if self.nbytes and self.median > 0 else None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["median_s"] = self.median
        d["min_s"] = min(self.runs) if self.runs else None
        d["max_s"] = max(self.runs) if self.runs else None
        d["gbps"] = self.gbps
        return d


@dataclass
class Exactness:
    logits_max_abs_diff: float = 0.0  # reuse vs recompute, over every round
    logits_tolerance: float = 0.0
    greedy_match: bool = True
    prefix_kv_max_abs_diff: float = 0.0  # loaded prefix vs recomputed prefix KV
    recompute_run_to_run: float = 0.0  # max |diff| between recomputes of different rounds
    logits_abs_max: float = 0.0
    logits_std: float = 0.0
    #: layer-wise reuse vs whole-chunk reuse logits: the same bytes and the same
    #: computation, so 0 (bit-identical) is the only right answer.
    layerwise_vs_whole_max_abs_diff: float = 0.0

    @property
    def within(self) -> bool:
        return self.logits_max_abs_diff <= self.logits_tolerance


# --------------------------------------------------------------------------- the run


class SlowTier:
    """A deliberately slow tier: the real client, throttled to ``bytes_per_s`` of KV
    (the stand-in of a throttled file system). A whole-chunk load waits
    ``bytes / rate`` before it runs; a layer-wise load streams: each layer is
    handed on no earlier than the rate allows for the bytes handed on so far."""

    def __init__(self, client: Any, chunk_bytes: int) -> None:
        self._client, self._chunk_bytes = client, chunk_bytes
        self.bytes_per_s = 0.0  # set once recompute has been timed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def load(self, keys: Sequence[bytes], *args: Any, **kw: Any) -> Any:
        if self.bytes_per_s > 0:
            time.sleep(len(keys) * self._chunk_bytes / self.bytes_per_s)
        return self._client.load(keys, *args, **kw)

    def load_layerwise(self, keys: Sequence[bytes], on_layer: Callable[..., None]) -> Any:
        start, sent = time.perf_counter(), 0

        def throttled(layer: int, first: int, views: Sequence[memoryview]) -> None:
            nonlocal sent
            sent += sum(v.nbytes for v in views)
            if self.bytes_per_s > 0:
                time.sleep(max(0.0, start + sent / self.bytes_per_s - time.perf_counter()))
            on_layer(layer, first, views)

        return self._client.load_layerwise(keys, throttled)


class WorkerSealed:
    """The client as the vLLM connector's worker loads with ``sealed_direct``
    (``kvoffload.integrations.sealed_loads``): each handed object decrypted
    in this process into a reused scratch buffer, then copied into place."""

    def __init__(self, client: SidecarClient, chunk_bytes: int, capacity: int) -> None:
        self._client = client
        self._loader = SealedLoader(chunk_bytes, capacity)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def load(self, keys: Sequence[bytes], into: Callable[..., None]) -> list[bool]:
        def place(i: int, layers: Sequence[memoryview]) -> bool:
            into(i, keys[i], layers)
            return True

        done = self._loader.load(self._client, keys, place)
        return [i < done for i in range(len(keys))]


def _proc_cpu(pid: int) -> float:
    """user + system CPU seconds of process ``pid`` (0: none), from /proc/PID/stat."""
    if pid <= 0:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Capped:
    """The client as the connector presents it once the guard chose to load the
    first ``chunks`` chunks only: the lookup answers no more than those."""

    def __init__(self, client: Any, chunks: int) -> None:
        self._client, self._chunks = client, chunks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def lookup(self, keys: Sequence[bytes]) -> int:
        return min(self._chunks, int(self._client.lookup(keys)))


class Probes:
    """The guard's probes: one chunk read in the background on a connection of its
    own, through the same throttle; no request ever joins one."""

    def __init__(self, tier: SlowTier, key: bytes, chunk_tokens: int) -> None:
        self._tier, self._key, self._ct = tier, key, chunk_tokens
        self.started = self.done = 0
        self._threads: list[threading.Thread] = []

    def start(self, guard: RecomputeGuard) -> None:
        def run() -> None:
            t0 = time.perf_counter()
            ok = self._tier.load([self._key], lambda *_a: None)
            if ok and ok[0].ok:
                guard.observe_load(self._ct, time.perf_counter() - t0)
            self.done += 1

        self.started += 1
        t = threading.Thread(target=run, name="bench-probe", daemon=True)
        self._threads.append(t)
        t.start()

    def join(self) -> None:
        for t in self._threads:
            t.join()


@dataclass
class Bench:
    model: Any
    contract: Any
    client: SidecarClient
    prompt: list[int]
    prefix_len: int
    obj_paths: list[Path]
    prefix_kv: kd.Prefill
    mincore: Any = field(default_factory=Mincore)
    rows: dict[str, Row] = field(default_factory=dict)
    exact: Exactness = field(default_factory=Exactness)
    progress: Callable[[str], None] = lambda _m: None
    #: Empties the sidecar's RAM tier (its drop_cache verb): a cold load reads files.
    drop_ram_tier: Callable[[], object] = lambda: None
    #: How much slower than recompute the slow tier's load of the prefix is made.
    slow_factor: float = 2.0
    #: The moderate tier (layer-wise): its throttle alone takes 0.9x recompute's time,
    #: so that with the load's own work a whole load takes about as long as recompute.
    moderate_factor: float = 0.9
    #: A second connection, for the guards' background probes (set by main).
    probe_client: Any = None
    #: The vLLM worker's sealed direct loads (set by main where the sidecar offers them).
    sealed: Any = None
    #: The sidecar's pid: its CPU time per operation (set by main).
    sidecar_pid: int = 0
    _ref_logits: torch.Tensor | None = None
    _reuse_logits: dict[tuple[str, bool], torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.reused_chunks = self.prefix_len // self.contract.chunk_tokens
        self.kv_bytes = self.reused_chunks * self.contract.layer_layout.num_layers
        self.kv_bytes *= kd.chunk_layer_bytes(
            self.contract.layer_layout, self.contract.chunk_tokens, torch.float32
        )
        self.file_bytes = sum(p.stat().st_size for p in self.obj_paths)
        self.read_buf = mv(touched(max(p.stat().st_size for p in self.obj_paths)))
        self.reader = raw_reader(self.obj_paths, self.read_buf)
        self.src = random_payload(self.kv_bytes, 1)
        self.dst = touched(self.kv_bytes)
        # Never slower than recompute (kvoffload.integrations.payoff): one guard per
        # tier, fed with this run's own measurements (recompute times, load times).
        chunk_file_bytes = max(1, self.file_bytes // max(1, self.reused_chunks))
        self.slow = SlowTier(self.client, chunk_file_bytes)
        self.moderate = SlowTier(self.client, chunk_file_bytes)
        # Probes re-measure a refusing guard's tier every second (30 s in the
        # connector), so that this short run has some, all in the background; an
        # estimate is stale (read 1.5x dearer) after 60 s, as in the connector.
        self.guards = {
            tier: RecomputeGuard(min_loads=1, min_steps=1, reprobe_s=1.0, stale_s=60.0)
            for tier in ("normal", "slow", "moderate")
        }
        self.decisions: dict[str, list[str]] = {"normal": [], "slow": [], "moderate": []}
        #: Per decision, the guard's own estimates (seconds): its plan, recompute, and
        #: loading the whole offer, from the rates it had measured by then.
        self.estimates: dict[str, list[dict[str, float]]] = {t: [] for t in self.decisions}
        self.decide_s: list[float] = []
        self.reference_s = 0.0
        #: CPU time (this process, every thread) of each timed operation, by op name.
        self.cpu: dict[str, list[float]] = {}
        #: The sidecar process's CPU time of each timed operation (clock-tick resolution).
        self.sidecar_cpu: dict[str, list[float]] = {}
        self.probes: dict[str, Probes] = {}

    def row(self, kind: str, name: str, nbytes: int = 0, note: str = "") -> Row:
        if name not in self.rows:
            self.rows[name] = Row(kind, name, nbytes=nbytes, note=note)
        return self.rows[name]

    # -- operations (each returns seconds)

    def recompute(self, timed: bool) -> float:
        t0 = time.perf_counter()
        full = kd.prefill(self.model, self.prompt)
        dt = time.perf_counter() - t0
        for guard in self.guards.values():
            guard.observe_step(len(self.prompt), dt)
        if timed:
            self._check_recompute(full)
        return dt

    def set_tiers(self, recompute_s: float) -> None:
        """Throttle the slow tiers against ``recompute_s`` (a warm-up recompute)."""
        self.reference_s = recompute_s
        self.slow.bytes_per_s = self.file_bytes / (self.slow_factor * recompute_s)
        self.moderate.bytes_per_s = self.kv_bytes / (self.moderate_factor * recompute_s)
        if self.probe_client is not None:
            key = chunk_keys(self.contract, self.client.salt, self.prompt)[0]
            for tier in ("slow", "moderate"):
                probe_tier = SlowTier(self.probe_client, self.slow._chunk_bytes)
                probe_tier.bytes_per_s = getattr(self, tier).bytes_per_s
                self.probes[tier] = Probes(probe_tier, key, self.contract.chunk_tokens)

    def reuse(
        self, cache_state: str, timed: bool, layerwise: bool = False, sealed: bool = False
    ) -> float:
        cached = None
        if cache_state == "cold":
            drop_cache(self.obj_paths)
            self.drop_ram_tier()
        if timed:
            cached = self.mincore.resident(self.obj_paths)
        fn = kd.reuse_prefill_layerwise if layerwise else kd.reuse_prefill
        client = self.sealed if sealed and self.sealed is not None else self.client
        r = fn(self.model, client, self.contract, self.prompt)
        if cache_state == "cold" and not layerwise and not sealed:
            self.guards["normal"].observe_load(self.prefix_len, r.load_s)
        if r.reused_chunks != self.reused_chunks:
            raise AssertionError(
                f"reuse {cache_state}: {r.reused_chunks} chunks reused, expected "
                f"{self.reused_chunks} (lookup found {r.lookup_chunks})"
            )
        if timed:
            name = f"reuse{' layer-wise' if layerwise else ''}, {cache_state} load"
            name += ", sealed direct" if sealed else ""
            self.row("ttft", name).runs.append(r.total_s)
            self.row("ttft", name).cached.append(cached)
            stages = (
                (
                    ("chunk keys", r.keys_s),
                    ("lookup", r.lookup_s),
                    ("load (suffix prefill running)", r.load_s),
                    ("suffix prefill after the load", r.compute_s),
                )
                if layerwise
                else (
                    ("chunk keys", r.keys_s),
                    ("lookup", r.lookup_s),
                    ("load", r.load_s),
                    ("DynamicCache from prefix", r.cache_s),
                    ("suffix prefill", r.compute_s),
                )
            )
            tag = "lw-" if layerwise else "sd-" if sealed else ""
            for stage, s in stages:
                self.row("stage", f"{tag}{cache_state}/{stage}").runs.append(s)
            self._check_reuse(r, cache_state, layerwise)
        return r.total_s

    def reuse_slow(self, timed: bool) -> float:
        """Reuse through the slow tier, unguarded: what a tier slower than recompute costs."""
        drop_cache(self.obj_paths)
        self.drop_ram_tier()
        r = kd.reuse_prefill(self.model, self.slow, self.contract, self.prompt)
        if not timed:  # the guard's first measurement; later ones are its probes
            self.guards["slow"].observe_load(self.prefix_len, r.load_s)
        if timed:
            self.row("ttft", "reuse, slow tier (no guard)").runs.append(r.total_s)
        return r.total_s

    def reuse_moderate(self, timed: bool) -> float:
        """Layer-wise reuse of the whole prefix through the moderate tier, unguarded."""
        drop_cache(self.obj_paths)
        self.drop_ram_tier()
        r = kd.reuse_prefill_layerwise(self.model, self.moderate, self.contract, self.prompt)
        if not timed:  # the guard's first measurement; later ones: its loads and probes
            self.guards["moderate"].observe_load(self.prefix_len, r.load_s)
        if timed:
            self.row("ttft", "reuse layer-wise, moderate tier (no guard)").runs.append(r.total_s)
        return r.total_s

    def offer(self, tier: str) -> Offer:
        """What the connector offers the guard: sync layer-wise loads for the
        moderate tier (compute runs alongside, layer by layer), serial otherwise."""
        layerwise = tier == "moderate"
        return Offer(
            self.prefix_len,
            tail=len(self.prompt) - self.prefix_len,
            granule=self.contract.chunk_tokens,
            overlap=len(self.prompt) if layerwise else 0,
            stages=self.contract.layer_layout.num_layers,
        )

    def guarded(self, tier: str, timed: bool) -> float:
        """The connector's choice: the guard decides from this run's rates, then
        the prefix (or its leading chunks) is loaded from ``tier``, the rest
        recomputed. A due probe starts in the background; nothing waits for it."""
        guard = self.guards[tier]
        t0 = time.perf_counter()
        c0 = time.thread_time()
        offer = self.offer(tier)
        decision = guard.decide(offer)
        tokens = decision.tokens
        load_rate, prefill_rate = guard.load_rate(), guard.prefill_rate()
        whole_s = (
            plan_seconds(offer, offer.offered, guard.safety() / load_rate, 1.0 / prefill_rate)
            if load_rate and prefill_rate
            else 0.0
        )
        due = guard.claim_probe()
        decide_cpu = time.thread_time() - c0
        if due and tier in self.probes:
            self.probes[tier].start(guard)  # a thread: this request does not wait for it
        chunks = tokens // self.contract.chunk_tokens
        if chunks:
            drop_cache(self.obj_paths)
            self.drop_ram_tier()
            client = Capped(getattr(self, tier) if tier != "normal" else self.client, chunks)
            fn = kd.reuse_prefill_layerwise if tier == "moderate" else kd.reuse_prefill
            r = fn(self.model, client, self.contract, self.prompt)
            guard.observe_load(r.reused_tokens, r.load_s)
        else:
            kd.prefill(self.model, self.prompt)
        dt = time.perf_counter() - t0
        if timed:
            self.row("ttft", f"guarded, {tier} tier (cold)").runs.append(dt)
            n = self.reused_chunks
            what = "load" if chunks == n else f"load {chunks}/{n}" if chunks else "recompute"
            self.decisions[tier].append(what)
            self.estimates[tier].append(
                {"plan_s": decision.plan_s, "recompute_s": decision.recompute_s, "whole_s": whole_s}
            )
            self.decide_s.append(decide_cpu)
            self.progress(f"    guard, {tier} tier: {decision.reason}")
        return dt

    def raw_read(self, cache_state: str, timed: bool) -> float:
        if cache_state == "cold":
            drop_cache(self.obj_paths)
        cached = self.mincore.resident(self.obj_paths) if timed else None
        t0 = time.perf_counter()
        for i in range(len(self.obj_paths)):
            self.reader(i)
        dt = time.perf_counter() - t0
        if timed:
            r = self.row(
                "ceiling",
                f"raw read {cache_state}",
                self.file_bytes,
                f"open+readv+close of the {len(self.obj_paths)} object files a load reads",
            )
            r.runs.append(dt)
            r.cached.append(cached)
        return dt

    def memcpy(self, timed: bool) -> float:
        t0 = time.perf_counter()
        np.copyto(self.dst, self.src)
        dt = time.perf_counter() - t0
        if timed:
            self.row(
                "ceiling", "memcpy", self.kv_bytes, "the prefix's KV bytes, numpy"
            ).runs.append(dt)
        return dt

    def suffix_only(self, timed: bool) -> float:
        n = self.prefix_len
        t0 = time.perf_counter()
        cache = kd.cache_from_kv(
            self.model.config,
            [k[:, :n] for k in self.prefix_kv.keys],
            [v[:, :n] for v in self.prefix_kv.values],
        )
        kd.prefill_suffix(self.model, self.prompt, cache, n)
        dt = time.perf_counter() - t0
        if timed:
            self.row(
                "ceiling",
                "suffix prefill alone",
                0,
                "DynamicCache from the prefix KV in memory + forward over the suffix",
            ).runs.append(dt)
        return dt

    # -- checks

    def _check_recompute(self, full: kd.Prefill) -> None:
        if self._ref_logits is None:
            self._ref_logits = full.logits
            self.exact.logits_tolerance = kd.logits_tolerance(full.logits)
            self.exact.logits_abs_max = float(full.logits.abs().max())
            self.exact.logits_std = float(full.logits.std())
            n = self.prefix_len
            self.exact.prefix_kv_max_abs_diff = max(
                max(kd.max_abs_diff(a[:, :n], b[:, :n]), kd.max_abs_diff(c[:, :n], d[:, :n]))
                for a, b, c, d in zip(
                    full.keys,
                    self.prefix_kv.keys,
                    full.values,
                    self.prefix_kv.values,
                    strict=True,
                )
            )
        else:
            self.exact.recompute_run_to_run = max(
                self.exact.recompute_run_to_run, kd.max_abs_diff(full.logits, self._ref_logits)
            )

    def _check_reuse(self, r: kd.ReuseResult, state: str, layerwise: bool) -> None:
        if self._ref_logits is None:
            raise AssertionError("no recompute to compare with")
        other = self._reuse_logits.get((state, not layerwise))
        if other is not None:
            self.exact.layerwise_vs_whole_max_abs_diff = max(
                self.exact.layerwise_vs_whole_max_abs_diff, kd.max_abs_diff(r.logits, other)
            )
        self._reuse_logits[(state, layerwise)] = r.logits
        diff = kd.max_abs_diff(r.logits, self._ref_logits)
        self.exact.logits_max_abs_diff = max(self.exact.logits_max_abs_diff, diff)
        same = int(r.logits.argmax()) == int(self._ref_logits.argmax())
        self.exact.greedy_match = self.exact.greedy_match and same

    # -- the rounds

    def run(self, rounds: int) -> None:
        ops: list[tuple[str, Callable[[bool], float]]] = [
            ("recompute", lambda t: self._ttft("recompute", self.recompute(t), t)),
            ("reuse cold", lambda t: self.reuse("cold", t)),
            ("reuse cold layer-wise", lambda t: self.reuse("cold", t, True)),
            ("reuse warm", lambda t: self.reuse("warm", t)),
            ("reuse warm layer-wise", lambda t: self.reuse("warm", t, True)),
            ("reuse cold sealed", lambda t: self.reuse("cold", t, sealed=True)),
            ("reuse warm sealed", lambda t: self.reuse("warm", t, sealed=True)),
            ("raw read cold", lambda t: self.raw_read("cold", t)),
            ("raw read warm", lambda t: self.raw_read("warm", t)),
            ("memcpy", self.memcpy),
            ("suffix prefill alone", self.suffix_only),
            ("reuse, slow tier", self.reuse_slow),
            ("guarded, normal tier", lambda t: self.guarded("normal", t)),
            ("guarded, slow tier", lambda t: self.guarded("slow", t)),
            (
                "recompute, peer",
                lambda t: self._ttft("recompute, peer", self.recompute(t), t),
            ),
            ("reuse, moderate tier", self.reuse_moderate),
            ("guarded, moderate tier", lambda t: self.guarded("moderate", t)),
        ]
        self.progress("warm-up: 1 + 3 recomputes (the slow tiers' reference), every operation once")
        self.recompute(False)  # the first call of each GEMM shape pays one-off costs
        self.set_tiers(statistics.median(self.recompute(False) for _ in range(3)))
        self.progress(f"  reference recompute            {self.reference_s * 1e3:10.1f} ms")
        for name, op in ops:
            dt = op(False)
            self.progress(f"  {name:<22} {dt * 1e3:10.1f} ms (untimed)")
        for i in range(rounds):
            self.progress(f"round {i + 1}/{rounds}")
            if i % 2:  # B/A: layer-wise first in every other round
                ops[1], ops[2], ops[3], ops[4] = ops[2], ops[1], ops[4], ops[3]
            for name, op in ops:
                c0, s0 = time.process_time(), _proc_cpu(self.sidecar_pid)
                dt = op(True)
                self.cpu.setdefault(name, []).append(time.process_time() - c0)
                self.sidecar_cpu.setdefault(name, []).append(_proc_cpu(self.sidecar_pid) - s0)
                self.progress(f"  {name:<22} {dt * 1e3:10.1f} ms")

    def _ttft(self, name: str, dt: float, timed: bool) -> float:
        if timed:
            r = self.row("ttft", name)
            r.runs.append(dt)
            r.cached.append(None)
        return dt


# --------------------------------------------------------------------------- output


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:,.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _cached(r: Row) -> str:
    vals = [c for c in r.cached if c is not None]
    return "-" if not vals else f"{statistics.median(vals):.0%}"


def summary(bench: Bench) -> dict[str, Any]:
    rows = bench.rows
    recompute = rows["recompute"].median
    out: dict[str, Any] = {"recompute_s": recompute}
    for state in ("cold", "warm"):
        reuse = rows[f"reuse, {state} load"].median
        out[f"reuse_{state}_s"] = reuse
        out[f"ratio_{state}"] = reuse / recompute if recompute > 0 else None
        out[f"speedup_{state}"] = recompute / reuse if reuse > 0 else None
    for state in ("cold", "warm"):
        whole = rows[f"reuse, {state} load"].median
        lw = rows[f"reuse layer-wise, {state} load"].median
        out[f"layerwise_{state}_s"] = lw
        out[f"layerwise_vs_whole_{state}"] = lw / whole if whole > 0 else None
    out["target_ratio"] = TARGET_RATIO
    out["meets_target_cold"] = out["ratio_cold"] is not None and out["ratio_cold"] <= TARGET_RATIO
    out["meets_target_warm"] = out["ratio_warm"] is not None and out["ratio_warm"] <= TARGET_RATIO
    suffix = rows["suffix prefill alone"].median
    raw_cold = rows["raw read cold"].median
    out["bound_cold_s"] = raw_cold + suffix
    out["bound_ratio_cold"] = (raw_cold + suffix) / recompute if recompute > 0 else None
    out["load_cold_x_raw_read_cold"] = rows["cold/load"].median / raw_cold if raw_cold > 0 else None
    peer = rows["recompute, peer"].median
    slow: dict[str, Any] = {
        "slow_tier_bytes_per_s": bench.slow.bytes_per_s,
        "moderate_tier_bytes_per_s": bench.moderate.bytes_per_s,
        "reuse_slow_s": rows["reuse, slow tier (no guard)"].median,
        "reuse_moderate_s": rows["reuse layer-wise, moderate tier (no guard)"].median,
        "recompute_peer_s": peer,
        "decisions": bench.decisions,
        "estimates": bench.estimates,
        "decide_cpu_s_max": max(bench.decide_s, default=0.0),
        "probes": {t: {"started": p.started, "done": p.done} for t, p in bench.probes.items()},
    }
    for tier in ("normal", "slow", "moderate"):
        r = rows[f"guarded, {tier} tier (cold)"]
        slow[f"guarded_{tier}_s"] = r.median
        slow[f"guarded_{tier}_max_s"] = max(r.runs)
        slow[f"guarded_{tier}_vs_recompute"] = r.median / recompute if recompute > 0 else None
        slow[f"guarded_{tier}_vs_peer"] = r.median / peer if peer > 0 else None
    pairs = [
        g / p
        for g, p in zip(
            rows["guarded, slow tier (cold)"].runs, rows["recompute, peer"].runs, strict=True
        )
        if p > 0
    ]
    slow["guarded_slow_vs_peer_per_round"] = pairs
    out["never_slower_than_recompute"] = slow
    out["sealed_direct"] = {
        f"{state}_{path}_{what}": val
        for state in ("cold", "warm")
        for path, row, op, stage in (
            ("staging", f"reuse, {state} load", f"reuse {state}", f"{state}/load"),
            (
                "sealed",
                f"reuse, {state} load, sealed direct",
                f"reuse {state} sealed",
                f"sd-{state}/load",
            ),
        )
        for what, val in (
            ("ttft_s", rows[row].median),
            ("load_s", rows[stage].median),
            ("cpu_s", statistics.median(bench.cpu[op])),
            ("sidecar_cpu_s", statistics.median(bench.sidecar_cpu[op])),
        )
    }
    return out


def render(console: Console, facts: dict[str, str], bench: Bench, summ: dict[str, Any]) -> None:
    console.print(machine_table(facts, title="machine and set-up"))

    rows = bench.rows
    rounds = len(rows["recompute"].runs)
    t = Table(title=f"time to first token (median of {rounds} rounds, ms)")
    for col in ("path", "median", "min", "max", "x recompute", "target", "cached"):
        t.add_column(col, justify="left" if col == "path" else "right")
    rec = rows["recompute"]
    t.add_row(
        f"recompute: full prefill of {len(bench.prompt)} tokens",
        _ms(rec.median),
        _ms(min(rec.runs)),
        _ms(max(rec.runs)),
        "1.000",
        "",
        "",
    )
    for state in ("cold", "warm"):
        r = rows[f"reuse, {state} load"]
        ratio = summ[f"ratio_{state}"]
        ok = summ[f"meets_target_{state}"]
        t.add_row(
            f"reuse, {state} load: {bench.reused_chunks} chunks + "
            f"{len(bench.prompt) - bench.prefix_len} tokens computed",
            _ms(r.median),
            _ms(min(r.runs)),
            _ms(max(r.runs)),
            f"{ratio:.3f}" if ratio is not None else "-",
            f"<= {TARGET_RATIO} " + ("[green]met[/green]" if ok else "[red]missed[/red]"),
            _cached(r),
        )
        lw = rows[f"reuse layer-wise, {state} load"]
        rec_s = rows["recompute"].median
        vs = summ[f"layerwise_vs_whole_{state}"]
        t.add_row(
            f"reuse layer-wise, {state} load (x whole-chunk: "
            + (f"{vs:.3f})" if vs is not None else "-)"),
            _ms(lw.median),
            _ms(min(lw.runs)),
            _ms(max(lw.runs)),
            f"{lw.median / rec_s:.3f}" if rec_s > 0 else "-",
            "",
            _cached(lw),
        )
    console.print(t)

    t = Table(title="layer-wise reuse, stage by stage (median ms)")
    for col in ("stage", "cold", "warm"):
        t.add_column(col, justify="left" if col == "stage" else "right")
    for stage in (
        "chunk keys",
        "lookup",
        "load (suffix prefill running)",
        "suffix prefill after the load",
    ):
        t.add_row(stage, _ms(rows[f"lw-cold/{stage}"].median), _ms(rows[f"lw-warm/{stage}"].median))
    console.print(t)

    t = Table(title="reuse, stage by stage (median ms)")
    for col in ("stage", "cold", "warm"):
        t.add_column(col, justify="left" if col == "stage" else "right")
    for stage in ("chunk keys", "lookup", "load", "DynamicCache from prefix", "suffix prefill"):
        t.add_row(stage, _ms(rows[f"cold/{stage}"].median), _ms(rows[f"warm/{stage}"].median))
    console.print(t)

    t = Table(title="ceilings of the same run (median ms)")
    for col in ("ceiling", "median", "MiB", "GB/s", "cached", "what"):
        t.add_column(col, justify="left" if col in ("ceiling", "what") else "right")
    for name in ("raw read cold", "raw read warm", "memcpy", "suffix prefill alone"):
        r = rows[name]
        t.add_row(
            name,
            _ms(r.median),
            f"{r.nbytes / MiB:.1f}" if r.nbytes else "-",
            f"{r.gbps:.3f}" if r.gbps else "-",
            _cached(r),
            r.note,
        )
    bound = summ["bound_ratio_cold"]
    t.add_row(
        "bound: raw read cold + suffix prefill alone",
        _ms(summ["bound_cold_s"]),
        "",
        "",
        "",
        f"the best a cold reuse could do here: {bound:.3f} x recompute" if bound else "",
    )
    console.print(t)
    load_x = summ["load_cold_x_raw_read_cold"]
    if load_x is not None:
        console.print(
            f"load (cold) took {load_x:.2f} x the raw cold read of the same object files "
            f"({bench.file_bytes / MiB:.1f} MiB of files for {bench.kv_bytes / MiB:.1f} MiB of KV)"
        )

    e = bench.exact
    t = Table(title="exactness: reuse vs recompute", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value")
    t.add_row(
        "logits max |reuse - recompute|",
        f"{e.logits_max_abs_diff:.3g} over every reuse run "
        + ("([green]within[/green]" if e.within else "([red]OVER[/red]")
        + f" the tolerance {e.logits_tolerance:.3g})",
    )
    t.add_row(
        "tolerance",
        f"{kd.LOGITS_RTOL:g} x max(1, max |logit|) = {kd.LOGITS_RTOL:g} x "
        f"{max(1.0, e.logits_abs_max):.3g}: fp32 GEMMs of different row counts (a "
        f"{len(bench.prompt) - bench.prefix_len}-row suffix vs a {len(bench.prompt)}-row prompt) "
        "may use kernels that round differently, ~1e-6 relative over these layers; a wrong KV "
        f"moves logits by their spread (std here {e.logits_std:.3g})",
    )
    t.add_row(
        "logits max |layer-wise - whole-chunk reuse|",
        f"{e.layerwise_vs_whole_max_abs_diff:.3g}"
        + (" (bit-identical)" if e.layerwise_vs_whole_max_abs_diff == 0 else " [red]DIFFER[/red]"),
    )
    t.add_row("greedy next token", "equal" if e.greedy_match else "[red]DIFFERENT[/red]")
    t.add_row("prefix KV max |loaded - recomputed|", f"{e.prefix_kv_max_abs_diff:.3g}")
    t.add_row("recompute run-to-run max |diff|", f"{e.recompute_run_to_run:.3g}")
    console.print(t)
    render_guard(console, bench, summ)
    render_sealed(console, summ)
    console.print(f"[bold]method[/bold]: {METHOD}")
    console.print(f"[bold]cold[/bold]: {COLD_METHOD}")


def render_sealed(console: Console, summ: dict[str, Any]) -> None:
    """Sealed direct reads (the vLLM worker's ``sealed_direct`` loads) against the
    staging path, same chunks, same run, interleaved in every round."""
    s = summ["sealed_direct"]
    t = Table(title="whole-chunk loads: staging vs sealed direct reads (median ms)")
    for col in ("load", "path", "TTFT", "load stage", "x staging", "this CPU", "sidecar CPU"):
        t.add_column(col, justify="left" if col in ("load", "path") else "right")
    for state in ("cold", "warm"):
        base = s[f"{state}_staging_load_s"]
        for path, label in (
            ("staging", "staging: the sidecar opens, the client copies out"),
            ("sealed", "sealed direct: the client opens into its scratch, copies out"),
        ):
            load = s[f"{state}_{path}_load_s"]
            t.add_row(
                state,
                label,
                _ms(s[f"{state}_{path}_ttft_s"]),
                _ms(load),
                f"{load / base:.2f}" if base > 0 else "-",
                _ms(s[f"{state}_{path}_cpu_s"]),
                _ms(s[f"{state}_{path}_sidecar_cpu_s"]),
            )
    console.print(t)
    console.print(
        "this CPU: process time of the bench process (every thread) per reuse; sidecar "
        "CPU: the sidecar's utime + stime over the same reuse (/proc, clock-tick "
        "resolution). Sealed direct: SidecarClient(sealed_direct=True) through "
        "kvoffload.integrations.sealed_loads.SealedLoader, as the vLLM worker loads."
    )


def render_guard(console: Console, bench: Bench, summ: dict[str, Any]) -> None:
    """Never slower than recompute: every guarded row against recompute (the
    ceiling), same run, and against the recompute run right after it (the peer)."""
    s = summ["never_slower_than_recompute"]
    rows = bench.rows
    t = Table(title="never slower than recompute (the recompute guard, cold loads, ms)")
    for col in ("path", "p50", "min", "max", "x recompute", "x peer", "CPU p50", "guard chose"):
        t.add_column(col, justify="left" if col in ("path", "guard chose") else "right")
    rc, peer = summ["recompute_s"], s["recompute_peer_s"]

    def add(label: str, name: str, op: str, chose: str = "") -> None:
        r = rows[name]
        x = f"{r.median / rc:.2f}" if rc > 0 else "-"
        xp = f"{r.median / peer:.2f}" if peer > 0 and "guarded" in label else ""
        cpu = bench.cpu.get(op)
        c = _ms(statistics.median(cpu)) if cpu else "-"
        t.add_row(label, _ms(r.median), _ms(min(r.runs)), _ms(max(r.runs)), x, xp, c, chose)

    add("recompute (the ceiling)", "recompute", "recompute")
    add("recompute, peer (run after the guarded slow tier)", "recompute, peer", "recompute, peer")
    add("reuse, slow tier (no guard)", "reuse, slow tier (no guard)", "reuse, slow tier")
    add(
        "reuse layer-wise, moderate tier (no guard)",
        "reuse layer-wise, moderate tier (no guard)",
        "reuse, moderate tier",
    )
    for tier in ("normal", "slow", "moderate"):
        chose = s["decisions"][tier]
        add(
            f"guarded, {tier} tier",
            f"guarded, {tier} tier (cold)",
            f"guarded, {tier} tier",
            ", ".join(f"{chose.count(c)}x {c}" for c in dict.fromkeys(chose)),
        )
    console.print(t)
    mib = s["slow_tier_bytes_per_s"] / MiB, s["moderate_tier_bytes_per_s"] / MiB
    pairs = ", ".join(f"{x:.3f}" for x in s["guarded_slow_vs_peer_per_round"])
    probes = ", ".join(
        f"{tier}: {p['started']} started, {p['done']} done" for tier, p in s["probes"].items()
    )
    console.print(
        f"slow tier: throttled to {mib[0]:.1f} MiB/s of files (a whole-chunk load of the "
        f"prefix set to {bench.slow_factor:g}x the reference: the median of 3 warm-up "
        f"recomputes, {bench.reference_s * 1e3:.1f} ms); moderate "
        f"tier: {mib[1]:.1f} MiB/s of KV streamed layer by layer "
        f"({bench.moderate_factor:g}x), loaded layer-wise while the suffix computes. The "
        "guards decide from this run's recompute and load times only. Guard decision "
        f"(decide + claim_probe) CPU time at most {s['decide_cpu_s_max'] * 1e6:.0f} us. "
        f"Guarded slow tier / the recompute right after it, per round: {pairs}. Background "
        f"probes (one chunk, own connection, nothing waits on them): {probes}. CPU p50: "
        "process time of this process (every thread; not the sidecar's, not sleeps)."
    )


# --------------------------------------------------------------------------- main


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--dir", type=Path, default=None, help="where the store lives (default: cwd)")
    p.add_argument("--quick", action="store_true", help="tiny model and prompt: a smoke run")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 3)")
    p.add_argument("--prefix-tokens", type=int, default=None, help="default 4096 (quick 512)")
    p.add_argument("--suffix-tokens", type=int, default=None, help="default 32 (quick 16)")
    p.add_argument("--chunk-tokens", type=int, default=None, help="default 256 (quick 64)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    a = p.parse_args(argv)
    a.rounds = a.rounds or 3
    a.prefix_tokens = a.prefix_tokens or (512 if a.quick else 4096)
    a.suffix_tokens = a.suffix_tokens or (16 if a.quick else 32)
    a.chunk_tokens = a.chunk_tokens or (64 if a.quick else 256)
    if a.rounds < 1 or a.threads < 1 or a.suffix_tokens < 1:
        p.error("--rounds, --threads and --suffix-tokens must be at least 1")
    if a.prefix_tokens < a.chunk_tokens or a.prefix_tokens % a.chunk_tokens:
        p.error("--prefix-tokens must be a positive multiple of --chunk-tokens")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    console, err, parent = begin(args.dir, 180)
    if not kd.transformers_available():
        err.print(kd.TRANSFORMERS_MISSING, markup=False)
        return 1
    if parent is None:
        return 2
    import transformers

    torch.set_num_threads(args.threads)
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    prefix = kd.random_tokens(args.prefix_tokens, shape.vocab_size, TOKEN_SEED)
    prompt = prefix + kd.random_tokens(args.suffix_tokens, shape.vocab_size, TOKEN_SEED + 1)
    if len(prompt) > shape.max_position_embeddings:
        err.print(f"the prompt exceeds {shape.max_position_embeddings} positions")
        return 2
    progress: Callable[[str], None] = lambda m: err.print(m, highlight=False)  # noqa: E731
    sidecar_pid: int | None = None
    try:
        with scratch_dir(parent, ".bench_ttft-") as base:
            facts = machine_facts(base)
            facts["load average 1/5/15 min (start)"] = loadavg()
            t_start = time.perf_counter()
            progress(f"model: {shape.describe()}, fp32, seed {SEED}")
            config = kd.llama_config(shape)
            model = kd.build_model(config, SEED)
            contract = kd.demo_contract(config, SEED, tenant=TENANT, chunk_tokens=args.chunk_tokens)
            n_chunks = args.prefix_tokens // args.chunk_tokens
            staging = kd.staging_bytes_for(contract.layer_layout, args.chunk_tokens, n_chunks)
            with (
                dev_sidecar(base) as sc,
                SidecarClient(
                    sc.socket_path, TENANT, staging_bytes=staging, name="bench_ttft"
                ) as client,
                SidecarClient(
                    sc.socket_path,
                    TENANT,
                    staging_bytes=kd.staging_bytes_for(contract.layer_layout, args.chunk_tokens, 1),
                    name="bench_ttft-probe",
                ) as probe_client,
                SidecarClient(
                    sc.socket_path,
                    TENANT,
                    staging_bytes=staging,
                    name="bench_ttft-sealed",
                    sealed_direct=True,
                ) as sealed_client,
            ):
                sidecar_pid = sc.pid
                progress(f"sidecar pid {sc.pid} on {sc.socket_path}")
                salt = client.salt
                if salt is None:
                    raise RuntimeError("the sidecar does not answer")
                progress(f"prefix: prefill {len(prefix)} tokens and save {n_chunks} chunks")
                t0 = time.perf_counter()
                pre = kd.prefill(model, prefix)
                prefix_prefill_s = time.perf_counter() - t0
                keys = chunk_keys(contract, salt, prefix)
                t0 = time.perf_counter()
                saved = client.save(
                    contract.fingerprint(),
                    list(zip(keys, kd.pack_chunks(pre.keys, pre.values, args.chunk_tokens),
                             strict=True)),
                )  # fmt: skip
                save_s = time.perf_counter() - t0
                if not all(saved):
                    raise RuntimeError(f"the sidecar saved {sum(saved)} of {len(saved)} chunks")
                os.sync()
                obj_paths = [sc.store_root / v1.object_relpath(TENANT, k) for k in keys]
                missing = [p for p in obj_paths if not p.exists()]
                if missing:
                    raise RuntimeError(f"saved objects not found: {missing[:2]}")
                bench = Bench(model, contract, client, prompt, len(prefix), obj_paths, pre)
                bench.probe_client = probe_client
                bench.sidecar_pid = sc.pid
                if not sealed_client.uses_sealed_direct():
                    raise RuntimeError("the sidecar offers no sealed direct reads (revision 16)")
                bench.sealed = WorkerSealed(
                    sealed_client, bench.kv_bytes // bench.reused_chunks, staging
                )
                bench.drop_ram_tier = SidecarTarget(Path(sc.socket_path)).drop_cache
                bench.progress = progress
                bench.run(args.rounds)
                for probes in bench.probes.values():
                    probes.join()
                sidecar_stats = dict(sc.stats)
            elapsed = time.perf_counter() - t_start
            facts["load average 1/5/15 min (end)"] = loadavg()
    except KeyboardInterrupt:
        err.print("interrupted: sidecar stopped, temp files removed")
        return 130
    facts["run time"] = f"{elapsed:.1f} s"
    facts["torch"] = (
        f"{torch.__version__}, torch.set_num_threads({args.threads}) -> "
        f"get_num_threads() = {torch.get_num_threads()}, interop threads "
        f"{torch.get_num_interop_threads()}"
    )
    facts["transformers"] = f"{transformers.__version__}, attention {config._attn_implementation}"
    facts["model"] = f"{shape.describe()}, fp32, random weights (seed {SEED})"
    facts["prompt"] = (
        f"{args.prefix_tokens} prefix + {args.suffix_tokens} suffix tokens; chunks of "
        f"{args.chunk_tokens} tokens: {n_chunks} chunks x {shape.num_layers} layers"
    )
    facts["KV of the prefix"] = (
        f"{bench.kv_bytes / MiB:.1f} MiB ({shape.kv_bytes_per_token()} B/token), "
        f"{bench.file_bytes / MiB:.1f} MiB of object files"
    )
    facts["sidecar"] = (
        f"python -m kvoffload.cli --dev serve (pid {sidecar_pid}); tenant {TENANT!r} "
        f"(dev policy: aes-256-gcm); durability {sidecar_stats.get('durability', '?')}"
    )
    facts["client"] = f"SidecarClient, staging {staging / MiB:.1f} MiB, load(into=prefix buffer)"
    facts["prefix set-up (untimed)"] = (
        f"prefill {prefix_prefill_s:.2f} s, save {save_s * 1e3:.0f} ms"
    )
    summ = summary(bench)
    render(console, facts, bench, summ)
    if args.json is not None:
        doc = {
            "machine": facts,
            "config": {
                "quick": args.quick,
                "rounds": args.rounds,
                "prefix_tokens": args.prefix_tokens,
                "suffix_tokens": args.suffix_tokens,
                "chunk_tokens": args.chunk_tokens,
                "threads": args.threads,
                "torch_threads": torch.get_num_threads(),
                "model": asdict(shape),
                "kv_bytes": bench.kv_bytes,
                "file_bytes": bench.file_bytes,
                "sidecar_pid": sidecar_pid,
            },
            "method": METHOD,
            "cold_method": COLD_METHOD,
            "summary": summ,
            "rows": [r.to_json() for r in bench.rows.values()],
            "exactness": asdict(bench.exact) | {"within_tolerance": bench.exact.within},
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
