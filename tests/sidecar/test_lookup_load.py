"""``lookup_load`` and piggy-backed completes (protocol-v1.md §5.32), real server socket.

What must hold: ``lookup_load`` answers exactly what ``lookup`` and then
``prepare_load`` of the same keys answer (misses, partial prefixes, the bytes
in staging); another tenant's keys never hit, for a permitted tenant and a
forbidden one alike; a malformed request gets one ``BAD_REQUEST`` reply and
the connection stays usable; a handle named in ``complete`` is released before
the request runs (its staging and pins free for it) and is gone afterwards; a
handle that is no live load handle is named in ``complete_failed``.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload import protocol as p
from kvoffload.protocol import ErrorCode
from kvoffload.staging import PAGE, StagingBuffer
from kvoffload.store import Store
from kvoffload.testing.fakestore import FakeStore
from tests.sidecar.inthread import Raw, ServerThread, grants

TENANT = "acme"
OTHER = "beta"
NS = b"\x31" * 32


def key(i: int) -> bytes:
    return bytes([i + 1]) * 32


def chunk(i: int) -> list[bytes]:
    rng = random.Random(i)
    return [rng.randbytes(3000 + 100 * i) for _ in range(3)]


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvo-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def server(sock_dir: Path, store: Store) -> Iterator[ServerThread]:
    for i in range(4):
        assert store.put(TENANT, NS, key(i), chunk(i))
    st = ServerThread(sock_dir, store, grants(TENANT, OTHER))
    yield st
    st.stop()


@pytest.fixture
def raw(server: ServerThread) -> Iterator[tuple[Raw, StagingBuffer]]:
    r = Raw(server.path)
    hello = r.hello(TENANT, OTHER, "nobody")
    assert hello.lookup_load
    buf = r.register(64 * PAGE)
    yield r, buf
    r.close()
    buf.close()


def _bytes(buf: StagingBuffer, reply: p.PrepareLoadReply) -> list[bytes]:
    return [
        bytes(buf.view[c.offset : c.offset + sum(c.layers)]) for c in reply.chunks if c.verified
    ]


def _settle(
    r: Raw, buf: StagingBuffer, ks: tuple[bytes, ...], first: p.PrepareLoadReply
) -> tuple[list[tuple[tuple[int, ...], bytes]], ErrorCode]:
    """Every chunk a load of ``ks`` that began with ``first`` ends with, and why
    it ended: a reply answered in part (``BUSY`` after progress, §5.29) is
    completed and the rest asked for again, as a client does. Both ways of
    answering are correct, so the comparison is of what a client ends with."""
    got: list[tuple[tuple[int, ...], bytes]] = []
    reply = first
    pos = 0
    while True:
        for c in reply.chunks:
            if c.verified:
                got.append((c.layers, bytes(buf.view[c.offset : c.offset + sum(c.layers)])))
        pos += reply.verified
        if reply.handle:
            assert r.call(p.CompleteLoad(reply.handle)) == p.Ack(p.Op.COMPLETE_LOAD)
        if not (reply.stop is ErrorCode.BUSY and reply.verified) or pos == len(ks):
            return got, reply.stop
        nxt = r.call(p.PrepareLoad(TENANT, ks[pos:]))
        assert isinstance(nxt, p.PrepareLoadReply)
        reply = nxt


@pytest.mark.parametrize(
    "keys",
    [
        [0, 1, 2, 3],  # all present
        [0, 1, 9, 2],  # a miss ends the prefix
        [9, 0],  # a miss first: nothing
        [2],
    ],
)
def test_lookup_load_answers_what_lookup_then_prepare_load_answer(
    raw: tuple[Raw, StagingBuffer], keys: list[int]
) -> None:
    r, buf = raw
    ks = tuple(key(i) for i in keys)
    for _ in range(2):  # cold, then with every chunk in the page cache
        looked = r.call(p.Lookup(TENANT, ks))
        prep = r.call(p.PrepareLoad(TENANT, ks))
        assert isinstance(looked, p.LookupReply) and isinstance(prep, p.PrepareLoadReply)
        assert len(prep.chunks) == len(ks)
        separate = _settle(r, buf, ks, prep)
        folded = r.call(p.LookupLoad(TENANT, ks))
        assert isinstance(folded, p.LookupLoadReply)
        assert folded.found == looked.found
        assert len(folded.chunks) == len(ks)
        assert _settle(r, buf, ks, folded) == separate
        want = [b"".join(chunk(i)) for i in keys[: looked.found]]
        assert [b for _l, b in separate[0]] == want


@pytest.mark.parametrize("tenant", [OTHER, "nobody"])
def test_another_tenants_keys_never_hit(raw: tuple[Raw, StagingBuffer], tenant: str) -> None:
    """``beta`` is granted and empty, ``nobody`` is not granted: both find nothing
    of ``acme``'s keys, and say so exactly as an empty tenant does."""
    r, _buf = raw
    reply = r.call(p.LookupLoad(tenant, tuple(key(i) for i in range(4))))
    assert isinstance(reply, p.LookupLoadReply)
    assert (reply.found, reply.handle, reply.stop) == (0, 0, ErrorCode.NOT_FOUND)
    assert not any(c.verified for c in reply.chunks)


