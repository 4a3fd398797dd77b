"""Per-tenant quotas in the store (policy ``quota``): a real Store, real LMDB, real files.

A quota bounds a tenant's stored + reserved bytes. Like the store's
capacity, it is a cache limit: the tenant's own least recently used
unpinned chunks make room, never another tenant's; only when nothing of its
own can go is a write refused (:class:`QuotaExceeded`, the protocol's
``NO_SPACE``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload.errors import QuotaExceeded, StoreFull
from kvoffload.layouts import v1
from kvoffload.store.api import ChunkRecord
from tests.helpers.stores import NS, key, layers, open_store

OBJ = v1.object_size([3000] * 4, True)


def put_with_quota(s: object, tenant: str, i: int, quota: int | None) -> bool:
    from kvoffload.store import Store

    assert isinstance(s, Store)
    res = s.reserve(tenant, OBJ, quota=quota)
    return s.put(tenant, NS, key(i, tenant), layers(i), reservation=res)


def test_a_tenant_at_its_quota_evicts_only_its_own_oldest_chunks(
    tmp_path: Path, kek_file: Path
) -> None:
    s = open_store(tmp_path, kek_file, low_watermark=0.75)
    try:
        quota = OBJ * 8
        for i in range(5):
            assert s.put("other", NS, key(i, "other"), layers(i))
        for i in range(8):
            assert put_with_quota(s, "acme", i, quota)
        assert s.tenant_accounted("acme") == quota
        s.touch("acme", [key(0, "acme")])  # chunk 0 is now the most recent
        assert put_with_quota(s, "acme", 8, quota)

        held = [i for i in range(9) if s.contains("acme", key(i, "acme"))]
        # Room for one more, plus the slack down to 75 % of the quota: the three
        # least recently used went (1, 2, 3), the touched chunk 0 stayed.
        assert held == [0, 4, 5, 6, 7, 8]
        assert s.tenant_accounted("acme") <= quota
        assert all(s.contains("other", key(i, "other")) for i in range(5))
        assert s.get("acme", key(0, "acme")) == layers(0)
        assert s.reserved_bytes == 0
    finally:
        s.close()


def test_pinned_chunks_are_never_evicted_for_a_quota(tmp_path: Path, kek_file: Path) -> None:
    s = open_store(tmp_path, kek_file)
    try:
        quota = OBJ * 3
        for i in range(3):
            assert put_with_quota(s, "acme", i, quota)
        s.pin("acme", [key(i, "acme") for i in range(3)])
        with pytest.raises(QuotaExceeded, match="tenant 'acme' quota full") as err:
            s.reserve("acme", OBJ, quota=quota)
        assert isinstance(err.value, StoreFull)  # what the server answers NO_SPACE for
        assert all(s.contains("acme", key(i, "acme")) for i in range(3))
        assert s.reserved_bytes == 0 and s.tenant_accounted("acme") == quota
        s.unpin("acme", [key(0, "acme")])
        assert put_with_quota(s, "acme", 3, quota)
        assert not s.contains("acme", key(0, "acme"))
    finally:
        s.close()


def test_zero_and_too_small_quotas_store_nothing(tmp_path: Path, kek_file: Path) -> None:
    s = open_store(tmp_path, kek_file)
    try:
        with pytest.raises(QuotaExceeded):
            s.reserve("acme", OBJ, quota=0)
        with pytest.raises(QuotaExceeded):
            s.reserve("acme", OBJ, quota=OBJ - 1)
        assert s.reserved_bytes == 0 and s.tenant_accounted("acme") == 0
        # A failed reservation under the store capacity gives the tenant's share back.
        small = open_store(tmp_path / "b", kek_file, capacity_bytes=OBJ // 2)
        try:
            with pytest.raises(StoreFull):
                small.reserve("acme", OBJ, quota=OBJ * 4)
            assert small.tenant_accounted("acme") == 0
        finally:
            small.close()
    finally:
        s.close()


def test_concurrent_writers_never_exceed_a_quota(tmp_path: Path, kek_file: Path) -> None:
    s = open_store(tmp_path, kek_file)
    quota = OBJ * 6
    peak = [0]
    errors: list[BaseException] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], s.tenant_accounted("acme"))

    def writer(w: int) -> None:
        try:
            for i in range(w * 100, w * 100 + 25):
                put_with_quota(s, "acme", i, quota)
        except BaseException as exc:
            errors.append(exc)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        stop.set()
        watcher.join()
        s.close()
    assert not errors
    assert 0 < peak[0] <= quota


def test_a_writer_that_freed_nothing_decides_full_on_one_view_of_the_room(
    tmp_path: Path, kek_file: Path
) -> None:
    """The race that made a concurrent writer see a full quota: its eviction
    freed nothing because another writer had just evicted everything (room
    was plentiful), and then, before it looked at the room again, other
    writes committed and filled the quota with chunks that could be evicted.
    "Nothing to evict" from the first moment and "no room" from the second
    must not combine into QuotaExceeded. The interleaving is forced through
    the store's own drop and the index's listing, each still doing its real
    work."""
    s = open_store(tmp_path, kek_file)
    quota = OBJ * 2
    try:
        assert put_with_quota(s, "acme", 1, quota)
        assert put_with_quota(s, "acme", 2, quota)
        real_drop = s._removal.drop
        real_records = s.index.records
        state = {"dropped_by_other": False, "refilled": False}

        def drop(tenant: str, k: bytes, **kw: Any) -> bool:
            if not state["dropped_by_other"]:
                state["dropped_by_other"] = True
                # Another writer evicts the tenant's chunks first.
                for i in (1, 2):
                    real_drop("acme", key(i, "acme"), reason="quota")
            return real_drop(tenant, k, **kw)

        def records(*args: Any, **kw: Any) -> Iterator[ChunkRecord]:
            out = list(real_records(*args, **kw))
            if state["dropped_by_other"] and not state["refilled"] and not s._state.mu.locked():
                state["refilled"] = True
                # Two other writers commit into the room that eviction made.
                assert put_with_quota(s, "acme", 3, quota)
                assert put_with_quota(s, "acme", 4, quota)
            return iter(out)

        s._capacity.evicts_with(drop)
        s.index.records = records  # type: ignore[method-assign]
        res = s.reserve("acme", OBJ, quota=quota)
        assert state["dropped_by_other"]
        assert s.put("acme", NS, key(5, "acme"), layers(5), reservation=res)
        assert s.tenant_accounted("acme") <= quota
        assert s.contains("acme", key(5, "acme"))
    finally:
        s.close()


def test_the_sidecar_enforces_the_policy_quota(tmp_path: Path) -> None:
    """A real daemon: saves beyond a tenant's quota evict its own oldest chunks."""
    import shutil
    import tempfile

    from tests.helpers.process import (
        load,
        lookup,
        no_tracebacks,
        save,
        start_configured,
        values,
        write_config,
    )
    from tests.sidecar_proc import Procs, chunk_key, chunk_layers, object_relpath

    workdir = Path(tempfile.mkdtemp(prefix="kvo-q-", dir="/tmp"))
    procs = Procs()
    try:
        one = max(
            v1.object_size([len(x) for x in chunk_layers("capped", "q", i)], True)
            for i in range(40)
        )
        cfg = write_config(
            workdir,
            f"""\
            version = 1

            [tenants.capped]
            quota = "{one * 6}B"

            [tenants.tiny]
            quota = "1KiB"

            [[grants]]
            uid = 0
            tenants = ["capped", "tiny", "free"]
            """,
        )
        sidecar = start_configured(procs, workdir, cfg)
        sock = sidecar.socket_path
        rounds = [list(range(r * 4, r * 4 + 4)) for r in range(5)]  # 20 chunks, 4 per save
        out = procs.steps(
            sock,
            [
                save("q", list(range(5)), "free"),
                *(save("q", idx, "capped") for idx in rounds),
                save("q", [0], "tiny"),
                save("q", list(range(100, 112)), "capped"),  # twice the quota in one call
                lookup("q", list(range(5)), "free"),
            ],
        )
        got = values(out)
        assert got[0] == [True] * 5
        assert got[1:6] == [[True] * 4] * 5  # each save fits: older chunks made room
        assert got[6] == [False]  # larger than the whole quota
        assert any("NO_SPACE" in w for w in out[6]["warnings"])
        # In one call, chunks in flight hold their room until stored, so a call
        # of twice the quota stores what fits and refuses the rest.
        big = got[7]
        assert True in big and False in big
        assert got[8] == 5  # another tenant's chunks are never evicted for a quota
        stats = sidecar.wait_idle()
        assert stats["reserved_bytes"] == 0 and stats["evictions"] >= 14
        # Nothing of the first rounds is left; the last call's stored chunks load.
        last = len(big) - 1 - big[::-1].index(True)
        out = procs.steps(
            sock, [lookup("q", rounds[0], "capped"), load("q", [100 + last], "capped")]
        )
        assert values(out) == [0, ["ok"]]
        on_disk = [
            path.stat().st_size
            for i in [*range(20), *range(100, 112)]
            if (path := workdir / "store" / object_relpath("capped", chunk_key("q", i))).exists()
        ]
        assert on_disk and sum(on_disk) <= one * 6  # the files keep the quota too
        no_tracebacks(sidecar)
    finally:
        procs.close()
        shutil.rmtree(workdir, ignore_errors=True)
