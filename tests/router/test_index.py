"""The prefix index: each location's longest prefix, tiers best-first, views by source."""

from __future__ import annotations

from kvoffload.router.index import Location, PrefixIndex, SourceState, TierMatch

GPU = Location("gpu", "w0")
CPU = Location("cpu", "w0")
STORE = Location("store", "node0")
SHARED = Location("store", "shared")


def live(ix: PrefixIndex, *locs: Location) -> None:
    for loc in locs:
        ix.set_state(loc, SourceState.LIVE)


def test_a_location_matches_up_to_its_first_missing_block() -> None:
    ix = PrefixIndex()
    live(ix, GPU, STORE)
    ix.apply_stored(GPU, [1, 2, 3, 5])  # 4 missing: 5 cannot count
    ix.apply_stored(STORE, [1, 2])
    assert ix.prefix_lengths([1, 2, 3, 4, 5]) == {GPU: 3, STORE: 2}
    assert ix.prefix_lengths([9, 1, 2]) == {}


def test_removed_and_cleared_blocks_stop_matching() -> None:
    ix = PrefixIndex()
    live(ix, GPU, CPU)
    ix.apply_stored(GPU, [1, 2, 3])
    ix.apply_stored(CPU, [1, 2, 3])
    ix.apply_removed(GPU, [2])
    assert ix.prefix_lengths([1, 2, 3]) == {GPU: 1, CPU: 3}
    ix.cleared(CPU)
    assert ix.prefix_lengths([1, 2, 3]) == {GPU: 1}
    assert ix.size(CPU) == 0 and ix.size(GPU) == 1  # 3 went with its parent 2


def test_compose_credits_each_tier_only_past_the_previous_reach() -> None:
    lengths = {GPU: 2, CPU: 1, STORE: 5, SHARED: 8}
    m = PrefixIndex.compose(lengths, GPU, CPU, [STORE], [SHARED])
    assert m == TierMatch(gpu=2, cpu=0, storage_local=3, storage_remote=3)
    assert m.longest == 8


def test_a_stale_source_is_read_from_the_routing_history() -> None:
    ix = PrefixIndex()
    live(ix, GPU)
    ix.apply_stored(GPU, [1, 2])
    ix.record_routed(GPU, [1, 2, 3, 4])
    assert ix.prefix_lengths([1, 2, 3, 4]) == {GPU: 2}
    ix.set_state(GPU, SourceState.STALE)
    assert ix.prefix_lengths([1, 2, 3, 4]) == {GPU: 4}
    assert ix.has_history()


def test_history_is_bounded_least_recently_routed_first_out() -> None:
    ix = PrefixIndex(history_capacity=3)
    ix.record_routed(GPU, [1, 2, 3])
    ix.record_routed(GPU, [1, 4])  # 1 refreshed, 2 is the oldest and goes
    assert ix.prefix_lengths([1]) == {GPU: 1}
    assert ix.prefix_lengths([2]) == {}


def test_inflight_blocks_count_until_dropped_with_refcounts() -> None:
    ix = PrefixIndex()
    live(ix, GPU)
    ix.add_inflight(GPU, [1, 2])
    ix.add_inflight(GPU, [1, 2, 3])
    assert ix.prefix_lengths([1, 2, 3]) == {GPU: 3}
    ix.drop_inflight(GPU, [1, 2, 3])
    assert ix.prefix_lengths([1, 2, 3]) == {GPU: 2}
    ix.drop_inflight(GPU, [1, 2])
    assert ix.prefix_lengths([1, 2, 3]) == {}


def test_many_locations_each_get_their_own_length() -> None:
    ix = PrefixIndex()
    locs = [Location("gpu", f"w{i}") for i in range(70)]  # past 64 bits of mask
    hashes = list(range(100, 200))
    for i, loc in enumerate(locs):
        ix.set_state(loc, SourceState.LIVE)
        ix.apply_stored(loc, hashes[:i])
    got = ix.prefix_lengths(hashes)
    assert all(got.get(loc, 0) == i for i, loc in enumerate(locs))
