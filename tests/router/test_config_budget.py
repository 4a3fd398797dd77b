"""The workers' vLLM scheduling settings in ``[priors]``: the TTFT model's budget and KV size."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.router.config import ConfigError, load_router_config

WORKERS = """
[[workers]]
name = "w0"
url = "http://10.0.0.1:8000"
"""


def load(tmp_path: Path, text: str) -> object:
    p = tmp_path / "router.toml"
    p.write_text(WORKERS + text, encoding="utf-8")
    return load_router_config(p, env={})


def test_budget_and_kv_capacity_reach_the_model(tmp_path: Path) -> None:
    cfg = load(tmp_path, "[priors]\nprefill_budget_tokens = 2048\nkv_capacity_tokens = 500000\n")
    pri = cfg.priors  # type: ignore[attr-defined]
    assert pri.prefill_budget_tokens == 2048 and pri.kv_capacity_tokens == 500_000
    assert load(tmp_path, "").priors.prefill_budget_tokens == 8192  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "text", ["prefill_budget_tokens = 0", "prefill_budget_tokens = '8k'", "kv_capacity_tokens = -1"]
)
def test_bad_values_are_one_line(tmp_path: Path, text: str) -> None:
    key = text.split(" ")[0]
    with pytest.raises(ConfigError, match=f"\\[priors\\] {key}"):
        load(tmp_path, f"[priors]\n{text}\n")
