#!/usr/bin/env python3
"""What ``kvoffload router`` adds to a request: latency and requests/s, direct vs through it.

One run, one machine: stand-in engines (small aiohttp servers answering
``/v1/completions`` with a short SSE stream at once: no model, so the numbers
are the HTTP path's own), a real ``kvoffload router`` process in front of them
with a real BPE tokenizer (trained here on the Python standard library's
sources, byte-level like GPT-2's and Llama 3's, with a BOS token), and one
client (aiohttp). Every prompt is a different text of about ``--tokens``
tokens, so the router tokenizes and hashes each one (sha256, vLLM's default);
the same prompts are also sent as token ids (no tokenizing).

One table, a row per (size, prompt as text or token ids, path): direct to the
engines (the ceiling of these engines and this client on this machine), the
router, and with ``--peer-src`` a second router from another checkout (a
before/after in the same run, same engines, client and tokenizer):

- concurrency 1: every path interleaved request by request; p50/p99, and the
  router's overhead (+p50: median of the paired differences to direct);
- concurrency ``--concurrency``: requests/s per path in alternating rounds,
  the ratio to direct, latency p50/p99, and the router's CPU per request.

The targets (issue 33): overhead ≤ 1 ms p50 for a 1k-token request; ≥ 1,000
requests/s at concurrency 32.

    PYTHONPATH=src python scripts/bench_router.py [--quick] [--tokens 1000,8000]
        [--requests 300] [--concurrency 32] [--seconds 5] [--rounds 2]
        [--peer-src DIR] [--router-src DIR] [--loop L] [--peer-loop L] [--json FILE]
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


def chats(tok: Path, text: str, tokens: int, n: int, turns: int = 5) -> list[str]:
    """``n`` chat-like prompts of about ``tokens`` tokens: ``turns`` turns, one new per prompt.

    Prompt ``i`` is turns ``i .. i + turns - 1`` of one long conversation, each
    ``<s>…</s>`` (special tokens, as a chat template writes them): four of its
    five turns were in the prompt before, as in a chat's later turns.
    """
    window = prompts(tok, text, tokens // turns, n + turns)
    return ["".join(f"<s>{w}</s>" for w in window[i : i + turns]) for i in range(n)]


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
    d: Path, src: Path, tok: Path, urls: list[str], processes: int | None, loop: str | None = None
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
    # The checkout's src first; the caller's other paths after it (an optional
    # package installed aside, e.g. uvloop), never the caller's own checkout.
    here = {str(ROOT / "src"), str(src)}
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in here]
    env["PYTHONPATH"] = os.pathsep.join([str(src), *extra])
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
            *(["--loop", loop] if loop is not None else []),
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
    direct: list[str], routers: list[str], texts: Sequence[str | list[int]]
) -> tuple[list[float], list[list[float]]]:
    """Concurrency 1: each prompt direct and through each router, in turn, order rotating."""
    import aiohttp

    d: list[float] = []
    r: list[list[float]] = [[] for _ in routers]
    async with aiohttp.ClientSession() as s:
        for i, t in enumerate(texts[:8]):  # warm every path (connections, caches)
            await one(s, direct[i % len(direct)], t)
            for u in routers:
                await one(s, u, t)
        for i, t in enumerate(texts):
            # Interleaved, the order rotated every request: all paths see the same noise.
            paths: list[int] = [-1, *range(len(routers))]
            k = i % len(paths)
            for j in paths[k:] + paths[:k]:
                if j < 0:
                    d.append(await one(s, direct[i % len(direct)], t))
                else:
                    r[j].append(await one(s, routers[j], t))
    return d, r


async def throughput(
    urls: list[str], texts: Sequence[str | list[int]], conc: int, seconds: float
) -> tuple[float, list[float]]:
    """``conc`` clients for ``seconds``: requests/s and each request's latency."""
    import aiohttp

    lat: list[float] = []
    stop = time.perf_counter() + seconds

    async def loop(k: int) -> None:
        i = k
        while time.perf_counter() < stop:
            lat.append(await one(s, urls[i % len(urls)], texts[i % len(texts)]))
            i += conc

    conn = aiohttp.TCPConnector(limit=conc * 2)
    async with aiohttp.ClientSession(connector=conn) as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(loop(k) for k in range(conc)))
        return len(lat) / (time.perf_counter() - t0), lat


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
        "--peer-src",
        type=Path,
        help="a second router from another checkout's src, measured in the same run",
    )
    ap.add_argument(
        "--tokenizer-processes", type=int, help="[model] tokenizer_processes (default: unset)"
    )
    ap.add_argument(
        "--loop",
        choices=("auto", "uvloop", "asyncio"),
        help="the router's --loop (default: none given, i.e. auto)",
    )
    ap.add_argument("--peer-loop", choices=("auto", "uvloop", "asyncio"), help="the peer's")
    ap.add_argument(
        "--chat",
        action="store_true",
        help="also chat-like text prompts (turns between special tokens, 4 of 5 seen before)",
    )
    ap.add_argument("--quick", action="store_true", help="1k tokens, 100 requests, 2 rounds of 2 s")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.engine is not None:
        engine(args.engine)
        return
    if args.quick:
        args.tokens, args.requests, args.seconds, args.rounds = "1000", 100, 2.0, 2
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
            routers: list[tuple[str, subprocess.Popen[bytes], str]] = []
            named = [("kvoffload router", args.router_src, args.loop)]
            if args.peer_src is not None:
                named.append((f"peer: {args.peer_src}", args.peer_src, args.peer_loop))
            for j, (name, src, loop) in enumerate(named):
                rd = d / f"router{j}"
                rd.mkdir()
                rp, rurl = start_router(
                    rd, src.resolve(), tok, urls, args.tokenizer_processes, loop
                )
                procs.append(rp)
                routers.append((name, rp, rurl))
            print(
                f"router from {args.router_src} (tokenizer_processes: "
                f"{args.tokenizer_processes}); {os.cpu_count()} cores on this machine"
            )
            out["rows"] = measure(args, sizes, tok, text, urls, routers)
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


