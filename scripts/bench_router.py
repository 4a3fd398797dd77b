#!/usr/bin/env python3
"""What ``kvoffload router`` adds to a request: latency and requests/s, direct vs through it.

One run, one machine: stand-in engines (small aiohttp servers answering
``/v1/completions`` with a short SSE stream at once: no model, so the numbers
are the HTTP path's own), a real ``kvoffload router`` process in front of them
with a real BPE tokenizer (trained here on the Python standard library's
sources, byte-level like GPT-2's and Llama 3's, with a BOS token), and one
client (aiohttp). Every prompt is a different text of about ``--tokens``
tokens, so the router tokenizes and hashes each one (sha256, vLLM's default).

- latency, concurrency 1: direct and through the router interleaved request
  by request, p50/p99 of each and the difference (the router's overhead);
- throughput, concurrency ``--concurrency``: requests/s direct (the ceiling of
  these engines and this client on this machine) and through the router, in
  alternating rounds, with the router's CPU per request.

The targets (issue 33): overhead ≤ 1 ms p50 for a 1k-token request; ≥ 1,000
requests/s at concurrency 32.

    PYTHONPATH=src python scripts/bench_router.py [--tokens 1000,8000] [--requests 300]
        [--concurrency 32] [--seconds 5] [--router-src DIR] [--json FILE]

``--router-src`` runs the router from another checkout's ``src`` (a before/after
comparison) with the same engines, client and tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

SSE = (
    b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"hi"}]}\n\n',
    b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"!"}]}\n\n'
    b"data: [DONE]\n\n",
)


# -- the stand-in engine (this script run with --engine) -----------------------------


def engine(port_file: Path) -> None:
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in SSE:
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n")

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)

    async def serve() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        site = web.SockSite(runner, sock)
        await site.start()
        port_file.write_text(str(sock.getsockname()[1]))
        await asyncio.Event().wait()

    asyncio.run(serve())


# -- set-up -----------------------------------------------------------------------------


def corpus(limit: int = 6 << 20) -> str:
    """Real text: the standard library's Python sources, up to ``limit`` characters."""
    parts: list[str] = []
    size = 0
    for p in sorted(Path(os.__file__).parent.glob("*.py")):
        try:
            t = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(t)
        size += len(t)
        if size >= limit:
            break
    return "".join(parts)


def make_tokenizer(folder: Path, text: str, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<s>", "</s>"], show_progress=False
    )
    lines = text.splitlines()
    tok.train_from_iterator((lines[i : i + 200] for i in range(0, len(lines), 200)), trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
        ),
        encoding="utf-8",
    )


