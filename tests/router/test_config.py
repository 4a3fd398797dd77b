"""The router's config: TOML + environment, each mistake one line naming file and key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.errors import ConfigError
from kvoffload.router.config import load_router_config

from .procs import ROOT, env

BASE = """
[[workers]]
name = "w0"
url = "http://10.0.0.1:8000"
node = "n0"
events = "tcp://10.0.0.1:5557"
[[workers]]
name = "w1"
url = "http://10.0.0.2:8000/"
node = "n1"
"""


def load(tmp_path: Path, text: str, environ: dict[str, str] | None = None) -> object:
    p = tmp_path / "router.toml"
    p.write_text(text, encoding="utf-8")
    return load_router_config(p, env=environ or {})


def test_a_full_config_loads_into_typed_values(tmp_path: Path) -> None:
    secret = tmp_path / "salt"
    secret.write_text("0123456789abcdef0123456789abcdef")
    cfg = load_router_config(
        _write(
            tmp_path,
            BASE
            + f"""
[router]
port = 9000
risk = 1.5
on_deadline_miss = "fastest"
default_deadline = "1500ms"
salt_secret_file = "{secret}"
[model]
block_size = 32
hash_algorithm = "sha256_cbor"
[priors]
prefill_tokens_per_s = 20000
storage_remote_bandwidth = "4GB"
[[stores]]
name = "fs"
nodes = ["n0", "n1"]
shared = true
[[lora]]
name = "sql"
path = "/adapters/sql"
[tenants.acme]
api_keys = ["k1"]
deadline = "2s"
[tenants.globex]
cache_salt = "explicit-salt"
""",
        ),
        env={"KVOFFLOAD_ROUTER_PORT": "9100"},
    )
    assert cfg.port == 9100  # the environment wins over the file
    assert cfg.risk == 1.5
    assert cfg.on_deadline_miss == "fastest" and cfg.default_deadline_s == 1.5
    assert cfg.workers[1].url == "http://10.0.0.2:8000"
    assert cfg.workers[0].metrics == "http://10.0.0.1:8000/metrics"
    assert cfg.priors.prefill_b_s == pytest.approx(1 / 20000)
    assert cfg.priors.storage_remote_bandwidth == 4e9
    assert cfg.topology().roots == {"fs": (True, ("n0", "n1"))}
    assert cfg.lora("sql") == ("sql", "/adapters/sql") and cfg.lora("m") is None
    salts = cfg.tenant_salts()
    assert salts["globex"] == "explicit-salt"
    assert len(salts["acme"]) == 64 and salts["acme"] != salts["globex"]
    assert cfg.tenants[0].deadline_s == 2.0
    assert cfg.hasher().block_size == 32


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "router.toml"
    p.write_text(text, encoding="utf-8")
    return p


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no \\[\\[workers\\]\\]"),
        (BASE + "[router]\nprot = 1\n", "unknown setting \\[router\\] prot"),
        (BASE + "[routr]\n", "unknown section \\[routr\\]"),
        (BASE + "[router]\nport = 70000\n", "\\[router\\] port: not a port"),
        (BASE + '[router]\non_deadline_miss = "drop"\n', "shed or fastest"),
        (BASE + '[router]\nrisk = "high"\n', "\\[router\\] risk: not a number"),
        (BASE + "[router]\nrisk = -1\n", "\\[router\\] risk: must not be negative"),
        (BASE + '[router]\ndefault_deadline = "-1s"\n', "default_deadline"),
        (BASE + '[model]\nhash_algorithm = "md5"\n', "hash_algorithm: must be one of"),
        (BASE + '[model]\nhash_algorithm = "xxhash"\n', "PYTHONHASHSEED"),
        (BASE + "[priors]\nprefill_tokens_per_s = 0\n", "\\[priors\\] prefill_tokens_per_s"),
        (BASE + '[[workers]]\nname = "w0"\nurl = "http://x:1"\n', "two workers are named 'w0'"),
        ('[[workers]]\nname = "a"\nurl = "ftp://x"\n', "url must be http"),
        ('[[workers]]\nurl = "http://x:1"\n', "needs name"),
        (BASE + '[[stores]]\nname = "s"\nnodes = ["n9"]\n', "unknown node 'n9'"),
        (BASE + "[tenants.a]\napi_keys = ['k']\n", "salt_secret_file is not set"),
        (
            BASE
            + "[tenants.a]\napi_keys=['k']\ncache_salt='x'\n"
            + "[tenants.b]\napi_keys=['k']\ncache_salt='y'\n",
            "share an API key",
        ),
        (BASE + "[tenants.a]\ncolour = 1\n", "unknown setting \\[tenants.a\\] colour"),
        ("[[workers]\n", "router.toml"),
    ],
)
def test_mistakes_are_one_line_naming_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        load(tmp_path, text)
    assert "\n" not in str(info.value)


def test_environment_values_are_validated_and_unknown_variables_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"KVOFFLOAD_ROUTER_PORT.*not a port"):
        load(tmp_path, BASE, {"KVOFFLOAD_ROUTER_PORT": "-3"})
    with pytest.raises(ConfigError, match="did you mean KVOFFLOAD_ROUTER_PORT"):
        load(tmp_path, BASE, {"KVOFFLOAD_ROUTER_PROT": "1"})


def test_the_cli_says_one_line_and_exits_1_on_a_bad_config(tmp_path: Path) -> None:
    bad = _write(tmp_path, BASE + "[router]\nport = 'x'\n")
    run = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "--config", str(bad), "router", "--check"],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1
    assert run.stderr.strip().count("\n") == 0 and "Traceback" not in run.stderr
    assert "[router] port" in run.stderr
    good = _write(tmp_path, BASE.replace('events = "tcp://10.0.0.1:5557"\n', ""))
    ok = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "--config", str(good), "router", "--check"],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0 and "2 workers" in ok.stdout
    missing = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "--config", str(tmp_path / "nope.toml"), "router"],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 1 and "cannot read config" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_a_missing_optional_package_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from kvoffload.cli import router as cli

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        ConfigError, match=r"needs the Python package 'aiohttp'.*kvoffload\[router\]"
    ):
        cli._need("aiohttp", "kvoffload router")


def test_the_docs_minimal_config_passes_check(tmp_path: Path) -> None:
    """docs/router.md's config block, with only the two files that live on a
    deployment (the tokenizer folder, the salt secret) made here."""
    for module in ("transformers", "tokenizers", "zmq", "aiohttp"):
        pytest.importorskip(module)
    from .tokenizer_dir import make_tokenizer

    doc = (ROOT / "docs/router.md").read_text(encoding="utf-8")
    block = doc.split("A minimal config", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    tokenizer = make_tokenizer(tmp_path / "tokenizer")
    secret = tmp_path / "router-salt"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    for shipped, here in (
        ('"/models/llama-3-8b"', f'"{tokenizer}"'),
        ('"/etc/kvoffload/router-salt"', f'"{secret}"'),
    ):
        assert shipped in block, shipped
        block = block.replace(shipped, here)
    config = _write(tmp_path, block)
    check = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "--config", str(config), "router", "--check"],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stderr
    assert check.stdout.strip() == "router config OK: 2 workers, 1 tenants"