def measure(
    args: argparse.Namespace,
    sizes: list[int],
    tok: Path,
    text: str,
    urls: list[str],
    routers: list[tuple[str, subprocess.Popen[bytes], str]],
) -> list[dict[str, Any]]:
    """One row per (size, prompt kind, path): direct first, then each router."""
    from tokenizers import Tokenizer as Rust

    rust = Rust.from_file(str(tok / "tokenizer.json"))
    rows: list[dict[str, Any]] = []
    for n in sizes:
        texts = prompts(tok, text, n, max(args.requests, 2000))
        c0 = time.process_time()
        ids = [e.ids for e in (rust.encode(t) for t in texts[:100])]
        alone = (time.process_time() - c0) / 100
        ids = [e.ids for e in rust.encode_batch(texts)]
        kinds: list[tuple[str, Sequence[str | list[int]]]] = [("text", texts), ("token ids", ids)]
        if args.chat:
            # Enough that no prompt comes twice to a router in one run.
            kinds.append(("chat", chats(tok, text, n, max(args.requests, 6000))))
        for kind, ps in kinds:
            dl, rls = asyncio.run(latency(urls, [r[2] for r in routers], ps[: args.requests]))
            paths = [("direct (the ceiling)", None, urls)] + [(r[0], r[1], [r[2]]) for r in routers]
            tp: dict[str, dict[str, list[float]]] = {
                name: {"rps": [], "cpu": [], "lat": []} for name, _, _ in paths
            }
            for rnd in range(args.rounds):
                for name, proc, us in paths if rnd % 2 == 0 else paths[::-1]:
                    c0 = tree_cpu_s(proc.pid) if proc is not None else 0.0
                    t1 = time.perf_counter()
                    rps, lat = asyncio.run(throughput(us, ps, args.concurrency, args.seconds))
                    took = time.perf_counter() - t1
                    tp[name]["rps"].append(rps)
                    tp[name]["lat"] += lat
                    if proc is not None:
                        used = tree_cpu_s(proc.pid) - c0
                        tp[name]["cpu"].append(used / max(1.0, rps * took))
            for j, (name, _, _) in enumerate(paths):
                c1 = dl if j == 0 else rls[j - 1]
                row: dict[str, Any] = {
                    "tokens": n,
                    "prompt": kind,
                    "path": name,
                    "tokenizer_alone_ms": alone * 1e3 if kind == "text" else None,
                    "c1_p50_ms": pct(c1, 0.5) * 1e3,
                    "c1_p99_ms": pct(c1, 0.99) * 1e3,
                    "concurrency": args.concurrency,
                    "rps_rounds": tp[name]["rps"],
                    "rps": statistics.median(tp[name]["rps"]),
                    "cpu_ms_per_request": [c * 1e3 for c in tp[name]["cpu"]],
                    "cN_p50_ms": pct(tp[name]["lat"], 0.5) * 1e3,
                    "cN_p99_ms": pct(tp[name]["lat"], 0.99) * 1e3,
                }
                if j:
                    diffs = [r - x for r, x in zip(c1, dl, strict=True)]
                    row["overhead_p50_ms"] = statistics.median(diffs) * 1e3
                    row["overhead_p99_ms"] = (pct(c1, 0.99) - pct(dl, 0.99)) * 1e3
                rows.append(row)
    return rows


