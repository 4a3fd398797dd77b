"""``kvoffload router --loop``: uvloop where installed, else asyncio's; one-line errors."""

from __future__ import annotations

import asyncio
import importlib.util
import sys

import pytest

from kvoffload.cli.router import event_loop
from kvoffload.errors import ConfigError


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
