"""``kvoffload demo``: cross-process KV reuse on CPU, printed as one table."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table
from rich.text import Text

from ..errors import SidecarStartError
from .app import JsonOpt, app, emit, err, human_bytes, out, state
from .exits import _CliUsageError, _DemoFailed

if TYPE_CHECKING:
    from ..integrations.demo_config import DemoConfig


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


@app.command()
def demo(
    prompt_tokens: Annotated[
        int,
        typer.Option(
            "--prompt-tokens", metavar="N", help="Tokens of the shared prefix (a document)."
        ),
    ] = 1024,
    suffix_tokens: Annotated[
        int,
        typer.Option("--suffix-tokens", metavar="N", help="Tokens of each worker's own question."),
    ] = 32,
    layers: Annotated[int, typer.Option("--layers", metavar="N", help="Model layers.")] = 4,
    hidden: Annotated[int, typer.Option("--hidden", metavar="N", help="Model hidden size.")] = 256,
    heads: Annotated[int, typer.Option("--heads", metavar="N", help="Attention heads.")] = 4,
    kv_heads: Annotated[int, typer.Option("--kv-heads", metavar="N", help="KV heads.")] = 2,
    chunk_tokens: Annotated[
        int, typer.Option("--chunk-tokens", metavar="N", help="Tokens per chunk.")
    ] = 256,
    seed: Annotated[
        int, typer.Option("--seed", metavar="N", help="Weight seed (= model revision).")
    ] = 0,
    threads: Annotated[
        int, typer.Option("--threads", metavar="N", help="torch threads per worker.")
    ] = 2,
    repeats: Annotated[
        int,
        typer.Option(
            "--repeats", metavar="N", help="B's rounds of reuse + recompute (medians shown)."
        ),
    ] = 3,
    as_json: JsonOpt = False,
) -> None:
    """Cross-process KV reuse on CPU: worker A saves a prompt's KV, worker B reuses it.

    Uses the embedded development store under ./.kvoffload: a sidecar already
    answering there is reused, otherwise `kvoffload --dev serve` is started and
    stopped afterwards. Each worker is its own process with a random-weight
    transformers Llama (the weight seed is the model revision, fp32): A
    prefills a shared prefix plus its question and saves every full chunk; B,
    with the same contract, looks up and loads the prefix and computes only
    its own question, then recomputes everything to compare logits and time
    to first token (--repeats rounds, medians shown); C, another revision
    (seed + 1), must miss and recompute.
    Needs torch and transformers (pip install 'kvoffload[demo]', or `make demo`);
    the options are checked first, without them.
    """
    from ..integrations.demo_config import demo_deps_message, demo_deps_missing

    cfg = _demo_config(
        prompt_tokens=prompt_tokens,
        suffix_tokens=suffix_tokens,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        chunk_tokens=chunk_tokens,
        seed=seed,
        threads=threads,
        repeats=repeats,
    )
    missing = demo_deps_missing()
    if missing:
        raise _DemoFailed(demo_deps_message(missing))
    try:
        from ..integrations import demo_run as kd
    except ImportError as exc:  # found but broken (a torch built for another Python, ...)
        raise _DemoFailed(
            f"the demo's torch or transformers does not import in {sys.executable} "
            f"({exc}): reinstall them: {sys.executable} -m pip install --force-reinstall "
            "'kvoffload[demo]'"
        ) from exc
    try:
        if as_json:
            data = kd.run_demo(cfg)
        else:
            with err.status("starting…") as status:
                data = kd.run_demo(cfg, progress=lambda m: status.update(m))
    except SidecarStartError:
        raise
    except RuntimeError as exc:
        raise _DemoFailed(str(exc)) from exc
    if as_json:
        emit(True, data)
        return
    a, b, c, sc = data["a"], data["b"], data["c"], data["sidecar"]
    yes_no = {True: ("yes", "green"), False: ("NO", "red")}
    table = Table(title="kvoffload demo: one prefix, three worker processes", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("result")
    table.add_row(
        "sidecar",
        f"started (pid {sc['pid']}), stopped at the end"
        if sc["started"]
        else "already running, reused (left running)",
    )
    table.add_row("store", f"{sc['store']} (embedded development store)")
    table.add_row("model", f"{data['model_description']}, fp32, random weights")
    table.add_row(
        "prompts",
        f"{cfg.prompt_tokens} shared tokens + {cfg.suffix_tokens} of each worker's own; "
        f"chunks of {cfg.chunk_tokens} tokens; torch threads {cfg.threads} per worker",
    )
    present = a.get("chunks_already_present", 0)
    new = a.get("chunks_new", a["chunks_saved"])
    table.add_row(
        "A: saved",
        (f"{new} new" + (f", {present} already present" if present else ""))
        + f" of {a['full_chunks']} chunks, {human_bytes(a['bytes_saved'])} "
        f"({a['model_revision']}; save {_ms(a['save_s'])})",
    )
    table.add_row(
        "A: own prefill",
        f"{_ms(a['prefill_s'])} (a cold start: first forward pass of a fresh process; "
        "not comparable with B's TTFT below)",
    )
    table.add_row(
        "B: reused",
        f"{b['chunks_reused']} chunks = {b['tokens_reused']} tokens, "
        f"{human_bytes(b['bytes_loaded'])} loaded; computed {b['tokens_computed']} tokens",
    )
    table.add_row(
        "TTFT without reuse",
        f"{_ms(b['ttft_recompute_s'])} (full prefill; median of {b['repeats']})",
    )
    table.add_row(
        "TTFT with reuse",
        f"{_ms(b['ttft_reuse_s'])} (median of {b['repeats']}) = keys {_ms(b['keys_s'])} "
        f"+ lookup {_ms(b['lookup_s'])} "
        f"+ load {_ms(b['load_s'])} + cache {_ms(b['cache_s'])} "
        f"+ suffix prefill {_ms(b['suffix_prefill_s'])}",
    )
    speedup = data["speedup"]
    table.add_row("speed-up", f"{speedup:.1f}x" if speedup else "-")
    table.add_row(
        "logits match",
        Text.assemble(
            yes_no[b["logits_match"]],
            f": max |reuse - recompute| = {b['logits_max_abs_diff']:.3g} "
            f"(tolerance {b['logits_tolerance']:.3g}); prefix KV max diff "
            f"{b['prefix_kv_max_abs_diff']:.3g}",
        ),
    )
    table.add_row(
        "greedy next token",
        Text.assemble(
            yes_no[b["greedy_match"]],
            f": {b['next_token']} with reuse, {b['recompute_next_token']} recomputed",
        ),
    )
    table.add_row(
        "C: other revision",
        f"{c['model_revision']}: {c['lookup_chunks']} chunks found, {c['chunks_reused']} "
        f"reused; recomputed {c['tokens_computed']} tokens in {_ms(c['ttft_reuse_s'])}",
    )
    out.print(table)
    out.print("What next:")
    out.print("  kvoffload --dev inspect     what the demo left in the store (tenant demo)")
    out.print("  kvoffload --dev ls          its chunks; kvoffload --dev purge --tenant demo")
    out.print("  make serve                  a sidecar for your own worker (README.md)")
    out.print("  vLLM: src/kvoffload/integrations/vllm/README.md (the connector, set-up)")


def _demo_config(
    *,
    prompt_tokens: int,
    suffix_tokens: int,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    chunk_tokens: int,
    seed: int,
    threads: int,
    repeats: int,
) -> DemoConfig:
    """The demo's settings from its options, checked before torch is imported; a bad
    option (or options that do not fit together) is a usage error, exit 2."""
    from ..integrations.demo_config import DemoConfig, ModelShape

    given = [
        flag
        for flag, value in (
            ("--root", state.root),
            ("--config", state.config_path),
            ("--index-dir", state.index_dir),
            ("--kek-file", state.kek_file),
        )
        if value is not None
    ]
    if given:
        raise _CliUsageError(
            f"demo always uses the embedded development store under ./.kvoffload; "
            f"drop {', '.join(given)}"
        )
    for flag, value in (
        ("--prompt-tokens", prompt_tokens),
        ("--suffix-tokens", suffix_tokens),
        ("--layers", layers),
        ("--hidden", hidden),
        ("--heads", heads),
        ("--kv-heads", kv_heads),
        ("--chunk-tokens", chunk_tokens),
        ("--threads", threads),
        ("--repeats", repeats),
    ):
        if value < 1:
            raise _CliUsageError(f"{flag} must be at least 1, got {value}")
    try:
        shape = ModelShape(
            num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads
        )
        return DemoConfig(
            shape=shape,
            prompt_tokens=prompt_tokens,
            suffix_tokens=suffix_tokens,
            chunk_tokens=chunk_tokens,
            seed=seed,
            other_seed=seed + 1,
            threads=threads,
            repeats=repeats,
        )
    except ValueError as exc:
        raise _CliUsageError(str(exc)) from exc
