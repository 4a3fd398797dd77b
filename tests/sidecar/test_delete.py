"""A tenant's own ``delete`` (protocol-v1.md §5.35, revision 18) with the real server.

A real Server on its own loop and a real Store; the client is
:class:`~kvoffload.client.SidecarClient`. What must hold: the named chunks of
the connection's tenant are gone (lookups miss, the bytes leave the tenant's
usage); another tenant's chunks under the same keys are never reached; a
tenant the connection may not write removes nothing; an older server that
does not know the verb gives None and the connection goes on.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.client import SidecarClient
from kvoffload.sidecar import session as session_mod
from kvoffload.store import Store
from tests.sidecar.inthread import ServerThread, grants

NS = b"\x19" * 32


def key(i: int) -> bytes:
    return bytes([0x60 + i]) * 32


@pytest.fixture
def server(sock_dir: Path, store: Store) -> Iterator[ServerThread]:
    st = ServerThread(sock_dir, store, grants("alice", "bob"))
    yield st
    st.stop()


def _client(server: ServerThread, tenant: str) -> SidecarClient:
    return SidecarClient(server.path, tenant, staging_bytes=1 << 20, timeout_s=20)


def _save(c: SidecarClient, n: int) -> None:
    chunks = [(key(i), [bytes([i]) * 5000]) for i in range(n)]
    assert c.save(NS, chunks) == [True] * n


def test_a_tenant_deletes_its_own_chunks_and_only_those(server: ServerThread, store: Store) -> None:
    with _client(server, "alice") as a, _client(server, "bob") as b:
        _save(a, 3)
        _save(b, 3)  # the same keys under another tenant
        used = store.tenant_usage()["alice"].bytes
        # one held, then the same again, then one absent
        assert a.delete([key(1), key(1), key(7)]) == [True, False, False]
        assert a.lookup([key(0)]) == 1 and a.lookup([key(1)]) == 0
        assert [x.ok for x in a.load([key(1)])] == [False]
        assert store.tenant_usage()["alice"].bytes < used
        assert a.delete([key(1)]) == [False]
        # bob's chunk of the same key is untouched, and bob cannot reach alice's.
        assert b.lookup([key(0), key(1), key(2)]) == 3
        assert b.delete([key(0)]) == [True]
        assert a.lookup([key(0)]) == 1
        assert a.delete([]) == []


def test_a_tenant_the_connection_may_not_write_removes_nothing(
    sock_dir: Path, store: Store
) -> None:
    st = ServerThread(sock_dir, store, grants("alice"))
    try:
        with _client(st, "alice") as a:
            _save(a, 1)
        with _client(st, "mallory") as m:
            assert m.delete([key(0)]) is None
        with _client(st, "alice") as a:
            assert a.lookup([key(0)]) == 1
    finally:
        st.stop()


def test_an_older_server_answers_none_and_the_connection_goes_on(
    server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    verbs = dict(session_mod._VERBS)
    verbs.pop(session_mod.Delete)
    monkeypatch.setattr(session_mod, "_VERBS", verbs)  # as a server before revision 18
    with _client(server, "alice") as a:
        _save(a, 1)
        assert a.delete([key(0)]) is None
        assert a.lookup([key(0)]) == 1  # not removed, and the same connection still serves
