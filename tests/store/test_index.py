"""The sidecar's LMDB index, against a real LMDB environment."""

from __future__ import annotations

import hashlib
import multiprocessing
import multiprocessing.queues
import random
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import lmdb
import pytest

from kvoffload.store.api import ChunkRecord, Usage
from kvoffload.store.index import Index, IndexCorrupt, IndexFailure, IndexVersionError
from kvoffload.store.index_records import INDEX_SCHEMA

NS_A = b"A" * 32
NS_B = b"B" * 32


def key(n: int | str) -> bytes:
    return hashlib.sha256(str(n).encode()).digest()


def rec(
    n: int | str,
    *,
    tenant: str = "t1",
    ns: bytes = NS_A,
    size: int = 4096,
    access: int = 1_000,
    expires: int = 0,
) -> ChunkRecord:
    return ChunkRecord(
        tenant=tenant,
        chunk_key=key(n),
        namespace=ns,
        key_epoch=1,
        size=size,
        payload=size // 2,
        num_layers=32,
        created_ns=access,
        last_access_ns=access,
        expires_ns=expires,
    )


def expected_usage(
    recs: Iterable[ChunkRecord],
) -> tuple[dict[str, Usage], dict[tuple[str, bytes], Usage]]:
    by_tenant: Counter[str] = Counter()
    n_tenant: Counter[str] = Counter()
    by_ns: Counter[tuple[str, bytes]] = Counter()
    n_ns: Counter[tuple[str, bytes]] = Counter()
    for r in recs:
        by_tenant[r.tenant] += r.size
        n_tenant[r.tenant] += 1
        by_ns[r.tenant, r.namespace] += r.size
        n_ns[r.tenant, r.namespace] += 1
    return (
        {t: Usage(by_tenant[t], n_tenant[t]) for t in n_tenant},
        {k: Usage(by_ns[k], n_ns[k]) for k in n_ns},
    )


def assert_usage_consistent(idx: Index) -> None:
    """Usage tables must equal what the chunks table adds up to."""
    tenants, namespaces = expected_usage(idx.records())
    assert idx.tenants() == tenants
    for tenant in tenants:
        assert idx.usage(tenant) == tenants[tenant]
        assert idx.namespaces(tenant) == {ns: u for (t, ns), u in namespaces.items() if t == tenant}
    assert idx.usage() == Usage(
        sum(u.bytes for u in tenants.values()), sum(u.count for u in tenants.values())
    )
    assert idx.count() == sum(u.count for u in tenants.values())


@pytest.fixture
def idx(tmp_path: Path) -> Iterable[Index]:
    with Index(tmp_path / "index") as index:
        yield index


def test_put_get_remove(idx: Index) -> None:
    r = rec(1, expires=5_000)
    assert idx.get("t1", key(1)) is None
    assert idx.put(r) is True
    assert idx.get("t1", key(1)) == r
    assert idx.count() == 1
    assert idx.remove("t1", key(1)) == r
    assert idx.get("t1", key(1)) is None
    assert idx.remove("t1", key(1)) is None
    assert idx.count() == 0
    assert list(idx.lru()) == []
    assert idx.expired(10_000) == []
    assert idx.usage("t1") == Usage(0, 0)
    assert idx.tenants() == {}


def test_duplicate_put_is_refused_and_changes_nothing(idx: Index) -> None:
    first = rec(1, size=1000, access=10, expires=99)
    assert idx.put(first)
    before = (idx.usage(), idx.tenants(), idx.namespaces("t1"))
    again = rec(1, size=5000, ns=NS_B, access=20, expires=0)
    assert idx.put(again) is False
    assert idx.get("t1", key(1)) == first
    assert (idx.usage(), idx.tenants(), idx.namespaces("t1")) == before
    assert idx.usage() == Usage(1000, 1)
    assert [r.chunk_key for r in idx.lru()] == [key(1)]
    assert idx.expired(99) == [first]
    assert idx.put_many([again, first]) == 0
    assert idx.usage() == Usage(1000, 1)


