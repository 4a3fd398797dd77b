"""Revocation and purge reach, in-process: the policy watcher, the revoked set, reload
bookkeeping (stats, metrics, audit), and a purge on one node of a shared root cancelling
another node's loads in flight and refusing its leases (issue 16, items 1 and 7).

The daemon-level behaviour, with peers under another uid, is in test_revocation.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.client import direct
from kvoffload.errors import ConfigError, LeaseInvalid
from kvoffload.events.consumer import EventConsumer
from kvoffload.layouts import v1
from kvoffload.sidecar.access.policy_file import load_policy, parse_policy
from kvoffload.sidecar.access.revocation import RevokedSet, policy_diff
from kvoffload.sidecar.config import ServerConfig
from kvoffload.sidecar.daemon import PolicyWatcher, reload_policy
from kvoffload.sidecar.events import SidecarEvents
from kvoffload.sidecar.metrics import Metrics
from kvoffload.sidecar.server import Server
from kvoffload.store import Store, StoreConfig, cancel
from kvoffload.store.api import StoreLease
from kvoffload.store.keys.keyring import Kek
from tests.helpers.events import NS as EV_NS
from tests.helpers.events import (
    announced,
)
from tests.helpers.events import blocks as ev_blocks
from tests.helpers.events import chunk_key as ev_key
from tests.helpers.stores import make_store

NS = bytes(range(32))
SENTINEL = 0xA5


def key(i: int) -> bytes:
    return hashlib.blake2b(f"k/{i}".encode(), digest_size=32).digest()


def layers(i: int) -> list[bytes]:
    return [bytes([i % 251 + 1]) * (3000 + 7 * n) for n in range(3)]


POLICY = """version = 1

[tenants.acme]
ttl = "1h"

[[grants]]
uid = 0
tenants = ["*"]
admin = true

