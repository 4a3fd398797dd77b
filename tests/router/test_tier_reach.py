"""Tiers that hold the prompt's middle: blocks the GPU evicted to the CPU tier still count.

The engine hits its GPU prefix cache up to the first miss and loads the rest,
block after block, from the tiers it reads. A CPU tier that holds blocks 4..9
of a prompt whose blocks 0..3 are still in the GPU is a 10-block reach, though
it does not hold block 0.
"""

from __future__ import annotations

from kvoffload.router.core import Router, Topology, WorkerInfo
from kvoffload.router.hashing import BlockHasher
from kvoffload.router.index import Location, SourceState, TierMatch


def router() -> Router:
    infos = (WorkerInfo("w0", "n0"), WorkerInfo("w1", "n1"))
    roots: dict[str, tuple[bool, tuple[str, ...]]] = {"shared": (True, ("n0", "n1"))}
    r = Router(Topology(infos, roots), block_tokens=16)
    for w in infos:
        r.set_worker_source(w.name, SourceState.LIVE)
    r.set_store_source("shared", SourceState.LIVE)
    return r


def test_cpu_blocks_past_the_gpu_prefix_are_credited() -> None:
    r = router()
    prompt = list(range(100, 110))
    r.index.apply_stored(Location("gpu", "w0"), prompt[:4])
    r.index.apply_stored(Location("cpu", "w0"), prompt[4:], chain=False)  # evicted there
    m = r.matches(prompt, ["w0", "w1"])
    assert m["w0"] == TierMatch(gpu=4, cpu=6)
    assert m["w1"] == TierMatch()


def test_each_tier_continues_where_the_better_ones_stop() -> None:
    r = router()
    prompt = list(range(200, 216))
    r.index.apply_stored(Location("gpu", "w0"), prompt[:3])
    r.index.apply_stored(Location("cpu", "w0"), prompt[3:6], chain=False)
    r.index.apply_stored(Location("store", "shared"), prompt[8:])  # not contiguous: 6, 7 missing
    assert r.matches(prompt, ["w0"])["w0"] == TierMatch(gpu=3, cpu=3)
    r.index.apply_stored(Location("store", "shared"), prompt[6:8])
    assert r.matches(prompt, ["w0"])["w0"] == TierMatch(gpu=3, cpu=3, storage_remote=10)
    # A GPU block past the first miss is not a GPU hit (the engine stops there).
    r.index.apply_stored(Location("gpu", "w1"), [prompt[0], prompt[5]])
    assert r.matches(prompt, ["w1"])["w1"].gpu == 1


def test_another_tenants_blocks_are_never_credited_in_the_middle_either() -> None:
    r = router()
    hasher = BlockHasher(block_size=16)
    tokens = list(range(16 * 8))
    mine = hasher.external_hashes(tokens, cache_salt="salt-a")
    theirs = hasher.external_hashes(tokens, cache_salt="salt-b")
    r.index.apply_stored(Location("gpu", "w0"), mine[:2])
    r.index.apply_stored(Location("cpu", "w0"), theirs[2:], chain=False)
    r.index.apply_stored(Location("store", "shared"), theirs)
    assert r.matches(mine, ["w0"])["w0"] == TierMatch(gpu=2)
    assert r.matches(theirs, ["w1"])["w1"] == TierMatch(storage_remote=8)
    d = r.decide(mine, len(tokens), now=0.0)
    assert all(c.match.cpu == 0 and c.match.storage_remote == 0 for c in d.candidates)
