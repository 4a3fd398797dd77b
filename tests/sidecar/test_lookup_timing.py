"""The lookup timing side channel (issue 16, item 6; docs/threat-model.md, protocol-v1 §5.28).

* A forbidden tenant's ``lookup`` and ``touch`` do a real, empty tenant's work:
  the same store calls, under the decoy tenant no request can name.
* A tenant's ``lookup_floor``/``lookup_jitter``: every lookup reply of the
  tenant leaves no earlier than arrival + floor (a lower bound: correctness,
  not speed), on a loop timer that delays neither other connections nor the
  connection's other requests; a held reply is dropped, never sent early, when
  the peer stops sending; overruns are counted.
* The policy keys are validated with file and line.

Timing is never asserted as an upper bound here; scripts/bench_timing.py
measures it.
"""

from __future__ import annotations

import os
import select
import socket
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvoffload import protocol as p
from kvoffload.errors import PolicyError
from kvoffload.protocol import ErrorCode, ProtocolError
from kvoffload.sidecar.access.policy import Grant, Policy, TenantPolicy
from kvoffload.sidecar.access.policy_file import MAX_LOOKUP_PADDING_S, parse_policy
from kvoffload.sidecar.config import ServerConfig
from kvoffload.sidecar.peer import Peer
from kvoffload.sidecar.service import Service
from kvoffload.sidecar.session import DECOY_TENANT, Session
from kvoffload.staging import StagingBuffer
from kvoffload.transport import UnixTransport
from tests.sidecar_proc import Procs, Sidecar

NS = bytes(range(32))
SECRET = b"s" * 32


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


# ---------------------------------------------------------------------------
# policy


def _policy(body: str) -> Policy:
    return parse_policy("version = 1\n" + body, source="policy.toml")


def test_policy_reads_floor_and_jitter_per_tenant_and_in_defaults() -> None:
    pol = _policy(
        '[defaults]\nlookup_floor = "1ms"\n\n'
        '[tenants.acme]\nlookup_floor = "250ms"\nlookup_jitter = "0.5ms"\n\n'
        '[tenants.beta]\nlookup_jitter = "none"\n'
    )
    assert pol.tenant("acme").lookup_floor_s == pytest.approx(0.25)
    assert pol.tenant("acme").lookup_jitter_s == pytest.approx(0.0005)
    assert pol.tenant("beta").lookup_floor_s == pytest.approx(0.001)  # from [defaults]
    assert pol.tenant("beta").lookup_jitter_s == 0.0
    assert pol.tenant("other").lookup_floor_s == pytest.approx(0.001)
    assert TenantPolicy().lookup_floor_s == 0.0 and TenantPolicy().lookup_jitter_s == 0.0


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ('"2s"', "between 0s and 1s"),
        ('"-1ms"', "bad duration for lookup_floor"),
        ("5", "bad duration for lookup_floor"),  # a bare number: which unit?
        ('"fast"', "bad duration for lookup_floor"),
    ],
)
def test_policy_refuses_a_bad_floor_with_its_line(value: str, words: str) -> None:
    text = f'version = 1\n\n[tenants.acme]\nttl = "1h"\nlookup_floor = {value}\n'
    with pytest.raises(PolicyError) as err:
        parse_policy(text, source="policy.toml")
    msg = str(err.value)
    assert "policy.toml" in msg and ":5" in msg and words in msg, msg


def test_policy_refuses_a_jitter_above_the_bound() -> None:
    with pytest.raises(PolicyError, match=r"lookup_jitter must be between 0s and 1s"):
        _policy('[defaults]\nlookup_jitter = "1.5s"\n')
    assert MAX_LOOKUP_PADDING_S == 1.0


# ---------------------------------------------------------------------------
# a forbidden tenant does an empty tenant's work (the verb layer, a real store)


