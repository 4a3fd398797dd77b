"""Protocol rules a fault test found broken (issue 11, item 7), over a real socket."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload import protocol as p
from kvoffload.protocol import CLIENT_MAGIC, SERVER_MAGIC, ErrorCode
from tests.helpers.server import FakeStore, ServerThread, sock_path, start


@pytest.fixture
def server() -> Iterator[ServerThread]:
    d = Path(tempfile.mkdtemp(prefix="kvo-", dir="/tmp"))  # AF_UNIX: a short path
    st = start(d, FakeStore())
    yield st
    st.stop()
    shutil.rmtree(d, ignore_errors=True)


def exchange(st: ServerThread, *msgs: dict[str, Any]) -> tuple[list[p.Reply], bool]:
    """Send raw frames; the replies read until the server closes (True) or a
    quiet second passes with the connection open (False)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(os.fspath(sock_path(st)))
        s.sendall(CLIENT_MAGIC + b"".join(p.encode_frame(m) for m in msgs))
        s.settimeout(2.0)
        data, closed = b"", False
        try:
            while chunk := s.recv(65536):
                data += chunk
            closed = True
        except TimeoutError:
            pass
    assert data.startswith(SERVER_MAGIC)
    frames = p.FrameDecoder().feed(data[len(SERVER_MAGIC) :])
    return [p.parse_reply(f.msg)[1] for f in frames], closed


@pytest.mark.parametrize(
    "first",
    [
        {"op": "lookup", "id": 1, "tenant": 7, "keys": []},  # malformed field
        {"op": "lookup", "id": 1, "tenant": "acme", "keys": [b"short"]},
        {"op": "stats", "id": 1, "bogus": True},
    ],
)
def test_a_malformed_non_hello_first_request_is_answered_then_closed(
    server: ServerThread, first: dict[str, Any]
) -> None:
    replies, closed = exchange(server, first)
    assert len(replies) == 1 and isinstance(replies[0], p.ErrorReply)
    assert replies[0].code is ErrorCode.BAD_REQUEST
    assert closed  # §3.3 rule 1


@pytest.mark.parametrize("op", ["frobnicate", "Lookup", "load_progress", ""])
def test_an_unknown_op_first_is_bad_request_then_closed(server: ServerThread, op: str) -> None:
    """§3.3 rule 1: any request but hello first, an op this server does not
    implement too, is BAD_REQUEST and closes (issue 28 item 10), not UNSUPPORTED."""
    replies, closed = exchange(server, {"op": op, "id": 1})
    assert len(replies) == 1 and isinstance(replies[0], p.ErrorReply)
    assert replies[0].code is ErrorCode.BAD_REQUEST, replies[0]
    assert closed


def test_an_unknown_op_after_hello_is_unsupported_and_the_connection_stays(
    server: ServerThread,
) -> None:
    hello = p.request_message(1, p.Hello(1, 1, "rules", ("acme",)))
    replies, closed = exchange(server, hello, {"op": "frobnicate", "id": 2})
    assert isinstance(replies[0], p.HelloReply)
    assert isinstance(replies[1], p.ErrorReply) and replies[1].code is ErrorCode.UNSUPPORTED
    assert not closed


@pytest.mark.parametrize("age", [1e300, 1.7e308, 2e10])
def test_ages_beyond_the_epoch_are_clamped_not_internal(age: float, store: Any) -> None:
    """§5.17/§5.18: a finite age beyond the Unix epoch (1e300 s) reaches before
    every chunk: ``ls`` older than it lists nothing, newer than it everything,
    and ``purge_older`` removes nothing; never INTERNAL (issue 28 item 10)."""
    from tests.helpers.server import Raw, grants

    for i in range(3):
        store.put("acme", bytes(32), bytes([i + 1]) * 32, [b"x" * 100])
    d = Path(tempfile.mkdtemp(prefix="kvo-", dir="/tmp"))
    st = start(d, store, grants("acme", admin=True))
    raw = Raw(st)
    try:
        assert isinstance(raw.call(p.Hello(1, 1, "rules", ())), p.HelloReply)
        replies = [
            raw.call(req)
            for req in (
                p.Ls(older_than_s=age),
                p.Ls(newer_than_s=age),
                p.Ls(older_than_s=age, newer_than_s=age),
                p.PurgeOlder(age),
                p.PurgeOlder(age, "acme"),
            )
        ]
    finally:
        raw.close()
        st.stop()
        shutil.rmtree(d, ignore_errors=True)
    assert not any(isinstance(r, p.ErrorReply) for r in replies), replies
    older, newer, both, purged_all, purged_acme = replies
    assert isinstance(older, p.LsReply) and older.report["chunks"] == []
    assert isinstance(newer, p.LsReply) and len(newer.report["chunks"]) == 3
    assert isinstance(both, p.LsReply) and both.report["chunks"] == []
    assert isinstance(purged_all, p.PurgeOlderReply) and purged_all.removed == 0
    assert isinstance(purged_acme, p.PurgeOlderReply) and purged_acme.removed == 0
    assert store.chunk_count() == 3


def test_a_malformed_hello_leaves_the_connection_open_for_a_good_one(
    server: ServerThread,
) -> None:
    replies, closed = exchange(server, {"op": "hello", "id": 1, "min_version": "x"})
    assert isinstance(replies[0], p.ErrorReply) and not closed


@pytest.mark.parametrize("tenant", ["acme\n", "acme\r", " acme", "acme/..", "a" * 65, ""])
def test_tenant_ids_are_matched_whole(tenant: str) -> None:
    with pytest.raises(p.ProtocolError) as info:
        p.parse_request({"op": "purge", "id": 3, "tenant": tenant})
    assert info.value.code is ErrorCode.BAD_REQUEST
