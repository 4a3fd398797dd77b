"""The LMCache peer: ``scripts/lmcache_peer.py`` run in its own venv, and its best rows.

The peer never imports kvoffload (LMCache pins numpy and torch); it runs as a
subprocess on the same directory, shapes and batch sizes as the benchmark
that runs it, and returns its rows as JSON.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

SCRIPTS = Path(__file__).resolve().parents[1]
LMCACHE_VENV = SCRIPTS.parent / ".venv-lmcache"
LMCACHE_PEER = SCRIPTS / "lmcache_peer.py"
LMCACHE_HOWTO = (
    "python3 -m venv .venv-lmcache && .venv-lmcache/bin/pip install torch==2.13.0 lmcache==0.5.6"
)


def run_lmcache_peer(
    py: Path,
    base: Path,
    err: Console,
    *,
    quick: bool,
    row_budget_s: float,
    large_mib_per_row: int,
    small_ops: int,
    large_batch: int,
    small_batch: int,
    durabilities: Sequence[str],
    shapes: Sequence[str] = ("large", "small"),
) -> tuple[str, dict[str, Any] | None]:
    """Run lmcache_peer.py with ``py`` (its venv's python) on ``base``; (one status line,
    its JSON or None). Never raises for a missing venv or a failed peer: the status says."""
    if not py.exists():
        return f"not run: {py} does not exist; create it with: {LMCACHE_HOWTO}", None
    out = base / "lmcache.json"
    cmd = [
        str(py),
        str(LMCACHE_PEER),
        "--dir",
        str(base),
        "--json",
        str(out),
        "--row-budget-s",
        str(row_budget_s),
        "--large-mib-per-row",
        str(large_mib_per_row),
        "--small-ops",
        str(small_ops),
        "--large-batch",
        str(large_batch),
        "--small-batch",
        str(small_batch),
        "--shapes",
        ",".join(shapes),
    ]
    durs = [d for d in durabilities if d in ("object", "none")]
    if not durs:
        return "not run: LMCache has only durabilities none (put) and object (put+fsync)", None
    cmd += ["--durability", ",".join(durs)]
    if quick:
        cmd.append("--quick")
    err.print(f"lmcache: {' '.join(cmd)}", highlight=False)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, cwd=base)
    try:
        rc = proc.wait()
    finally:
        if proc.poll() is None:  # we were interrupted: stop it (it cleans up, then _exit)
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if rc != 0 or not out.exists():
        return f"failed: lmcache_peer.py exited with {rc} (its stderr is above)", None
    doc: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    out.unlink()
    return "ran", doc


def best_lmcache(peer: dict[str, Any], shape: str, name: str) -> dict[str, Any] | None:
    """LMCache's fastest variant (buffered / O_DIRECT, as its run configured its threads)
    of row ``name`` (put, put+fsync, get cold, get warm) for ``shape``; None if none ran."""
    rows = [r for r in peer.get("rows", []) if r["shape"] == shape and r["name"] == name]
    return max(rows, key=lambda r: float(r["gbps"])) if rows else None
