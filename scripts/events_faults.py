#!/usr/bin/env python3
"""Failure mode 5 against a real sidecar: a consumer that misses events never diverges.

A dev sidecar with its KV-event feed, a small capacity (saves evict), and a
consumer following it over its ipc:// sockets. Each round does one random
thing: saves (with engine hashes), a purge of the tenant, a consumer pause
with saves meanwhile (a gap; beyond the buffer: an overrun), a consumer
killed and restarted (a new one, first contact), or a SIGKILL of the sidecar
and a restart (a new incarnation). After each round the consumer's view must
equal the store's truth, read back through the protocol (``lookup`` of every
chunk ever saved). Divergences (must be 0) and recoveries are printed.

    PYTHONPATH=src python scripts/events_faults.py [--rounds 1000] [--seed 1]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from kvoffload import protocol as p
from kvoffload.client import SidecarClient
from kvoffload.events.consumer import EventConsumer
from kvoffload.events.sources import Health, SourceSpec
from kvoffload.testing import dev_sidecar
from kvoffload.transport import UnixTransport

NS = bytes(range(32))
TENANT = "faults"
LAYER = 32 << 10


def _key(i: int) -> bytes:
    return i.to_bytes(4, "big") + b"\x3c" * 28


def _blocks(i: int) -> p.EngineBlocks:
    return p.EngineBlocks(tuple(i.to_bytes(4, "big") + bytes([j]) * 28 for j in range(2)), 16)


def _truth(c: SidecarClient, saved: set[int]) -> dict[Any, dict[Any, int]]:
    """What the store holds now; chunks found gone leave ``saved`` (ids are never reused)."""
    held: dict[Any, int] = {}
    for i in sorted(saved):
        if c.lookup([_key(i)]) == 1:
            for h in _blocks(i).hashes:
                held[h] = held.get(h, 0) + 1
        else:
            saved.discard(i)
    return {("STORAGE", "LOCAL"): held} if held else {}


def _purge(sock: Path) -> None:
    t = UnixTransport.connect(sock, timeout_s=30)
    try:
        for rid, req in enumerate((p.Hello(1, 1, "faults", (TENANT,)), p.Purge(TENANT)), 1):
            t.send(p.request_message(rid, req))
            p.parse_reply(t.recv().msg)
    finally:
        t.close()


def run(rounds: int, seed: int) -> int:
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="kvo-faults-", dir="/tmp"))
    policy = work / "policy.toml"
    policy.write_text(
        f'version = 1\n[[grants]]\nuid = {os.getuid()}\ntenants = ["*"]\nadmin = true\n'
    )
    env = {
        "KVOFFLOAD_EVENTS_ENABLED": "1",
        "KVOFFLOAD_EVENTS_BUFFER": "24",
        "KVOFFLOAD_STORE_CAPACITY": "1MiB",
        "KVOFFLOAD_POLICY": str(policy),
    }
    kinds: Counter[str] = Counter()
    recoveries: Counter[str] = Counter()
    divergences = 0
    saved: set[int] = set()
    next_id = 0
    try:
        with dev_sidecar(work, env=env) as running:
            proc = running.process
            sock = running.socket_path
            base = sock.parent
            spec = SourceSpec(
                "node", f"ipc://{base / 'kvevents.pub'}", f"ipc://{base / 'kvevents.replay'}",
                snapshots=True,
            )  # fmt: skip

            def client() -> SidecarClient:
                return SidecarClient(sock, TENANT, staging_bytes=1 << 20, timeout_s=30)

            def save(c: SidecarClient, n: int) -> None:
                nonlocal next_id
                for _ in range(n):
                    i, next_id = next_id, next_id + 1
                    layers = [bytes([i % 251]) * LAYER, bytes([(i + 3) % 251]) * LAYER]
                    if c.save(NS, [(_key(i), layers)], blocks=[_blocks(i)]) == [True]:
                        saved.add(i)

            consumer = EventConsumer([spec], request_timeout_s=5, idle_check_s=0)
            c = client()
            for r in range(rounds):
                op = rng.choice(["save", "save", "save", "purge", "pause", "consumer", "kill"])
                kinds[op] += 1
                if op == "save":
                    save(c, rng.randint(1, 4))
                elif op == "purge":
                    _purge(sock)
                elif op == "pause":
                    consumer.pause("node")
                    save(c, rng.randint(1, 40))  # beyond 24 batches: an overrun
                    consumer.resume("node")
                elif op == "consumer":
                    recoveries.update(consumer.status("node").recoveries)
                    consumer.close()
                    save(c, rng.randint(0, 3))  # while no consumer runs
                    consumer = EventConsumer([spec], request_timeout_s=5, idle_check_s=0)
                elif op == "kill":
                    c.close()
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
                    proc.start()
                    proc.wait_ready()
                    c = client()
                save(c, 1)  # a live batch after each round shows any gap
                deadline = time.monotonic() + 60
                while True:
                    consumer.poll(0.02)
                    consumer.sync("node")
                    # Read again each time: a purge removes its chunks in the background.
                    want = _truth(c, saved)
                    with consumer.lock:
                        same = consumer.view("node").snapshot() == want
                    if same and consumer.status("node").health is Health.LIVE:
                        break
                    if time.monotonic() > deadline:
                        divergences += 1
                        print(f"round {r} ({op}): diverged: {consumer.status('node')}")
                        break
            recoveries.update(consumer.status("node").recoveries)
            consumer.close()
            c.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rec = {str(k): v for k, v in sorted(recoveries.items())}
    print(f"{rounds} rounds {dict(kinds)}; divergences {divergences}; recoveries {rec}")
    return divergences


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    sys.exit(1 if run(args.rounds, args.seed) else 0)


if __name__ == "__main__":
    main()
