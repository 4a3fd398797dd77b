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

from .test_server import FakeStore, ServerThread, sock_path, start


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