def test_lookup_counts_the_present_prefix(idx: Index) -> None:
    for n in (0, 1, 3):
        idx.put(rec(n))
    assert idx.lookup("t1", [key(0), key(1), key(2), key(3)]) == 2
    assert idx.lookup("t1", [key(0), key(1)]) == 2
    assert idx.lookup("t1", [key(2), key(0)]) == 0
    assert idx.lookup("t1", []) == 0
    assert idx.lookup("t2", [key(0)]) == 0
    with pytest.raises(ValueError):
        idx.lookup("t1", [key(0), b"short"])
    # The batch checks (in C, over the whole batch) refuse what _check_key refuses:
    # any key of the wrong size or type, anywhere in the batch, present or not.
    for bad in (key(0) + b"x", bytearray(key(0)), memoryview(key(0)), "k" * 32):
        with pytest.raises(ValueError):
            idx.lookup("t1", [key(0), key(1), bad])  # type: ignore[list-item]
        with pytest.raises(ValueError):  # a batch of one takes checks of its own
            idx.lookup("t1", [bad], now_ns=1)  # type: ignore[list-item]
    with pytest.raises(ValueError):
        idx.lookup("t1", [key(9), b""])
    assert [idx.lookup("t1", [key(n)], now_ns=1) for n in range(4)] == [1, 1, 0, 1]


def test_lookup_stops_at_an_expired_record(idx: Index) -> None:
    idx.put(rec(0))
    idx.put(rec(1, expires=500))
    idx.put(rec(2))
    keys = [key(0), key(1), key(2)]
    assert idx.lookup("t1", keys) == 3  # no clock: expiry is not looked at
    assert idx.lookup("t1", keys, now_ns=499) == 3
    assert idx.lookup("t1", keys, now_ns=500) == 1
    assert idx.lookup("t1", keys[::2], now_ns=10**18) == 2  # 0: never expires
    # One key alone (a path of its own): the same answers.
    assert [idx.lookup("t1", [k], now_ns=500) for k in keys] == [1, 0, 1]
    assert idx.lookup("t1", keys[1:2], now_ns=499) == 1
    assert idx.lookup("t1", keys[:1], now_ns=1, created_after_ns=10**18) == 0


def test_lookup_refuses_a_bad_tenant_every_time(idx: Index) -> None:
    # Lookups remember the key prefix of the tenants they saw (index_records.
    # tenant_prefix): a refused name must be refused again, never remembered.
    idx.put(rec(0, tenant="a"))
    for _ in range(2):
        for bad in ("a\x00", "a\x00b", "x" * 256, "\ud800"):
            with pytest.raises(ValueError):
                idx.lookup(bad, [key(0)])
        with pytest.raises(TypeError):
            idx.lookup(b"a", [key(0)])  # type: ignore[arg-type]
        assert idx.lookup("a", [key(0)]) == 1
        assert idx.lookup("ab", [key(0)]) == 0
        assert idx.lookup("é" * 127, [key(0)]) == 0  # 254 bytes: a valid name


def test_tenants_are_isolated(idx: Index) -> None:
    a = rec(7, tenant="a", size=100)
    b = rec(7, tenant="b", size=300)
    ab = rec(7, tenant="ab", size=500)
    assert idx.put(a) and idx.put(b) and idx.put(ab)
    assert idx.count() == 3
    assert idx.get("a", key(7)) == a
    assert idx.get("b", key(7)) == b
    # "a" is a byte prefix of "ab": its scans must not see the other tenant.
    assert list(idx.records("a")) == [a]
    assert idx.lookup("a", [key(7)]) == 1
    assert idx.remove("a", key(7)) == a
    assert idx.get("a", key(7)) is None
    assert idx.get("b", key(7)) == b
    assert idx.get("ab", key(7)) == ab
    assert idx.tenants() == {"b": Usage(300, 1), "ab": Usage(500, 1)}
    with pytest.raises(ValueError):
        idx.put(rec(1, tenant="a\x00b"))
    with pytest.raises(ValueError):
        idx.get("a", b"\x00" * 31)
    assert idx.count() == 2


