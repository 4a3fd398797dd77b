"""`kvoffload demo`: worker processes reuse KV through a sidecar the demo starts and stops.

Plus the library steps of ``kvoffload.integrations.demo_model`` in-process (no sidecar): chunks
packed and unpacked are the same KV, and a suffix prefilled over that prefix
gives the logits of a full prefill.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (pip install -e '.[demo]')",
)

DEMO_TIMEOUT_S = 600


def _sidecars_in(directory: Path) -> list[int]:
    """Pids of running `kvoffload ... serve` processes whose working directory is ``directory``."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if b"kvoffload.cli" in cmdline and b"serve" in cmdline and Path(cwd) == directory:
            pids.append(int(proc.name))
    return pids


@pytest.mark.slow
def test_demo_json_reuses_across_processes_and_stops_its_sidecar(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    proc = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "demo", "--json",
         "--prompt-tokens", "512", "--layers", "2", "--hidden", "128"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(proc.stdout)
    a, b, c = data["a"], data["b"], data["c"]

    assert a["chunks_saved"] == 2 and a["bytes_saved"] > 0
    assert b["chunks_reused"] > 0
    assert b["chunks_reused"] == 2 and b["tokens_computed"] == 32
    assert b["bytes_loaded"] == a["bytes_saved"]
    assert b["logits_match"] is True
    assert b["logits_max_abs_diff"] <= b["logits_tolerance"]
    assert b["greedy_match"] is True
    assert b["ttft_reuse_s"] > 0 and b["ttft_recompute_s"] > 0
    # Three processes, none of them the CLI: nothing reached B but through the sidecar.
    assert len({a["pid"], b["pid"], c["pid"], os.getpid()}) == 4
    assert a["model_revision"] == b["model_revision"] == "demo-llama@seed0"
    assert a["namespace"] == b["namespace"]

    assert c["model_revision"] == "demo-llama@seed1"
    assert c["namespace"] != b["namespace"]
    assert c["lookup_chunks"] == 0 and c["chunks_reused"] == 0
    assert c["tokens_computed"] == 544

    sidecar = data["sidecar"]
    assert sidecar["started"] is True and sidecar["stopped"] is True
    assert not Path(f"/proc/{sidecar['pid']}").exists(), "the demo's sidecar still runs"
    assert _sidecars_in(tmp_path) == []
    assert (tmp_path / ".kvoffload" / "store").is_dir()
    assert a["chunks_new"] == 2 and a["chunks_already_present"] == 0

    # A second run finds A's chunks there: "already present", not "saved" again.
    again = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "demo",
         "--prompt-tokens", "512", "--layers", "2", "--hidden", "128", "--repeats", "1"],
        cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=DEMO_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    assert "0 new, 2 already present of 2 chunks" in again.stdout
    assert "cold start" in again.stdout
    assert "kvoffload --dev inspect" in again.stdout.split("What next:", 1)[1]
    assert "[green]" not in again.stdout and "yes: max |reuse" in again.stdout


def test_demo_refuses_a_bad_shape(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "demo", "--hidden", "100", "--heads", "3"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert not (tmp_path / ".kvoffload").exists()


def test_pack_unpack_and_suffix_prefill_equal_a_full_prefill() -> None:
    from kvoffload.integrations import demo_model as kd

    torch.set_num_threads(1)
    shape = kd.ModelShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=97)
    config = kd.llama_config(shape)
    model = kd.build_model(config, seed=3)
    chunk = 32
    tokens = kd.random_tokens(3 * chunk + 5, shape.vocab_size, seed=7)
    full = kd.prefill(model, tokens)
    assert full.num_tokens == len(tokens)

    chunks = kd.pack_chunks(full.keys, full.values, chunk)
    assert len(chunks) == 3 and all(len(c) == shape.num_layers for c in chunks)
    layer_bytes = kd.chunk_layer_bytes(kd.layer_layout(config), chunk, torch.float32)
    assert all(t.is_contiguous() and t.numel() * 4 == layer_bytes for c in chunks for t in c)
    # What a load hands back: bytes per layer.
    loaded = [[t.numpy().tobytes() for t in c] for c in chunks]
    cache = kd.unpack_chunks(config, loaded, chunk)
    assert int(cache.get_seq_length()) == 3 * chunk
    logits = kd.prefill_suffix(model, tokens, cache, 3 * chunk)
    diff = kd.max_abs_diff(logits, full.logits)
    assert diff <= kd.logits_tolerance(full.logits), diff
    assert int(logits.argmax()) == int(full.logits.argmax())

    # A prefix from another revision is the wrong KV: it visibly changes the logits.
    other = kd.prefill(kd.build_model(config, seed=4), tokens)
    wrong = kd.cache_from_kv(
        config, [k[:, : 3 * chunk] for k in other.keys], [v[:, : 3 * chunk] for v in other.values]
    )
    assert kd.max_abs_diff(kd.prefill_suffix(model, tokens, wrong), full.logits) > 100 * diff + 1e-3


def test_contract_names_the_revision_and_the_layout() -> None:
    from kvoffload.integrations import demo_model as kd

    shape = kd.ModelShape(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=97)
    config = kd.llama_config(shape)
    c0 = kd.demo_contract(config, 0, chunk_tokens=64)
    c1 = kd.demo_contract(config, 1, chunk_tokens=64)
    assert c0.model_revision == "demo-llama@seed0"
    assert c0.kv_dtype == "float32"
    assert (c0.layer_layout.num_layers, c0.layer_layout.num_kv_heads) == (3, 2)
    assert (c0.layer_layout.head_dim, c0.layer_layout.cache_layout) == (16, "HND")
    assert c0.rope["rope_theta"] == shape.rope_theta
    assert c0.fingerprint() != c1.fingerprint()
    assert (
        c0.fingerprint()
        == kd.demo_contract(kd.llama_config(shape), 0, chunk_tokens=64).fingerprint()
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--prompt-tokens", "100"), "shorter than one chunk"),
        (("--prompt-tokens", "300", "--chunk-tokens", "512"), "shorter than one chunk"),
    ],
)
def test_demo_refuses_a_prompt_shorter_than_a_chunk(
    tmp_path: Path, args: tuple[str, ...], says: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "demo", *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / ".kvoffload").exists()


def test_demo_refuses_options_it_would_ignore(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "--root", str(tmp_path / "r"), "demo"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "drop --root" in proc.stderr
    assert not (tmp_path / ".kvoffload").exists() and not (tmp_path / "r").exists()