def test_unlisted_tenant_and_no_staging_are_whole_request_errors(server: ServerThread) -> None:
    r = Raw(server.path)
    try:
        r.hello(TENANT)
        reply = r.call(p.LookupLoad(TENANT, (key(0),)))
        assert isinstance(reply, p.ErrorReply)
        assert (reply.op, reply.code) == ("lookup_load", ErrorCode.NOT_REGISTERED)
        buf = r.register()
        reply = r.call(p.LookupLoad(OTHER, (key(0),)))
        assert isinstance(reply, p.ErrorReply) and reply.code is ErrorCode.BAD_REQUEST
        assert "not named in hello" in reply.message
        buf.close()
    finally:
        r.close()


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"keys": []}, "keys"),
        ({"keys": [b"\x01" * 31]}, "keys"),
        ({"tenant": "a\n"}, "tenant"),
        ({"complete": [3, 3]}, "complete"),
        ({"complete": [0]}, "complete"),
        ({"complete": "7"}, "complete"),
        ({"complete": list(range(1, p.MAX_PIGGYBACK + 2))}, "complete"),
    ],
)
def test_a_malformed_lookup_load_gets_one_clear_error_and_the_connection_lives(
    raw: tuple[Raw, StagingBuffer], over: dict[str, Any], field: str
) -> None:
    r, _buf = raw
    msg = {"op": "lookup_load", "id": 77, "tenant": TENANT, "keys": [key(0)], **over}
    r.t.send(msg)
    rid, reply = r.recv()
    assert rid == 77 and isinstance(reply, p.ErrorReply)
    assert (reply.op, reply.code) == ("lookup_load", ErrorCode.BAD_REQUEST)
    assert field in reply.message and "\n" not in reply.message
    after = r.call(p.LookupLoad(TENANT, (key(0),)))
    assert isinstance(after, p.LookupLoadReply) and after.found == 1 and after.handle


def test_lease_load_takes_no_complete(raw: tuple[Raw, StagingBuffer]) -> None:
    r, _buf = raw
    r.t.send({"op": "lease_load", "id": 5, "tenant": TENANT, "keys": [key(0)], "complete": [1]})
    rid, reply = r.recv()
    assert rid == 5 and isinstance(reply, p.ErrorReply)
    assert reply.code is ErrorCode.BAD_REQUEST and "complete" in reply.message


# -- piggy-backed completes ---------------------------------------------------------


@pytest.mark.parametrize("verb", ["prepare_load", "lookup_load"])
def test_a_piggy_backed_complete_frees_staging_for_the_request_itself(
    sock_dir: Path, store: Store, verb: str
) -> None:
    """Staging holds one chunk: the second load fits only if the first handle
    is released before it is served."""
    assert store.put(TENANT, NS, key(0), [b"a" * PAGE])
    assert store.put(TENANT, NS, key(1), [b"b" * PAGE])
    st = ServerThread(sock_dir, store, grants(TENANT))
    r = Raw(st.path)
    buf: StagingBuffer | None = None
    try:
        r.hello(TENANT)
        buf = r.register(PAGE)
        first = r.call(p.PrepareLoad(TENANT, (key(0),)))
        assert isinstance(first, p.PrepareLoadReply) and first.verified == 1
        held = r.call(p.PrepareLoad(TENANT, (key(1),)))
        assert isinstance(held, p.PrepareLoadReply) and held.stop is ErrorCode.BUSY
        second: p.Request
        if verb == "prepare_load":
            second = p.PrepareLoad(TENANT, (key(1),), complete=(first.handle,))
        else:
            second = p.LookupLoad(TENANT, (key(1),), complete=(first.handle,))
        got = r.call(second)
        assert isinstance(got, p.PrepareLoadReply)
        assert got.verified == 1 and got.complete_failed == ()
        assert bytes(buf.view[:PAGE]) == b"b" * PAGE
        # The first handle is gone: completing it again is an unknown handle.
        again = r.call(p.CompleteLoad(first.handle))
        assert isinstance(again, p.ErrorReply) and again.code is ErrorCode.BAD_HANDLE
        assert r.call(p.CompleteLoad(got.handle)) == p.Ack(p.Op.COMPLETE_LOAD)
    finally:
        r.close()
        if buf is not None:
            buf.close()
        st.stop()


