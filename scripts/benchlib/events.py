"""The KV-event rows: save throughput with events on vs off, and the batches per
second the sidecar's publisher sustains (docs/spec/events-v1.md)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

from rich.table import Table

from kvoffload import protocol as p
from kvoffload.client import SidecarClient
from kvoffload.testing import dev_sidecar

NS = bytes(range(32))


def _blocks(i: int, n: int) -> p.EngineBlocks:
    return p.EngineBlocks(
        tuple(i.to_bytes(4, "big") + bytes([j]) * 28 for j in range(n)), 16, group_idx=0
    )


def bench_saves(chunk_mib: int, chunks: int, blocks_per_chunk: int) -> dict[str, float]:
    layer = os.urandom(1 << 20) * (chunk_mib // 2 or 1)
    layers = [layer, layer]
    payload = sum(len(x) for x in layers)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    with contextlib.ExitStack() as stack:
        clients: dict[str, SidecarClient] = {}
        for name, env in (("off", {}), ("on", {"KVOFFLOAD_EVENTS_ENABLED": "1"})):
            d = Path(tempfile.mkdtemp(prefix=f"kvo-bench-ev-{name}-", dir="/tmp"))
            stack.callback(shutil.rmtree, d, True)
            running = stack.enter_context(dev_sidecar(d, env=env))
            clients[name] = stack.enter_context(
                SidecarClient(running.socket_path, "bench", staging_bytes=2 * payload + (1 << 20))
            )
        for i in range(chunks):
            for name in ("off", "on") if i % 2 == 0 else ("on", "off"):
                key = i.to_bytes(4, "big") + name.encode().ljust(28, b"\0")
                blocks = [_blocks(i, blocks_per_chunk)] if name == "on" else None
                t0 = time.perf_counter()
                ok = clients[name].save(NS, [(key, layers)], blocks=blocks)
                dt = time.perf_counter() - t0
                if ok != [True]:
                    raise SystemExit(f"save {i} to the events-{name} sidecar failed")
                rates[name].append(payload / dt)
    med = {k: sorted(v)[len(v) // 2] for k, v in rates.items()}
    return {"off": med["off"], "on": med["on"], "payload": float(payload)}


def bench_publisher(batches: int, blocks_per_chunk: int) -> dict[str, float]:
    import zmq

    from kvoffload.events.publisher import KVEventPublisher, MemoryReplayBuffer
    from kvoffload.events.wire import BlockStored
    from kvoffload.sidecar.events import IndexReplayBuffer
    from kvoffload.store.index import Index

    out: dict[str, float] = {}
    d = Path(tempfile.mkdtemp(prefix="kvo-bench-pub-", dir="/tmp"))
    try:
        for name in ("memory", "index"):
            ctx = zmq.Context()
            idx = Index(d / f"index-{name}") if name == "index" else None
            buf = IndexReplayBuffer(idx) if idx is not None else MemoryReplayBuffer()
            pub = KVEventPublisher(f"ipc://{d}/{name}.pub", buffer=buf, context=ctx)
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.RCVHWM, 0)
            sub.connect(f"ipc://{d}/{name}.pub")
            time.sleep(0.2)  # let the subscription reach the publisher
            ev = BlockStored(
                tuple(_blocks(0, blocks_per_chunk).hashes), None, (), 16, None, "STORAGE", None
            )
            t0 = time.perf_counter()
            for _ in range(batches):
                pub.publish([ev])
            got = 0
            while got < batches and sub.poll(2000):
                sub.recv_multipart()
                got += 1
            dt = time.perf_counter() - t0
            out[name] = batches / dt
            out[f"{name}_received"] = float(got)
            pub.close()
            sub.close(linger=0)
            if idx is not None:
                idx.close()
            ctx.term()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return out


def events_table(
    title: str, save: str, cost: str, bound: str, saves: dict[str, float], pub: dict[str, float]
) -> tuple[Table, float]:
    """The rows of :func:`bench_saves` and :func:`bench_publisher` (``save``: what the
    save rows say they save, ``cost``: the cost row's name), and the cost in %."""
    pct = 100.0 * (1 - saves["on"] / saves["off"])
    t = Table(title=title)
    for col in ("row", "value", "peer / ceiling", "bound"):
        t.add_column(col)
    t.add_row(f"{save}, events off (median MB/s)", f"{saves['off'] / 1e6:.0f}", "-", "-")
    t.add_row(
        f"{save}, events on (median MB/s)",
        f"{saves['on'] / 1e6:.0f}",
        f"off: {saves['off'] / 1e6:.0f}",
        "-",
    )
    t.add_row(cost, f"{pct:.1f} %", "-", bound)
    t.add_row(
        "publisher, durable buffer (batches/s)",
        f"{pub['index']:.0f}",
        f"memory buffer: {pub['memory']:.0f}",
        "-",
    )
    return t, pct
