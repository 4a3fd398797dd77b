"""The small-chunk path: the one-round-trip ``store`` verb (protocol-v1.md §5.21),
one index transaction per batch of saves, and the fast lookup of the index.

Everything runs on a real ``Store`` (LMDB, files, AES-GCM) and a real staging
memfd; the verb is driven through ``Session`` directly, through a real server
on a Unix socket, and from a client process that is SIGKILLed mid-request.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload import protocol as p
from kvoffload.client import SidecarClient
from kvoffload.layouts import v1
from kvoffload.protocol import ErrorCode, region_size
from kvoffload.sidecar.access.policy import Grant, Policy
from kvoffload.sidecar.config import ServerConfig
from kvoffload.sidecar.peer import Peer
from kvoffload.sidecar.service import Service
from kvoffload.sidecar.session import Session
from kvoffload.sidecar.writes import Writes
from kvoffload.staging import PAGE, StagingBuffer
from kvoffload.store.api import ChunkRecord
from kvoffload.store.files import Durability
from kvoffload.store.index import Index
from tests.helpers.paths import DATA, REPO
from tests.helpers.server import sock_path, start, wait_until
from tests.helpers.stores import make_store, root_with_fanout

NS = b"\x33" * 32
SECRET = b"\x5b" * 32
ME = Peer(os.getpid(), os.getuid(), (os.getgid(),))
SRC = str(REPO / "src")


def key(i: int) -> bytes:
    return (i + 1).to_bytes(4, "little") * 8


def layers_of(i: int) -> list[bytes]:
    """Three layers, none a multiple of a page, contents unique to the chunk."""
    return [bytes([(i * 7 + j) & 0xFF]) * (1000 + 517 * j + i) for j in range(3)]


def grants(*tenants: str) -> Policy:
    return Policy(grants=[Grant("uid", os.getuid(), frozenset(tenants))])


@pytest.fixture
def service(store: Any) -> Service:
    return Service(store, grants("acme"), ServerConfig(secret=SECRET, max_handles=8))


@pytest.fixture
def buf() -> Iterator[StagingBuffer]:
    b = StagingBuffer(16 * PAGE)
    yield b
    b.close()


def open_session(service: Service, buf: StagingBuffer, *tenants: str) -> Session:
    s = Session(service, ME)
    assert isinstance(s.hello(p.Hello(1, 1, "unit", tenants or ("acme",))), p.HelloReply)
    reply = s.register_staging(p.RegisterStaging(buf.size), [os.dup(buf.fd)])
    assert reply == p.Ack(p.Op.REGISTER_STAGING)
    return s


def place(buf: StagingBuffer, chunks: dict[int, int]) -> tuple[p.StoreChunk, ...]:
    """Copy chunk i's packed layers to offset ``chunks[i]``; the store chunks."""
    out = []
    for i, off in chunks.items():
        data = b"".join(layers_of(i))
        buf.view[off : off + len(data)] = data
        out.append(p.StoreChunk(key(i), tuple(map(len, layers_of(i))), offset=off))
    return tuple(out)


def load_bytes(store: Any, i: int) -> bytes | None:
    out = bytearray(sum(map(len, layers_of(i))))
    got = store.get_into("acme", key(i), memoryview(out))
    return None if got is None else bytes(out)


def object_files(store: Any) -> list[Path]:
    return [p for p in (store.root / "objects").rglob("*") if p.is_file()]


# -- the verb, on a Session ------------------------------------------------------


def test_hello_announces_store(service: Service, buf: StagingBuffer) -> None:
    s = Session(service, ME)
    reply = s.hello(p.Hello(1, 1, "unit", ("acme",)))
    assert isinstance(reply, p.HelloReply) and reply.store


