"""The vLLM connector registers its namespaces' contracts (protocol-v1 §5.19), so that
``invalidate`` finds what a real engine stored by its model revision (§5.20).

vLLM's real v1 scheduler and a real sidecar process, as in test_scheduler_real.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from kvoffload.client import call_tenantless
from kvoffload.protocol import Invalidate, InvalidateReply, Namespaces, NamespacesReply
from tests.vllm.scheduling import CT, prompt_of, settings, stored_chunks

from ..sidecar_proc import DevSidecar
from .engine import Engine, make_request, make_vllm_config

pytestmark = pytest.mark.vllm


def test_connector_registers_contracts_and_invalidate_removes_by_revision(
    tiny_model: Path, sidecar: DevSidecar, tenant: str
) -> None:
    engine = Engine(make_vllm_config(tiny_model, settings(sidecar, tenant)), num_blocks=128)
    try:
        prompt = prompt_of(4 * CT + 3, seed=5)
        req = engine.add(make_request("a", prompt))
        engine.run_to_completion([req])
        assert stored_chunks(engine, sidecar, tenant, prompt) == 4
        contract = engine.connector.contracts.contract(None, 0)

        _, (reply,) = call_tenantless(sidecar.socket_path, [Namespaces(tenant)])
        assert isinstance(reply, NamespacesReply)
        rows: list[dict[str, Any]] = list(reply.report["namespaces"])
        assert [r["namespace"] for r in rows] == [contract.fingerprint().hex()]
        assert rows[0]["contract"] == contract.to_dict()  # every field, as the engine built it

        other = Invalidate(model_revision=contract.model_revision + "-other", tenant=tenant)
        inv = Invalidate(model_revision=contract.model_revision, tenant=tenant)
        _, (miss, hit) = call_tenantless(sidecar.socket_path, [other, inv])
        assert isinstance(miss, InvalidateReply) and miss.report["removed_chunks"] == 0
        assert isinstance(hit, InvalidateReply) and hit.report["removed_chunks"] == 4
        assert stored_chunks(engine, sidecar, tenant, prompt) == 0
    finally:
        engine.close()
