"""A prefill's progress as its KV events show it: where the worker's oldest request is.

vLLM stores (and publishes ``BlockStored`` for) a prompt's blocks as its chunks
are computed, so the run of a request's hashes its worker's GPU holds by events
is how far its prefill has come. The router reads it at each decision: a head
request that has shown one chunk in the time of three is a slow one and the
queue behind it is longer than modelled; one that is nearly done leaves less.
Routing history and in-flight credit are not events and show no progress.
"""

from __future__ import annotations

from kvoffload.router.core import Router, Topology, WorkerInfo
from kvoffload.router.index import Location, PrefixIndex, SourceState
from kvoffload.router.model import Priors

BT = 16
N = 32_768  # four chunks of the 8192-token budget
PRIORS = Priors(prefill_a_s=0.02, prefill_b_s=1e-4)  # a chunk ≈ 0.84 s


def two_busy_workers() -> tuple[Router, dict[str, list[int]]]:
    """w0 and w1 each given one long prompt at t = 0 (the same size, nothing cached)."""
    infos = (WorkerInfo("w0", "n0"), WorkerInfo("w1", "n1"))
    r = Router(Topology(infos), priors=PRIORS, block_tokens=BT)
    for w in infos:
        r.set_worker_source(w.name, SourceState.LIVE)
    prompts = {}
    for i, w in enumerate(("w0", "w1")):
        hashes = [(i + 1) * 1_000_000 + k for k in range(N // BT)]
        r.dispatch(r.decide(hashes, N, now=0.0), 0.0, worker=w)
        prompts[w] = hashes
    r.decide([7], 100, now=1.0)  # a look at t = 1 (progress seen after it counts from it)
    return r, prompts


def small_request(r: Router, now: float) -> dict[str, float]:
    d = r.decide([9_999_999], 200, now=now)
    assert d.worker is not None
    return {c.worker: c.estimate.ttft_s for c in d.candidates} | {"chosen": float(d.worker[1])}


def test_a_head_that_shows_one_chunk_in_the_time_of_three_keeps_its_worker_busy_longer() -> None:
    quiet, _ = two_busy_workers()
    before = small_request(quiet, 2.5)
    assert before["w0"] == before["w1"]  # nothing seen: the two look alike

    r, prompts = two_busy_workers()
    # w0's prompt has stored one chunk's blocks by t = 2.5 (modelled: three); w1's three.
    r.index.apply_stored(Location("gpu", "w0"), prompts["w0"][: 8192 // BT])
    r.index.apply_stored(Location("gpu", "w1"), prompts["w1"][: 3 * 8192 // BT])
    after = small_request(r, 2.5)
    assert after["w0"] > before["w0"] + 1.0  # a slow head: more than a second more queue
    assert after["w1"] <= before["w1"]  # on pace, and further along than the drain says
    assert after["chosen"] == 1  # the old model, blind to it, took w0 (the tie's first)


def test_a_head_ahead_of_its_model_leaves_less_queue() -> None:
    quiet, _ = two_busy_workers()
    before = small_request(quiet, 1.5)
    r, prompts = two_busy_workers()
    # By t = 1.5 w1's prompt shows three chunks done (modelled: about one and a half).
    r.index.apply_stored(Location("gpu", "w1"), prompts["w1"][: 3 * 8192 // BT])
    after = small_request(r, 1.5)
    assert after["w1"] < before["w1"] - 0.5
    assert after["w0"] == before["w0"]
    assert after["chosen"] == 1


def test_progress_counts_events_only_not_history_or_in_flight_credit() -> None:
    ix = PrefixIndex()
    gpu = Location("gpu", "w0")
    ix.set_state(gpu, SourceState.LIVE)
    hashes = list(range(100, 110))
    ix.record_routed(gpu, hashes)
    ix.add_inflight(gpu, hashes)
    assert ix.stored_run(hashes, 0, gpu) == 0
    ix.apply_stored(gpu, hashes[:4])
    assert ix.stored_run(hashes, 0, gpu) == 4
    assert ix.stored_run(hashes, 2, gpu) == 4
    assert ix.stored_run(hashes, 0, Location("gpu", "w1")) == 0  # another worker's GPU
    ix.apply_removed(gpu, hashes[2:3])
    assert ix.stored_run(hashes, 0, gpu) == 2
