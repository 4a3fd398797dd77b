"""Measure the lookup timing side channel of a real sidecar process (docs/threat-model.md).

A peer granted tenants ``own``, ``empty`` (which never stored anything) and
``padded`` (whose policy sets ``lookup_floor``) but not tenant ``other``
probes the sidecar's ``lookup`` through one connection whose ``hello`` names
all four (for ``other`` it gets the fake salt of protocol-v1 §5.1; it probes
with the keys ``other`` really stored, as an attacker who knows or guesses
the tokens and the salt would):

``forbidden_present``
    tenant ``other``, keys ``other`` stored (the answer is 0: forbidden, §6);
``forbidden_absent``
    tenant ``other``, keys nobody stored;
``empty_absent``
    tenant ``empty``: a real, empty tenant;
``own_absent``
    tenant ``own``, keys nobody stored (a miss in a tenant that has chunks);
``own_present``
    tenant ``own``, keys ``own`` stored (a hit, within the tenant);
``padded_present`` / ``padded_absent``
    the same in tenant ``padded`` (``--floor``, ``--jitter``; ``--floor 0s`` skips them);
``load_forbidden`` / ``load_empty``
    ``prepare_load`` instead of ``lookup``: of ``other``'s real keys, and in ``empty``.

Every kind runs ``--probes`` times, all kinds interleaved in one random order
(a loaded machine's drift hits every kind alike), after an untimed warm-up;
each probe is one request's round trip on the client (send to reply read).
For each kind: median, p90, minimum; for each pair: the difference of
medians, the Mann-Whitney U test's two-sided p-value (normal approximation
with tie correction, numpy only) and AUC = U / (n1 n2), the probability that
a probe of the first kind takes longer than one of the second (0.5: no
difference a prober could use). Every reply's ``found`` is checked: a
forbidden tenant answering anything but 0 stops the run.

The store is filled under a policy granting this uid every tenant; the
sidecar is then restarted with the probing policy (the index and files stay).

Usage::

    .venv/bin/python scripts/bench_timing.py                 # 2,000 probes per kind (~1 min)
    .venv/bin/python scripts/bench_timing.py --quick         # 200 per kind (seconds)
    .venv/bin/python scripts/bench_timing.py --floor 5ms --jitter 1ms --json out.json

The sidecar is stopped and the temp dir removed on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from rich.console import Console
from rich.table import Table

import kvoffload
from kvoffload import testing
from kvoffload.client import SidecarClient
from kvoffload.protocol import (
    Ack,
    Hello,
    HelloReply,
    Lookup,
    LookupReply,
    PrepareLoad,
    PrepareLoadReply,
    RegisterStaging,
    parse_reply,
    request_message,
)
from kvoffload.staging import StagingBuffer
from kvoffload.transport import UnixTransport
from kvoffload.units import parse_duration

OWN, OTHER, PADDED, EMPTY = "own", "other", "padded", "empty"
NAMESPACE = bytes(range(32))
LAYER_BYTES = 4096
KINDS = (
    "forbidden_present",
    "forbidden_absent",
    "empty_absent",
    "own_absent",
    "own_present",
    "padded_present",
    "padded_absent",
    "load_forbidden",
    "load_empty",
)
#: (a, b, what a difference between them would tell a prober)
PAIRS = (
    ("forbidden_present", "empty_absent", "forbidden (its keys) vs empty tenant"),
    ("forbidden_absent", "empty_absent", "forbidden vs empty tenant"),
    ("forbidden_present", "forbidden_absent", "presence in a forbidden tenant"),
    ("forbidden_present", "own_absent", "forbidden vs a miss where chunks are"),
    ("empty_absent", "own_absent", "empty vs a miss where chunks are"),
    ("own_present", "own_absent", "hit vs miss, unpadded"),
    ("padded_present", "padded_absent", "hit vs miss, padded"),
    ("load_forbidden", "load_empty", "prepare_load: forbidden vs empty"),
)
ALPHA = 0.01


# --------------------------------------------------------------------------- statistics


def mann_whitney(a: npt.NDArray[np.float64], b: npt.NDArray[np.float64]) -> dict[str, float]:
    """Two-sided Mann-Whitney U test, normal approximation with tie correction.

    Returns U (of ``a``), z, the p-value and AUC = U / (n1 n2): the probability
    that a value of ``a`` exceeds one of ``b`` (ties count half).
    """
    n1, n2 = len(a), len(b)
    if n1 == 0 or n2 == 0:
        raise ValueError("both samples need at least one value")
    both = np.concatenate([a, b])
    order = np.argsort(both, kind="mergesort")
    ranks = np.empty(len(both), dtype=np.float64)
    sorted_vals = both[order]
    # Average ranks of ties: each run of equal values gets the mean of its positions.
    starts = np.flatnonzero(np.r_[True, sorted_vals[1:] != sorted_vals[:-1]])
    ends = np.r_[starts[1:], len(both)]
    avg = (starts + ends + 1) / 2.0  # 1-based mean rank of each run
    ranks[order] = np.repeat(avg, ends - starts)
    u = float(ranks[:n1].sum() - n1 * (n1 + 1) / 2.0)
    n = n1 + n2
    ties = (ends - starts).astype(np.float64)
    var = n1 * n2 / 12.0 * ((n + 1) - float((ties**3 - ties).sum()) / (n * (n - 1)))
    mean = n1 * n2 / 2.0
    if var <= 0:
        return {"u": u, "z": 0.0, "p": 1.0, "auc": u / (n1 * n2)}
    # Continuity correction towards the mean.
    z = (u - mean - math.copysign(0.5, u - mean)) / math.sqrt(var) if u != mean else 0.0
    p = math.erfc(abs(z) / math.sqrt(2.0))
    return {"u": u, "z": z, "p": min(1.0, p), "auc": u / (n1 * n2)}


def describe(lat_s: npt.NDArray[np.float64]) -> dict[str, float]:
    us = lat_s * 1e6
    return {
        "n": len(us),
        "median_us": float(np.median(us)),
        "p90_us": float(np.percentile(us, 90)),
        "min_us": float(us.min()),
        "mean_us": float(us.mean()),
    }


# --------------------------------------------------------------------------- the sidecar


def _policy(grant: Sequence[str], floor: str, jitter: str) -> str:
    """The policy; without a floor it has no padding keys (a sidecar from before
    them can then be measured too)."""
    tenants = ", ".join(json.dumps(t) for t in grant)
    padded = ""
    if parse_duration(floor, require_unit=True):
        padded = f'[tenants.{PADDED}]\nlookup_floor = "{floor}"\nlookup_jitter = "{jitter}"\n\n'
    return (
        "version = 1\n\n"
        '[defaults]\nttl = "none"\nquota = "none"\n\n'
        f"{padded}[[grants]]\nuid = {os.getuid()}\ntenants = [{tenants}]\n"
    )


@contextlib.contextmanager
def sidecar(work: Path, sock: Path) -> Iterator[testing.SidecarProcess]:
    cmd = testing.cli_argv("--config", str(work / "config.toml"), "serve")
    proc = testing.SidecarProcess(
        work, sock, cmd, log_path=work / "sidecar.log", tie_to_parent=True
    )
    proc.start()
    try:
        proc.wait_ready(60.0)
        yield proc
    finally:
        proc.stop()


def setup(work: Path, sock: Path, floor: str, jitter: str) -> None:
    kek = work / "kek"
    fd = os.open(kek, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(32))
    os.close(fd)
    policy = work / "policy.toml"
    policy.write_text(_policy(["*"], floor, jitter), encoding="utf-8")
    policy.chmod(0o600)
    (work / "config.toml").write_text(
        "[store]\n"
        f"root = {json.dumps(str(work / 'store'))}\n"
        f"index_dir = {json.dumps(str(work / 'index'))}\n"
        'capacity = "none"\ndurability = "none"\n\n'
        f"[server]\nsocket = {json.dumps(str(sock))}\n\n"
        f"[security]\nkek_file = {json.dumps(str(kek))}\npolicy = {json.dumps(str(policy))}\n",
        encoding="utf-8",
    )


def fill(sock: Path, tenant: str, sets: int, keys: int, seed: int) -> list[tuple[bytes, ...]]:
    """Store ``sets`` key sets of ``keys`` chunks each in ``tenant``; the sets."""
    rng = random.Random(f"{seed}/{tenant}")
    layer = bytes(LAYER_BYTES)
    out = [tuple(rng.randbytes(32) for _ in range(keys)) for _ in range(sets)]
    with SidecarClient(sock, tenant, staging_bytes=8 << 20) as c:
        for ks in out:
            if not all(c.save(NAMESPACE, [(k, [layer]) for k in ks])):
                raise RuntimeError(f"could not store the key sets of tenant {tenant!r}")
    return out


class Prober:
    """One connection naming every tenant; a lookup's round trip, timed on the client."""

    def __init__(self, sock: Path) -> None:
        self.t = UnixTransport.connect(os.fspath(sock), timeout_s=30)
        self.rid = 0
        reply = self._call(Hello(1, 1, "bench_timing", (OWN, OTHER, PADDED, EMPTY)))
        if not isinstance(reply, HelloReply):
            raise RuntimeError(f"hello refused: {reply!r}")
        self.staging = StagingBuffer(1 << 20)
        reply = self._call(RegisterStaging(self.staging.size), [self.staging.fd])
        if not isinstance(reply, Ack):
            raise RuntimeError(f"register_staging refused: {reply!r}")

    def _call(self, req: Any, fds: Sequence[int] = ()) -> Any:
        self.rid += 1
        self.t.send(request_message(self.rid, req), fds)
        got, reply = parse_reply(self.t.recv().msg)
        if got != self.rid:
            raise RuntimeError(f"reply to {got}, expected {self.rid}")
        return reply

    def probe(self, verb: str, tenant: str, keys: tuple[bytes, ...]) -> tuple[int, float]:
        """One ``lookup`` (or ``prepare_load``): chunks found, and the round trip."""
        self.rid += 1
        req = Lookup(tenant, keys) if verb == "lookup" else PrepareLoad(tenant, keys)
        msg = request_message(self.rid, req)
        start = time.perf_counter()
        self.t.send(msg)
        frame = self.t.recv()
        elapsed = time.perf_counter() - start
        got, reply = parse_reply(frame.msg)
        if got != self.rid:
            raise RuntimeError(f"reply to {got}, expected {self.rid}")
        if isinstance(reply, LookupReply):
            return reply.found, elapsed
        if isinstance(reply, PrepareLoadReply) and reply.handle == 0:
            return sum(c.verified for c in reply.chunks), elapsed
        raise RuntimeError(f"unexpected reply {reply!r}")

    def close(self) -> None:
        self.t.close()
        self.staging.close()


