#!/usr/bin/env python3
"""What the KV-event feed costs: save throughput with events on vs off, and the
batches per second the sidecar's publisher sustains (docs/spec/events-v1.md).

Two dev sidecars in one run (events off, events on), the same chunks saved to
each in alternation so that both see the same disk and page cache; then the
publisher alone, with the durable (index) buffer and with an in-memory one
(its ceiling: no LMDB write per batch). The issue's bound: events cost at
most 5 % of save throughput for 32 MiB chunks.

    PYTHONPATH=src python scripts/bench_events.py [--chunk-mib 32] [--chunks 16] [--batches 20000]
"""

from __future__ import annotations

import argparse

from rich.console import Console

from benchlib.events import bench_publisher, bench_saves, events_table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunk-mib", type=int, default=32)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=16, help="engine blocks per chunk")
    ap.add_argument("--batches", type=int, default=20_000)
    args = ap.parse_args()
    console = Console()
    saves = bench_saves(args.chunk_mib, args.chunks, args.blocks)
    pub = bench_publisher(args.batches, args.blocks)
    title = "KV events: cost on saves, publisher rate"
    save = f"save {args.chunk_mib} MiB chunks"
    t, _cost = events_table(title, save, "events' cost on save throughput", "≤ 5 %", saves, pub)
    console.print(t)
    console.print(
        f"received {pub['index_received']:.0f}/{args.batches} (durable) and "
        f"{pub['memory_received']:.0f}/{args.batches} (memory) batches by one subscriber; "
        f"{args.blocks} engine blocks per event; medians over {args.chunks} saves each."
    )


if __name__ == "__main__":
    main()