def test_lru_order_follows_touch(idx: Index) -> None:
    for n in range(5):
        idx.put(rec(n, access=10 + n))
    assert [r.chunk_key for r in idx.lru()] == [key(n) for n in range(5)]
    idx.touch("t1", [key(0), key(2), key("missing")], now_ns=100)
    assert [r.chunk_key for r in idx.lru()] == [key(n) for n in (1, 3, 4, 0, 2)]
    assert idx.get("t1", key(0)) == replace(rec(0, access=10), last_access_ns=100)
    # An out-of-order (older) touch must not move an entry back.
    idx.touch("t1", [key(2)], now_ns=50)
    got = idx.get("t1", key(2))
    assert got is not None and got.last_access_ns == 100
    assert [r.chunk_key for r in idx.lru(limit=2)] == [key(1), key(3)]
    assert list(idx.lru(limit=0)) == []
    # Touching another tenant's key is a no-op for this one.
    idx.touch("t2", [key(1)], now_ns=1_000)
    assert next(idx.lru()).chunk_key == key(1)
    assert idx.count() == 5
    assert_usage_consistent(idx)


def test_iteration_resumes_across_batches(idx: Index) -> None:
    idx._batch = 3
    recs = [rec(n, access=1_000 - n, ns=NS_A if n % 2 else NS_B) for n in range(20)]
    assert idx.put_many(recs) == 20
    assert list(idx.lru()) == sorted(recs, key=lambda r: r.last_access_ns)
    assert list(idx.lru(limit=7)) == sorted(recs, key=lambda r: r.last_access_ns)[:7]
    assert sorted(idx.records(), key=lambda r: r.chunk_key) == sorted(
        recs, key=lambda r: r.chunk_key
    )
    assert {r.chunk_key for r in idx.records("t1", NS_A)} == {key(n) for n in range(1, 20, 2)}
    assert list(idx.records(namespace=NS_B)) == list(idx.records("t1", NS_B))
    assert list(idx.records("nobody")) == []


def test_lru_iteration_allows_writes_between_items(idx: Index) -> None:
    idx._batch = 2
    for n in range(6):
        idx.put(rec(n, access=n + 1))
    seen = []
    for r in idx.lru():
        seen.append(r.chunk_key)
        # Eviction removes as it walks; must neither deadlock nor skip.
        assert idx.remove(r.tenant, r.chunk_key) == r
    assert seen == [key(n) for n in range(6)]
    assert idx.count() == 0


def test_expired(idx: Index) -> None:
    idx.put(rec("never", expires=0))
    idx.put(rec("e50", expires=50))
    idx.put(rec("e100", expires=100))
    idx.put(rec("e200", expires=200))
    assert idx.expired(10) == []
    assert [r.chunk_key for r in idx.expired(100)] == [key("e50"), key("e100")]
    assert [r.chunk_key for r in idx.expired(100, limit=1)] == [key("e50")]
    assert [r.chunk_key for r in idx.expired(10**18)] == [key("e50"), key("e100"), key("e200")]
    removed = idx.remove_many([("t1", key("e50")), ("t1", key("absent")), ("t1", key("e200"))])
    assert [r.chunk_key for r in removed] == [key("e50"), key("e200")]
    assert [r.chunk_key for r in idx.expired(10**18)] == [key("e100")]


def test_usage_is_exact(idx: Index) -> None:
    idx.put(rec(1, tenant="a", ns=NS_A, size=100))
    idx.put(rec(2, tenant="a", ns=NS_A, size=200))
    idx.put(rec(3, tenant="a", ns=NS_B, size=400))
    idx.put(rec(4, tenant="b", ns=NS_A, size=800))
    assert idx.usage("a") == Usage(700, 3)
    assert idx.usage("b") == Usage(800, 1)
    assert idx.usage("c") == Usage(0, 0)
    assert idx.usage() == Usage(1500, 4)
    assert idx.tenants() == {"a": Usage(700, 3), "b": Usage(800, 1)}
    assert idx.namespaces("a") == {NS_A: Usage(300, 2), NS_B: Usage(400, 1)}
    assert idx.namespaces("b") == {NS_A: Usage(800, 1)}
    idx.remove("a", key(3))
    assert idx.namespaces("a") == {NS_A: Usage(300, 2)}
    idx.remove("b", key(4))
    assert idx.tenants() == {"a": Usage(300, 2)}
    assert idx.namespaces("b") == {}


