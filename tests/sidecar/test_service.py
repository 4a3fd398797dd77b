"""The verb layer without a socket: ``Session`` on a real ``Store`` and a real staging buffer.

``tests/sidecar/test_server.py`` drives the same verbs through frames; here each
verb is a plain call, so the rules of protocol-v1.md §5 to §8 (isolation,
handles, regions, reservations, pins) are checked directly. The last tests
pin down ``load_or_create_secret``'s atomic creation.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload import protocol as p
from kvoffload.protocol import ErrorCode, StoreStatus, fake_salt
from kvoffload.sidecar.access.policy import Grant, Policy, TenantPolicy
from kvoffload.sidecar.config import ServerConfig
from kvoffload.sidecar.peer import Peer
from kvoffload.sidecar.secret import load_or_create_secret
from kvoffload.sidecar.service import Service
from kvoffload.sidecar.session import Session
from kvoffload.staging import PAGE, StagingBuffer

NS = b"\x22" * 32
SECRET = b"\x5a" * 32
ME = Peer(os.getpid(), os.getuid(), (os.getgid(),))


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def grants(*tenants: str, admin: bool = False) -> Policy:
    return Policy(grants=[Grant("uid", os.getuid(), frozenset(tenants), admin=admin)])


@pytest.fixture
def service(store: Any) -> Service:
    return Service(store, grants("acme"), ServerConfig(secret=SECRET, max_handles=8))


@pytest.fixture
def buf() -> Iterator[StagingBuffer]:
    b = StagingBuffer(8 * PAGE)
    yield b
    b.close()


def open_session(service: Service, buf: StagingBuffer | None, *tenants: str) -> Session:
    s = Session(service, ME)
    reply = s.hello(p.Hello(1, 1, "unit", tenants or ("acme",)))
    assert isinstance(reply, p.HelloReply)
    if buf is not None:
        # The server owns the descriptor it receives: hand it a duplicate.
        assert s.register_staging(p.RegisterStaging(buf.size), [os.dup(buf.fd)]) == p.Ack(
            p.Op.REGISTER_STAGING
        )
    return s


def call(s: Session, req: p.Request) -> p.Reply:
    return s.execute(req)


def store_chunk(s: Session, buf: StagingBuffer, k: bytes, layers: list[bytes]) -> p.Reply:
    prep = call(s, p.PrepareStore("acme", NS, (p.ChunkSpec(k, tuple(map(len, layers))),)))
    assert isinstance(prep, p.PrepareStoreReply)
    assert prep.chunks[0].status is StoreStatus.WRITE
    off = prep.chunks[0].offset
    data = b"".join(layers)
    buf.view[off : off + len(data)] = data
    return call(s, p.CompleteStore(prep.handle))


# -- hello and isolation (§5.1, §6) -------------------------------------------------------


def test_hello_grants_only_permitted_tenants(service: Service, store: Any) -> None:
    s = Session(service, ME)
    reply = s.hello(p.Hello(1, 1, "unit", ("acme", "rival")))
    assert isinstance(reply, p.HelloReply)
    assert reply.version == 1 and s.version == 1
    assert reply.salts["acme"] == store.tenant_salt("acme")
    assert reply.salts["rival"] == fake_salt(SECRET, "rival")
    assert reply.salts["rival"] != store.tenant_salt("acme")
    assert "rival" not in store.tenants()  # a forbidden name creates no tenant
    assert reply.direct == {"acme": False, "rival": False}


def test_hello_without_a_common_version_says_so(service: Service) -> None:
    s = Session(service, ME)
    reply = s.hello(p.Hello(2, 3, "future", ("acme",)))
    assert isinstance(reply, p.ErrorReply)
    assert reply.code is ErrorCode.UNSUPPORTED_VERSION
    assert reply.server_versions == (1, 1)
    assert s.version is None


def test_forbidden_tenant_answers_like_an_empty_tenant(store: Any, buf: StagingBuffer) -> None:
    store.put("rival", NS, key(1), [b"secret" * 100])
    service = Service(store, grants("acme", "empty"), ServerConfig(secret=SECRET))
    s = open_session(service, buf, "acme", "empty", "rival")
    keys = (key(1), key(2))
    for tenant in ("empty", "rival"):
        assert call(s, p.Lookup(tenant, keys)) == p.LookupReply(0)
        assert call(s, p.Touch(tenant, keys)) == p.Ack(p.Op.TOUCH)
        load = call(s, p.PrepareLoad(tenant, keys))
        assert load == p.PrepareLoadReply(0, ErrorCode.NOT_FOUND, (p.LoadSlot(False),) * 2)
    assert s.open_handles() == 0
    refused = call(s, p.PrepareStore("rival", NS, (p.ChunkSpec(key(3), (10,)),)))
    assert isinstance(refused, p.ErrorReply) and refused.code is ErrorCode.FORBIDDEN
    assert store.reserved_bytes == 0
    # Not named in hello: the client's own mistake.
    unnamed = call(s, p.Lookup("other", keys))
    assert isinstance(unnamed, p.ErrorReply) and unnamed.code is ErrorCode.BAD_REQUEST
    assert store.lookup("rival", [key(1)]) == 1  # untouched


def test_a_policy_change_applies_to_the_next_request(service: Service, store: Any) -> None:
    store.put("acme", NS, key(1), [b"x" * 10])
    s = open_session(service, None)
    assert call(s, p.Lookup("acme", (key(1),))) == p.LookupReply(1)
    assert s.lookup_inline(p.Lookup("acme", (key(1),))) == p.LookupReply(1)
    service.policy = grants()
    assert call(s, p.Lookup("acme", (key(1),))) == p.LookupReply(0)
    assert s.lookup_inline(p.Lookup("acme", (key(1),))) is None  # to the pool, answered 0


def test_admin_verbs_need_the_admin_right(service: Service, store: Any) -> None:
    store.put("acme", NS, key(1), [b"x" * 10])
    s = open_session(service, None)
    for req in (p.Purge("acme"), p.Fsck(repair=False)):
        reply = call(s, req)
        assert isinstance(reply, p.ErrorReply) and reply.code is ErrorCode.FORBIDDEN
    stats = call(s, p.Stats())
    assert isinstance(stats, p.StatsReply) and "tenants" not in stats.stats
    assert stats.stats["server"]["connections"] == 1
    service.policy = grants("acme", admin=True)
    assert call(s, p.Purge("acme")) == p.PurgeReply(1)
    assert store.get("acme", key(1)) is None  # its key is destroyed


# -- store and load (§5.4 to §5.8, §7, §8) ----------------------------------------------------


def test_store_then_load_round_trip(service: Service, store: Any, buf: StagingBuffer) -> None:
    s = open_session(service, buf)
    layers = [os.urandom(3000), os.urandom(PAGE + 7)]
    assert store_chunk(s, buf, key(1), layers) == p.CompleteStoreReply((True,))
    assert store.reserved_bytes == 0
    again = call(s, p.PrepareStore("acme", NS, (p.ChunkSpec(key(1), (3000, PAGE + 7)),)))
    assert again == p.PrepareStoreReply(0, (p.StoreSlot(StoreStatus.EXISTS),))
    buf.view[:] = b"\0" * buf.size
    load = call(s, p.PrepareLoad("acme", (key(1), key(2))))
    assert isinstance(load, p.PrepareLoadReply) and load.handle
    assert load.stop is ErrorCode.NOT_FOUND
    first, second = load.chunks
    assert first.verified and first.layers == (3000, PAGE + 7) and not second.verified
    got = bytes(buf.view[first.offset : first.offset + sum(first.layers)])
    assert got == b"".join(layers)
    assert call(s, p.CompleteLoad(load.handle)) == p.Ack(p.Op.COMPLETE_LOAD)
    late = call(s, p.CompleteLoad(load.handle))
    assert isinstance(late, p.ErrorReply) and late.code is ErrorCode.BAD_HANDLE
    assert s.open_handles() == 0


def test_staging_limits_reject_per_chunk(service: Service, store: Any, buf: StagingBuffer) -> None:
    s = open_session(service, buf)
    half = 5 * PAGE  # two of them do not fit 8 pages
    prep = call(
        s,
        p.PrepareStore(
            "acme",
            NS,
            (
                p.ChunkSpec(key(1), (half,)),
                p.ChunkSpec(key(2), (half,)),
                p.ChunkSpec(key(3), (buf.size + 1,)),
            ),
        ),
    )
    assert isinstance(prep, p.PrepareStoreReply) and prep.handle
    assert [c.status for c in prep.chunks] == [
        StoreStatus.WRITE,
        StoreStatus.REJECTED,
        StoreStatus.REJECTED,
    ]
    assert [c.code for c in prep.chunks[1:]] == [ErrorCode.BUSY, ErrorCode.TOO_LARGE]
    done = call(s, p.CompleteStore(prep.handle))
    assert done == p.CompleteStoreReply((True, False, False))
    assert store.lookup("acme", [key(1)]) == 1 and store.lookup("acme", [key(2)]) == 0


def test_not_registered_and_shutting_down(service: Service) -> None:
    s = open_session(service, None)
    req = p.PrepareStore("acme", NS, (p.ChunkSpec(key(1), (10,)),))
    reply = call(s, req)
    assert isinstance(reply, p.ErrorReply) and reply.code is ErrorCode.NOT_REGISTERED
    service.draining = True
    reply = call(s, req)
    assert isinstance(reply, p.ErrorReply) and reply.code is ErrorCode.SHUTTING_DOWN


def test_bad_handles(service: Service, store: Any, buf: StagingBuffer) -> None:
    s = open_session(service, buf)
    for req in (p.CompleteStore(999), p.CompleteLoad(999), p.Abort(999)):
        reply = call(s, req)
        assert isinstance(reply, p.ErrorReply) and reply.code is ErrorCode.BAD_HANDLE
    prep = call(s, p.PrepareStore("acme", NS, (p.ChunkSpec(key(1), (10,)),)))
    assert isinstance(prep, p.PrepareStoreReply) and prep.handle
    # A store handle is not a load handle, and asking wrongly does not consume it.
    wrong = call(s, p.CompleteLoad(prep.handle))
    assert isinstance(wrong, p.ErrorReply) and wrong.code is ErrorCode.BAD_HANDLE
    buf.view[prep.chunks[0].offset : prep.chunks[0].offset + 10] = b"0123456789"
    assert call(s, p.CompleteStore(prep.handle)) == p.CompleteStoreReply((True,))
    assert store.get("acme", key(1)) == [b"0123456789"]


def test_abort_releases_reservation_and_region(
    service: Service, store: Any, buf: StagingBuffer
) -> None:
    s = open_session(service, buf)
    whole = (p.ChunkSpec(key(1), (buf.size,)),)
    prep = call(s, p.PrepareStore("acme", NS, whole))
    assert isinstance(prep, p.PrepareStoreReply) and prep.handle
    assert store.reserved_bytes > 0
    busy = call(s, p.PrepareStore("acme", NS, (p.ChunkSpec(key(2), (10,)),)))
    assert isinstance(busy, p.PrepareStoreReply) and busy.chunks[0].code is ErrorCode.BUSY
    assert call(s, p.Abort(prep.handle)) == p.Ack(p.Op.ABORT)
    assert store.reserved_bytes == 0
    assert store.lookup("acme", [key(1)]) == 0  # nothing written (§8)
    again = call(s, p.Abort(prep.handle))
    assert isinstance(again, p.ErrorReply) and again.code is ErrorCode.BAD_HANDLE
    # The whole buffer is free again.
    prep = call(s, p.PrepareStore("acme", NS, whole))
    assert isinstance(prep, p.PrepareStoreReply) and prep.chunks[0].status is StoreStatus.WRITE


def test_expire_handles_then_release(service: Service, store: Any, buf: StagingBuffer) -> None:
    s = open_session(service, buf)
    prep = call(s, p.PrepareStore("acme", NS, (p.ChunkSpec(key(1), (10,)),)))
    assert isinstance(prep, p.PrepareStoreReply) and prep.handle
    assert s.expire_handles(time.monotonic() - 60) == []  # not old enough
    expired = s.expire_handles(time.monotonic() + 1)
    assert len(expired) == 1 and s.open_handles() == 0
    assert store.reserved_bytes > 0  # taken, not yet released
    s.release_all(expired)
    assert store.reserved_bytes == 0
    late = call(s, p.CompleteStore(prep.handle))
    assert isinstance(late, p.ErrorReply) and late.code is ErrorCode.BAD_HANDLE


def test_release_all_frees_everything_a_disconnect_holds(
    service: Service, store: Any, buf: StagingBuffer
) -> None:
    store.put("acme", NS, key(0), [b"y" * 100])
    s = open_session(service, buf)
    prep = call(s, p.PrepareStore("acme", NS, (p.ChunkSpec(key(1), (100,)),)))
    load = call(s, p.PrepareLoad("acme", (key(0),)))
    assert isinstance(prep, p.PrepareStoreReply) and prep.handle
    assert isinstance(load, p.PrepareLoadReply) and load.handle
    assert s.open_handles() == 2 and store.reserved_bytes > 0
    s.release_all()
    assert s.open_handles() == 0 and store.reserved_bytes == 0
    assert service.session_count() == 1
    s.close()
    assert service.session_count() == 0
    assert s.handles.staging is not None and s.handles.staging.closed
    assert store.lookup("acme", [key(1)]) == 0


def test_too_many_handles_is_busy(store: Any, buf: StagingBuffer) -> None:
    service = Service(store, grants("acme"), ServerConfig(secret=SECRET, max_handles=1))
    s = open_session(service, buf)
    first = call(s, p.PrepareStore("acme", NS, (p.ChunkSpec(key(1), (10,)),)))
    assert isinstance(first, p.PrepareStoreReply) and first.handle
    second = call(s, p.PrepareStore("acme", NS, (p.ChunkSpec(key(2), (10,)),)))
    assert isinstance(second, p.ErrorReply) and second.code is ErrorCode.BUSY


def test_direct_path_lease_then_abort_leaves_nothing(store: Any) -> None:
    policy = Policy(
        tenants={"acme": TenantPolicy(encryption=False, direct=True)},
        grants=[Grant("uid", os.getuid(), frozenset({"acme", "plain"}))],
    )
    service = Service(store, policy, ServerConfig(secret=SECRET))
    s = open_session(service, None, "acme", "plain", "rival")
    hello = Session(service, ME).hello(p.Hello(1, 1, "unit", ("acme", "plain", "rival")))
    assert isinstance(hello, p.HelloReply)
    assert hello.direct == {"acme": True, "plain": False, "rival": False}
    lease = call(s, p.LeaseStore("acme", NS, (p.ChunkSpec(key(1), (100, 200)),)))
    assert isinstance(lease, p.LeaseStoreReply) and lease.handle
    # §5.14: the server's durability setting, the worker's hint for how to write
    # (a probe of the store for it answered "" for the real store, so workers
    # always wrote with O_DIRECT).
    assert lease.durability == "none" == store.config.durability.value
    slot = lease.chunks[0]
    assert slot.status is StoreStatus.WRITE and slot.offsets
    assert Path(slot.path).stat().st_size == slot.size
    assert store.reserved_bytes > 0
    assert call(s, p.Abort(lease.handle)) == p.Ack(p.Op.ABORT)
    assert not Path(slot.path).exists() and store.reserved_bytes == 0
    for req in (
        p.LeaseStore("plain", NS, (p.ChunkSpec(key(1), (10,)),)),
        p.LeaseLoad("plain", (key(1),)),
        p.LeaseStore("rival", NS, (p.ChunkSpec(key(1), (10,)),)),
    ):
        reply = call(s, req)
        assert isinstance(reply, p.ErrorReply) and reply.code is ErrorCode.FORBIDDEN
    # A tenant the connection may not use: the empty tenant's answer, not FORBIDDEN.
    miss = call(s, p.LeaseLoad("rival", (key(1),)))
    assert miss == p.LeaseLoadReply(0, ErrorCode.NOT_FOUND, (p.ReadSlot(False),))


# -- the persistent secret -------------------------------------------------------------------


def test_secret_is_created_once_0600_and_then_read(tmp_path: Path) -> None:
    path = tmp_path / "server-secret"
    secret = load_or_create_secret(path)
    assert len(secret) == 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_secret(path) == secret
    assert os.listdir(tmp_path) == ["server-secret"]  # no temp file left


@pytest.mark.parametrize("size", [0, 5, 31])
def test_a_short_secret_from_a_crashed_start_is_replaced(
    tmp_path: Path, size: int, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "server-secret"
    path.write_bytes(os.urandom(size))  # what a first start killed mid-write left
    with caplog.at_level(logging.WARNING, logger="kvoffload.server"):
        secret = load_or_create_secret(path)
    assert len(secret) == 32
    assert path.read_bytes() == secret
    assert "crashed" in caplog.text
    assert load_or_create_secret(path) == secret
    assert sorted(os.listdir(tmp_path)) == ["server-secret"]


def test_a_long_secret_is_refused_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "server-secret"
    data = os.urandom(64)
    path.write_bytes(data)
    with pytest.raises(ValueError, match="delete the file"):
        load_or_create_secret(path)
    assert path.read_bytes() == data


@pytest.mark.parametrize("failing", ["fsync", "write"])
def test_a_failed_creation_leaves_no_secret_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    path = tmp_path / "server-secret"

    def broken(*args: object, **kwargs: object) -> int:
        raise OSError(errno.EIO, f"simulated {failing} failure")

    if failing == "fsync":
        monkeypatch.setattr(os, "fsync", broken)
    else:
        monkeypatch.setattr(os, "write", broken)
        monkeypatch.setattr(os, "pwrite", broken)
        monkeypatch.setattr(os, "pwritev", broken)
    with pytest.raises(OSError, match="simulated"):
        load_or_create_secret(path)
    assert not path.exists()
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    assert len(load_or_create_secret(path)) == 32


def test_concurrent_first_starts_agree_on_one_secret(tmp_path: Path) -> None:
    path = tmp_path / "server-secret"
    results: list[bytes] = []
    barrier = threading.Barrier(8)

    def start() -> None:
        barrier.wait()
        results.append(load_or_create_secret(path))

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and len(set(results)) == 1
    assert path.read_bytes() == results[0]
