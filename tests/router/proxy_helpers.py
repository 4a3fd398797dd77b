"""Helpers shared by the tests (moved out of test_proxy.py)."""

from __future__ import annotations

import time
from typing import Any

import pytest

PROMPT = list(range(1000, 1000 + 3200))  # 200 blocks of 16 tokens


def completion(prompt: list[int], **kw: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt, "max_tokens": 4, **kw}


def worker_of(headers: dict[str, str]) -> str:
    return headers["x-kvoffload-worker"]


def wait_until(fn: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not fn():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)