def test_store_writes_every_chunk_before_the_reply(
    service: Service, store: Any, buf: StagingBuffer
) -> None:
    s = open_session(service, buf)
    chunks = place(buf, {0: 0, 1: 2 * PAGE, 2: 5 * PAGE})
    reply = s.execute(p.StoreBatch("acme", NS, chunks))
    assert reply == p.StoreReply((True, True, True), (0, 0, 0))
    # The client may reuse the buffer at once: the bytes were sealed before the reply.
    buf.view[:] = b"\xee" * buf.size
    for i in range(3):
        assert load_bytes(store, i) == b"".join(layers_of(i))
    assert store.reserved_bytes == 0
    assert s.open_handles() == 0
    # every region back
    assert s.handles.alloc is not None and s.handles.alloc.largest_free == buf.size
    # Stored again: present, so stored (and nothing is read from the regions).
    again = s.execute(p.StoreBatch("acme", NS, chunks[:1]))
    assert again == p.StoreReply((True,), (0,))


@pytest.mark.parametrize(
    ("offsets", "why"),
    [
        ({0: 100}, "aligned"),  # not at a multiple of the alignment
        ({0: 15 * PAGE}, "exceeds"),  # its ~5 KiB run past the 16-page buffer
        ({0: 16 * PAGE}, "exceeds"),  # starts at the end
        ({0: 0, 1: PAGE}, "overlaps"),  # chunk 0 takes two pages: 1 starts inside it
        ({0: 4 * PAGE, 1: 4 * PAGE}, "overlaps"),
    ],
)
def test_bad_regions_are_refused_as_a_whole(
    service: Service, store: Any, buf: StagingBuffer, offsets: dict[int, int], why: str
) -> None:
    s = open_session(service, buf)
    chunks = tuple(
        p.StoreChunk(key(i), tuple(map(len, layers_of(i))), offset=off)
        for i, off in offsets.items()
    )
    reply = s.execute(p.StoreBatch("acme", NS, chunks))
    assert isinstance(reply, p.ErrorReply) and reply.code is ErrorCode.BAD_REQUEST
    assert why in reply.message
    assert store.lookup("acme", [key(i) for i in offsets]) == 0
    assert object_files(store) == []
    assert store.reserved_bytes == 0
    assert s.handles.alloc is not None and s.handles.alloc.largest_free == buf.size


def test_a_region_held_by_an_open_load_is_busy_and_left_alone(
    service: Service, store: Any, buf: StagingBuffer
) -> None:
    store.put("acme", NS, key(9), layers_of(9))
    s = open_session(service, buf)
    load = s.execute(p.PrepareLoad("acme", (key(9),)))
    assert isinstance(load, p.PrepareLoadReply) and load.handle
    held = load.chunks[0].offset
    want = b"".join(layers_of(9))
    free = next(o for o in range(0, buf.size, 4 * PAGE) if abs(o - held) >= 4 * PAGE)
    chunks = place(buf, {1: free})
    clash = p.StoreChunk(key(2), tuple(map(len, layers_of(2))), offset=held)
    reply = s.execute(p.StoreBatch("acme", NS, (*chunks, clash)))
    assert reply == p.StoreReply((True, False), (0, int(ErrorCode.BUSY)))
    # The load's bytes were not read as chunk 2, and chunk 2 is not stored.
    assert bytes(buf.view[held : held + len(want)]) == want
    assert store.lookup("acme", [key(2)]) == 0
    assert s.execute(p.CompleteLoad(load.handle)) == p.Ack(p.Op.COMPLETE_LOAD)
    assert store.reserved_bytes == 0
    assert s.handles.alloc is not None and s.handles.alloc.largest_free == buf.size


def test_a_forbidden_tenant_is_refused_before_the_store(store: Any, buf: StagingBuffer) -> None:
    service = Service(store, grants("acme"), ServerConfig(secret=SECRET))
    s = open_session(service, buf, "acme", "rival")
    reply = s.execute(p.StoreBatch("rival", NS, place(buf, {0: 0})))
    assert isinstance(reply, p.ErrorReply) and reply.code is ErrorCode.FORBIDDEN
    assert "rival" not in store.tenants()
    assert s.handles.alloc is not None and s.handles.alloc.largest_free == buf.size


def test_store_before_registering_staging(service: Service) -> None:
    s = Session(service, ME)
    assert isinstance(s.hello(p.Hello(1, 1, "unit", ("acme",))), p.HelloReply)
    chunk = p.StoreChunk(key(0), (10,), offset=0)
    reply = s.execute(p.StoreBatch("acme", NS, (chunk,)))
    assert isinstance(reply, p.ErrorReply) and reply.code is ErrorCode.NOT_REGISTERED