def test_usage_stays_consistent_under_random_operations(idx: Index) -> None:
    rng = random.Random(1234)
    tenants = ["a", "b", "c"]
    for _ in range(600):
        tenant = rng.choice(tenants)
        n = rng.randrange(40)
        op = rng.random()
        if op < 0.55:
            idx.put(rec(n, tenant=tenant, ns=rng.choice([NS_A, NS_B]), size=rng.randrange(1, 9999)))
        elif op < 0.85:
            idx.remove(tenant, key(n))
        else:
            idx.touch(tenant, [key(n)], now_ns=rng.randrange(10**6))
    assert idx.count() > 0
    assert_usage_consistent(idx)
    assert len(list(idx.lru())) == idx.count()


def test_clear_keeps_meta(idx: Index) -> None:
    idx.set_meta("store_id", b"\x01\x02")
    idx.put_many([rec(n, expires=5) for n in range(10)])
    idx.clear()
    assert idx.count() == 0
    assert list(idx.lru()) == []
    assert idx.expired(10) == []
    assert idx.usage() == Usage(0, 0)
    assert idx.namespaces("t1") == {}
    assert idx.get_meta("store_id") == b"\x01\x02"
    assert idx.get_meta("index_schema") == str(INDEX_SCHEMA).encode()
    assert idx.put(rec(1))


def test_meta(idx: Index) -> None:
    assert idx.get_meta("store_id") is None
    idx.set_meta("store_id", b"abc")
    assert idx.get_meta("store_id") == b"abc"
    with pytest.raises(ValueError):
        idx.set_meta("index_schema", b"2")


def test_reopen_keeps_everything(tmp_path: Path) -> None:
    path = tmp_path / "index"
    recs = [
        rec(n, tenant=f"t{n % 3}", ns=NS_A if n % 2 else NS_B, access=n, expires=n)
        for n in range(50)
    ]
    with Index(path) as idx:
        idx.put_many(recs)
        idx.touch("t0", [key(0)], now_ns=10_000)
        idx.set_meta("store_id", b"sid")
        idx.flush()
        before = (list(idx.records()), list(idx.lru()), idx.expired(25), idx.tenants())
    with pytest.raises(IndexFailure):
        idx.count()
    with Index(path) as again:
        after = (list(again.records()), list(again.lru()), again.expired(25), again.tenants())
        assert after == before
        assert again.get_meta("store_id") == b"sid"
        assert again.count() == 50
        assert list(again.lru())[-1].chunk_key == key(0)
        assert_usage_consistent(again)


def test_map_grows_from_64kib(tmp_path: Path) -> None:
    path = tmp_path / "index"
    recs = [rec(n, tenant=f"t{n % 4}", access=n, expires=n + 1) for n in range(5000)]
    with Index(path, map_size=64 << 10) as idx:
        for r in recs[:2000]:
            assert idx.put(r)
        assert idx.put_many(recs[2000:]) == 3000
        assert idx.count() == 5000
        assert idx.lookup("t0", [key(n) for n in range(0, 5000, 4)]) == 1250
        assert_usage_consistent(idx)
    assert (path / "data.mdb").stat().st_size > 64 << 10
    # Reopening with the small size must adopt the grown map, not truncate it.
    with Index(path, map_size=64 << 10) as idx:
        assert idx.count() == 5000
        assert idx.get("t3", key(4999)) == recs[4999]
        assert idx.put(rec("one more"))


def _rewrite_schema(path: Path, value: bytes | None, *, chunk: bool = False) -> None:
    env = lmdb.open(str(path), max_dbs=8)
    try:
        meta = env.open_db(b"meta")
        chunks = env.open_db(b"chunks")
        with env.begin(write=True) as txn:
            if value is None:
                txn.delete(b"index_schema", db=meta)
            else:
                txn.put(b"index_schema", value, db=meta)
            if chunk:
                txn.put(b"t\x00" + key(1), b"x", db=chunks)
    finally:
        env.close()