# --------------------------------------------------------------------------- the run


def machine_facts() -> dict[str, Any]:
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count() or 0
    return {
        "cores": os.cpu_count(),
        "cores usable": affinity,
        "load average (1, 5, 15 min)": [round(x, 2) for x in os.getloadavg()],
        "kernel": platform.release(),
        "python": platform.python_version(),
        "git": _git_state(),
        # The sidecar imports the same package (PYTHONPATH): a before/after run says which.
        "kvoffload from": str(Path(kvoffload.__file__).resolve().parent.parent),
    }


def _git_state() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return head or "unknown"


def run(args: argparse.Namespace, work: Path, console: Console) -> dict[str, Any]:
    floor_s = parse_duration(args.floor, require_unit=True) or 0.0
    padded = floor_s > 0
    kinds = [k for k in KINDS if padded or not k.startswith("padded")]
    sock = work / "kvo.sock"
    setup(work, sock, args.floor, args.jitter)
    sets = 64
    with sidecar(work, sock):
        stored = {t: fill(sock, t, sets, args.keys, args.seed) for t in (OWN, OTHER, PADDED)}
    policy = work / "policy.toml"
    policy.write_text(_policy([OWN, PADDED, EMPTY], args.floor, args.jitter), encoding="utf-8")
    rng = random.Random(args.seed)
    schedule = [k for k in kinds for _ in range(args.probes)]
    rng.shuffle(schedule)
    warmup = [kinds[i % len(kinds)] for i in range(args.warmup)]
    lat: dict[str, list[float]] = {k: [] for k in kinds}
    expect_found = {
        "forbidden_present": 0,
        "forbidden_absent": 0,
        "empty_absent": 0,
        "own_absent": 0,
        "own_present": args.keys,
        "padded_present": args.keys,
        "padded_absent": 0,
        "load_forbidden": 0,
        "load_empty": 0,
    }
    load_before = os.getloadavg()
    with sidecar(work, sock) as proc:
        # The probes as the attacker prepares them: absent keys drawn now, not timed.
        probes: list[tuple[str, str, tuple[bytes, ...]]] = []  # kind, tenant, keys
        for kind in warmup + schedule:
            prefix = kind.split("_")[-1] if kind.startswith("load") else kind.split("_")[0]
            tenant = {"forbidden": OTHER, "own": OWN, "padded": PADDED, "empty": EMPTY}[prefix]
            if kind.endswith("present") or kind == "load_forbidden":
                keys = stored[tenant][rng.randrange(sets)]
            else:
                keys = tuple(rng.randbytes(32) for _ in range(args.keys))
            probes.append((kind, tenant, keys))
        prober = Prober(sock)
        try:
            for i, (kind, tenant, keys) in enumerate(probes):
                verb = "prepare_load" if kind.startswith("load") else "lookup"
                found, elapsed = prober.probe(verb, tenant, keys)
                if found != expect_found[kind]:
                    raise RuntimeError(
                        f"{kind}: lookup found {found}, expected {expect_found[kind]}"
                    )
                if i >= len(warmup):
                    lat[kind].append(elapsed)
        finally:
            prober.close()
        stats = proc.stats()
    load_after = os.getloadavg()
    arrays = {k: np.asarray(v, dtype=np.float64) for k, v in lat.items()}
    per_kind = {k: describe(a) for k, a in arrays.items()}
    pairs = []
    for a, b, what in PAIRS:
        if a not in arrays or b not in arrays:
            continue
        test = mann_whitney(arrays[a], arrays[b])
        pairs.append(
            {
                "a": a,
                "b": b,
                "what": what,
                "delta_median_us": per_kind[a]["median_us"] - per_kind[b]["median_us"],
                **test,
                "distinguishable": test["p"] < ALPHA,
            }
        )
    facts = machine_facts()
    facts["load average before probes"] = [round(x, 2) for x in load_before]
    facts["load average after probes"] = [round(x, 2) for x in load_after]
    return {
        "config": {
            "probes_per_kind": args.probes,
            "keys_per_lookup": args.keys,
            "warmup": args.warmup,
            "floor": args.floor if padded else None,
            "jitter": args.jitter if padded else None,
            "seed": args.seed,
            "alpha": ALPHA,
        },
        "facts": facts,
        "kinds": per_kind,
        "pairs": pairs,
        "lookup_padding": stats.get("lookup_padding", {}),
    }


