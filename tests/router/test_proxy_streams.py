"""Answers that break, and requests that are hostile, through a real ``kvoffload router``.

The workers are tests/router/standin_worker.py (a test double of vLLM's HTTP
surface on real sockets); told ``die_after``, one kills its own process in the
middle of a streamed answer, as a crashed engine does: right after the
response headers (vLLM sends them before the first token) or after some of
the stream. The client is http.client on a real socket.
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import Any

import pytest

from .procs import RouterProc, Worker, cluster, request
from .standin_worker import SSE_CHUNKS

PROMPT = list(range(1000, 1000 + 3200))


def completion(prompt: list[int], **kw: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt, "max_tokens": 4, **kw}


def holder_of(router: RouterProc, workers: list[Worker]) -> Worker:
    """The worker the router sends PROMPT to (and so its extensions, by prefix)."""
    status, headers, _ = router.post("/v1/completions", completion(PROMPT))
    assert status == 200
    return next(w for w in workers if w.name == headers["x-kvoffload-worker"])


def stream(port: int, body: object) -> tuple[int, dict[str, str], bytes, bool]:
    """POSTs and reads the whole answer: (status, headers, bytes, whether it ended cleanly)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        headers = {k.lower(): v for k, v in resp.getheaders()}
        try:
            return resp.status, headers, resp.read(), True
        except http.client.IncompleteRead as exc:
            return resp.status, headers, exc.partial, False
    finally:
        conn.close()


def metric(router: RouterProc, line: str) -> bool:
    return line.encode() in router.get("/metrics")[2]


def assert_openai_error(body: bytes, status: int) -> dict[str, Any]:
    err: dict[str, Any] = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["code"] == status
    return err


def test_a_worker_dying_after_its_headers_is_retried_elsewhere(tmp_path: Path) -> None:
    with cluster(tmp_path, health_interval='"60s"') as (router, workers):
        dying = holder_of(router, workers)
        dying.control(die_after=0)
        status, headers, body, clean = stream(router.port, completion([*PROMPT, 5], stream=True))
        # Nothing had reached the client: it gets the whole stream from the other worker.
        assert (status, body, clean) == (200, b"".join(SSE_CHUNKS), True)
        assert headers["x-kvoffload-worker"] != dying.name
        assert dying.proc.wait(10) == 1  # it really died, mid-request
        assert metric(router, "kvoffload_router_retries_total 1.0")
        assert json.loads(router.get("/health")[2])["workers"][dying.name] is False


def test_a_worker_dying_mid_stream_is_an_error_the_client_sees(tmp_path: Path) -> None:
    with cluster(tmp_path, health_interval='"60s"') as (router, workers):
        dying = holder_of(router, workers)
        dying.control(die_after=2)  # the first event whole, then death
        status, _, body, clean = stream(router.port, completion([*PROMPT, 5], stream=True))
        assert status == 200 and not clean  # no chunked terminator: a transport error
        first_event = SSE_CHUNKS[0] + SSE_CHUNKS[1]
        assert body.startswith(first_event)
        # Cut between events: an OpenAI error event follows (openai-python raises it).
        rest = body[len(first_event) :]
        assert rest.startswith(b"data: ") and rest.endswith(b"\n\n")
        err = assert_openai_error(rest[len(b"data: ") :], 502)
        assert dying.name in err["message"]
        assert b"[DONE]" not in body
        others = [w for w in workers if w is not dying]
        assert all(  # a stream the client has seen part of is never replayed elsewhere
            r["body"]["prompt"] != [*PROMPT, 5] for w in others for r in w.received()
        )
        assert metric(
            router, f'kvoffload_router_requests_total{{outcome="broken",worker="{dying.name}"}} 1.0'
        )


def test_a_stream_cut_inside_an_event_ends_broken_without_an_added_event(
    tmp_path: Path,
) -> None:
    with cluster(tmp_path, health_interval='"60s"') as (router, workers):
        dying = holder_of(router, workers)
        dying.control(die_after=1)  # half an event (and half a UTF-8 character)
        status, _, body, clean = stream(router.port, completion([*PROMPT, 5], stream=True))
        assert status == 200 and not clean
        assert body == SSE_CHUNKS[0]  # what the worker sent, nothing glued onto it


@pytest.mark.parametrize(
    "raw",
    [b"[" * 100_000, b'{"a":' * 100_000, b'{"prompt": [' + b"[" * 50_000 + b"]}"],
    ids=["arrays", "objects", "in-a-field"],
)
def test_deeply_nested_json_is_a_400(tmp_path: Path, raw: bytes) -> None:
    with cluster(tmp_path, n=1) as (router, workers):
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/kv/query"):
            status, headers, body = request(router.port, "POST", path, raw=raw)
            assert status == 400
            assert headers["content-type"].startswith("application/json")
            err = assert_openai_error(body, 400)
            assert err["type"] == "invalid_request_error"
        assert workers[0].received() == []
        status, _, _ = router.post("/v1/completions", completion([1, 2, 3]))
        assert status == 200  # and the router is still serving


def test_every_error_the_router_makes_is_in_the_openai_format(tmp_path: Path) -> None:
    with cluster(tmp_path, n=1, max_body='"8KiB"') as (router, workers):
        big = completion(list(range(5000)))
        status, headers, body = router.post("/v1/completions", big)
        assert status == 413
        assert headers["content-type"].startswith("application/json")
        assert "limit" in assert_openai_error(body, 413)["message"]
        raw = b'{"n": ' + b"9" * 4400 + b"}"
        status, _, body = request(router.port, "POST", "/v1/completions", raw=raw)
        assert status == 400  # an integer beyond Python's digit limit
        assert_openai_error(body, 400)
        status, _, body = router.get("/v1/nowhere")
        assert status == 404
        assert assert_openai_error(body, 404)["type"] == "not_found_error"
        status, headers, body = router.get("/v1/completions")
        assert status == 405 and "POST" in headers["allow"]
        assert_openai_error(body, 405)
        # A charset the header claims but Python does not know: the JSON is still read.
        status, _, body = request(
            router.port,
            "POST",
            "/v1/completions",
            raw=json.dumps(completion([1, 2])).encode(),
            headers={"Content-Type": "application/json; charset=klingon"},
        )
        assert status == 200, body
        assert len(workers[0].received()) == 1
