"""Lookups answered on the connection's fast path (issue 30), through a real server
socket and a real store: every rule of the generic path still holds.

What must hold: the decisions a session keeps per policy generation are made
afresh at a swap, so a revocation refuses the very next lookup of an open
connection, a new ``lookup_floor`` pads the very next one, and a new
``max_age`` expires chunks for the very next one; every lookup is counted in
``kvoffload_request_seconds`` and in ``stats``; frames the fast path does
not take (another verb, an unknown key, a bad frame) are answered by the
generic path, in order, with the connection usable or one clear error.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from kvoffload import protocol as p
from kvoffload.protocol import ErrorCode
from kvoffload.sidecar.access.policy import Policy, TenantPolicy
from kvoffload.sidecar.metrics import Metrics
from kvoffload.store import Store
from tests.sidecar.inthread import Raw, ServerThread, grants

TENANT = "acme"
NS = b"\x41" * 32
KEYS = tuple(bytes([i + 1]) * 32 for i in range(8))


@pytest.fixture
def metrics(store: Store) -> Metrics:
    return Metrics(store.stats)


@pytest.fixture
def server(sock_dir: Path, store: Store, metrics: Metrics) -> Iterator[ServerThread]:
    for k in KEYS:
        assert store.put(TENANT, NS, k, [b"x" * 3000])
    st = ServerThread(sock_dir, store, grants(TENANT), metrics)
    yield st
    st.stop()


@pytest.fixture
def raw(server: ServerThread) -> Iterator[Raw]:
    r = Raw(server.path)
    r.hello(TENANT)
    yield r
    r.close()


def _found(r: Raw, n: int = len(KEYS)) -> int:
    reply = r.call(p.Lookup(TENANT, KEYS[:n]))
    assert isinstance(reply, p.LookupReply), reply
    return reply.found


def test_a_revocation_refuses_the_very_next_lookup(server: ServerThread, raw: Raw) -> None:
    assert [_found(raw) for _ in range(3)] == [len(KEYS)] * 3  # decided and kept
    server.server.policy = grants("someone-else")
    assert _found(raw) == 0
    server.server.policy = grants(TENANT)
    assert _found(raw) == len(KEYS)


def _with(settings: TenantPolicy) -> Policy:
    return Policy(tenants={TENANT: settings}, grants=grants(TENANT).grants)


def test_a_new_lookup_floor_pads_the_very_next_lookup(server: ServerThread, raw: Raw) -> None:
    assert _found(raw) == len(KEYS)
    padded = raw.call(p.Stats())
    assert isinstance(padded, p.StatsReply) and padded.stats["lookup_padding"] == {}
    server.server.policy = _with(TenantPolicy(lookup_floor_s=0.001))
    assert _found(raw) == len(KEYS)
    stats = raw.call(p.Stats())
    assert isinstance(stats, p.StatsReply)
    assert stats.stats["lookup_padding"][TENANT]["padded"] == 1


def test_a_new_max_age_expires_chunks_for_the_very_next_lookup(
    server: ServerThread, raw: Raw
) -> None:
    assert _found(raw) == len(KEYS)
    server.server.policy = _with(TenantPolicy(max_age_s=1e-6))
    assert _found(raw) == 0


def test_every_lookup_is_counted_in_the_histogram_and_in_stats(raw: Raw, metrics: Metrics) -> None:
    for n in range(1, 6):
        assert _found(raw, n) == n
    # A request is counted once its reply is out: the stats request, read after
    # the last lookup's turn of the loop, is the synchronisation.
    stats = raw.call(p.Stats())
    assert isinstance(stats, p.StatsReply)
    assert stats.stats["requests"]["lookup"]["count"] == 5
    text = metrics.render().decode()
    assert re.search(r'^kvoffload_request_seconds_count\{verb="lookup"\} 5\.0$', text, re.M)
    inf = re.search(r'^kvoffload_request_seconds_bucket\{le="\+Inf",verb="lookup"\} (\S+)$',
                    text, re.M)  # fmt: skip
    assert inf is not None and float(inf.group(1)) == 5.0


def _frame(msg: dict[str, object]) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return struct.pack("<I", len(body)) + body


def _lookup(rid: int, n: int, **extra: object) -> dict[str, object]:
    return {"op": "lookup", "id": rid, "tenant": TENANT, "keys": list(KEYS[:n]), **extra}


def test_frames_the_fast_path_leaves_are_answered_in_order_by_the_generic_path(
    raw: Raw,
) -> None:
    """One write: fast lookups, then a stats, a lookup with a key the fast path
    does not know, an unlisted tenant's and another fast lookup; each answered."""
    frames = [
        _frame(_lookup(11, 1)),
        _frame(_lookup(12, 2)),
        _frame({"op": "stats", "id": 13}),
        _frame(_lookup(14, 3, extension={"a": 1})),
        _frame({**_lookup(15, 4), "tenant": "beta"}),
        _frame(_lookup(16, 5)),
    ]
    raw.t.socket.sendall(b"".join(frames))
    got = dict(raw.recv() for _ in frames)
    assert got[11] == p.LookupReply(1) and got[12] == p.LookupReply(2)
    assert isinstance(got[13], p.StatsReply)
    assert got[14] == p.LookupReply(3)
    assert got[15] == p.ErrorReply("lookup", ErrorCode.BAD_REQUEST,
                                   "tenant 'beta' was not named in hello")  # fmt: skip
    assert got[16] == p.LookupReply(5)


def test_a_reused_request_id_after_fast_lookups_is_one_clear_fatal_error(
    server: ServerThread, raw: Raw
) -> None:
    """A bad frame behind good lookups in the same read: the lookups are answered,
    then one error frame names the fault, and the connection closes."""
    garbage = struct.pack("<I", 3) + b"\xc1\xc1\xc1"
    raw.t.socket.sendall(_frame(_lookup(21, 1)) + _frame(_lookup(22, 1)) + garbage)
    assert raw.recv() == (21, p.LookupReply(1))
    assert raw.recv() == (22, p.LookupReply(1))
    rid, err = raw.recv()
    assert rid == 0 and isinstance(err, p.ErrorReply) and err.code is ErrorCode.BAD_REQUEST
    assert "undecodable frame body" in err.message