def render(doc: dict[str, Any], console: Console) -> None:
    facts = Table(title="machine")
    facts.add_column("fact")
    facts.add_column("value")
    for k, v in doc["facts"].items():
        facts.add_row(k, str(v))
    console.print(facts)
    cfg = doc["config"]
    t = Table(
        title=f"lookup latency per probe kind ({cfg['probes_per_kind']} probes each, "
        f"{cfg['keys_per_lookup']} keys per lookup, interleaved; client round trip)"
    )
    for col in ("kind", "n", "median us", "p90 us", "min us"):
        t.add_column(col, justify="right" if col != "kind" else "left")
    for kind, s in doc["kinds"].items():
        t.add_row(
            kind, str(s["n"]), f"{s['median_us']:.1f}", f"{s['p90_us']:.1f}", f"{s['min_us']:.1f}"
        )
    console.print(t)
    p = Table(title=f"pairs: Mann-Whitney U, two-sided, normal approximation (alpha {ALPHA})")
    for col in ("a vs b", "tells", "delta median us", "p", "AUC", "verdict"):
        p.add_column(col)
    for r in doc["pairs"]:
        p.add_row(
            f"{r['a']} vs {r['b']}",
            r["what"],
            f"{r['delta_median_us']:+.1f}",
            f"{r['p']:.3g}",
            f"{r['auc']:.3f}",
            "DIFFERS" if r["distinguishable"] else "no difference found",
        )
    console.print(p)
    if cfg["floor"]:
        console.print(
            f"padded tenant: lookup_floor {cfg['floor']}, lookup_jitter {cfg['jitter']}; "
            f"sidecar's counts: {doc['lookup_padding']}"
        )


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="200 probes per kind (a smoke run)")
    ap.add_argument("--probes", type=int, default=None, help="probes per kind (default 2000)")
    ap.add_argument("--keys", type=int, default=4, help="keys per lookup (default 4)")
    ap.add_argument("--warmup", type=int, default=200, help="untimed probes first (default 200)")
    ap.add_argument("--floor", default="2ms", help='padded tenant\'s lookup_floor ("0s": none)')
    ap.add_argument("--jitter", default="1ms", help="padded tenant's lookup_jitter")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dir", type=Path, default=None, help="parent of the temp dir (default /tmp)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if args.probes is None:
        args.probes = 200 if args.quick else 2000
    if args.probes < 2 or args.keys < 1 or args.warmup < 0:
        ap.error("--probes must be at least 2, --keys at least 1, --warmup at least 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    console = Console() if sys.stdout.isatty() else Console(width=160)
    parent = args.dir or Path("/tmp")
    # AF_UNIX paths are limited to 107 bytes: a short temp dir.
    work = Path(tempfile.mkdtemp(prefix="kvt-", dir=parent if len(str(parent)) < 60 else "/tmp"))
    try:
        doc = run(args, work, console)
    except Exception as exc:
        log = work / "sidecar.log"
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
        print(f"bench_timing: {exc}\n{tail}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    render(doc, console)
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
