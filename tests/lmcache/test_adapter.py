"""The plugin class in this process, as LMCache's storage controllers call it, against a
real sidecar: usage after a restart, a wrong-size chunk, a sidecar that is down, listing.

LMCache's ``MemoryObj`` is replaced by a stand-in holding only what an L2 adapter
touches (``byte_array``); test_mp_server.py runs the real ones through the real server.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from lmcache.v1.distributed.api import ObjectKey

from kvoffload.integrations.lmcache.adapter import KVOffloadL2Adapter
from kvoffload.testing import cli_argv

from ..sidecar_proc import DevSidecar, clean_env, dev_sidecar


class MemoryObjStandIn:
    """A stand-in for LMCache's MemoryObj: a writable ``byte_array``, nothing else."""

    def __init__(self, data: bytes) -> None:
        self.buf = bytearray(data)
        self.byte_array = memoryview(self.buf)


def _wait(fd: int, poll: Callable[[], Any]) -> Any:
    """Poll the task's event fd as LMCache's controllers do (bounded, not timed)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = poll()
        if r is not None:
            return r
        if select.select([fd], [], [], 0.05)[0]:
            with contextlib.suppress(BlockingIOError):
                os.read(fd, 8)
    raise AssertionError("the adapter never completed the task")


def _keys(salt: str, n: int, tag: str = "k") -> list[ObjectKey]:
    return [
        ObjectKey(f"{tag}{i}".encode().ljust(32, b"."), "m", 0x01000100, 0, salt) for i in range(n)
    ]


def store(a: KVOffloadL2Adapter, keys: list[ObjectKey], objs: list[Any]) -> Any:
    tid = a.submit_store_task(keys, objs)
    return _wait(a.get_store_event_fd(), lambda: a.pop_completed_store_tasks().get(tid))


def lookup(a: KVOffloadL2Adapter, keys: list[ObjectKey]) -> list[int]:
    tid = a.submit_lookup_and_lock_task(keys, {})
    bm = _wait(a.get_lookup_and_lock_event_fd(), lambda: a.query_lookup_and_lock_result(tid))
    a.submit_unlock(keys)
    return list(bm.get_indices_list())


def load(a: KVOffloadL2Adapter, keys: list[ObjectKey], objs: list[Any]) -> list[int]:
    tid = a.submit_load_task(keys, objs)
    return list(_wait(a.get_load_event_fd(), lambda: a.query_load_result(tid)).get_indices_list())


@pytest.fixture
def make(sidecar: DevSidecar) -> Iterator[Callable[..., KVOffloadL2Adapter]]:
    made: list[KVOffloadL2Adapter] = []

    def _make(**params: Any) -> KVOffloadL2Adapter:
        params.setdefault("socket", str(sidecar.socket_path))
        params.setdefault("usage_refresh_s", 0.001)
        a = KVOffloadL2Adapter(params)
        a.set_backend_identity("plugin")
        made.append(a)
        return a

    yield _make
    for a in made:
        a.close()


def test_usage_is_the_sidecars_also_right_after_a_restart(
    make: Callable[..., KVOffloadL2Adapter], sidecar: DevSidecar
) -> None:
    """LMCache's eviction controller sees a bounded pool whose usage survives a restart
    of LMCache (its own adapters count in the process and start at 0)."""
    a = make(tenants={"ua": "usage-a"}, max_capacity_bytes=64 << 20)
    assert a.supports_global_eviction
    objs = [MemoryObjStandIn(os.urandom(100_000)) for _ in range(3)]
    res = store(a, _keys("ua", 3), objs)
    assert res.is_successful() and res.bytes_transferred() == 300_000
    on_disk = sidecar.stats()["tenant_usage"]["usage-a"]["bytes"]
    u = a.get_usage()
    assert u.total_capacity_bytes == 64 << 20
    assert u.total_bytes_used >= on_disk >= 300_000
    assert u.bytes_by_cache_salt["ua"] == on_disk
    a.close()
    b = make(tenants={"ua": "usage-a"}, max_capacity_bytes=64 << 20)  # LMCache restarted
    u2 = b.get_usage()
    assert u2.bytes_by_cache_salt["ua"] == on_disk and u2.total_bytes_used >= on_disk
    assert 0 < u2.usage_fraction < 1
    assert lookup(b, _keys("ua", 3)) == [0, 1, 2]


def test_a_chunk_of_another_size_is_a_miss_and_never_touches_the_buffer(
    make: Callable[..., KVOffloadL2Adapter],
) -> None:
    a = make(tenants={"us": "size-t"})
    data = os.urandom(8192)
    assert store(a, _keys("us", 1), [MemoryObjStandIn(data)]).is_successful()
    right, wrong = MemoryObjStandIn(bytes(8192)), MemoryObjStandIn(b"\x07" * 16384)
    assert load(a, _keys("us", 1), [wrong]) == []
    assert bytes(wrong.buf) == b"\x07" * 16384
    assert load(a, _keys("us", 1), [right]) == [0]
    assert bytes(right.buf) == data


def test_a_sidecar_that_is_down_gives_misses_and_failed_stores(
    make: Callable[..., KVOffloadL2Adapter], tmp_path: Path
) -> None:
    a = make(socket=str(tmp_path / "absent.sock"), timeout_s=2)
    res = store(a, _keys("", 2), [MemoryObjStandIn(b"x" * 4096) for _ in range(2)])
    assert not res.is_successful()
    assert lookup(a, _keys("", 2)) == []
    assert load(a, _keys("", 2), [MemoryObjStandIn(bytes(4096)) for _ in range(2)]) == []
    assert not a.supports_global_eviction  # no capacity known: LMCache does not evict
    assert a.report_status()["is_healthy"] is False


def test_listing_shows_what_the_sidecar_still_holds(
    make: Callable[..., KVOffloadL2Adapter], sidecar: DevSidecar
) -> None:
    a = make(tenants={"ul": "list-t"})
    keys = _keys("ul", 3, "L")
    assert store(a, keys, [MemoryObjStandIn(os.urandom(5000)) for _ in keys]).is_successful()
    page = a.list_l2_keys(page_size=2)
    assert len(page.entries) == 2 and page.next_page_token == "2"
    rest = a.list_l2_keys(page_size=2, cursor=page.next_page_token)
    assert len(rest.entries) == 1 and rest.next_page_token is None
    listed = {e.key.chunk_hash_hex for e in (*page.entries, *rest.entries)}
    assert listed == {k.chunk_hash.hex() for k in keys}
    assert a.list_l2_keys(model_name="other").entries == ()
    with pytest.raises(ValueError, match="malformed cursor"):
        a.list_l2_keys(cursor="x")
    a.delete(keys[:1])  # discarded by LMCache's eviction: out of the listing
    assert len(a.list_l2_keys().entries) == 2
    r = subprocess.run(
        cli_argv("--dev", "purge", "--tenant", "list-t", "--yes"),
        cwd=sidecar.workdir,
        capture_output=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert a.list_l2_keys().entries == ()
    assert lookup(a, keys) == []


class DeletedListener:
    """Records what the adapter tells LMCache's listeners it deleted."""

    def __init__(self) -> None:
        self.deleted: list[ObjectKey] = []

    def on_l2_keys_stored(self, keys: list[ObjectKey], sizes: list[int]) -> None:
        pass

    def on_l2_keys_accessed(self, keys: list[ObjectKey]) -> None:
        pass

    def on_l2_keys_deleted(self, keys: list[ObjectKey]) -> None:
        self.deleted.extend(keys)


