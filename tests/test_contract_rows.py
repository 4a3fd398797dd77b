"""contract-v1 §8: the ``vllm-row-v1:<hex>`` cache layout of kvoffload's vLLM tier."""

from __future__ import annotations

import pytest

from kvoffload.contract import CompatContract, LayerLayout
from kvoffload.errors import ContractError

ROW = "vllm-row-v1:" + "0123456789abcdef" * 2


def _contract(layout: str) -> CompatContract:
    return CompatContract(
        model_revision="m@1",
        tokenizer_hash="t",
        chat_template_version="none",
        attention_backend="FLASH_ATTN",
        kv_dtype="float16",
        block_size=16,
        layer_layout=LayerLayout(2, 1, 1, layout),
        tenant_namespace="acme",
        chunk_tokens=32,
    )


def test_a_row_layout_is_a_contract_of_its_own() -> None:
    row = _contract(ROW)
    other = _contract("vllm-row-v1:" + "f" * 32)
    assert row.fingerprint() != other.fingerprint()
    assert row.fingerprint() != _contract("NHD").fingerprint()
    assert CompatContract.from_dict(row.to_dict()).fingerprint() == row.fingerprint()


@pytest.mark.parametrize(
    "bad", ["vllm-row-v1:", "vllm-row-v1:" + "A" * 32, "vllm-row-v2:" + "0" * 32, "row", "nhd"]
)
def test_other_layouts_are_refused(bad: str) -> None:
    with pytest.raises(ContractError, match="cache_layout"):
        _contract(bad)
