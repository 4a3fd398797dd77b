"""The Store's read-only views (what the CLI lists), with no data I/O."""

from __future__ import annotations

from kvoffload.sidecar.store import Store

NS = bytes(range(32))
NS2 = bytes(32)


def key(i: int) -> bytes:
    return bytes([i]) * 32


def test_views_count_what_was_stored(store: Store) -> None:
    store.put("acme", NS, key(1), [b"a" * 100])
    store.put("acme", NS2, key(2), [b"b" * 200], encrypt=False)
    store.put("beta", NS, key(1), [b"c" * 300])
    assert store.chunk_count() == 3
    usage = store.tenant_usage()
    assert sorted(usage) == ["acme", "beta"]
    assert usage["acme"].count == 2
    assert sum(u.bytes for u in usage.values()) == store.used_bytes
    per_ns = store.namespace_usage("acme")
    assert {ns: u.count for ns, u in per_ns.items()} == {NS: 1, NS2: 1}
    assert {(r.tenant, r.chunk_key) for r in store.chunks()} == {
        ("acme", key(1)),
        ("acme", key(2)),
        ("beta", key(1)),
    }
    assert [r.chunk_key for r in store.chunks(tenant="acme", namespace=NS2)] == [key(2)]
    assert [r.key_epoch > 0 for r in store.chunks(tenant="acme")] == [True, False]