def test_piggy_backed_completes_release_pins_and_name_unknown_handles(sock_dir: Path) -> None:
    fake = FakeStore()
    fake.data[(TENANT, key(0))] = [b"x" * 100]
    fake.data[(TENANT, key(1))] = [b"y" * 100]
    st = ServerThread(sock_dir, fake, grants(TENANT))
    r = Raw(st.path)
    buf: StagingBuffer | None = None
    try:
        r.hello(TENANT)
        buf = r.register(8 * PAGE)
        a = r.call(p.PrepareLoad(TENANT, (key(0),)))
        b = r.call(p.LookupLoad(TENANT, (key(1),)))
        assert isinstance(a, p.PrepareLoadReply) and isinstance(b, p.LookupLoadReply)
        assert a.handle and b.handle and fake.pins
        # Both completed on the way by a request that itself finds nothing; an
        # unknown handle among them is named, and the good ones still released.
        bogus = 999
        got = r.call(p.LookupLoad(TENANT, (key(7),), complete=(a.handle, bogus, b.handle)))
        assert isinstance(got, p.LookupLoadReply)
        assert got.complete_failed == (bogus,)
        assert (got.found, got.handle, got.stop) == (0, 0, ErrorCode.NOT_FOUND)
        assert not fake.pins
        for h in (a.handle, b.handle):
            again = r.call(p.CompleteLoad(h))
            assert isinstance(again, p.ErrorReply) and again.code is ErrorCode.BAD_HANDLE
    finally:
        r.close()
        if buf is not None:
            buf.close()
        st.stop()


def test_a_complete_is_done_even_when_the_request_is_refused(sock_dir: Path) -> None:
    """A request refused as a whole (here: a tenant not named in hello) still
    completes its handles: the client counts them completed once sent."""
    fake = FakeStore()
    fake.data[(TENANT, key(0))] = [b"x" * 100]
    st = ServerThread(sock_dir, fake, grants(TENANT))
    r = Raw(st.path)
    buf: StagingBuffer | None = None
    try:
        r.hello(TENANT)
        buf = r.register(8 * PAGE)
        a = r.call(p.PrepareLoad(TENANT, (key(0),)))
        assert isinstance(a, p.PrepareLoadReply) and a.handle and fake.pins
        refused = r.call(p.PrepareLoad(OTHER, (key(0),), complete=(a.handle,)))
        assert isinstance(refused, p.ErrorReply) and refused.code is ErrorCode.BAD_REQUEST
        assert not fake.pins
    finally:
        r.close()
        if buf is not None:
            buf.close()
        st.stop()


def test_a_padded_tenants_lookup_load_is_held_like_its_lookup(sock_dir: Path, store: Store) -> None:
    """§5.28: a tenant with a ``lookup_floor`` has every lookup-carrying reply
    padded, ``lookup_load``'s too (counted in stats), and the reply held is
    the whole answer."""
    import os

    from kvoffload.sidecar.access.policy import Grant, Policy, TenantPolicy

    assert store.put(TENANT, NS, key(0), chunk(0))
    policy = Policy(
        grants=[Grant("uid", os.getuid(), frozenset({TENANT}))],
        tenants={TENANT: TenantPolicy(lookup_floor_s=0.005)},
    )
    st = ServerThread(sock_dir, store, policy)
    r = Raw(st.path)
    buf: StagingBuffer | None = None
    try:
        r.hello(TENANT)
        buf = r.register()
        for _ in range(3):
            got = r.call(p.LookupLoad(TENANT, (key(0), key(9))))
            assert isinstance(got, p.LookupLoadReply)
            assert (got.found, got.verified, got.stop) == (1, 1, ErrorCode.NOT_FOUND)
            assert r.call(p.CompleteLoad(got.handle)) == p.Ack(p.Op.COMPLETE_LOAD)
        stats = r.call(p.Stats())
        assert isinstance(stats, p.StatsReply)
        assert stats.stats["lookup_padding"][TENANT]["padded"] == 3
    finally:
        r.close()
        if buf is not None:
            buf.close()
        st.stop()