def report(out: dict[str, Any], args: argparse.Namespace) -> None:
    conc = args.concurrency
    print(
        f"\nStand-in engines answering at once (the HTTP path's own cost). Concurrency 1: "
        f"{args.requests} requests per path, interleaved request by request; +p50 is the "
        f"median of the paired differences to direct, +p99 the difference of the p99s. "
        f"Concurrency {conc}: median req/s of {args.rounds} rounds of {args.seconds:g} s per "
        "path, alternating; CPU: the router process's (and its children's) per request."
    )
    head = (
        "tokens",
        "prompt",
        "path",
        "c1 p50",
        "p99",
        "+p50",
        "+p99",
        f"c{conc} req/s",
        "×direct",
        "p50",
        "p99",
        "CPU/req",
    )
    fmt = "{:>6} {:>9} {:<22} {:>7} {:>7} {:>6} {:>6} {:>10} {:>7} {:>7} {:>7} {:>8}"
    print(fmt.format(*head))
    direct: dict[tuple[int, str], dict[str, Any]] = {}
    for r in out["rows"]:
        key = (r["tokens"], r["prompt"])
        if "overhead_p50_ms" not in r:
            direct[key] = r
        base = direct[key]
        cpu = r["cpu_ms_per_request"]
        cells = [
            r["tokens"],
            r["prompt"],
            r["path"][:22],
            f"{r['c1_p50_ms']:.2f}",
            f"{r['c1_p99_ms']:.2f}",
            f"{r['overhead_p50_ms']:.2f}" if "overhead_p50_ms" in r else "-",
            f"{r['overhead_p99_ms']:.2f}" if "overhead_p99_ms" in r else "-",
            f"{r['rps']:.0f}",
            f"{r['rps'] / base['rps']:.2f}",
            f"{r['cN_p50_ms']:.1f}",
            f"{r['cN_p99_ms']:.1f}",
            f"{statistics.median(cpu):.2f}" if cpu else "-",
        ]
        print(fmt.format(*cells))
    print("(ms; req/s rounds and CPU per round in --json)")
    for r in out["rows"]:
        if r["tokenizer_alone_ms"] is not None and r["path"] == "direct (the ceiling)":
            print(
                f"the tokenizer alone, {r['tokens']} tokens: {r['tokenizer_alone_ms']:.2f} ms "
                "of CPU per prompt (Rust encode, this client): the text rows' floor"
            )
    print("targets (issue 33): +p50 ≤ 1 ms at 1k tokens; ≥ 1,000 req/s at concurrency 32:")
    for r in out["rows"]:
        if r["tokens"] == 1000 and r["path"] == "kvoffload router":
            p50_ok = "met" if r["overhead_p50_ms"] <= 1.0 else "NOT met"
            rps_ok = "met" if r["rps"] >= 1000 else "NOT met"
            print(
                f"  {r['prompt']:>9}: +p50 {r['overhead_p50_ms']:.2f} ms ({p50_ok}); "
                f"{r['rps']:.0f} req/s ({rps_ok})"
            )
    print(
        f"This machine: {os.cpu_count()} cores, shared (load average "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}): client, engines and routers on them."
    )


if __name__ == "__main__":
    main()
