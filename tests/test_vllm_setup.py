"""What a vLLM user needs before the connector runs: the tokenizer hash and the
vLLM version check (no vLLM needed: both are standard-library modules)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.errors import KVOffloadConfigError
from kvoffload.integrations.vllm_version import TESTED_RANGE, check_vllm_version
from kvoffload.tokenizer_hash import tokenizer_hash


def _tokenizer(d: Path, *, eos: str = "</s>", spaced: bool = False, template: str = "a") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    vocab = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}}, "added_tokens": []}
    cfg = {"eos_token": eos, "bos_token": "<s>", "chat_template": template}
    indent = 4 if spaced else None
    (d / "tokenizer.json").write_text(json.dumps(vocab, indent=indent, sort_keys=not spaced))
    items = reversed(list(cfg.items())) if spaced else cfg.items()
    (d / "tokenizer_config.json").write_text(json.dumps(dict(items), indent=indent))
    (d / "config.json").write_text('{"not": "a tokenizer file"}')
    return d


def test_the_hash_is_canonical_and_covers_special_tokens(tmp_path: Path) -> None:
    base = tokenizer_hash(_tokenizer(tmp_path / "a"))
    assert base.startswith("tok-b2-") and len(base) == len("tok-b2-") + 32
    # Same tokenizer, other formatting and key order, other path, other template: same.
    assert tokenizer_hash(_tokenizer(tmp_path / "b", spaced=True)) == base
    assert tokenizer_hash(_tokenizer(tmp_path / "c", template="b")) == base
    # Another special token: another tokenizer.
    assert tokenizer_hash(_tokenizer(tmp_path / "d", eos="<|eot|>")) != base
    (tmp_path / "a" / "merges.txt").write_text("a b\n")
    assert tokenizer_hash(tmp_path / "a") != base  # a file that decides tokenization


def test_nothing_to_hash_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError):
        tokenizer_hash(tmp_path)
    with pytest.raises(FileNotFoundError):
        tokenizer_hash(tmp_path / "absent")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    return subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", *args],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip


def test_the_tokenizer_hash_command(tmp_path: Path) -> None:
    d = _tokenizer(tmp_path / "tok")
    r = _cli("tokenizer-hash", str(d))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == tokenizer_hash(d)
    r = _cli("tokenizer-hash", str(tmp_path / "nothing"))
    assert r.returncode == 2 and r.stderr.startswith("usage: no tokenizer to hash")


def test_the_vllm_version_check(caplog: pytest.LogCaptureFixture) -> None:
    assert check_vllm_version("0.33.0") and check_vllm_version("0.33.2+cpu")
    for bad in ("0.32.1", "0.34.0", "1.0.0", "garbage"):
        with pytest.raises(KVOffloadConfigError, match=r"vllm>=0\.33,<0\.34") as err:
            check_vllm_version(bad, env={})
        assert bad in str(err.value) and "KVOFFLOAD_VLLM_UNTESTED=1" in str(err.value)
    with caplog.at_level(logging.WARNING):
        assert check_vllm_version("0.34.0", env={"KVOFFLOAD_VLLM_UNTESTED": "1"}) is False
    assert "starting anyway" in caplog.text and TESTED_RANGE == ">=0.33,<0.34"


def test_the_vllm_extra_pins_the_tested_range() -> None:
    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    extra = pyproject["project"]["optional-dependencies"]["vllm"]
    assert f"vllm{TESTED_RANGE}" in extra
    assert not any(dep.startswith("torch") for dep in extra)  # vLLM's own torch stays