def prompts(folder: Path, text: str, tokens: int, n: int) -> list[str]:
    """``n`` different windows of ``text`` of about ``tokens`` tokens each."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    sample = text[:200_000]
    per_char = len(tok.encode(sample).ids) / len(sample)
    width = int(tokens / per_char)
    step = max(1, (len(text) - width) // n)
    return [text[i * step : i * step + width] for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up")
        time.sleep(0.1)


def start_engine(d: Path, i: int) -> tuple[subprocess.Popen[bytes], str]:
    pf = d / f"engine{i}.port"
    proc = subprocess.Popen(
        [sys.executable, __file__, "--engine", str(pf)], stdout=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 60
    while not pf.exists() or not pf.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("a stand-in engine did not start")
        time.sleep(0.05)
    url = f"http://127.0.0.1:{pf.read_text()}"
    wait_http(url + "/health", proc)
    return proc, url


def start_router(
    d: Path, src: Path, tok: Path, urls: list[str], processes: int | None
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    lines = ["[router]", 'health_interval = "1s"', 'metrics_interval = "1s"', "[model]"]
    lines += [f'tokenizer = "{tok}"']
    if processes is not None:
        lines += [f"tokenizer_processes = {processes}"]
    for i, u in enumerate(urls):
        lines += ["[[workers]]", f'name = "e{i}"', f'url = "{u}"', f'node = "n{i}"']
    cfg = d / "router.toml"
    cfg.write_text("\n".join(lines) + "\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    env["PYTHONPATH"] = str(src)
    log = (d / "router.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvoffload.cli",
            "--config",
            str(cfg),
            "router",
            "--port",
            str(port),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc)
    return proc, url


# -- the client -------------------------------------------------------------------------


async def one(session: Any, url: str, prompt: str | list[int]) -> float:
    body = {"model": "m", "prompt": prompt, "max_tokens": 2, "stream": True}
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as r:
        data = await r.read()
        if r.status != 200 or not data.endswith(b"[DONE]\n\n"):
            raise RuntimeError(f"{url}: HTTP {r.status}: {data[:200]!r}")
    return time.perf_counter() - t0


async def latency(
    direct: list[str], router: str, texts: Sequence[str | list[int]]
) -> tuple[list[float], list[float]]:
    import aiohttp

    d: list[float] = []
    r: list[float] = []
    async with aiohttp.ClientSession() as s:
        for i, t in enumerate(texts[:8]):  # warm both paths (connections, caches)
            await one(s, direct[i % len(direct)], t)
            await one(s, router, t)
        for i, t in enumerate(texts):
            # Interleaved, the order swapped every other request: both see the same noise.
            if i % 2:
                d.append(await one(s, direct[i % len(direct)], t))
                r.append(await one(s, router, t))
            else:
                r.append(await one(s, router, t))
                d.append(await one(s, direct[i % len(direct)], t))
    return d, r


async def throughput(
    urls: list[str], texts: Sequence[str | list[int]], conc: int, seconds: float
) -> float:
    import aiohttp

    done = 0
    stop = time.perf_counter() + seconds

    async def loop(k: int) -> None:
        nonlocal done
        i = k
        while time.perf_counter() < stop:
            await one(s, urls[i % len(urls)], texts[i % len(texts)])
            done += 1
            i += conc

    conn = aiohttp.TCPConnector(limit=conc * 2)
    async with aiohttp.ClientSession(connector=conn) as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(loop(k) for k in range(conc)))
        return done / (time.perf_counter() - t0)


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its children (the router's tokenizer processes)."""
    total = cpu_s(pid)
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        kids = []
    for k in kids:
        with contextlib.suppress(OSError):  # a child that just exited
            total += cpu_s(int(k))
    return total


def cpu_s(pid: int) -> float:
    try:
        return time.clock_gettime((~pid << 3) | 2)
    except OSError:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--tokens", default="1000,8000", help="prompt sizes, comma-separated")
    ap.add_argument("--requests", type=int, default=300, help="per size, for the latency rows")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=5.0, help="per throughput round")
    ap.add_argument("--rounds", type=int, default=2, help="throughput rounds per path")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--router-src", type=Path, default=ROOT / "src")
    ap.add_argument(
        "--tokenizer-processes", type=int, help="[model] tokenizer_processes (default: unset)"
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.engine is not None:
        engine(args.engine)
        return
    sizes = [int(x) for x in args.tokens.split(",")]
    procs: list[subprocess.Popen[bytes]] = []
    out: dict[str, Any] = {"params": {k: str(v) for k, v in vars(args).items()}, "rows": []}
    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        d = Path(tmp)
        try:
            text = corpus()
            tok = d / "tok"
            t0 = time.perf_counter()
            make_tokenizer(tok, text, args.vocab)
            print(
                f"tokenizer: BPE, {args.vocab} tokens, trained in {time.perf_counter() - t0:.1f}s"
            )
            urls = []
            for i in range(args.engines):
                p, u = start_engine(d, i)
                procs.append(p)
                urls.append(u)
            rp, rurl = start_router(
                d, args.router_src.resolve(), tok, urls, args.tokenizer_processes
            )
            procs.append(rp)
            print(
                f"router from {args.router_src} (tokenizer_processes: "
                f"{args.tokenizer_processes}); {os.cpu_count()} cores on this machine"
            )
            from tokenizers import Tokenizer as Rust

            rust = Rust.from_file(str(tok / "tokenizer.json"))
            rows = []
            for n in sizes:
                texts = prompts(tok, text, n, args.requests)
                c0 = time.process_time()
                ids = [e.ids for e in (rust.encode(t) for t in texts)]
                alone = (time.process_time() - c0) / len(texts)
                for kind, ps in (("text", texts), ("token ids", ids)):
                    dl, rl = asyncio.run(latency(urls, rurl, ps))
                    rows.append(
                        {
                            "tokens": n,
                            "prompt": kind,
                            "tokenizer_alone_ms": alone * 1e3 if kind == "text" else None,
                            "direct_p50_ms": pct(dl, 0.5) * 1e3,
                            "direct_p99_ms": pct(dl, 0.99) * 1e3,
                            "router_p50_ms": pct(rl, 0.5) * 1e3,
                            "router_p99_ms": pct(rl, 0.99) * 1e3,
                            "overhead_p50_ms": statistics.median(
                                r - x for r, x in zip(rl, dl, strict=True)
                            )
                            * 1e3,
                        }
                    )
            out["rows"] = rows
            texts = prompts(tok, text, sizes[0], 2000)
            ids = [e.ids for e in (rust.encode(t) for t in texts)]
            out["throughput"] = []
            for kind, ps in (("text", texts), ("token ids", ids)):
                direct_rps: list[float] = []
                router_rps: list[float] = []
                cpu_per_req: list[float] = []
                for _ in range(args.rounds):
                    direct_rps.append(
                        asyncio.run(throughput(urls, ps, args.concurrency, args.seconds))
                    )
                    c0 = tree_cpu_s(rp.pid)
                    t1 = time.perf_counter()
                    rps = asyncio.run(throughput([rurl], ps, args.concurrency, args.seconds))
                    used = tree_cpu_s(rp.pid) - c0
                    router_rps.append(rps)
                    cpu_per_req.append(used / (rps * (time.perf_counter() - t1)))
                out["throughput"].append(
                    {
                        "tokens": sizes[0],
                        "prompt": kind,
                        "concurrency": args.concurrency,
                        "direct_rps": direct_rps,
                        "router_rps": router_rps,
                        "router_cpu_ms_per_request": [c * 1e3 for c in cpu_per_req],
                    }
                )
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
    report(out, args)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1), encoding="utf-8")


