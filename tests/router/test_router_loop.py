"""``kvoffload router --loop``: uvloop where installed, else asyncio's; one-line errors."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.cli.router import event_loop
from kvoffload.errors import ConfigError

from .tokenizer_dir import make_bpe


def test_asyncio_when_asked() -> None:
    loop = event_loop("asyncio")
    try:
        assert type(loop).__module__.startswith("asyncio")
    finally:
        loop.close()


def test_auto_falls_back_to_asyncio_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop: ImportError, as if absent
    loop = event_loop("auto")
    try:
        assert type(loop).__module__.startswith("asyncio")
        assert loop.run_until_complete(asyncio.sleep(0, "ran")) == "ran"
    finally:
        loop.close()


def test_uvloop_insisted_on_without_it_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)
    with pytest.raises(ConfigError, match=r"kvoffload\[fast\]") as got:
        event_loop("uvloop")
    assert "\n" not in str(got.value)


def test_an_unknown_loop_is_refused() -> None:
    with pytest.raises(ConfigError, match="auto, uvloop, asyncio"):
        event_loop("trio")


@pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="uvloop not installed")
def test_auto_takes_uvloop_where_installed() -> None:
    loop = event_loop("auto")
    try:
        assert type(loop).__module__.startswith("uvloop")
    finally:
        loop.close()


def _run_router(tmp_path: Path, tokenizer: Path | None) -> subprocess.CompletedProcess[str]:
    cfg = tmp_path / "router.toml"
    lines = ["[router]", "[model]"]
    if tokenizer is not None:
        lines.append(f'tokenizer = "{tokenizer}"')
    lines += ["[[workers]]", 'name = "a"', 'url = "http://127.0.0.1:9"', 'node = "n"']
    cfg.write_text("\n".join(lines) + "\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2] / "src")
    cmd = [sys.executable, "-m", "kvoffload.cli", "--config", str(cfg), "router", "--loop", "trio"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_the_no_tokenizer_warning_only_without_one(tmp_path: Path) -> None:
    """It used to be printed whenever no events endpoint was configured, tokenizer or not."""
    pytest.importorskip("transformers")
    bare = _run_router(tmp_path, None)
    assert bare.returncode == 1 and "--loop: 'trio'" in bare.stderr
    assert "no [model] tokenizer" in bare.stderr
    tok = _run_router(tmp_path, make_bpe(tmp_path / "tok"))
    assert tok.returncode == 1 and "--loop: 'trio'" in tok.stderr
    assert "no [model] tokenizer" not in tok.stderr
    assert "Traceback" not in tok.stderr
