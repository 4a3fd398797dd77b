"""Live router benchmark: kvoffload router, sglang-router, round-robin; same engines and trace.

N stand-in engines (:mod:`benchlib.live_engine`: an OpenAI-compatible HTTP
server over vLLM 0.33's real v1 scheduler and KV-cache manager, stepping in
compressed real time with the step-time model of ``scripts/benchlib/sim_vllm.py``,
publishing vLLM's KV events over ZMQ with vLLM's own publisher) serve, one
router after another, the same slice of a Mooncake trace replayed by one
client that measures TTFT at the first byte of each SSE body. Between two
routers the engines' prefix caches are emptied (vLLM's
``reset_prefix_cache``), so every router starts from cold engines.

Rows:

- ``kvoffload``: ``kvoffload router`` configured with the engines, their
  event endpoints, the tokenizer, block size and the deployment's budget and
  KV size as ``[priors]`` (none of the step model);
- ``sglang``: ``sglang-router`` (the Rust router from PyPI) ``--policy
  cache_aware`` with its defaults;
- ``round-robin``: ``sglang-router --policy round_robin``; without
  sglang-router, the client's own round-robin straight to the engines.

Prompts are text: each 512-token block of a trace's ``hash_ids`` becomes 512
words of a word-level tokenizer built on the spot (one word a token, derived
from the id: the same id at the same position gives the same vLLM block hash),
so that sglang-router, which routes on text, and kvoffload, which tokenizes,
see the prompt each as in production. Ceilings in the same run: the TTFT of an
idle, cold engine for the median request (measured through HTTP, and the step
model's value), and the infinite-cache bound of the prefix hit share.

Run under the vLLM venv, e.g. ``.venv-vllm/bin/python scripts/bench_router_live.py``.
sglang-router: ``--sglang-python`` (an interpreter that imports
``sglang_router``), else ``.venv-sglang-router/bin/python`` of the repository
(``requirements/sglang-router.txt``), else this interpreter.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from benchlib.trace import BLOCK, Req, infinite_cache_missing, load_trace

ROOT = Path(__file__).resolve().parents[1]
_TRACE = Path("shared") / "traces" / "mooncake_synthetic_trace.jsonl"
#: ``../shared/traces/`` beside the checkout (a worktree's is one level further up).
DEFAULT_TRACE = next((p / _TRACE for p in ROOT.parents if (p / _TRACE).is_file()), ROOT / _TRACE)
VOCAB = 32_000
ROWS = ("kvoffload", "sglang", "round-robin")


# -- prompts -----------------------------------------------------------------------


def make_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer: ``t<i>`` is token ``i``; no special tokens added."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB)}
    vocab["<unk>"] = VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return folder


def prompt_text(blocks: Sequence[int], n: int, cache: dict[int, list[str]]) -> str:
    words: list[str] = []
    for h in blocks:
        got = cache.get(h)
        if got is None:
            rng = random.Random(h * 7919 + 1)
            got = [f"t{rng.randrange(VOCAB)}" for _ in range(BLOCK)]
            cache[h] = got
        words.extend(got)
        if len(words) >= n:
            break
    return " ".join(words[:n])


# -- processes ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def child_env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "scripts"), str(ROOT / "src")])
    return e


def http(url: str, body: object = None, timeout: float = 30) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), bytes(exc.read())


class Proc:
    def __init__(self, argv: list[str], log: Path) -> None:
        self._log = log.open("wb")
        self.log = log
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=self._log
        )

    def first_line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline().decode().strip() if ready else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


@dataclass
class Engine:
    name: str
    proc: Proc
    url: str
    events: str
    replay: str


def start_engines(args: argparse.Namespace, tok: Path, work: Path) -> list[Engine]:
    engines: list[Engine] = []
    for i in range(args.engines):
        name = f"e{i}"
        ev, rp = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        argv = [
            sys.executable, "-m", "benchlib.live_engine", "--name", name,
            "--events", ev, "--replay", rp, "--tokenizer", str(tok),
            "--gpu-blocks", str(args.gpu_blocks), "--budget", str(args.budget),
            "--time-scale", str(args.time_scale), "--noise", str(args.noise),
            "--seed", str(args.seed + i),
        ]  # fmt: skip
        engines.append(Engine(name, Proc(argv, work / f"{name}.log"), "", ev, rp))
    for e in engines:
        line = e.proc.first_line(180)
        if not line.isdigit():
            raise RuntimeError(f"engine {e.name} did not start: {e.proc.log.read_text()[-800:]}")
        e.url = f"http://127.0.0.1:{line}"
    return engines


def wait_http(url: str, proc: Proc, what: str, ok: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            status, body = http(url, timeout=5)
            if ok(status, body):
                return
        except OSError:
            pass
        if proc.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start: {proc.log.read_text()[-800:]}")
        time.sleep(0.2)


def start_kvoffload(args: argparse.Namespace, engines: list[Engine], tok: Path, work: Path) -> Any:
    port = free_port()
    lines = [
        "[router]",
        'host = "127.0.0.1"',
        'health_interval = "1s"',
        'metrics_interval = "0.5s"',
        "[model]",
        f'tokenizer = "{tok}"',
        f"block_size = {BLOCK}",
        'hash_algorithm = "sha256"',
        "[priors]",
        f"prefill_budget_tokens = {args.budget}",
        f"kv_capacity_tokens = {args.gpu_blocks * BLOCK}",
    ]
    for e in engines:
        lines += [
            "[[workers]]",
            f'name = "{e.name}"',
            f'url = "{e.url}"',
            f'node = "node-{e.name}"',
            f'events = "{e.events}"',
            f'events_replay = "{e.replay}"',
        ]
    cfg = work / "kvoffload-router.toml"
    cfg.write_text("\n".join(lines) + "\n", encoding="utf-8")
    argv = [sys.executable, "-m", "kvoffload.cli", "--config", str(cfg), "router"]
    proc = Proc([*argv, "--port", str(port)], work / "kvoffload-router.log")

    def live(status: int, body: bytes) -> bool:
        if status != 200:
            return False
        return bool(json.loads(body).get("mode") == "exact")

    wait_http(f"http://127.0.0.1:{port}/health", proc, "kvoffload router", live)
    return proc, f"http://127.0.0.1:{port}"


def sglang_python(args: argparse.Namespace) -> str | None:
    cands: list[str] = [str(args.sglang_python)] if args.sglang_python else []
    cands.append(str(ROOT / ".venv-sglang-router" / "bin" / "python"))
    for c in cands:
        if c and Path(c).exists():
            r = subprocess.run([c, "-c", "import sglang_router"], capture_output=True, check=False)
            if r.returncode == 0:
                return c
    return str(sys.executable) if importlib.util.find_spec("sglang_router") else None


def start_sglang(py: str, policy: str, engines: list[Engine], work: Path) -> Any:
    port = free_port()
    argv = [
        py, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--policy", policy, "--log-level", "warn", "--worker-urls", *[e.url for e in engines],
    ]  # fmt: skip
    proc = Proc(argv, work / f"sglang-router-{policy}.log")
    wait_http(f"http://127.0.0.1:{port}/health", proc, "sglang-router", lambda s, b: s == 200)
    return proc, f"http://127.0.0.1:{port}"


# -- the client --------------------------------------------------------------------


@dataclass
class Outcome:
    ttft_s: float | None = None
    complete: bool = False
    error: str | None = None
    engine: str | None = None


@dataclass
class Row:
    router: str
    detail: str
    requests: int
    complete: int
    errors: int
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    gpu_hit_share: float
    per_engine: dict[str, int] = field(default_factory=dict)
    engine_lag_s: float = 0.0
    span_s: float = 0.0


def count_events(body: bytes) -> tuple[int, bool]:
    n = 0
    done = False
    for ev in body.split(b"\n\n"):
        ev = ev.strip()
        if not ev.startswith(b"data: "):
            continue
        data = ev[6:]
        if data == b"[DONE]":
            done = True
            continue
        obj = json.loads(data)
        if "error" in obj:
            return n, False
        n += len(obj.get("choices") or ())
    return n, done


async def one(session: Any, url: str, prompt: str, out: int, at: float, o: Outcome) -> None:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, at - loop.time()))
    body = {"model": "m", "prompt": prompt, "max_tokens": out, "stream": True, "ignore_eos": True}
    t0 = loop.time()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            o.engine = resp.headers.get("X-KVOffload-Worker")
            if resp.status != 200:
                o.error = f"HTTP {resp.status}"
                await resp.read()
                return
            buf = bytearray()
            async for chunk in resp.content.iter_any():
                if o.ttft_s is None and chunk:
                    o.ttft_s = loop.time() - t0
                buf += chunk
        n, done = count_events(bytes(buf))
        o.complete = done and n == out
        if not o.complete:
            o.error = f"stream ended after {n} of {out} tokens (done={done})"
    except Exception as exc:  # a transport error is this request's error, not the run's
        o.error = f"{type(exc).__name__}: {exc}"


async def replay(urls: list[str], reqs: list[tuple[float, str, int]]) -> list[Outcome]:
    import aiohttp

    outcomes = [Outcome() for _ in reqs]
    timeout = aiohttp.ClientTimeout(total=600)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        t0 = asyncio.get_running_loop().time() + 0.2
        await asyncio.gather(
            *(
                one(session, urls[i % len(urls)], p, out, t0 + at, outcomes[i])
                for i, (at, p, out) in enumerate(reqs)
            )
        )
    return outcomes


def pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def reset(engines: list[Engine]) -> None:
    for e in engines:
        for _ in range(100):
            status, _ = http(f"{e.url}/_reset", {})
            if status == 200:
                break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"engine {e.name} would not reset its prefix cache")


def engine_stats(engines: list[Engine]) -> dict[str, dict[str, Any]]:
    return {e.name: json.loads(http(f"{e.url}/_stats")[1]) for e in engines}


def run_row(
    router: str, detail: str, urls: list[str], engines: list[Engine], reqs: list[Any]
) -> Row:
    reset(engines)
    t0 = time.monotonic()
    outcomes = asyncio.run(replay(urls, reqs))
    span = time.monotonic() - t0
    st = engine_stats(engines)
    ttfts = [o.ttft_s for o in outcomes if o.complete and o.ttft_s is not None]
    prompt = sum(s["prompt_tokens"] for s in st.values())
    hits = sum(s["hit_tokens"] for s in st.values())
    errs = [o.error for o in outcomes if o.error]
    if errs:
        print(f"  {router}: {len(errs)} errors, first: {errs[0]}", file=sys.stderr)
    return Row(
        router=router,
        detail=detail,
        requests=len(reqs),
        complete=sum(o.complete for o in outcomes),
        errors=len(errs),
        ttft_p50_s=pct(ttfts, 0.5),
        ttft_p90_s=pct(ttfts, 0.9),
        ttft_p99_s=pct(ttfts, 0.99),
        gpu_hit_share=hits / prompt if prompt else 0.0,
        per_engine={n: int(s["requests"]) for n, s in st.items()},
        engine_lag_s=sum(float(s["lag_s"]) for s in st.values()),
        span_s=span,
    )


def idle_ttft(engines: list[Engine], prompt: str, out: int) -> float:
    """The ceiling: an idle, cold engine's TTFT for one request, through HTTP."""
    reset(engines)
    got = asyncio.run(replay([engines[0].url], [(0.0, prompt, out)]))[0]
    if got.ttft_s is None or not got.complete:
        raise RuntimeError(f"the idle engine did not answer: {got.error}")
    return got.ttft_s


