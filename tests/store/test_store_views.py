"""The Store's read-only views (what the CLI lists), with no data I/O."""

from __future__ import annotations

from kvoffload.store import Store

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


def _no_age(row: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in row.items() if k != "age_s"}


def test_ls_rows_pages_with_skip_and_limit(store: Store) -> None:
    from kvoffload.sidecar.admin import inspect_report, ls_rows

    for i in range(7):
        store.put("acme", NS, key(i), [b"a" * 100])
    store.put("beta", NS2, key(1), [b"b" * 100], encrypt=False)
    everything, more = ls_rows(store)
    assert len(everything) == 8 and not more
    pages: list[dict[str, object]] = []
    while True:
        page, more = ls_rows(store, tenant="acme", skip=len(pages), limit=3)
        pages.extend(page)
        if not more:
            break
    assert [r["key"] for r in pages] == [key(i).hex() for i in range(7)]
    # age_s ticks between the calls on a slow machine: every other field must match.
    whole, more = ls_rows(store, tenant="acme", limit=7)
    assert not more and [_no_age(r) for r in whole] == [_no_age(r) for r in pages]
    assert ls_rows(store, tenant="acme", limit=6)[1] is True
    assert ls_rows(store, older_than_s=3600) == ([], False)  # all were just created
    assert len(ls_rows(store, newer_than_s=3600)[0]) == 8
    assert ls_rows(store, namespace=NS2)[0][0]["tenant"] == "beta"
    report = inspect_report(store, store.root)
    assert report["chunks"] == 8 and report["tenants"]["acme"]["chunks"] == 7
    assert report["tenants_with_keys"] == ["acme"]  # beta is plaintext: no keys