class RecordingStore:
    """The real store, with the lookup-path calls the verbs make recorded."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.calls: list[tuple[str, str, tuple[bytes, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def lookup(self, tenant: str, keys: Sequence[bytes]) -> int:
        self.calls.append(("lookup", tenant, tuple(keys)))
        return int(self._store.lookup(tenant, keys))

    def lookup_cached(self, tenant: str, keys: Sequence[bytes]) -> int | None:
        self.calls.append(("lookup_cached", tenant, tuple(keys)))
        found: int | None = self._store.lookup_cached(tenant, keys)
        return found

    def touch(self, tenant: str, keys: Sequence[bytes]) -> None:
        self.calls.append(("touch", tenant, tuple(keys)))
        self._store.touch(tenant, keys)

    def payload_info(self, tenant: str, key: bytes) -> Any:
        self.calls.append(("payload_info", tenant, (key,)))
        return self._store.payload_info(tenant, key)

    def lease_load(self, tenant: str, key: bytes) -> Any:
        self.calls.append(("lease_load", tenant, (key,)))
        return self._store.lease_load(tenant, key)

    def pin(self, tenant: str, keys: Sequence[bytes]) -> None:
        self.calls.append(("pin", tenant, tuple(keys)))
        self._store.pin(tenant, keys)

    def unpin(self, tenant: str, keys: Sequence[bytes]) -> None:
        self.calls.append(("unpin", tenant, tuple(keys)))
        self._store.unpin(tenant, keys)

    def get_many_into(self, tenant: str, keys: Sequence[bytes], outs: Any) -> Any:
        self.calls.append(("get_many_into", tenant, tuple(keys)))
        return self._store.get_many_into(tenant, keys, outs)


@pytest.fixture
def recorded(store: Any) -> Iterator[tuple[RecordingStore, Session]]:
    for i in range(4):
        store.put("victim", key(i), NS, [b"v" * 100])
    rec = RecordingStore(store)
    # "empty" may take the direct path, so its lease_load is a miss, not FORBIDDEN.
    pol = Policy(
        tenants={"empty": TenantPolicy(encryption=False, direct=True)},
        grants=[Grant("uid", os.getuid(), frozenset({"own", "empty"}))],
    )
    service = Service(rec, pol, ServerConfig(secret=SECRET))
    session = Session(service, Peer(os.getpid(), os.getuid(), (os.getgid(),)))
    assert isinstance(session.hello(p.Hello(1, 1, "t", ("own", "empty", "victim"))), p.HelloReply)
    yield rec, session
    session.close()


def test_forbidden_lookup_walks_the_index_like_an_empty_tenant(
    recorded: tuple[RecordingStore, Session],
) -> None:
    rec, session = recorded
    keys = tuple(key(i) for i in range(4))  # what "victim" really stored
    for path in ("inline", "pool"):
        for tenant in ("empty", "victim"):
            rec.calls.clear()
            req = p.Lookup(tenant, keys)
            reply = session.lookup_inline(req) if path == "inline" else session.lookup(req)
            if path == "inline" and reply is None:
                reply = session.lookup(req)  # what the connection does next
            assert reply == p.LookupReply(0), (path, tenant)
            if tenant == "empty":
                empty_calls = [(verb, ks) for verb, _t, ks in rec.calls]
                assert empty_calls, "an empty tenant's lookup reads the index"
            else:
                # The same store calls with the same keys, under the decoy tenant.
                assert [(verb, ks) for verb, _t, ks in rec.calls] == empty_calls, path
                assert {t for _v, t, _k in rec.calls} == {DECOY_TENANT}, rec.calls


def test_forbidden_touch_does_an_empty_tenants_work(
    recorded: tuple[RecordingStore, Session],
) -> None:
    rec, session = recorded
    keys = (key(0), key(1))
    assert session.touch(p.Touch("victim", keys)) == p.Ack(p.Op.TOUCH)
    assert rec.calls == [("touch", DECOY_TENANT, keys)]
    rec.calls.clear()
    session.touch(p.Touch("empty", keys))
    assert rec.calls == [("touch", "empty", keys)]


def test_forbidden_loads_make_an_empty_tenants_store_calls(
    recorded: tuple[RecordingStore, Session],
) -> None:
    """prepare_load and lease_load: the same store calls as for an empty tenant,
    under the decoy; the answer is all-miss with no handle, nothing left pinned."""
    rec, session = recorded
    buf = StagingBuffer(64 * 1024)
    try:
        ack = session.register_staging(p.RegisterStaging(buf.size), [os.dup(buf.fd)])
        assert ack == p.Ack(p.Op.REGISTER_STAGING)
        keys = tuple(key(i) for i in range(4))  # what "victim" really stored
        for verb in (p.PrepareLoad, p.LeaseLoad):
            rec.calls.clear()
            empty = session.execute(verb("empty", keys))
            empty_calls = [(v, ks) for v, _t, ks in rec.calls]
            rec.calls.clear()
            forbidden = session.execute(verb("victim", keys))
            assert forbidden == empty, verb
            assert getattr(forbidden, "handle", None) == 0
            assert [(v, ks) for v, _t, ks in rec.calls] == empty_calls, verb
            assert {t for _v, t, _k in rec.calls} == {DECOY_TENANT}, rec.calls
        assert session.open_handles() == 0
    finally:
        buf.close()


def test_the_decoy_tenant_can_never_be_named_and_holds_nothing(store: Any) -> None:
    msg = {"op": "hello", "id": 1, "min_version": 1, "max_version": 1, "client": "x"}
    with pytest.raises(ProtocolError) as err:
        p.parse_request({**msg, "tenants": [DECOY_TENANT]})
    assert err.value.code is ErrorCode.BAD_REQUEST
    msg = {"op": "lookup", "id": 2, "tenant": DECOY_TENANT, "keys": [key(0)]}
    with pytest.raises(ProtocolError) as err:
        p.parse_request(msg)
    assert err.value.code is ErrorCode.BAD_REQUEST
    assert store.lookup(DECOY_TENANT, [key(0)]) == 0


# ---------------------------------------------------------------------------
# padded lookups, through a real sidecar process


def _start(procs: Procs, workdir: Path, tenants_toml: str, metrics_port: int = 0) -> Sidecar:
    kek = workdir / "kek"
    kek.write_bytes(os.urandom(32))
    kek.chmod(0o600)
    policy = workdir / "policy.toml"
    policy.write_text(
        f'version = 1\n\n{tenants_toml}\n[[grants]]\nuid = {os.getuid()}\ntenants = ["*"]\n'
    )
    policy.chmod(0o600)
    sock = workdir / "kvo.sock"
    cfg = workdir / "kvoffload.toml"
    cfg.write_text(
        f'[store]\nroot = "{workdir}/store"\nindex_dir = "{workdir}/index"\n'
        f'durability = "none"\n\n[server]\nsocket = "{sock}"\n\n'
        f'[security]\nkek_file = "{kek}"\npolicy = "{policy}"\n'
        + (f"\n[metrics]\nport = {metrics_port}\n" if metrics_port else "")
    )
    sc = procs.sidecar(workdir, sock, Sidecar.serve_argv("--config", str(cfg), "serve"))
    sc.start().wait_ready()
    return sc


class Conn:
    """A bare protocol connection: send now, read replies later (in any order)."""

    def __init__(self, sock: Path, tenants: Sequence[str]) -> None:
        self.t = UnixTransport.connect(os.fspath(sock), timeout_s=30)
        self.send(1, p.Hello(1, 1, "timing-test", tuple(tenants)))
        assert isinstance(self.recv()[1], p.HelloReply)
        self.staging: Any = None

    def send(self, rid: int, req: p.Request, fds: Sequence[int] = ()) -> None:
        self.t.send(p.request_message(rid, req), fds)

    def recv(self) -> tuple[int, p.Reply]:
        return p.parse_reply(self.t.recv(timeout_s=30).msg)

    def call(self, rid: int, req: p.Request, fds: Sequence[int] = ()) -> p.Reply:
        self.send(rid, req, fds)
        got, reply = self.recv()
        assert got == rid
        return reply

    def pending(self) -> bool:
        """Whether a reply's bytes are waiting (no wait: an ordering check)."""
        r, _, _ = select.select([self.t.socket], [], [], 0)
        return bool(r)

    def close(self) -> None:
        self.t.close()