# -- main --------------------------------------------------------------------------


def build_requests(args: argparse.Namespace, trace: list[Req]) -> tuple[list[Any], dict[str, Any]]:
    from benchlib.vllm_engine import StepModel, scaled

    t0 = trace[0].arrival  # the slice's own clock: it starts at 0, as the load scaling assumes
    trace = [replace(r, arrival=r.arrival - t0) for r in trace]
    missing, inf_hit = infinite_cache_missing(trace)
    step = StepModel()
    at = scaled(trace, missing, step, args.budget, args.engines, args.load)
    t_first = at[0].arrival
    cache: dict[int, list[str]] = {}
    reqs = [
        ((r.arrival - t_first) * args.time_scale, prompt_text(r.blocks, r.n, cache), args.max_out)
        for r in at
    ]
    med = sorted(trace, key=lambda r: r.n)[len(trace) // 2]
    facts = {
        "infinite_cache_hit_share": inf_hit,
        "median_prompt_tokens": med.n,
        "median_prompt": prompt_text(med.blocks, med.n, cache),
        "model_idle_ttft_s": step.prefill_s(med.n, 0, args.budget) * args.time_scale,
        "replay_span_s": reqs[-1][0],
    }
    return reqs, facts


def print_table(rows: list[Row], facts: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\n{args.engines} engines (vLLM 0.33 scheduler, stand-in runner), "
        f"{len(rows[0].per_engine) if rows else 0} answering; trace {args.trace.name} "
        f"[{args.offset}:{args.offset + args.requests}], load {args.load}, "
        f"time scale {args.time_scale} (TTFT in wall seconds), max_tokens {args.max_out}"
    )
    head = f"{'router':<12} {'what':<34} {'reqs':>5} {'full':>5} {'err':>4} "
    head += f"{'p50 s':>7} {'p90 s':>7} {'p99 s':>7} {'GPU hit':>8} {'lag s':>6}  per engine"
    print(head)
    for r in rows:
        per = " ".join(f"{v}" for v in r.per_engine.values())
        print(
            f"{r.router:<12} {r.detail:<34} {r.requests:>5} {r.complete:>5} {r.errors:>4} "
            f"{r.ttft_p50_s:>7.3f} {r.ttft_p90_s:>7.3f} {r.ttft_p99_s:>7.3f} "
            f"{r.gpu_hit_share:>7.1%} {r.engine_lag_s:>6.2f}  {per}"
        )
    print(
        f"{'ceiling':<12} {'idle cold engine, median request':<34} {'1':>5} {'':>5} {'':>4} "
        f"{facts['idle_ttft_s']:>7.3f} {'':>7} {'':>7} "
        f"{facts['infinite_cache_hit_share']:>7.1%}  (model: {facts['model_idle_ttft_s']:.3f} s "
        f"for {facts['median_prompt_tokens']} tokens; hit share: the infinite-cache bound)"
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument(
        "--offset", type=int, help="skip the trace's first N requests (default: the last ones)"
    )
    ap.add_argument("--requests", type=int, help="default 160 (--quick: 24)")
    ap.add_argument("--engines", type=int, help="default 4 (--quick: 2)")
    ap.add_argument("--load", type=float, default=0.85, help="prefill busy share (inf. cache)")
    ap.add_argument("--time-scale", type=float, help="wall s per modelled s (default 0.2)")
    ap.add_argument("--max-out", type=int, default=8, help="max_tokens of every request")
    ap.add_argument("--gpu-blocks", type=int, default=600, help="KV blocks of 512 per engine")
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--noise", type=float, default=0.0, help="σ of each prefill's time")
    ap.add_argument("--row", choices=ROWS, action="append", help="default: all three")
    ap.add_argument("--sglang-python", help="a Python that imports sglang_router")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--quick", action="store_true", help="24 requests, 2 engines: for tests")
    args = ap.parse_args(argv)
    args.requests = args.requests or (24 if args.quick else 160)
    args.engines = args.engines or (2 if args.quick else 4)
    args.time_scale = args.time_scale or (0.05 if args.quick else 0.2)
    bad = (
        args.requests < 1
        or args.engines < 1
        or (args.offset is not None and args.offset < 0)
        or not 0 < args.load <= 4
        or not 0 < args.time_scale <= 1
        or args.max_out < 1
        or args.noise < 0
        or args.budget < 16
        or args.gpu_blocks < 8
    )
    if bad:
        ap.error(
            "needs --requests, --engines, --max-out >= 1, 0 < --load <= 4, "
            "0 < --time-scale <= 1, --noise >= 0, --budget >= 16, --gpu-blocks >= 8"
        )
    if not args.trace.is_file():
        ap.error(f"no trace file {args.trace}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        return run(args)
    except RuntimeError as exc:
        print(f"bench_router_live: {exc}", file=sys.stderr)
        return 1


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("vllm") is None:
        print(
            "bench_router_live: the engines need vLLM 0.33 (run under .venv-vllm)", file=sys.stderr
        )
        return 2
    full = load_trace(args.trace, None)
    if args.offset is None:  # the trace's end: its conversations have a history there
        args.offset = max(0, len(full) - args.requests)
    trace = full[args.offset : args.offset + args.requests]
    if not trace:
        print(f"bench_router_live: no requests past --offset {args.offset}", file=sys.stderr)
        return 2
    args.requests = len(trace)
    rows_wanted = args.row or list(ROWS)
    py = sglang_python(args)
    if py is None and "sglang" in rows_wanted:
        print(
            "sglang-router is not installed (pip install -r requirements/sglang-router.txt "
            "into .venv-sglang-router): its row is left out, round-robin is the client's own"
        )
    work = Path(tempfile.mkdtemp(prefix="bench-router-live-"))
    tok = make_tokenizer(work / "tokenizer")
    reqs, facts = build_requests(args, trace)
    print(
        f"{len(reqs)} requests over {facts['replay_span_s']:.1f} s of wall time; "
        f"starting {args.engines} engines (logs in {work})",
        flush=True,
    )
    engines = start_engines(args, tok, work)
    rows: list[Row] = []
    try:
        facts["idle_ttft_s"] = idle_ttft(engines, facts["median_prompt"], args.max_out)
        for name in rows_wanted:
            proc: Proc | None = None
            if name == "kvoffload":
                proc, url = start_kvoffload(args, engines, tok, work)
                urls, detail = [url], "kvoffload router (events, /metrics)"
            elif name == "sglang":
                if py is None:
                    continue
                proc, url = start_sglang(py, "cache_aware", engines, work)
                urls, detail = [url], "sglang-router 0.3.2 cache_aware"
            elif py is not None:
                proc, url = start_sglang(py, "round_robin", engines, work)
                urls, detail = [url], "sglang-router round_robin"
            else:
                urls, detail = [e.url for e in engines], "the client's own, direct"
            try:
                print(f"  running {name} ...", file=sys.stderr, flush=True)
                rows.append(run_row(name, detail, urls, engines, reqs))
            finally:
                if proc is not None:
                    proc.stop()
    finally:
        for e in engines:
            e.proc.stop()
    shutil.rmtree(work, ignore_errors=True)  # kept (its logs) only when a run fails
    print_table(rows, facts, args)
    if args.json:
        facts.pop("median_prompt", None)
        doc = {
            "params": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "ceilings": facts,
            "rows": [asdict(r) for r in rows],
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
