"""KV events, through the events wire codec, into the router's index and its decisions."""

from __future__ import annotations

from kvoffload.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
)
from kvoffload.router.core import Router, Topology, WorkerInfo
from kvoffload.router.feed import Source, apply_batch
from kvoffload.router.hashing import BlockHasher
from kvoffload.router.index import Location, SourceState

HASHER = BlockHasher(block_size=16)
TOKENS = list(range(5000, 5000 + 16 * 20))


def router() -> Router:
    infos = (WorkerInfo("w0", "n0"), WorkerInfo("w1", "n1"))
    roots: dict[str, tuple[bool, tuple[str, ...]]] = {
        "n0": (False, ("n0",)),
        "n1": (False, ("n1",)),
        "fs": (True, ("n0", "n1")),
    }
    r = Router(Topology(infos, roots), block_tokens=16)
    for w in ("w0", "w1"):
        r.set_worker_source(w, SourceState.LIVE)
    for root in roots:
        r.set_store_source(root, SourceState.LIVE)
    return r


def stored(
    hashes: list[bytes] | list[int], medium: str | None, locality: str | None = None
) -> BlockStored:
    return BlockStored(
        block_hashes=tuple(hashes),
        parent_block_hash=None,
        token_ids=(),
        block_size=16,
        lora_id=None,
        medium=medium,
        lora_name=None,
        locality=locality,
    )


def wire(*events: object) -> EventBatch:
    """Encode as vLLM 0.33 does and decode again: the router sees what the wire carried."""
    return decode_batch(encode_batch(EventBatch(1.0, tuple(events))))  # type: ignore[arg-type]


def test_engine_events_with_full_hashes_fill_the_gpu_and_cpu_tiers() -> None:
    r = router()
    full = HASHER.block_hashes(TOKENS)
    apply_batch(r, Source("worker", "w0"), wire(stored(full[:12], "GPU"), stored(full, "CPU")))
    m = r.matches(HASHER.external_hashes(TOKENS), ["w0", "w1"])
    assert (m["w0"].gpu, m["w0"].cpu, m["w1"].longest) == (12, 8, 0)


def test_int_hashes_and_storage_events_map_to_the_nodes_roots() -> None:
    r = router()
    ext = HASHER.external_hashes(TOKENS)
    apply_batch(r, Source("worker", "w0"), wire(stored(ext[:5], "STORAGE", "LOCAL")))
    apply_batch(r, Source("worker", "w1"), wire(stored(ext, "STORAGE", "REMOTE")))
    m = r.matches(ext, ["w0", "w1"])
    # The shared root is readable from both nodes; n0's own store only from w0.
    assert (m["w0"].storage_local, m["w0"].storage_remote) == (5, 15)
    assert (m["w1"].storage_local, m["w1"].storage_remote) == (0, 20)


def test_a_sidecar_feed_fills_its_root_and_removals_and_clears_apply() -> None:
    r = router()
    ext = HASHER.external_hashes(TOKENS)
    src = Source("store", "fs")
    apply_batch(r, src, wire(stored(ext, "STORAGE", "REMOTE")))
    apply_batch(r, src, wire(BlockRemoved(block_hashes=tuple(ext[10:11]), medium="STORAGE")))
    assert r.matches(ext, ["w1"])["w1"].storage_remote == 10
    apply_batch(r, src, wire(AllBlocksCleared()))
    assert r.matches(ext, ["w1"])["w1"].longest == 0
    assert r.index.size(Location("store", "fs")) == 0


def test_other_kv_cache_groups_are_skipped() -> None:
    r = router()
    ext = HASHER.external_hashes(TOKENS)
    ev = BlockStored(
        block_hashes=tuple(ext),
        parent_block_hash=None,
        token_ids=(),
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=1,
    )
    assert apply_batch(r, Source("worker", "w0"), wire(ev)) == 0
    assert r.matches(ext, ["w0"])["w0"].longest == 0


def test_events_steer_the_decision_to_the_holder() -> None:
    r = router()
    ext = HASHER.external_hashes(TOKENS)
    apply_batch(r, Source("worker", "w1"), wire(stored(ext, "GPU")))
    assert r.decide(ext, len(TOKENS), now=0.0).worker == "w1"
    apply_batch(r, Source("worker", "w1"), wire(AllBlocksCleared()))
    d = r.decide(ext, len(TOKENS), now=0.0)
    assert all(c.match.longest == 0 for c in d.candidates)