def _save(sock: Path, tenant: str, keys: Sequence[bytes]) -> None:
    from kvoffload.client import SidecarClient

    with SidecarClient(sock, tenant, staging_bytes=1 << 20) as c:
        assert all(c.save(NS, [(k, [b"x" * 4096]) for k in keys]))


def test_no_padded_lookup_reply_arrives_before_the_floor(procs: Procs, workdir: Path) -> None:
    floor = 0.15
    sc = _start(
        procs,
        workdir,
        f'[tenants.slow]\nlookup_floor = "{int(floor * 1000)}ms"\nlookup_jitter = "20ms"\n',
    )
    stored = [key(i) for i in range(3)]
    _save(sc.socket_path, "slow", stored)
    _save(sc.socket_path, "fast", stored)
    conn = Conn(sc.socket_path, ["slow", "fast"])
    try:
        rid = 10
        # Hits (the inline path when unpadded) and misses (the pool path).
        for keys, found in ((stored, 3), ([key(99)], 0), (stored[:1], 1)):
            for _ in range(2):
                rid += 1
                start = time.monotonic()
                reply = conn.call(rid, p.Lookup("slow", tuple(keys)))
                elapsed = time.monotonic() - start
                assert reply == p.LookupReply(found)
                # The client's round trip contains the server's arrival-to-send time.
                assert elapsed >= floor, (keys, elapsed)
        stats = sc.stats()
        assert stats["lookup_padding"]["slow"]["padded"] == 6
        assert "fast" not in stats["lookup_padding"]  # no floor, not padded
    finally:
        conn.close()


