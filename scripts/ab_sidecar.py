"""A/B of `scripts/bench_sidecar.py`: two source trees, one invocation, rounds interleaved.

Each ``--tree NAME=PATH`` is a checkout (``PATH/src`` and ``PATH/scripts``): every
round runs that tree's own ``bench_sidecar.py`` with its own ``src`` first on
``PYTHONPATH`` (so a tree from before a package move benches its own code),
the trees alternating round by round (A B, B A, A B ...) so that a drift of the
machine's load falls on both. Arguments after ``--`` go to every run. The
table holds, per row of the target table and per lookup latency, the median
over rounds of each tree, the spread (min-max) and after/before: a row is
"worse" only where the ratio is below the other tree's own spread allows.

    .venv/bin/python scripts/ab_sidecar.py --tree before=/tmp/base --tree after=. \\
        --rounds 3 -- --quick --no-lmcache

A measuring tool, not a test: the machine's own noise is printed beside every
ratio (the spread of each tree's rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Samples:
    """One metric's values per tree, over rounds."""

    unit: str
    higher_is_better: bool
    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, tree: str, v: float | None) -> None:
        if v is not None:
            self.values.setdefault(tree, []).append(v)


def parse_trees(specs: Sequence[str]) -> list[tuple[str, Path]]:
    trees = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        root = Path(path).resolve()
        if not sep or not name:
            raise SystemExit(f"ab_sidecar: --tree wants NAME=PATH, got {spec!r}")
        if not (root / "src" / "kvoffload").is_dir() or not (root / "scripts").is_dir():
            raise SystemExit(f"ab_sidecar: {root} is not a kvoffload checkout (no src/kvoffload)")
        trees.append((name, root))
    if len(trees) != 2 or trees[0][0] == trees[1][0]:
        raise SystemExit("ab_sidecar: give exactly two --tree NAME=PATH with distinct names")
    return trees


#: bench_sidecar's line of the sidecar's CPU per 1-key lookup (a tree from before
#: its JSON held it prints it too).
_CPU_LINE = re.compile(r"(\w+)/sidecar CPU per 1-key lookup\s+([\d.]+) us")


def run_one(root: Path, python: str, args: Sequence[str], out: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": f"{root / 'src'}{os.pathsep}{root / 'scripts'}"}
    cmd = [python, str(root / "scripts" / "bench_sidecar.py"), *args, "--json", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise SystemExit(f"ab_sidecar: bench_sidecar in {root} failed ({proc.returncode}):\n{tail}")
    doc: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    if "lookup_cpu_us" not in doc:
        doc["lookup_cpu_us"] = dict(cpu_lines(f"{proc.stdout}\n{proc.stderr}"))
    return doc


def cpu_lines(text: str) -> list[tuple[str, float]]:
    """(durability, µs) of each line of the sidecar's CPU per 1-key lookup in ``text``."""
    return [(d, float(v)) for d, v in _CPU_LINE.findall(text)]


def collect(doc: dict[str, Any], tree: str, into: dict[str, Samples]) -> None:
    for t in doc.get("targets", []):
        into.setdefault(f"{t['id']} GB/s", Samples("GB/s", True)).add(tree, t.get("ours_gbps"))
    for dur, us in doc.get("lookup_cpu_us", {}).items():
        name = f"{dur}/sidecar CPU per 1-key lookup µs"
        into.setdefault(name, Samples("µs", False)).add(tree, us)
    for lt in doc.get("latency", []):
        for q in ("p50_us", "p99_us"):
            name = f"{lt['kind']} {lt['id']} {q[:3]}"
            into.setdefault(name, Samples("µs", False)).add(tree, lt.get(q))


def verdict(s: Samples, a: str, b: str) -> tuple[float | None, str]:
    va, vb = s.values.get(a, []), s.values.get(b, [])
    if not va or not vb:
        return None, "missing"
    ma, mb = statistics.median(va), statistics.median(vb)
    if ma <= 0:
        return None, "-"
    ratio = mb / ma
    # Beyond noise: every round of one tree on the far side of every round of the other.
    if s.higher_is_better:
        worse, better = max(vb) < min(va), min(vb) > max(va)
    else:
        worse, better = min(vb) > max(va), max(vb) < min(va)
    return ratio, "worse" if worse else "better" if better else "within noise"


def render(samples: dict[str, Samples], a: str, b: str, rounds: int) -> str:
    lines = [
        f"A/B of bench_sidecar: {a} vs {b}, {rounds} round(s) each, interleaved; "
        "median [min-max] over rounds",
        f"{'metric':<44} {a:>22} {b:>22} {b + '/' + a:>10}  verdict",
    ]

    def cell(vals: list[float]) -> str:
        if not vals:
            return "-"
        return f"{statistics.median(vals):.3f} [{min(vals):.3g}-{max(vals):.3g}]"

    for name, s in samples.items():
        ratio, v = verdict(s, a, b)
        r = f"{ratio:.3f}" if ratio is not None else "-"
        ca, cb = cell(s.values.get(a, [])), cell(s.values.get(b, []))
        lines.append(f"{name:<44} {ca:>22} {cb:>22} {r:>10}  {v}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, passthrough = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", default=[], help="NAME=PATH of a checkout (twice)")
    p.add_argument("--rounds", type=int, default=3, help="runs of each tree (default 3)")
    p.add_argument("--python", default=sys.executable, help="interpreter for both trees")
    p.add_argument("--json", type=Path, default=None, help="also write every sample here")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    trees = parse_trees(args.tree)
    samples: dict[str, Samples] = {}
    loads: list[list[float]] = []
    with tempfile.TemporaryDirectory(prefix="kvo-ab-") as tmp:
        for r in range(args.rounds):
            order = trees if r % 2 == 0 else trees[::-1]
            for name, root in order:
                print(f"round {r + 1}/{args.rounds}: {name} ({root})", file=sys.stderr, flush=True)
                doc = run_one(root, args.python, passthrough, Path(tmp) / f"{name}-{r}.json")
                collect(doc, name, samples)
                loads.append(list(os.getloadavg()))
    a, b = trees[0][0], trees[1][0]
    print(render(samples, a, b, args.rounds))
    print(f"load average (1, 5, 15 min) after each run: {[round(x[0], 2) for x in loads]}")
    if args.json is not None:
        doc = {
            "trees": {n: str(t) for n, t in trees},
            "rounds": args.rounds,
            "args": passthrough,
            "samples": {k: {"unit": s.unit, "values": s.values} for k, s in samples.items()},
            "loadavg": loads,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
