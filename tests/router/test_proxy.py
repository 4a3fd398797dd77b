"""``kvoffload router`` as a real process in front of stand-in workers on real sockets.

The workers are tests/router/standin_worker.py: small real HTTP servers
standing in for vLLM's API server (a test double of its HTTP surface: vLLM
itself runs in the vLLM tier). No event source is configured, so the router
runs DEGRADED: what it knows of each worker's cache is its own routing history.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.router.proxy_helpers import PROMPT, completion, wait_until, worker_of

from .procs import RouterProc, Worker, cluster, request, write_config
from .standin_worker import SSE_CHUNKS


def query(router: RouterProc, prompt: list[int], **headers: str) -> dict[str, Any]:
    status, _, body = router.post("/v1/kv/query", {"tokens": prompt}, **headers)
    assert status == 200, body
    got: dict[str, Any] = json.loads(body)
    return got


def test_sse_passes_through_byte_for_byte_and_json_unchanged(tmp_path: Path) -> None:
    with cluster(tmp_path) as (router, _workers):
        status, headers, body = router.post("/v1/completions", completion(PROMPT, stream=True))
        assert status == 200
        assert headers["content-type"].startswith("text/event-stream")
        assert body == b"".join(SSE_CHUNKS)
        status, headers, body = router.post(
            "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        )
        assert status == 200
        assert json.loads(body)["worker"] == worker_of(headers)
        status, _, body = router.get("/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["id"] == "m"


def test_a_shared_prefix_goes_back_to_the_worker_that_holds_it(tmp_path: Path) -> None:
    with cluster(tmp_path, n=3) as (router, _workers):
        _, h1, _ = router.post("/v1/completions", completion(PROMPT))
        first = worker_of(h1)
        for i in range(3):
            _, h, _ = router.post("/v1/completions", completion(PROMPT + [7, 8, 9] * (i + 1)))
            assert worker_of(h) == first
        got = query(router, PROMPT)
        assert got["mode"] == "degraded"
        assert got["workers"][first]["gpu"] == 3200
        others = [w for w in got["workers"] if w != first]
        assert all(got["workers"][w]["longest_matched"] == 0 for w in others)


def test_an_overloaded_worker_holding_the_prefix_loses_to_an_idle_one(tmp_path: Path) -> None:
    with cluster(tmp_path) as (router, workers):
        _, h, _ = router.post("/v1/completions", completion(PROMPT))
        holder = worker_of(h)
        busy = next(w for w in workers if w.name == holder)
        busy.control(waiting=40, running=60)

        def queued() -> bool:
            return float(query(router, PROMPT)["workers"][holder]["queue_s"]) > 1.0

        wait_until(queued, "the router to scrape the busy worker's /metrics")
        _, h, _ = router.post("/v1/completions", completion([*PROMPT, 1, 2, 3]))
        assert worker_of(h) != holder
        terms = query(router, PROMPT)["workers"]
        assert terms[holder]["gpu"] == 3200 and terms[holder]["missing_tokens"] == 1
        assert terms[holder]["queue_s"] > 10 * terms[holder]["prefill_s"]  # the queue, not the work
        assert terms[holder]["estimated_ttft_s"] > max(
            t["estimated_ttft_s"] for w, t in terms.items() if w != holder
        )


def test_no_worker_meeting_the_deadline_is_a_429_with_retry_after(tmp_path: Path) -> None:
    with cluster(tmp_path) as (router, workers):
        status, headers, body = router.post(
            "/v1/completions", completion(PROMPT), **{"X-KVOffload-Deadline-Ms": "1"}
        )
        assert status == 429
        assert int(headers["retry-after"]) >= 1
        assert json.loads(body)["error"]["type"] == "rate_limit_error"
        assert all(w.received() == [] for w in workers)
        status, _, _ = router.post(
            "/v1/completions", completion(PROMPT), **{"X-KVOffload-Deadline-Ms": "60000"}
        )
        assert status == 200
        status, _, body = router.post(
            "/v1/completions", completion(PROMPT), **{"X-KVOffload-Deadline-Ms": "soon"}
        )
        assert status == 400 and b"Deadline" in body
        _, _, metrics = router.get("/metrics")
        assert b"kvoffload_router_shed_total 1.0" in metrics


def test_a_killed_worker_is_retried_elsewhere_and_excluded(tmp_path: Path) -> None:
    # Health checks far apart: the router learns of the death from the request itself.
    with cluster(tmp_path, health_interval='"60s"') as (router, workers):
        _, h, _ = router.post("/v1/completions", completion(PROMPT))
        holder = worker_of(h)
        dead = next(w for w in workers if w.name == holder)
        dead.kill()
        status, h, body = router.post("/v1/completions", completion([*PROMPT, 5], stream=True))
        assert status == 200 and body == b"".join(SSE_CHUNKS)
        assert worker_of(h) != holder
        _, _, health = router.get("/health")
        assert json.loads(health)["workers"][holder] is False
        _, _, metrics = router.get("/metrics")
        assert b"kvoffload_router_retries_total 1.0" in metrics


def test_a_worker_failing_health_checks_gets_nothing(tmp_path: Path) -> None:
    with cluster(tmp_path) as (router, workers):
        workers[0].control(healthy=False)
        wait_until(
            lambda: json.loads(router.get("/health")[2])["workers"]["w0"] is False,
            "the health check to mark w0",
        )
        for i in range(4):
            _, h, _ = router.post("/v1/completions", completion([i] * 40))
            assert worker_of(h) == "w1"
        workers[1].control(healthy=False)
        wait_until(lambda: router.get("/health")[0] == 503, "no healthy worker")
        status, _, body = router.post("/v1/completions", completion([1]))
        assert status == 503 and b"no worker available" in body


def test_a_5xx_before_the_first_byte_is_retried_once(tmp_path: Path) -> None:
    with cluster(tmp_path) as (router, workers):
        for w in workers:
            w.control(status=500)
        status, _, body = router.post("/v1/completions", completion(PROMPT))
        assert status == 502 and b"HTTP 500" in body
        assert sum(len(w.received()) for w in workers) == 2  # one try each, no more


TENANTS = """
[tenants.alice]
api_keys = ["key-alice"]
cache_salt = "salt-alice-0123456789"
[tenants.mallory]
api_keys = ["key-mallory"]
cache_salt = "salt-mallory-0123456789"
"""


def test_another_tenants_guess_of_a_prompt_is_routed_cold(tmp_path: Path) -> None:
    alice = {"Authorization": "Bearer key-alice"}
    mallory = {"Authorization": "Bearer key-mallory"}
    with cluster(tmp_path, n=3, extra=TENANTS) as (router, workers):
        _, h, _ = router.post("/v1/completions", completion(PROMPT), **alice)
        holder = worker_of(h)
        mine = query(router, PROMPT, **alice)["workers"]
        assert mine[holder]["longest_matched"] == 3200
        # Mallory guesses Alice's prompt exactly, even passing Alice's salt as her own.
        theirs = query(router, PROMPT, **mallory)["workers"]
        assert all(t["longest_matched"] == 0 for t in theirs.values())
        spoof = request(
            router.port,
            "POST",
            "/v1/kv/query",
            {"tokens": PROMPT, "cache_salt": "salt-alice-0123456789"},
            mallory,
        )
        assert all(t["longest_matched"] == 0 for t in json.loads(spoof[2])["workers"].values())
        _, h, _ = router.post(
            "/v1/completions", completion(PROMPT, cache_salt="salt-alice-0123456789"), **mallory
        )
        forwarded = [r["body"] for w in workers for r in w.received()]
        salts = {b.get("cache_salt") for b in forwarded}
        assert salts == {"salt-alice-0123456789", "salt-mallory-0123456789:salt-alice-0123456789"}
        assert all("authorization" not in json.dumps(b).lower() for b in forwarded)
        status, _, body = router.post("/v1/completions", completion(PROMPT))
        assert status == 401 and b"API key" in body
        status, _, _ = router.post("/v1/kv/query", {"tokens": PROMPT}, Authorization="Bearer nope")
        assert status == 401


def test_the_worker_gets_the_clients_bytes_with_only_the_tenants_salt_added(
    tmp_path: Path,
) -> None:
    # Spacing, key order and an unescaped "é" survive only if the bytes are not re-encoded.
    raw = b'{ "model" : "m",\n  "prompt": [1, 2, 3],  "max_tokens": 4, "note": "\xc3\xa9" }'
    with cluster(tmp_path, extra=TENANTS) as (router, workers):
        alice = {"Authorization": "Bearer key-alice"}
        status, _, _ = request(router.port, "POST", "/v1/completions", raw=raw, headers=alice)
        assert status == 200
        own = raw.replace(b'"m",', b'"m", "cache_salt": "mine",')
        status, _, _ = request(router.port, "POST", "/v1/completions", raw=own, headers=alice)
        assert status == 200
        sent = [r for w in workers for r in w.received()]
        spliced = next(r for r in sent if r["body"]["cache_salt"] == "salt-alice-0123456789")
        assert spliced["raw"].encode() == b'{"cache_salt":"salt-alice-0123456789",' + raw[1:]
        # The client's own salt is kept behind the tenant's: one member, re-encoded.
        mine = next(r for r in sent if r is not spliced)
        assert mine["raw"].count("cache_salt") == 1
        assert mine["body"]["cache_salt"] == "salt-alice-0123456789:mine"


def test_a_cookie_a_worker_sets_rides_on_no_other_request(tmp_path: Path) -> None:
    # By host name: aiohttp's default cookie jar would keep it (it drops IP-address cookies).
    worker = Worker("w0")
    try:
        worker.url = worker.url.replace("127.0.0.1", "localhost")
        router = RouterProc(write_config(tmp_path / "router.toml", [worker]), tmp_path / "log")
        try:
            worker.control(cookie="session=alice-secret; Path=/")
            _, headers, _ = router.post("/v1/completions", completion(PROMPT))
            assert "alice-secret" in headers["set-cookie"]  # its own client gets it
            router.post("/v1/completions", completion([1, 2, 3]))  # another client
            assert [r["cookie"] for r in worker.received()] == [None, None]
        finally:
            router.stop()
    finally:
        worker.stop()


def test_select_and_reserve_books_the_choice_until_released(tmp_path: Path) -> None:
    with cluster(tmp_path) as (router, _workers):
        status, _, body = router.post("/v1/kv/select", {"tokens": PROMPT, "reserve": True})
        assert status == 200
        sel = json.loads(body)
        assert sel["worker"] in ("w0", "w1") and sel["url"].startswith("http://127.0.0.1:")
        rid = sel["reservation"]
        # The reservation is booked: the chosen worker has a queue now, and its blocks in flight.
        booked = query(router, PROMPT)["workers"][sel["worker"]]
        assert booked["queue_s"] > 0 and booked["gpu"] == 3200
        status, _, _ = router.post("/v1/kv/release", {"reservation": rid, "outcome": "finished"})
        assert status == 200
        assert query(router, PROMPT)["workers"][sel["worker"]]["queue_s"] == 0
        status, _, _ = router.post("/v1/kv/release", {"reservation": rid, "outcome": "finished"})
        assert status == 404
        status, _, _ = router.post("/v1/kv/release", {"reservation": rid, "outcome": "maybe"})
        assert status == 400


def test_bad_requests_get_one_clear_answer(tmp_path: Path) -> None:
    with cluster(tmp_path) as (router, workers):
        status, _, body = request(router.port, "POST", "/v1/completions", raw=b"{not json")
        assert status == 400 and json.loads(body)["error"]["message"].startswith("the request body")
        status, _, body = router.post("/v1/completions", [1, 2])
        assert status == 400
        status, _, body = router.post("/v1/kv/query", {"tokens": ["a"]})
        assert status == 400
        status, _, body = router.post("/v1/kv/query", {"prompt": "text, no tokenizer"})
        assert status == 400 and b"tokenize" in body
        assert all(w.received() == [] for w in workers)


def test_chat_is_tokenized_with_the_models_template_and_matched(tmp_path: Path) -> None:
    from .tokenizer_dir import make_tokenizer

    folder = make_tokenizer(tmp_path / "tok")
    system = " ".join(f"w{i % 400}" for i in range(600))  # a long shared system prompt
    with cluster(tmp_path, n=3, extra=f'[model]\ntokenizer = "{folder}"\n') as (router, _):

        def chat(user: str) -> dict[str, Any]:
            return {
                "model": "m",
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": user},
                ],
            }

        _, h, _ = router.post("/v1/chat/completions", chat("hello"))
        holder = worker_of(h)
        for user in ("world", "w7 w8", "hello world"):
            _, h, _ = router.post("/v1/chat/completions", chat(user))
            assert worker_of(h) == holder
        status, _, body = router.post("/v1/kv/query", {"prompt": system})
        assert status == 200
        # The completion form adds <s>, the chat form does not: no shared first block.
        assert json.loads(body)["workers"][holder]["longest_matched"] == 0
        status, _, body = router.post("/v1/kv/query", chat("w9"))
        assert json.loads(body)["workers"][holder]["longest_matched"] >= 592