def report(out: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\nlatency, concurrency 1, {args.requests} requests per row (interleaved), "
        "stand-in engines answering at once; tokenizer alone: this client's CPU per prompt:"
    )
    head = ("tokens", "prompt", "tokenizer", "direct p50", "p99", "router p50", "p99", "overhead")
    print("{:>6} {:>9} {:>10} {:>11} {:>8} {:>11} {:>8} {:>9}".format(*head))
    for r in out["rows"]:
        alone = "-" if r["tokenizer_alone_ms"] is None else f"{r['tokenizer_alone_ms']:.2f}ms"
        cells = [r[k] for k in ("direct_p50_ms", "direct_p99_ms", "router_p50_ms")]
        cells += [r["router_p99_ms"], r["overhead_p50_ms"]]
        print(
            "{:>6} {:>9} {:>10} {:>9.2f}ms {:>6.2f}ms {:>9.2f}ms {:>6.2f}ms {:>7.2f}ms".format(
                r["tokens"], r["prompt"], alone, *cells
            )
        )

    def rounds(xs: list[float], fmt: str = "{:.0f}") -> str:
        return ", ".join(fmt.format(x) for x in xs)

    for t in out["throughput"]:
        d, r = max(t["direct_rps"]), max(t["router_rps"])
        print(
            f"\nthroughput, concurrency {t['concurrency']}, {t['tokens']}-token prompts as "
            f"{t['prompt']}, best of {len(t['direct_rps'])} rounds of {args.seconds:.0f}s each:"
        )
        print(f"  direct (the ceiling): {d:8.0f} req/s   rounds: {rounds(t['direct_rps'])}")
        print(f"  through the router:   {r:8.0f} req/s   rounds: {rounds(t['router_rps'])}")
        cpu = rounds(t["router_cpu_ms_per_request"], "{:.2f}")
        print(f"  router / direct: {r / d:.2f}; the router's CPU per request: {cpu} ms")
    print(
        "targets: overhead ≤ 1 ms p50 at 1k tokens; ≥ 1,000 req/s at concurrency 32. "
        f"This machine: {os.cpu_count()} cores, shared (load average "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}): client, engines and router on them."
    )


if __name__ == "__main__":
    main()
