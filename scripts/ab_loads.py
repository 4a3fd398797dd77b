"""A/B loads through a real sidecar: the same run, one source tree against another.

For each ``--src NAME=PATH`` (a ``src`` directory: ``PATH`` goes first on the
sidecar's PYTHONPATH) and each round, a fresh sidecar (durability object) is
started alone, saves ``(ops + 1) * batch`` chunks of the shape through
``SidecarClient.save``, and is timed loading them: cold (``os.sync`` and
``POSIX_FADV_DONTNEED`` on the batch's object files before every op) and then
warm, whole-chunk (``load(into=...)`` copying each chunk into a pre-touched
buffer) and, with ``--layerwise``, ``load_layerwise``. Interleaved with those
ops, op by op, the raw ceiling: a buffered ``preadv`` of the very same object
files into a pre-touched buffer, one file after the other and on 4 threads
(the faster is the ceiling). Sidecars run one at a time, alternating by round:
two sidecars (and their clients' staging buffers) alive at once bias the
second one's copies. The load average is printed with every row.

    PYTHONPATH=$PWD/src .venv/bin/python scripts/ab_loads.py \\
        --src before=/tmp/base/src --src after=$PWD/src --shape large --rounds 2 --layerwise

This is a measuring tool for the load path (issue 12), not a test: on a busy
machine only back-to-back pairs of the same run say anything.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchlib.chunks import NAMESPACE, Shape, mv, random_payload, split_layers, touched
from benchlib.method import drop_cache
from benchlib.sidecar import SEALED_TENANT, run_sidecar
from kvoffload.client import SidecarClient

SHAPES = {
    "large": Shape("large", 32, 1 << 20, "Llama-3-8B, 256 tokens", 0),
    "small": Shape("small", 4, 16 << 10, "4 x 16 KiB", 0),
}


def _one(name: str, src: str, a: argparse.Namespace, work: Path) -> str:
    shape = SHAPES[a.shape]
    pay = shape.layers * shape.layer_bytes
    payload = random_payload(pay, 7)
    layers = split_layers(payload, shape)
    nchunks = a.batch * (a.ops + 1)
    keys = [i.to_bytes(4, "big") + os.urandom(28) for i in range(nchunks)]
    with contextlib.ExitStack() as stack:
        sc = stack.enter_context(run_sidecar(work / name, "object", None, env={"PYTHONPATH": src}))
        client = stack.enter_context(
            SidecarClient(
                sc.socket,
                SEALED_TENANT,
                staging_bytes=max(256 << 20, 2 * a.batch * pay),
                timeout_s=120,
                name="ab_loads",
            )
        )
        for i in range(0, nchunks, a.batch):
            if not all(client.save(NAMESPACE, [(k, layers) for k in keys[i : i + a.batch]])):
                raise RuntimeError(f"{name}: save failed\n{sc.log_tail()}")
        os.sync()
        dst = mv(touched(a.batch * pay))

        def into(idx: int, _key: bytes, views: Sequence[memoryview]) -> None:
            at = idx * pay
            for v in views:
                dst[at : at + v.nbytes] = v
                at += v.nbytes

        def on_layer(layer: int, first: int, views: Sequence[memoryview]) -> None:
            for j, v in enumerate(views):
                at = (first + j) * pay + layer * shape.layer_bytes
                dst[at : at + v.nbytes] = v

        objs = [sc.object_path(SEALED_TENANT, k) for k in keys]
        fsize = objs[0].stat().st_size
        stride = -(-fsize // 4096) * 4096
        rbuf = mv(touched(a.batch * stride))
        slots = [rbuf[j * stride : j * stride + fsize] for j in range(a.batch)]
        pool = stack.enter_context(ThreadPoolExecutor(4))

        def raw(i: int, parallel: bool) -> None:
            paths = objs[i * a.batch : (i + 1) * a.batch]

            def read(j: int) -> None:
                fd = os.open(paths[j], os.O_RDONLY | os.O_CLOEXEC)
                try:
                    if os.preadv(fd, [slots[j]], 0) != fsize:
                        raise RuntimeError(f"{paths[j]}: short read")
                finally:
                    os.close(fd)

            if parallel:
                list(pool.map(read, range(len(paths))))
            else:
                for j in range(len(paths)):
                    read(j)

        def load(i: int, layerwise: bool) -> None:
            ks = keys[i * a.batch : (i + 1) * a.batch]
            got = client.load_layerwise(ks, on_layer) if layerwise else client.load(ks, into=into)
            if not all(r.ok for r in got):
                raise RuntimeError(f"{name}: a load missed\n{sc.log_tail()}")

        ops: list[tuple[str, Callable[[int], None]]] = [
            ("raw x1", lambda i: raw(i, False)),
            ("raw x4", lambda i: raw(i, True)),
            ("whole", lambda i: load(i, False)),
        ]
        if a.layerwise:
            ops.append(("layerwise", lambda i: load(i, True)))
        lines = []
        for cache in ("cold", "warm"):
            la = os.getloadavg()[0]
            total = dict.fromkeys((o[0] for o in ops), 0.0)
            for i in range(1, a.ops + 1):
                for oname, fn in ops[i % len(ops) :] + ops[: i % len(ops)]:
                    if cache == "cold":
                        drop_cache(objs[i * a.batch : (i + 1) * a.batch])
                    t = time.perf_counter()
                    fn(i)
                    total[oname] += time.perf_counter() - t
            gb = a.ops * a.batch * pay / 1e9
            ceil = max(gb / total["raw x1"], gb / total["raw x4"])
            cells = [
                f"{k} {gb / v:.3f}" + ("" if k.startswith("raw") else f" ({gb / v / ceil:.2f}x)")
                for k, v in total.items()
            ]
            lines.append(
                f"{name:>8} {a.shape} {cache}: GB/s " + "  ".join(cells) + f"  [load {la:.2f}]"
            )
        return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--src", action="append", required=True, help="NAME=PATH to a src directory")
    p.add_argument("--shape", choices=sorted(SHAPES), default="large")
    p.add_argument("--batch", type=int, default=8, help="chunks per load() call")
    p.add_argument("--ops", type=int, default=8, help="timed load() calls per row")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layerwise", action="store_true", help="also load_layerwise")
    p.add_argument("--dir", type=Path, default=None, help="file system to test (default: cwd)")
    a = p.parse_args(argv)
    srcs = [s.split("=", 1) for s in a.src]
    if any(len(s) != 2 for s in srcs):
        p.error("--src NAME=PATH")
    work = Path(tempfile.mkdtemp(prefix=".ab_loads-", dir=a.dir or Path.cwd()))
    try:
        for r in range(a.rounds):
            for name, src in srcs if r % 2 == 0 else list(reversed(srcs)):
                print(_one(name, str(Path(src).resolve()), a, work / f"r{r}"), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
