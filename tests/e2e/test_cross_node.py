"""A prefix computed on one node is reused on another node, bit for bit.

Three sidecars ("nodes" a, b, c) share one store root with ``[store] shared``:
on a JuiceFS volume with one FUSE client per node where FUSE is available (the
multi-node tier), else on one local directory (the same protocol, minus the
client caches). Each node keeps its own index. Engine A (a real vLLM 0.33
scheduler and connector, a transformers model on the CPU stand-in runner, its
own process) saves its prefix through node a; engine B loads it through node b,
which learned of a's chunks from a's journal; node c restarts and catches up,
then engine C loads the same prefix through it. B and C compute only their
suffix and match a full recompute: tokens, every logit, every KV byte.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.reuse import (
    PROMPT_A_TOKENS,
    PROMPT_B_TOKENS,
    PROMPT_C_TOKENS,
    SHARED,
    SPEC,
    assert_reuse_is_exact,
    connector,
    job,
    run_and_recompute,
    run_engines,
)

from ..sharedfs import juice_volume, juicefs_unavailable
from ..sidecar_proc import SharedNode, shared_root_sidecars, wait_until
from .standin import requires_transformers, requires_vllm, write_model_dir

pytestmark = [pytest.mark.vllm, pytest.mark.slow, requires_transformers, requires_vllm]


@contextlib.contextmanager
def _roots(base: Path) -> Iterator[list[Path]]:
    if juicefs_unavailable() is None:
        with juice_volume(base / "juicefs", nodes=3) as mounts:
            yield [m / "store" for m in mounts]
    else:
        one = base / "shared-root"
        yield [one, one, one]


@pytest.fixture(scope="module")
def nodes() -> Iterator[list[SharedNode]]:
    pytest.importorskip("kvoffload.integrations.vllm", reason="the vLLM connector is absent")
    base = Path(tempfile.mkdtemp(prefix="kvo-xnode-", dir="/tmp"))  # short socket paths
    try:
        with _roots(base) as roots, shared_root_sidecars(base, roots) as started:
            yield started
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_prefix_saved_on_one_node_is_reused_on_two_others(
    nodes: list[SharedNode], tmp_path_factory: pytest.TempPathFactory
) -> None:
    a, b, c = nodes
    model_dir = write_model_dir(SPEC, tmp_path_factory.mktemp("model"))
    tenant = f"t-{uuid.uuid4().hex[:12]}"
    rev = SPEC.model_revision
    saved = run_engines(
        [job("a", model_dir, connector(a, tenant, rev), PROMPT_A_TOKENS, max_new_tokens=4)],
        tmp_path_factory.mktemp("engines-a"),
    )
    assert saved["a"]["runs"]["a"]["num_external_cached_tokens"] == 0
    chunks = SHARED // 32

    def indexed(n: SharedNode) -> int:
        return int(n.stats()["chunks"])

    # b learns of a's chunks from a's journal (its own index), within the discovery delay.
    wait_until(lambda: indexed(b) >= chunks, "node b follows a's journal", timeout_s=60)
    assert int(b.stats()["shared"]["followed"]) >= chunks
    # c restarts and catches up from the journals (positions kept in its index).
    c.stop()
    c.start()
    wait_until(lambda: indexed(c) >= chunks, "node c has a's chunks after a restart", timeout_s=60)
    results = run_engines(
        [
            job("b", model_dir, connector(b, tenant, rev), PROMPT_B_TOKENS, max_new_tokens=16),
            job("c", model_dir, connector(c, tenant, rev), PROMPT_C_TOKENS, max_new_tokens=8),
        ],
        tmp_path_factory.mktemp("engines-bc"),
    )
    for name in ("b", "c"):
        run, recompute = run_and_recompute(results, name)
        assert_reuse_is_exact(run, recompute, hit=SHARED)