def test_unknown_schema_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "index"
    with Index(path) as idx:
        idx.put(rec(1))
        assert idx.get_meta("index_schema") == str(INDEX_SCHEMA).encode()
    _rewrite_schema(path, str(INDEX_SCHEMA + 1).encode())
    with pytest.raises(IndexVersionError, match="schema version"):
        Index(path)
    _rewrite_schema(path, b"garbage")
    with pytest.raises(IndexCorrupt):
        Index(path)
    _rewrite_schema(path, None)
    with pytest.raises(IndexCorrupt, match="no schema version"):
        Index(path)
    # A refused open must have released the environment for the next attempt.
    _rewrite_schema(path, str(INDEX_SCHEMA).encode())
    with Index(path) as idx:
        assert idx.get("t1", key(1)) == rec(1)


def test_undecodable_record_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "index"
    Index(path).close()
    _rewrite_schema(path, str(INDEX_SCHEMA).encode(), chunk=True)
    with Index(path) as idx, pytest.raises(IndexCorrupt):
        idx.get("t", key(1))
    assert issubclass(IndexCorrupt, IndexFailure)
    assert issubclass(IndexVersionError, IndexFailure)


def test_second_open_in_same_process_is_refused(tmp_path: Path) -> None:
    with Index(tmp_path / "index"), pytest.raises(IndexFailure):
        Index(tmp_path / "index")


def _child_main(path: str, queue: multiprocessing.queues.Queue[object]) -> None:
    try:
        with Index(Path(path)) as idx:
            queue.put((list(idx.records()), idx.usage(), idx.get_meta("store_id")))
    except BaseException as exc:
        queue.put(exc)


def test_second_process_sees_the_records(tmp_path: Path) -> None:
    path = tmp_path / "index"
    recs = [rec(n, tenant=f"t{n % 2}", size=100 + n) for n in range(30)]
    with Index(path) as idx:
        idx.put_many(recs)
        idx.set_meta("store_id", b"sid")
        expected = (list(idx.records()), idx.usage())
    ctx = multiprocessing.get_context("spawn")
    queue: multiprocessing.queues.Queue[object] = ctx.Queue()
    proc = ctx.Process(target=_child_main, args=(str(path), queue))
    proc.start()
    try:
        result = queue.get(timeout=120)
    finally:
        proc.join(timeout=60)
    assert not isinstance(result, BaseException), result
    assert result == (*expected, b"sid")
    assert proc.exitcode == 0
    assert len(expected[0]) == 30


def test_concurrent_puts_from_threads(tmp_path: Path) -> None:
    # A tiny map forces resizes while other threads write and read.
    with Index(tmp_path / "index", map_size=64 << 10) as idx:
        per_thread = 300
        errors: list[BaseException] = []
        done = threading.Event()

        def writer(t: int) -> None:
            try:
                for n in range(per_thread):
                    assert idx.put(rec(f"{t}-{n}", tenant=f"t{t % 3}", size=t * 1000 + n))
                    if n % 50 == 0:
                        idx.touch(f"t{t % 3}", [key(f"{t}-{n}")], now_ns=10**9 + n)
            except BaseException as exc:
                errors.append(exc)

        def reader() -> None:
            try:
                while not done.is_set():
                    idx.lookup("t0", [key("0-0"), key("0-1")])
                    sum(1 for _ in idx.lru(limit=50))
                    idx.usage()
                    # Yield the GIL: a reader spinning flat out only measures
                    # CPython's 5 ms switch interval, not the index.
                    time.sleep(0.001)
            except BaseException as exc:
                errors.append(exc)

        writers = [threading.Thread(target=writer, args=(t,)) for t in range(8)]
        readers = [threading.Thread(target=reader) for _ in range(2)]
        for th in writers + readers:
            th.start()
        for th in writers:
            th.join(timeout=120)
        done.set()
        for th in readers:
            th.join(timeout=60)
        assert not errors, errors
        assert not any(th.is_alive() for th in writers + readers)
        assert idx.count() == 8 * per_thread
        for t in range(8):
            keys = [key(f"{t}-{n}") for n in range(per_thread)]
            assert idx.lookup(f"t{t % 3}", keys) == per_thread
        assert idx.usage() == Usage(
            sum(t * 1000 + n for t in range(8) for n in range(per_thread)), 8 * per_thread
        )
        assert_usage_consistent(idx)
    assert (tmp_path / "index" / "data.mdb").stat().st_size > 64 << 10