def test_a_floor_delays_neither_other_connections_nor_other_requests(
    procs: Procs, workdir: Path
) -> None:
    """Ordering, not timing: A's reply is still held (floor 1 s) when B's arrive."""
    sc = _start(procs, workdir, '[tenants.slow]\nlookup_floor = "1s"\nlookup_jitter = "1s"\n')
    a = Conn(sc.socket_path, ["slow", "fast"])
    b = Conn(sc.socket_path, ["fast"])
    try:
        a.send(2, p.Lookup("slow", (key(1),)))
        # Another connection, several requests, while A's lookup is held.
        for rid in range(2, 6):
            assert b.call(rid, p.Lookup("fast", (key(rid),))) == p.LookupReply(0)
        assert not a.pending(), "A's padded reply left before B's requests were answered"
        # The same connection: a later unpadded request overtakes the held reply (§3.3).
        a.send(3, p.Lookup("fast", (key(7),)))
        a.send(4, p.Stats())
        got = [a.recv() for _ in range(3)]
        assert [rid for rid, _ in got] == [3, 4, 2] or [rid for rid, _ in got] == [4, 3, 2]
        assert dict(got)[2] == p.LookupReply(0)
    finally:
        a.close()
        b.close()


def test_a_held_reply_is_dropped_not_sent_early_when_the_peer_stops_sending(
    procs: Procs, workdir: Path
) -> None:
    sc = _start(procs, workdir, '[tenants.slow]\nlookup_floor = "1s"\n')
    conn = Conn(sc.socket_path, ["slow"])
    try:
        conn.send(2, p.Lookup("slow", (key(1),)))
        conn.t.socket.shutdown(socket.SHUT_WR)  # EOF for the server; we can still read
        conn.t.socket.settimeout(30)
        rest = b""
        while chunk := conn.t.socket.recv(4096):
            rest += chunk
        assert rest == b"", "the held reply was sent after the peer's EOF"
    finally:
        conn.close()
    # The sidecar is fine, and the next connection is served.
    c2 = Conn(sc.socket_path, ["other"])
    try:
        assert c2.call(2, p.Lookup("other", (key(1),))) == p.LookupReply(0)
    finally:
        c2.close()


def test_overruns_are_counted_for_the_operator(procs: Procs, workdir: Path) -> None:
    # A floor of one microsecond: no reply is computed within it.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sc = _start(procs, workdir, '[tenants.tiny]\nlookup_floor = "0.001ms"\n', port)
    conn = Conn(sc.socket_path, ["tiny", "forbidden"])
    try:
        for rid in range(2, 5):
            assert conn.call(rid, p.Lookup("tiny", (key(rid),))) == p.LookupReply(0)
        counts = sc.stats()["lookup_padding"]["tiny"]
        assert counts == {"padded": 3, "overruns": 3}
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            text = r.read().decode()
        assert 'kvoffload_lookup_floor_overruns_total{tenant="tiny"} 3.0' in text
    finally:
        conn.close()


def test_a_forbidden_tenants_floor_applies_to_its_probes(procs: Procs, workdir: Path) -> None:
    """A floor is the tenant's: a peer without a grant to it waits it too, as a
    granted peer of an empty tenant would (§6)."""
    sc = _start(procs, workdir, '[tenants.guarded]\nlookup_floor = "150ms"\n')
    # Narrow the grant: this uid may use "mine" only. The sidecar reads the policy
    # at start, so restart it.
    policy = workdir / "policy.toml"
    policy.write_text(
        'version = 1\n\n[tenants.guarded]\nlookup_floor = "150ms"\n\n'
        f'[[grants]]\nuid = {os.getuid()}\ntenants = ["mine"]\n'
    )
    sc.stop()
    sc.start().wait_ready()
    conn = Conn(sc.socket_path, ["guarded", "mine"])
    try:
        start = time.monotonic()
        assert conn.call(2, p.Lookup("guarded", (key(1),))) == p.LookupReply(0)
        assert time.monotonic() - start >= 0.15
    finally:
        conn.close()


def test_policy_check_shows_the_padding_and_refuses_a_bad_floor_in_one_line(
    tmp_path: Path,
) -> None:
    import json
    import subprocess
    import sys

    good = tmp_path / "good.toml"
    good.write_text(
        'version = 1\n[tenants.acme]\nlookup_floor = "5ms"\nlookup_jitter = "1ms"\n'
        '[[grants]]\nuid = 0\ntenants = ["acme"]\n'
    )
    good.chmod(0o600)
    run = [sys.executable, "-m", "kvoffload.cli", "policy", "check"]
    out = subprocess.run([*run, str(good), "--json"], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    acme = json.loads(out.stdout)["tenants"]["acme"]
    assert acme["lookup_floor_s"] == pytest.approx(0.005)
    assert acme["lookup_jitter_s"] == pytest.approx(0.001)
    bad = tmp_path / "bad.toml"
    bad.write_text('version = 1\n[tenants.acme]\nlookup_floor = "3s"\n')
    bad.chmod(0o600)
    out = subprocess.run([*run, str(bad)], capture_output=True, text=True, check=False)
    assert out.returncode == 1
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert len(lines) == 1 and f"{bad}:3:" in lines[0] and "lookup_floor" in lines[0], lines
