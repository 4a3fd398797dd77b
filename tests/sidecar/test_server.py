"""The sidecar server over a real Unix socket, with the real client and raw protocol frames.

Most tests use ``FakeStore``, an in-memory test double of the store API
(so these tests pin down the server, not the store); the last ones run the
real ``Store`` end to end.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload import protocol as p
from kvoffload.client import SidecarClient
from kvoffload.errors import ListenError
from kvoffload.protocol import CLIENT_MAGIC, SERVER_MAGIC, ErrorCode, StoreStatus
from kvoffload.sidecar.secret import load_or_create_secret
from kvoffload.staging import PAGE
from kvoffload.transport import TransportClosed
from tests.helpers.server import (
    NS,
    SECRET,
    FakeStore,
    Raw,
    ServerThread,
    grants,
    key,
    sock_path,
    start,
    wait_until,
)


@pytest.fixture
def fake_store() -> FakeStore:
    return FakeStore()


@pytest.fixture
def server(sock_dir: Path, fake_store: FakeStore) -> Iterator[ServerThread]:
    st = start(sock_dir, fake_store)
    yield st
    st.stop()


# -- through the real client -----------------------------------------------------


def test_client_end_to_end(server: ServerThread, fake_store: FakeStore) -> None:
    with SidecarClient(sock_path(server), "acme", staging_bytes=8 * PAGE) as c:
        assert c.salt == fake_store.salts["acme"]
        data = {key(i): [os.urandom(5000), os.urandom(3), os.urandom(PAGE)] for i in range(5)}
        assert c.save(NS, list(data.items())) == [True] * 5
        assert {k: v for (t, k), v in fake_store.data.items()} == data
        assert c.lookup([*data, key(99)]) == 5
        got = c.load([*data, key(99)])
        assert [g.ok for g in got] == [True] * 5 + [False]
        assert [[bytes(v) for v in g.layers] for g in got[:5]] == list(data.values())
        c.touch(list(data))
        assert len(fake_store.touched) == 5
        stats = c.stats()
        assert stats["chunks"] == 5
        assert "tenants" not in stats  # only admins learn how many tenants exist
        assert stats["server"]["protocol_version"] == 1
    wait_until(lambda: not server.server.connections, "connection closed")
    assert fake_store.reserved == 0
    assert not fake_store.pins


def test_forbidden_tenant_looks_empty_and_writes_are_refused(
    server: ServerThread, fake_store: FakeStore
) -> None:
    fake_store.data[("beta", key(1))] = [b"secret"]
    raw = Raw(server)
    hello = raw.hello("acme", "beta")
    assert hello.salts["beta"] == p.fake_salt(SECRET, "beta")
    assert hello.salts["acme"] == fake_store.salts["acme"]
    raw.register()
    assert raw.call(p.Lookup("beta", (key(1),))) == p.LookupReply(0)
    load = raw.call(p.PrepareLoad("beta", (key(1), key(2))))
    assert load == p.PrepareLoadReply(
        0, ErrorCode.NOT_FOUND, (p.LoadSlot(False), p.LoadSlot(False))
    )
    assert raw.call(p.Touch("beta", (key(1),))) == p.Ack(p.Op.TOUCH)
    store = raw.call(p.PrepareStore("beta", NS, (p.ChunkSpec(key(3), (10,)),)))
    assert isinstance(store, p.ErrorReply)
    assert store.code is ErrorCode.FORBIDDEN
    # The store was never asked anything about beta: no content or timing signal.
    assert "beta" not in fake_store.tenants_seen
    raw.close()
    with SidecarClient(sock_path(server), "beta", staging_bytes=4 * PAGE) as c:
        assert c.salt == p.fake_salt(SECRET, "beta")
        assert c.save(NS, [(key(3), [b"x"])]) == [False]
        assert c.load([key(1)])[0].ok is False


def test_policy_reload_applies_to_open_connections(
    server: ServerThread, fake_store: FakeStore
) -> None:
    with SidecarClient(sock_path(server), "acme", staging_bytes=4 * PAGE) as c:
        assert c.save(NS, [(key(1), [b"x"])]) == [True]
        assert c.lookup([key(1)]) == 1
        server.server.policy = grants("someone-else")
        assert c.lookup([key(1)]) == 0
        assert c.save(NS, [(key(2), [b"y"])]) == [False]
        assert c.connected  # refused, not disconnected


def test_tenant_not_named_in_hello_is_bad_request(server: ServerThread) -> None:
    raw = Raw(server)
    raw.hello("acme")
    reply = raw.call(p.Lookup("other", (key(1),)))
    assert isinstance(reply, p.ErrorReply) and reply.code is ErrorCode.BAD_REQUEST
    raw.close()


def test_persistent_secret_makes_fake_salts_survive_restarts(sock_dir: Path) -> None:
    secret_file = sock_dir / "secret"
    first = load_or_create_secret(secret_file)
    assert load_or_create_secret(secret_file) == first
    assert secret_file.stat().st_mode & 0o777 == 0o600
    salts = []
    for _ in range(2):
        st = start(sock_dir, FakeStore(), secret=load_or_create_secret(secret_file))
        raw = Raw(st)
        salts.append(raw.hello("acme", "beta").salts["beta"])
        raw.close()
        st.stop()
    assert salts[0] == salts[1] == p.fake_salt(first, "beta")


# -- handshake and framing ---------------------------------------------------------


def _read_all(s: socket.socket) -> bytes:
    s.settimeout(20)
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_wrong_magic_is_closed_without_a_reply(server: ServerThread) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(os.fspath(sock_path(server)))
        s.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert _read_all(s) == SERVER_MAGIC


def test_oversize_frame_gets_a_fatal_error_frame(server: ServerThread) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(os.fspath(sock_path(server)))
        s.sendall(CLIENT_MAGIC + struct.pack("<I", 2 * p.MAX_FRAME))
        data = _read_all(s)
    assert data.startswith(SERVER_MAGIC)
    frames = p.FrameDecoder().feed(data[len(SERVER_MAGIC) :])
    assert len(frames) == 1
    rid, reply = p.parse_reply(frames[0].msg)
    assert rid == 0
    assert isinstance(reply, p.ErrorReply) and reply.code is ErrorCode.FRAME_TOO_LARGE


def test_version_mismatch_is_explained_then_closed(server: ServerThread) -> None:
    raw = Raw(server)
    reply = raw.call(p.Hello(2, 3, "future-client", ("acme",)))
    assert isinstance(reply, p.ErrorReply)
    assert reply.code is ErrorCode.UNSUPPORTED_VERSION
    assert reply.server_versions == (1, 1)
    assert "2..3" in reply.message
    with pytest.raises(TransportClosed):
        raw.t.recv()


def test_requests_before_hello_are_refused(server: ServerThread) -> None:
    raw = Raw(server)
    reply = raw.call(p.Lookup("acme", (key(1),)))
    assert isinstance(reply, p.ErrorReply) and reply.code is ErrorCode.BAD_REQUEST
    with pytest.raises(TransportClosed):
        raw.t.recv()


def test_unsealed_staging_is_refused(server: ServerThread) -> None:
    raw = Raw(server)
    raw.hello()
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, PAGE)
    reply = raw.call(p.RegisterStaging(PAGE), [fd])
    os.close(fd)
    assert isinstance(reply, p.ErrorReply) and reply.code is ErrorCode.BAD_REQUEST
    assert "sealed" in reply.message
    not_registered = raw.call(p.PrepareLoad("acme", (key(1),)))
    assert isinstance(not_registered, p.ErrorReply)
    assert not_registered.code is ErrorCode.NOT_REGISTERED
    raw.close()


def test_descriptors_with_other_requests_are_refused_and_closed(server: ServerThread) -> None:
    raw = Raw(server)
    raw.hello()
    r, w = os.pipe()
    try:
        reply = raw.call(p.Lookup("acme", (key(1),)), [r])
        assert isinstance(reply, p.ErrorReply) and reply.code is ErrorCode.BAD_REQUEST
        # The server closed its copy: the pipe's only reader is now ours.
        os.close(r)
        r = -1
        with pytest.raises(BrokenPipeError):
            os.write(w, b"x")
    finally:
        if r >= 0:
            os.close(r)
        os.close(w)
    raw.close()


def test_replies_come_back_out_of_order(server: ServerThread, fake_store: FakeStore) -> None:
    fake_store.slow_key = key(7)
    raw = Raw(server)
    raw.hello()
    raw.t.send(p.request_message(10, p.Lookup("acme", (key(7),))))
    raw.t.send(p.request_message(11, p.Lookup("acme", (key(8),))))
    first = p.parse_reply(raw.t.recv().msg)
    fake_store.release_slow.set()
    second = p.parse_reply(raw.t.recv().msg)
    assert [first[0], second[0]] == [11, 10]
    raw.close()


# -- staging, handles and their release --------------------------------------------


def test_store_statuses_and_staging_limits(sock_dir: Path) -> None:
    store = FakeStore(capacity=20_000)
    store.data[("acme", key(0))] = [b"old"]
    st = start(sock_dir, store)
    raw = Raw(st)
    raw.hello()
    buf = raw.register(3 * PAGE)
    reply = raw.call(
        p.PrepareStore(
            "acme",
            NS,
            (
                p.ChunkSpec(key(0), (5,)),  # present already
                p.ChunkSpec(key(1), (PAGE, PAGE, PAGE, 1)),  # more than the whole buffer
                p.ChunkSpec(key(2), (PAGE + 1,)),  # two pages: fits
                p.ChunkSpec(key(3), (PAGE + 1,)),  # two more: buffer now full
                p.ChunkSpec(key(4), (10,)),  # fits the buffer, not the capacity
            ),
        )
    )
    assert isinstance(reply, p.PrepareStoreReply)
    statuses = [(s.status, s.code) for s in reply.chunks]
    assert statuses == [
        (StoreStatus.EXISTS, ErrorCode.OK),
        (StoreStatus.REJECTED, ErrorCode.TOO_LARGE),
        (StoreStatus.WRITE, ErrorCode.OK),
        (StoreStatus.REJECTED, ErrorCode.BUSY),
        (StoreStatus.REJECTED, ErrorCode.NO_SPACE),
    ]
    off = reply.chunks[2].offset
    buf.view[off : off + PAGE + 1] = b"z" * (PAGE + 1)
    done = raw.call(p.CompleteStore(reply.handle))
    assert done == p.CompleteStoreReply((True, False, True, False, False))
    assert store.data[("acme", key(2))] == [b"z" * (PAGE + 1)]
    assert store.reserved == 0
    again = raw.call(p.CompleteStore(reply.handle))
    assert isinstance(again, p.ErrorReply) and again.code is ErrorCode.BAD_HANDLE
    raw.close()
    buf.close()
    st.stop()


def test_load_stops_at_busy_and_resumes(server: ServerThread, fake_store: FakeStore) -> None:
    for i in range(3):
        fake_store.data[("acme", key(i))] = [bytes([i]) * PAGE, b"t"]
    raw = Raw(server)
    raw.hello()
    buf = raw.register(4 * PAGE)
    first = raw.call(p.PrepareLoad("acme", (key(0), key(1), key(2))))
    assert isinstance(first, p.PrepareLoadReply)
    assert [c.verified for c in first.chunks] == [True, True, False]
    assert first.stop is ErrorCode.BUSY
    assert first.chunks[0].layers == (PAGE, 1)
    off = first.chunks[1].offset
    assert bytes(buf.view[off : off + PAGE + 1]) == b"\x01" * PAGE + b"t"
    assert fake_store.pins == Counter({("acme", key(0)): 1, ("acme", key(1)): 1})
    assert raw.call(p.CompleteLoad(first.handle)) == p.Ack(p.Op.COMPLETE_LOAD)
    assert not fake_store.pins
    rest = raw.call(p.PrepareLoad("acme", (key(2), key(9))))
    assert isinstance(rest, p.PrepareLoadReply)
    assert [c.verified for c in rest.chunks] == [True, False]
    assert rest.stop is ErrorCode.NOT_FOUND
    raw.close()
    buf.close()


def test_disconnect_releases_reservations_pins_and_staging(
    server: ServerThread, fake_store: FakeStore
) -> None:
    fake_store.data[("acme", key(0))] = [b"x" * 100]
    raw = Raw(server)
    raw.hello()
    buf = raw.register(4 * PAGE)
    prep = raw.call(p.PrepareStore("acme", NS, (p.ChunkSpec(key(1), (100,)),)))
    assert isinstance(prep, p.PrepareStoreReply) and prep.handle
    load = raw.call(p.PrepareLoad("acme", (key(0),)))
    assert isinstance(load, p.PrepareLoadReply) and load.handle
    assert fake_store.reserved > 0 and fake_store.pins
    raw.close()
    wait_until(lambda: not server.server.connections, "connection torn down")
    assert fake_store.reserved == 0
    assert not fake_store.pins
    assert ("acme", key(1)) not in fake_store.data  # an unfinished store leaves nothing
    buf.close()


def test_expired_handles_are_released(sock_dir: Path, fake_store: FakeStore) -> None:
    st = start(sock_dir, fake_store, handle_ttl_s=0.2)
    raw = Raw(st)
    assert raw.hello().handle_ttl_s == 0.2
    buf = raw.register(4 * PAGE)
    prep = raw.call(p.PrepareStore("acme", NS, (p.ChunkSpec(key(1), (100,)),)))
    assert isinstance(prep, p.PrepareStoreReply)
    wait_until(lambda: fake_store.reserved == 0, "reservation expired")
    late = raw.call(p.CompleteStore(prep.handle))
    assert isinstance(late, p.ErrorReply) and late.code is ErrorCode.BAD_HANDLE
    raw.close()
    buf.close()
    st.stop()


def test_admin_verbs_need_the_admin_right(sock_dir: Path, fake_store: FakeStore) -> None:
    fake_store.data[("acme", key(0))] = [b"x"]
    st = start(sock_dir, fake_store, policy=grants("acme"))
    raw = Raw(st)
    raw.hello()
    for req in (p.Purge("acme"), p.Fsck(repair=True)):
        reply = raw.call(req)
        assert isinstance(reply, p.ErrorReply) and reply.code is ErrorCode.FORBIDDEN
    assert fake_store.data
    st.server.policy = grants(admin=True)
    assert raw.call(p.Purge("acme")) == p.PurgeReply(1)
    assert not fake_store.data
    fsck = raw.call(p.Fsck(repair=True))
    assert isinstance(fsck, p.FsckReply)
    assert fsck.report["clean"] is True and fsck.report["repaired"] is True
    assert fsck.report["verified_data"] is False and fsck.report["index_records"] == 0
    stats = raw.call(p.Stats())
    assert isinstance(stats, p.StatsReply) and stats.stats["tenants"] == 7
    raw.close()
    st.stop()


def test_shutdown_tells_clients_and_they_degrade_to_misses(
    sock_dir: Path, fake_store: FakeStore
) -> None:
    st = start(sock_dir, fake_store)
    raw = Raw(st)
    raw.hello()
    client = SidecarClient(sock_path(st), "acme", staging_bytes=4 * PAGE)
    assert client.save(NS, [(key(1), [b"x"])]) == [True]
    st.stop()
    rid, reply = p.parse_reply(raw.t.recv().msg)
    assert rid == 0
    assert isinstance(reply, p.ErrorReply) and reply.code is ErrorCode.SHUTTING_DOWN
    assert client.lookup([key(1)]) == 0
    assert client.load([key(1)])[0].ok is False
    assert not sock_path(st).exists()
    client.close()
    raw.close()


def test_refuses_to_steal_a_live_socket(server: ServerThread, sock_dir: Path) -> None:
    with pytest.raises(ListenError, match="already serving"):
        start(sock_dir, FakeStore())


# -- the real store ----------------------------------------------------------------


def test_real_store_end_to_end_and_corruption_is_a_miss(sock_dir: Path, store: Any) -> None:
    from kvoffload.layouts import v1

    st = start(sock_dir, store)
    try:
        with SidecarClient(sock_path(st), "acme", staging_bytes=16 * PAGE) as c:
            salt = c.salt
            assert salt is not None and salt == store.tenant_salt("acme")
            data = {key(i): [os.urandom(3000), os.urandom(PAGE + 7)] for i in range(3)}
            assert c.save(NS, list(data.items())) == [True] * 3
            assert c.save(NS, [(key(0), data[key(0)])]) == [True]  # exists is success
            got = c.load(list(data))
            assert [[bytes(v) for v in g.layers] for g in got] == list(data.values())
            path = store.root / v1.object_relpath("acme", key(1))
            raw = bytearray(path.read_bytes())
            raw[-PAGE // 2] ^= 0xFF  # inside the last layer's padding or data
            raw[v1.ALIGN + 10] ^= 0xFF  # inside the first layer
            path.write_bytes(bytes(raw))
            got = c.load(list(data))
            assert [g.ok for g in got] == [True, False, False]
    finally:
        st.stop()


def test_byte_budget_bounds_concurrent_payload() -> None:
    from kvoffload.sidecar.server import ByteBudget

    budget = ByteBudget(100)
    peak = 0
    lock = threading.Lock()

    def work(n: int) -> None:
        nonlocal peak
        with budget.hold(n):
            with lock:
                peak = max(peak, budget.in_use)
            time.sleep(0.01)

    threads = [threading.Thread(target=work, args=(n,)) for n in (60, 60, 30, 250, 10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak <= 100  # never more than the limit, even with a request larger than it
    assert budget.in_use == 0
    with pytest.raises(ValueError):
        ByteBudget(0)
