"""The client's side of revision 15 (protocol-v1.md §5.32), against a real server.

``SidecarClient.lookup_load`` gives what ``lookup`` then ``load`` give; a
load's complete rides on the next load request (no frame of its own) and is
sent as ``complete_load`` before any other verb; a server without revision
15 gets the old requests and nothing is left held.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload.client import SidecarClient
from kvoffload.sidecar import session as session_mod
from kvoffload.store import Store
from tests.sidecar.inthread import ServerThread, grants

TENANT = "acme"
NS = b"\x32" * 32
STAGING = 1 << 20


def key(i: int) -> bytes:
    return bytes([i + 1]) * 32


def chunk(i: int) -> list[bytes]:
    rng = random.Random(i)
    return [rng.randbytes(2000 + 10 * i) for _ in range(2)]


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvo-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def server(sock_dir: Path, store: Store) -> Iterator[ServerThread]:
    for i in range(6):
        assert store.put(TENANT, NS, key(i), chunk(i))
    st = ServerThread(sock_dir, store, grants(TENANT))
    yield st
    st.stop()


def _open_handles(st: ServerThread) -> int:
    return sum(s.open_handles() for s in st.server.service.sessions())


def _client(st: ServerThread) -> SidecarClient:
    return SidecarClient(st.path, TENANT, staging_bytes=STAGING, timeout_s=20)


@pytest.mark.parametrize("keys", [[0, 1, 2, 3, 4, 5], [0, 1, 9, 2], [9], [3]])
def test_lookup_load_gives_what_lookup_then_load_give(
    server: ServerThread, keys: list[int]
) -> None:
    ks = [key(i) for i in keys]
    with _client(server) as c:
        found, loaded = c.lookup_load(ks)
        info = c.server_info
        assert info is not None and info.lookup_load
        assert found == c.lookup(ks)
        separate = c.load(ks)
    assert [(r.key, r.ok) for r in loaded] == [(r.key, r.ok) for r in separate]
    assert [r.layers for r in loaded] == [r.layers for r in separate]
    n = sum(r.ok for r in loaded)
    assert n == found
    assert [b"".join(bytes(v) for v in r.layers or ()) for r in loaded[:n]] == [
        b"".join(chunk(i)) for i in keys[:n]
    ]


def test_a_loads_complete_rides_on_the_next_load(server: ServerThread) -> None:
    with _client(server) as c:
        assert all(r.ok for r in c.load([key(0)]))
        # Deferred: the server still holds the first load's handle...
        assert _open_handles(server) == 1
        assert all(r.ok for r in c.load([key(1)]))
        # ...until the next load completes it on the way; now only its own is held.
        assert _open_handles(server) == 1
        found, got = c.lookup_load([key(2), key(3)])
        assert found == 2 and all(r.ok for r in got)
        assert _open_handles(server) == 1
        # Any other verb first sends the deferred complete_load of its own.
        c.touch([key(0)])
        assert _open_handles(server) == 0


def test_a_server_without_revision_15_gets_the_old_requests(
    server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_hello = session_mod.Session.hello

    def old_hello(self: Any, req: Any) -> Any:
        reply = real_hello(self, req)
        return type(reply)(**{**{f: getattr(reply, f) for f in reply.__struct_fields__},
                              "lookup_load": False})  # fmt: skip

    monkeypatch.setattr(session_mod.Session, "hello", old_hello)
    seen: list[str] = []
    real_execute = session_mod.Session.execute

    def spy(self: Any, req: Any, emit: Any = None) -> Any:
        seen.append(req.OP.value)
        return real_execute(self, req, emit)

    monkeypatch.setattr(session_mod.Session, "execute", spy)
    with _client(server) as c:
        found, got = c.lookup_load([key(0), key(1), key(9)])
        info = c.server_info
        assert info is not None and not info.lookup_load
        assert found == 2 and [r.ok for r in got] == [True, True, False]
        c.touch([key(0)])
        assert _open_handles(server) == 0
    assert "lookup_load" not in seen