def test_delete_removes_the_chunk_from_the_sidecar_and_only_that_salts(
    make: Callable[..., KVOffloadL2Adapter], sidecar: DevSidecar
) -> None:
    """LMCache's eviction controller discards an object: the sidecar no longer holds
    it (a fresh adapter, as after a restart, misses it too, and the tenant's bytes
    go down), while the same chunk hash under another salt, of the same tenant or
    of another one, still hits."""
    a = make(tenants={"da": "del-a", "da2": "del-a", "db": "del-b"})
    heard = DeletedListener()
    a.register_listener(heard)
    mine, same_tenant, other = _keys("da", 2, "D"), _keys("da2", 2, "D"), _keys("db", 2, "D")
    for ks in (mine, same_tenant, other):
        assert store(a, ks, [MemoryObjStandIn(os.urandom(6000)) for _ in ks]).is_successful()
    before = sidecar.stats()["tenant_usage"]["del-a"]["bytes"]
    a.delete([mine[0]])
    assert heard.deleted == [mine[0]]
    assert lookup(a, mine[:1]) == [] and lookup(a, mine[1:]) == [0]
    assert lookup(a, same_tenant) == [0, 1] and lookup(a, other) == [0, 1]
    assert load(a, mine[:1], [MemoryObjStandIn(bytes(6000))]) == []
    assert sidecar.stats()["tenant_usage"]["del-a"]["bytes"] < before
    b = make(tenants={"da": "del-a", "da2": "del-a", "db": "del-b"})  # LMCache restarted
    assert lookup(b, mine[:1]) == [] and lookup(b, same_tenant) == [0, 1]
    # A key the sidecar no longer holds and this server never saw: nothing to tell.
    heard.deleted.clear()
    b.register_listener(heard)
    b.delete([mine[0]])
    assert heard.deleted == []


def test_the_sidecars_feed_names_objects_by_lmcaches_chunk_hash(tmp_path: Path) -> None:
    """What LMCache's vLLM connector announces for a chunk in CPU memory (its
    ``chunk_hash``) is what the sidecar's KV-event feed announces for the chunk in
    storage, once per chunk (rank 0, group 0), and retracts when LMCache deletes it."""
    with dev_sidecar(env={"KVOFFLOAD_EVENTS_ENABLED": "1"}) as sc:
        a = KVOffloadL2Adapter({"socket": str(sc.socket_path), "tenants": {"ev": "ev-t"}})
        try:
            (k0,) = _keys("ev", 1, "E")
            other_group = ObjectKey(k0.chunk_hash, "m", k0.kv_rank, 1, "ev")
            rank1 = ObjectKey(b"R".ljust(32, b"."), "m", 0x02010200, 0, "ev")
            objs = [MemoryObjStandIn(os.urandom(4096)) for _ in range(3)]
            assert store(a, [k0, other_group, rank1], objs).is_successful()
            a.delete([k0])
        finally:
            a.close()
        r = subprocess.run(
            cli_argv("--dev", "events", "tail", "--from", "0", "--count", "2", "--json",
                     "--timeout", "30"),
            cwd=sc.workdir, env=clean_env(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        events = [json.loads(line) for line in r.stdout.splitlines()]
        assert [(e["type"], e["block_hashes"], e["medium"]) for e in events] == [
            ("BlockStored", [k0.chunk_hash.hex()], "STORAGE"),
            ("BlockRemoved", [k0.chunk_hash.hex()], "STORAGE"),
        ]
        assert events[0]["block_size"] == 256