def test_a_failed_write_mid_batch_leaves_no_half_visible_chunk(
    service: Service, store: Any, buf: StagingBuffer
) -> None:
    """Chunk 2's fan-out directory is a regular file (a real ENOTDIR): the chunks
    before it are stored whole, it and the ones after it are not, and nothing of
    them is on disk or in the index."""
    leaf = store.root / Path(v1.object_relpath("acme", key(2))).parent
    leaf.parent.mkdir(parents=True, exist_ok=True)
    leaf.write_bytes(b"not a directory")
    s = open_session(service, buf)
    chunks = place(buf, {0: 0, 1: 2 * PAGE, 2: 4 * PAGE, 3: 6 * PAGE})
    reply = s.execute(p.StoreBatch("acme", NS, chunks))
    assert isinstance(reply, p.StoreReply)
    assert reply.stored == (True, True, False, False)
    assert reply.codes[:2] == (0, 0) and reply.codes[2] == int(ErrorCode.INTERNAL)
    for i in (0, 1):
        assert load_bytes(store, i) == b"".join(layers_of(i))
    for i in (2, 3):
        assert store.lookup("acme", [key(i)]) == 0
        assert not (store.root / v1.object_relpath("acme", key(i))).exists()
    names = {f.name for f in object_files(store)}
    assert not any(n.startswith(v1.TMP_PREFIX) for n in names)  # no temp file left
    assert len([n for n in names if n.endswith(v1.OBJECT_SUFFIX)]) == 2
    assert store.reserved_bytes == 0


# -- one index transaction per batch ----------------------------------------------


