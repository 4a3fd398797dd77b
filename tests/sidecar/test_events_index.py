"""What the KV-event feed keeps in the index (block hashes per chunk, the durable
replay buffer, the incarnation), and its settings in the policy and the config."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kvoffload.errors import ConfigError, PolicyError
from kvoffload.sidecar.access.policy_file import load_policy
from kvoffload.sidecar.config import load_config
from kvoffload.store.api import ChunkRecord
from kvoffload.store.index import Index

NS = b"\x07" * 32


def _key(n: int) -> bytes:
    return hashlib.sha256(str(n).encode()).digest()


def _rec(n: int, tenant: str = "t1") -> ChunkRecord:
    return ChunkRecord(tenant, _key(n), NS, 1, 4096, 2048, 2, 1000, 1000, 0)


@pytest.fixture
def idx(tmp_path: Path) -> Index:
    return Index(tmp_path / "index")


def test_hashes_are_kept_once_per_stored_chunk_and_leave_with_it(idx: Index) -> None:
    assert not idx.set_blocks("t1", _key(1), b"h1")  # not stored: nothing kept
    assert idx.put(_rec(1)) and idx.put(_rec(2)) and idx.put(_rec(3, tenant="t2"))
    assert idx.set_blocks("t1", _key(1), b"h1")
    assert not idx.set_blocks("t1", _key(1), b"other")  # never replaced
    assert idx.set_blocks("t2", _key(3), b"h3")
    assert idx.get_blocks("t1", _key(1)) == b"h1"
    assert idx.get_blocks("t1", _key(2)) is None
    assert sorted(idx.all_blocks()) == [("t1", _key(1), b"h1"), ("t2", _key(3), b"h3")]
    assert idx.remove("t1", _key(1)) is not None
    assert idx.get_blocks("t1", _key(1)) is None
    # A chunk stored again later starts without hashes.
    assert idx.put(_rec(1)) and idx.get_blocks("t1", _key(1)) is None
    idx.clear()
    assert list(idx.all_blocks()) == []


def test_the_replay_buffer_is_bounded_ordered_and_survives_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "index"
    idx = Index(path)
    for seq in range(10, 30):
        idx.append_event(seq, f"b{seq}".encode(), keep=8)
    assert idx.last_event_seq() == 29
    got = idx.events_since(0)
    assert [s for s, _ in got] == list(range(22, 30))
    assert idx.events_since(27) == [(27, b"b27"), (28, b"b28"), (29, b"b29")]
    assert idx.events_since(30) == []
    idx.close()
    again = Index(path)
    assert again.last_event_seq() == 29 and len(again.events_since(0)) == 8
    again.close()


def test_incarnations_rise_across_opens_and_above_the_buffer(tmp_path: Path) -> None:
    pytest.importorskip("zmq")
    from kvoffload.events.wire import make_seq, split_seq
    from kvoffload.sidecar.events import next_incarnation

    path = tmp_path / "index"
    idx = Index(path)
    assert next_incarnation(idx) == 1
    assert next_incarnation(idx) == 2
    idx.append_event(make_seq(9, 4), b"x", keep=10)  # a buffer ahead of the counter
    assert next_incarnation(idx) == 10
    idx.close()
    idx = Index(path)
    n = next_incarnation(idx)
    assert n == 11 and make_seq(n, 1) > make_seq(9, 4) and split_seq(make_seq(n, 1))[0] == n
    idx.close()


def test_policy_events_switch(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text(
        "version = 1\n[defaults]\nevents = false\n"
        '[tenants.a]\nevents = true\n[tenants.b]\nttl = "1h"\n'
    )
    pol = load_policy(path)
    assert pol.tenant("a").events is True
    assert pol.tenant("b").events is False  # from [defaults]
    path.write_text('version = 1\n[tenants.a]\nevents = "no"\n')
    with pytest.raises(PolicyError, match="events must be true or false"):
        load_policy(path)


def test_events_settings_from_file_and_environment(tmp_path: Path) -> None:
    cfg_file = tmp_path / "k.toml"
    cfg_file.write_text('[events]\nenabled = true\nbuffer = 500\nlocality = "remote"\n')
    cfg = load_config(cfg_file, env={"KVOFFLOAD_EVENTS_TOPIC": "kv@n1@m"})
    ev = cfg.events
    assert ev.enabled and ev.buffer == 500 and ev.locality == "REMOTE" and ev.topic == "kv@n1@m"
    assert ev.endpoint is None  # the ipc default beside the socket
    for bad, what in (
        ('[events]\nendpoint = "http://x"\n', "endpoint"),
        ("[events]\nbuffer = 0\n", "buffer"),
        ('[events]\nlocality = "moon"\n', "locality"),
        ('[events]\nenabled = "maybe"\n', "enabled"),
        ("[events]\nendpoints = 1\n", "unknown setting"),
    ):
        cfg_file.write_text(bad)
        with pytest.raises(ConfigError, match=what) as info:
            load_config(cfg_file, env={})
        assert "\n" not in str(info.value)