[[grants]]
uid = 1001
tenants = {tenants}
"""


def write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.chmod(0o644)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------
# The watcher


def test_the_watcher_sees_renames_and_in_place_edits_but_not_a_touch(tmp_path: Path) -> None:
    pol = tmp_path / "policy.toml"
    write(pol, POLICY.format(tenants='["acme"]'))
    w = PolicyWatcher(pol)
    assert not w.changed()
    write(pol, POLICY.format(tenants='["beta"]'))  # an editor's rename
    assert w.changed() and not w.changed()
    with pol.open("r+") as f:  # in place, same size, a later mtime
        f.write(POLICY.format(tenants='["gama"]'))
    os.utime(pol, ns=(time.time_ns(), pol.stat().st_mtime_ns + 10**9))
    assert w.changed()
    os.utime(pol, ns=(time.time_ns(), pol.stat().st_mtime_ns + 10**9))  # touch: same content
    assert not w.changed()
    pol.unlink()
    assert w.changed()  # gone: the reload refuses it and says why


# ---------------------------------------------------------------------------
# The revoked set


def test_the_revoked_set_persists_and_a_damaged_file_fails_closed(tmp_path: Path) -> None:
    path = tmp_path / "revoked.json"
    old = parse_policy(POLICY.format(tenants='["acme", "beta"]'))
    new = parse_policy(POLICY.format(tenants='["acme"]'))
    s = RevokedSet(path)
    assert s.apply(old) == ([], [])
    assert s.apply(new) == (["beta"], [])
    assert "beta" in RevokedSet(path) and "acme" not in RevokedSet(path)
    assert path.stat().st_mode & 0o777 == 0o600
    # Named in a grant again: restored, persistently.
    assert RevokedSet(path).apply(old) == ([], ["beta"])
    assert "beta" not in RevokedSet(path)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="revoked-tenant list is unreadable"):
        RevokedSet(path)


def test_policy_diff_names_grants_tenants_and_settings() -> None:
    old = parse_policy(POLICY.format(tenants='["acme", "beta"]'))
    new = parse_policy(POLICY.format(tenants='["gamma"]').replace('ttl = "1h"', 'ttl = "2h"'))
    d = policy_diff(old, new)
    assert d["grants"] == {"uid 1001": {"added": ["gamma"], "removed": ["acme", "beta"]}}
    assert d["tenants"] == {"added": ["gamma"], "removed": ["beta"], "revoked": ["beta"]}
    assert d["settings"] == {"acme": {"ttl_s": [3600.0, 7200.0]}}
    assert policy_diff(old, old) == {
        "grants": {},
        "tenants": {"added": [], "removed": [], "revoked": []},
        "settings": {},
    }


# ---------------------------------------------------------------------------
# A reload's bookkeeping: stats, metrics, audit


@pytest.fixture
def served(tmp_path: Path, kek_file: Path) -> Iterator[tuple[Server, Store, Path]]:
    pol = tmp_path / "policy.toml"
    write(pol, POLICY.format(tenants='["acme", "beta"]'))
    store = make_store(tmp_path / "store", kek_file, durability="none")
    server = Server(
        store,
        load_policy(pol),
        ServerConfig(socket_path=tmp_path / "s.sock", revoked_file=tmp_path / "revoked.json"),
        metrics=Metrics(store.stats),
    )
    try:
        yield server, store, pol
    finally:
        server.pool.shutdown()
        store.close()


def _audit(store: Store) -> list[dict[str, object]]:
    path = store.config.resolved_index_dir() / "audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_refused_reload_is_counted_audited_and_changes_nothing(
    served: tuple[Server, Store, Path],
) -> None:
    server, store, pol = served
    before = server.policy
    write(pol, POLICY.format(tenants='"acme"'))
    assert not reload_policy(server, lambda: load_policy(pol))
    assert server.policy is before and server.service.generation == 0
    st = server.service.policy_state
    assert st.last_reload_ok is False and st.reloads_refused == 1
    assert st.last_error is not None and f"{pol}:13:" in st.last_error
    metrics = server.metrics
    assert metrics is not None
    text = metrics.render().decode()
    assert 'kvoffload_policy_reloads_total{result="refused"} 1.0' in text
    assert "kvoffload_policy_last_reload_success 0.0" in text
    assert _audit(store)[-1]["event"] == "policy_reload_refused"

    write(pol, POLICY.format(tenants='["acme"]'))
    assert reload_policy(server, lambda: load_policy(pol))
    text = metrics.render().decode()
    assert 'kvoffload_policy_reloads_total{result="ok"} 1.0' in text
    assert "kvoffload_policy_last_reload_success 1.0" in text
    events = [e["event"] for e in _audit(store)]
    assert events[-2:] == ["policy_reload", "revoke"]
    assert server.service.revoked.tenants == frozenset({"beta"})


# ---------------------------------------------------------------------------
# Shared root: a purge on node A reaches node B's loads and leases


@pytest.fixture
def nodes(tmp_path: Path, kek_file: Path) -> Iterator[list[Store]]:
    opened: list[Store] = []
    for name in ("a", "b"):
        cfg = StoreConfig(
            root=tmp_path / "root",
            index_dir=tmp_path / f"index-{name}",
            durability="none",  # type: ignore[arg-type]
            shared=True,
            journal_poll_s=3600,
            probe_files_on_miss=False,
        )
        opened.append(Store(cfg, Kek.from_file(kek_file), create=True))
    yield opened
    for s in opened:
        s.close()


def test_a_purge_on_one_node_cancels_a_load_in_flight_on_another(
    nodes: list[Store], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = nodes
    keys = [key(i) for i in range(3)]
    for i, k in enumerate(keys):
        assert a.put("acme", NS, k, layers(i))
    b.follow_journals()
    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "hold").touch()
    monkeypatch.setattr(cancel, "_GATE", str(gate))  # the test hook, in-process
    outs = [memoryview(bytearray([SENTINEL]) * sum(map(len, layers(i)))) for i in range(3)]
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(b.get_many_into("acme", keys, outs)))
    t.start()
    deadline = time.monotonic() + 30
    while not (gate / "waiting").exists():
        assert time.monotonic() < deadline, "the load never reached the hook"
        time.sleep(0.01)
    a.purge_namespace("acme", NS)
    assert b.follow_journals() >= 1  # the journal's PURGE_NAMESPACE reaches b
    (gate / "hold").unlink()
    t.join(30)
    assert got == [[None, None, None]]
    assert all(bytes(o) == bytes([SENTINEL]) * len(o) for o in outs)
    assert b.lookup("acme", keys) == 0


def _leased_object(store: Store, i: int) -> StoreLease:
    lease = store.lease_store("acme", NS, key(i), [len(x) for x in layers(i)])
    assert lease is not None
    header = v1.plain_header_block(
        tenant="acme",
        namespace=NS,
        chunk_key=key(i),
        lengths=tuple(len(x) for x in layers(i)),
        checks=direct.checks_of(layers(i)),
    )
    direct.PosixDirectIO().write_object(str(lease.tmp), header, layers(i), lease.offsets[1])
    return lease


def test_a_purge_on_one_node_refuses_another_nodes_lease(nodes: list[Store]) -> None:
    a, b = nodes
    ok = _leased_object(b, 1)
    assert b.publish_lease(ok)  # the control: a lease publishes
    lease = _leased_object(b, 2)
    a.purge_namespace("acme", NS)
    b.follow_journals()
    with pytest.raises(LeaseInvalid, match="purged or revoked"):
        b.publish_lease(lease)
    assert not lease.tmp.exists()
    assert b.lookup("acme", [key(2)]) == 0
    assert b.stats()["reserved_bytes"] == 0


# ---------------------------------------------------------------------------
# Events: a namespace purge (the path gov-keys's invalidate shares) is published


def test_a_namespace_purge_publishes_block_removed_for_exactly_its_chunks(
    wired: tuple[Store, SidecarEvents, EventConsumer],
) -> None:
    store, events, consumer = wired
    other = bytes(32)
    for i, ns in ((1, EV_NS), (2, EV_NS), (3, other)):
        assert store.put("acme", ns, ev_key(i), [os.urandom(4000)])
        assert events.record("acme", ev_key(i), ev_blocks(i))
    everything = {h for i in (1, 2, 3) for h in ev_blocks(i).hashes}
    assert announced(consumer) == everything
    assert store.purge_namespace("acme", EV_NS) == 2
    assert announced(consumer) == set(ev_blocks(3).hashes)