def test_a_batch_commits_its_records_in_one_transaction(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    single: list[ChunkRecord] = []
    put_each = Index.put_each

    def counted(recs: list[ChunkRecord]) -> list[bool]:
        calls.append(len(recs))
        return put_each(store.index, recs)

    def one(rec: ChunkRecord) -> bool:
        single.append(rec)
        raise AssertionError("a record indexed on its own")

    monkeypatch.setattr(store.index, "put_each", counted)
    monkeypatch.setattr(store.index, "put", one)
    chunks = [(key(i), layers_of(i)) for i in range(8)]
    assert store.put_many("acme", NS, chunks) == [True] * 8
    assert calls == [8] and single == []
    for i in range(8):
        assert load_bytes(store, i) == b"".join(layers_of(i))
    assert store.stats()["chunks"] == 8


_CRASH = """
import os, sys
from pathlib import Path
from kvoffload.store.index import Index
from kvoffload.store.keys.keyring import Kek
from kvoffload.store import Store, StoreConfig

root, kek, durability = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
store = Store(StoreConfig(root=root, durability=durability), Kek.from_file(kek), create=True)
def crash(self, recs):
    os._exit(17)  # the objects are written, the index commit never happens
Index.put_each = crash
key = lambda i: (i + 1).to_bytes(4, "little") * 8
store.put_many("acme", b"\\x33" * 32, [(key(i), [bytes([i]) * 3000, b"x" * 5]) for i in range(4)])
"""


@pytest.mark.parametrize("durability", ["object", "none"])
def test_a_crash_between_objects_and_index_leaves_no_wrong_hit(
    tmp_path: Path, kek_file: Path, durability: str
) -> None:
    from kvoffload.store import Store, StoreConfig
    from kvoffload.store.keys.keyring import Kek

    root = tmp_path / "store"
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.run(
        [sys.executable, "-c", _CRASH, str(root), str(kek_file), durability],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 17, proc.stderr.decode()
    cfg = StoreConfig(root=root, durability=Durability.NONE)
    with Store(cfg, Kek.from_file(kek_file)) as store:
        # The objects are on disk but were never indexed. The store may adopt them
        # (each one verified) or miss them; it never answers with other bytes.
        written = [f for f in object_files(store) if not f.name.startswith(v1.TMP_PREFIX)]
        assert len(written) == 4
        for i in range(4):
            out = bytearray(3005)
            got = store.get_into("acme", key(i), memoryview(out))
            assert got is None or bytes(out) == bytes([i]) * 3000 + b"x" * 5
        store.fsck(repair=True)  # a rebuild adopts every one of them, each verified
        for i in range(4):
            out = bytearray(3005)
            assert store.get_into("acme", key(i), memoryview(out)) == [3000, 5]
            assert bytes(out) == bytes([i]) * 3000 + b"x" * 5


# -- through a real server and client ------------------------------------------------


def test_the_client_uses_store_when_announced_and_the_old_path_otherwise(
    sock_dir: Path, store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []
    for verb in ("store", "prepare_store"):
        monkeypatch.setattr(Writes, verb, _spy(seen, verb, getattr(Writes, verb)))
    st = start(sock_dir, store)
    try:
        data = [(key(i), layers_of(i)) for i in range(6)]
        with SidecarClient(sock_path(st), "acme", staging_bytes=64 * PAGE) as c:
            assert c.save(NS, data[:3]) == [True] * 3
        assert seen == ["store"]
        # An older server: its hello does not announce store.
        hello = Session.hello
        monkeypatch.setattr(
            Session,
            "hello",
            lambda self, req: _without_store(hello(self, req)),
        )
        seen.clear()
        with SidecarClient(sock_path(st), "acme", staging_bytes=64 * PAGE) as c:
            assert c.save(NS, data) == [True] * 6
            got = c.load([k for k, _ in data])
            assert [[bytes(v) for v in g.layers] for g in got] == [ls for _, ls in data]
        assert seen == ["prepare_store"]
    finally:
        st.stop()


def test_a_large_batch_keeps_the_two_step_save(sock_dir: Path, store: Any) -> None:
    """Above STORE_VERB_MAX_BYTES only the chunks the sidecar lacks are copied."""
    from kvoffload.client.staged import STORE_VERB_MAX_BYTES

    seen: list[str] = []
    st = start(sock_dir, store)
    try:
        with pytest.MonkeyPatch.context() as mp:
            for verb in ("store", "prepare_store"):
                mp.setattr(Writes, verb, _spy(seen, verb, getattr(Writes, verb)))
            big = [bytes([7]) * (STORE_VERB_MAX_BYTES // 2 + 1)] * 2
            with SidecarClient(sock_path(st), "acme", staging_bytes=16 << 20) as c:
                assert c.save(NS, [(key(1), big)]) == [True]
                assert c.save(NS, [(key(2), layers_of(2))]) == [True]
                assert [bytes(v) for v in c.load([key(1)])[0].layers] == big
        assert seen == ["prepare_store", "store"]
    finally:
        st.stop()


def _spy(seen: list[str], verb: str, real: Any) -> Any:
    def spy(self: Writes, req: Any) -> Any:
        seen.append(verb)
        return real(self, req)

    return spy


def _without_store(reply: p.Reply) -> p.Reply:
    if isinstance(reply, p.HelloReply):
        fields = {f: getattr(reply, f) for f in reply.__struct_fields__}
        return p.HelloReply(**{**fields, "store": False})
    return reply


def test_store_through_the_server_batches_larger_than_one_request(
    sock_dir: Path, store: Any
) -> None:
    """A save bigger than the staging buffer goes as several ``store`` requests."""
    st = start(sock_dir, store)
    try:
        data = [(key(i), layers_of(i)) for i in range(20)]
        with SidecarClient(sock_path(st), "acme", staging_bytes=8 * PAGE) as c:
            assert c.save(NS, data) == [True] * 20
            got = c.load([k for k, _ in data])
        assert [[bytes(v) for v in g.layers] for g in got] == [ls for _, ls in data]
    finally:
        st.stop()


_KILLED = """
import os, signal, sys
from kvoffload import protocol as p
from kvoffload.staging import StagingBuffer
from kvoffload.transport import UnixTransport

t = UnixTransport.connect(sys.argv[1], timeout_s=20)
def call(rid, req, fds=()):
    t.send(p.request_message(rid, req), fds)
    return p.parse_reply(t.recv().msg)[1]
assert isinstance(call(1, p.Hello(1, 1, "killed", ("acme",))), p.HelloReply)
buf = StagingBuffer(64 * 4096)
assert call(2, p.RegisterStaging(buf.size), [buf.fd]) == p.Ack(p.Op.REGISTER_STAGING)
key = lambda i: (i + 1).to_bytes(4, "little") * 8
chunks = []
for i in range(16):
    data = bytes([i]) * 9000
    buf.view[i * 12288 : i * 12288 + 9000] = data
    chunks.append(p.StoreChunk(key(i), (4000, 5000), offset=i * 12288))
t.send(p.request_message(3, p.StoreBatch("acme", b"\\x33" * 32, tuple(chunks))))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_client_killed_mid_store_leaves_whole_chunks_or_none(sock_dir: Path, store: Any) -> None:
    st = start(sock_dir, store)
    try:
        env = {**os.environ, "PYTHONPATH": SRC}
        proc = subprocess.run(
            [sys.executable, "-c", _KILLED, str(sock_path(st))], env=env, timeout=120
        )
        assert proc.returncode == -signal.SIGKILL
        wait_until(lambda: not st.server.connections, "the killed client's connection closed")
        # Whatever the server got to before the peer vanished is whole and
        # verified; the rest is absent. Nothing is left reserved or half-written.
        for i in range(16):
            out = bytearray(9000)
            got = store.get_into("acme", key(i), memoryview(out))
            if got is None:
                assert not (store.root / v1.object_relpath("acme", key(i))).exists()
            else:
                assert got == [4000, 5000] and bytes(out) == bytes([i]) * 9000
        assert not any(f.name.startswith(v1.TMP_PREFIX) for f in object_files(store))
        assert store.reserved_bytes == 0
    finally:
        st.stop()


def test_store_reply_codes_must_match_stored() -> None:
    bad = {"op": "store", "id": 3, "code": 0, "stored": [True, False], "codes": [0]}
    with pytest.raises(p.ProtocolError):
        p.parse_reply(bad)
    chunk = {"key": key(0), "layers": [10]}  # no offset
    with pytest.raises(p.ProtocolError) as exc:
        p.parse_request({"op": "store", "id": 4, "tenant": "a", "namespace": NS, "chunks": [chunk]})
    assert exc.value.request_id == 4  # answered BAD_REQUEST, the connection stays usable


def test_region_claim_takes_only_free_aligned_ranges() -> None:
    from kvoffload.staging import RegionAllocator

    a = RegionAllocator(16 * PAGE)
    assert a.claim(3 * PAGE, 5000)  # two pages
    assert not a.claim(4 * PAGE, 1)  # inside it
    assert not a.claim(2 * PAGE, PAGE + 1)  # runs into it
    assert not a.claim(100, 10)  # unaligned
    assert not a.claim(16 * PAGE, 1) and not a.claim(15 * PAGE, PAGE + 1)  # outside
    assert a.alloc(3 * PAGE) == 0  # first fit still works around a claim
    assert a.claim(5 * PAGE, PAGE)
    for off in (0, 3 * PAGE, 5 * PAGE):
        a.free(off)
    assert a.largest_free == 16 * PAGE


# -- lookup ------------------------------------------------------------------------------


def test_lookup_with_ttls_not_due_and_one_due_elsewhere(tmp_path: Path) -> None:
    """The fast path (no record due) and the per-key path (some record due) agree."""
    now = time.time_ns()
    with Index(tmp_path / "ix") as ix:
        keys = [key(i) for i in range(6)]
        for i, k in enumerate(keys[:5]):
            exp = now + 10**12 if i % 2 else 0  # half never expire, half much later
            ix.put(ChunkRecord("t", k, NS, 0, 10, 10, 1, now, now, exp))
        assert ix.lookup("t", keys, now_ns=now) == 5
        assert ix.lookup("t", keys[:3], now_ns=now) == 3
        # Another tenant's record falls due: the per-key path, same answers.
        ix.put(ChunkRecord("u", keys[0], NS, 0, 10, 10, 1, now, now, now - 1))
        assert ix.lookup("t", keys, now_ns=now) == 5
        assert ix.lookup("u", keys, now_ns=now) == 0
        # A due record inside the prefix ends it; without now_ns expiry is ignored.
        assert ix.lookup("t", keys, now_ns=now + 10**12) == 1
        assert ix.lookup("t", keys) == 5
        assert ix.lookup("t", [keys[5], keys[0]], now_ns=now) == 0
        assert ix.lookup("t", [], now_ns=now) == 0
        with pytest.raises(ValueError):
            ix.lookup("t", [b"short"], now_ns=now)


def test_region_size_is_what_the_client_packs() -> None:
    assert region_size([1000, 1517, 2034]) == 2 * PAGE


# -- fan-out (layout-v1.md §2, params.fanout) ---------------------------------------

DATA = DATA / "v1"


def test_golden_layouts_name_their_fanout(tmp_path: Path) -> None:
    from kvoffload.layouts import read_layout

    for name, fanout in (("layout.json", (2,)), ("layout-fanout-2-2.json", (2, 2))):
        d = tmp_path / name
        d.mkdir()
        (d / "layout.json").write_bytes((DATA / name).read_bytes())
        assert read_layout(d).fanout == fanout


def test_a_new_store_has_one_fanout_level(store: Any) -> None:
    assert store.layout.fanout == (2,)
    assert json.loads((store.root / "layout.json").read_text())["params"]["fanout"] == [2]
    store.put("acme", NS, key(1), layers_of(1))
    h = key(1).hex()
    assert (store.root / "objects" / "acme" / h[:2] / f"{h}{v1.OBJECT_SUFFIX}").is_file()
    # Its 256 leaves, made before the tenant's first write (tests/store/test_fanout_ahead.py).
    assert len(list((store.root / "objects" / "acme").iterdir())) == 256


def test_an_old_two_level_store_opens_loads_and_stays_two_level(
    tmp_path: Path, kek_file: Path
) -> None:
    from kvoffload.store import Store, StoreConfig
    from kvoffload.store.keys.keyring import Kek

    root = tmp_path / "store"
    root_with_fanout(root, [2, 2])
    cfg = StoreConfig(root=root, durability=Durability.NONE)
    with Store(cfg, Kek.from_file(kek_file)) as s:
        assert s.layout.fanout == (2, 2)
        assert s.put_many("acme", NS, [(key(i), layers_of(i)) for i in range(3)]) == [True] * 3
    for i in range(3):
        h = key(i).hex()
        assert (root / "objects" / "acme" / h[:2] / h[2:4] / f"{h}{v1.OBJECT_SUFFIX}").is_file()
    with Store(cfg, Kek.from_file(kek_file)) as s:  # reopened: same layout, same files
        for i in range(3):
            assert load_bytes(s, i) == b"".join(layers_of(i))
        report = s.fsck(repair=False)
        assert report.clean and report.objects_on_disk == 3
        s.index.clear()  # lost index: rebuilt from the two-level tree
        s.fsck(repair=True)
        assert s.lookup("acme", [key(i) for i in range(3)]) == 3


@pytest.mark.parametrize("fanout", [[1], [2, 2, 2], [], "2/2", [2.0], [True]])
def test_an_unknown_fanout_is_refused_at_open(tmp_path: Path, kek_file: Path, fanout: Any) -> None:
    from kvoffload.errors import LayoutError

    root = tmp_path / "store"
    root_with_fanout(root, fanout)
    with pytest.raises(LayoutError, match="fanout"):
        make_store(root, kek_file, durability=Durability.NONE, create=False)
    assert list((root / "objects").iterdir()) == []


def test_a_key_twice_in_one_batch_is_stored_once(store: Any) -> None:
    chunks = [(key(1), layers_of(1)), (key(2), layers_of(2)), (key(1), layers_of(1))]
    assert store.put_many("acme", NS, chunks) == [True, True, False]
    assert store.stats()["chunks"] == 2
    assert load_bytes(store, 1) == b"".join(layers_of(1))
    assert store.reserved_bytes == 0
