"""What OpenAI's own Python client sees of a worker dying under ``kvoffload router``.

openai-python (in the vLLM tier's venv; skipped where it is not installed)
against a real router process in front of stand-in workers
(tests/router/standin_worker.py, a test double of vLLM's HTTP surface) that
kill themselves mid-answer when told ``die_after``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .procs import RouterProc, Worker, cluster

openai = pytest.importorskip("openai")

PROMPT = list(range(1000, 1000 + 3200))


def holder_of(router: RouterProc, workers: list[Worker]) -> Worker:
    status, headers, _ = router.post("/v1/completions", {"model": "m", "prompt": PROMPT})
    assert status == 200
    return next(w for w in workers if w.name == headers["x-kvoffload-worker"])


def texts(router: RouterProc) -> list[str]:
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{router.port}/v1", api_key="x", max_retries=0
    )
    stream = client.completions.create(model="m", prompt=[*PROMPT, 5], max_tokens=4, stream=True)
    return [c.choices[0].text for c in stream]


def test_the_client_gets_the_whole_stream_when_a_worker_dies_before_its_first_byte(
    tmp_path: Path,
) -> None:
    with cluster(tmp_path, health_interval='"60s"') as (router, workers):
        holder_of(router, workers).control(die_after=0)
        assert texts(router) == ["h\u00e9llo", " world"]


def test_the_client_raises_when_a_worker_dies_mid_stream(tmp_path: Path) -> None:
    with cluster(tmp_path, health_interval='"60s"') as (router, workers):
        dying = holder_of(router, workers)
        dying.control(die_after=2)
        with pytest.raises(openai.APIError, match=dying.name):
            texts(router)
