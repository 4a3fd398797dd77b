"""Layer-wise loads (protocol-v1.md §5.26–§5.27): a real Store behind a real server socket.

The sidecar reads a batch layer-major and reports each layer once every chunk's
copy of it passed its tag check; the client hands each layer out as it is
reported. What must hold: every byte handed out is a verified byte of the chunk
it is said to be; a corrupt layer *k* is never handed out and makes its chunk
and every later one a miss; a cancelled load stops before its next layer.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvoffload import protocol as p
from kvoffload.client import SidecarClient
from kvoffload.layouts import v1
from kvoffload.sidecar.reads import Reads
from kvoffload.store import Store
from tests.helpers.server import Raw, ServerThread, start
from tests.helpers.stores import make_store

TENANT = "acme"
NS = b"\x33" * 32
LAYERS = 5
CHUNKS = 4


def key(i: int) -> bytes:
    return bytes([i + 1]) * 32


def chunk(i: int) -> list[bytes]:
    rng = random.Random(i)
    return [rng.randbytes(3000 + 512 * j) for j in range(LAYERS)]


@pytest.fixture
def real_store(tmp_path: Path, kek_file: Path) -> Iterator[Store]:
    s = make_store(tmp_path / "root", kek_file, durability="none")
    yield s
    s.close()


@pytest.fixture
def server(sock_dir: Path, real_store: Store) -> Iterator[ServerThread]:
    st = start(sock_dir, real_store)
    yield st
    st.stop()


@pytest.fixture
def client(server: ServerThread) -> Iterator[SidecarClient]:
    path = server.server.config.socket_path
    assert path is not None
    c = SidecarClient(path, TENANT, staging_bytes=1 << 20)
    ok = c.save(NS, [(key(i), chunk(i)) for i in range(CHUNKS)])
    assert ok == [True] * CHUNKS
    yield c
    c.close()


class Recorder:
    """``on_layer``: every (layer, chunk, bytes) handed out, in call order."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, bytes]] = []

    def __call__(self, layer: int, first: int, views: Sequence[memoryview]) -> None:
        for j, v in enumerate(views):
            self.calls.append((layer, first + j, bytes(v)))

    def chunks_of(self, layer: int) -> list[int]:
        return [c for lay, c, _ in self.calls if lay == layer]


def corrupt_layer(store: Store, i: int, layer: int) -> None:
    path = store.root / v1.object_relpath(TENANT, key(i))
    h = v1.decode_header(path.read_bytes())
    os.chmod(path, 0o600)
    with open(path, "r+b") as f:
        f.seek(h.layers[layer].offset + 17)
        b = f.read(1)
        f.seek(h.layers[layer].offset + 17)
        f.write(bytes([b[0] ^ 0x40]))


def test_hello_announces_layerwise(client: SidecarClient) -> None:
    assert client.lookup([key(0)]) == 1
    info = client.server_info
    assert info is not None and info.layerwise


def test_layers_arrive_layer_major_and_exact(client: SidecarClient) -> None:
    rec = Recorder()
    results = client.load_layerwise([key(i) for i in range(CHUNKS)], rec)
    assert [r.ok for r in results] == [True] * CHUNKS
    # Layer-major: every chunk's layer l before any chunk's layer l+1 (a
    # whole-chunk load would hand out chunk 0's five layers first).
    assert [lay for lay, _, _ in rec.calls] == sorted(lay for lay, _, _ in rec.calls)
    for layer in range(LAYERS):
        assert rec.chunks_of(layer) == list(range(CHUNKS))
    for layer, c, data in rec.calls:
        assert data == chunk(c)[layer]


def test_corrupt_layer_is_never_handed_out(client: SidecarClient, real_store: Store) -> None:
    bad, bad_layer = 2, 3
    corrupt_layer(real_store, bad, bad_layer)
    rec = Recorder()
    results = client.load_layerwise([key(i) for i in range(CHUNKS)], rec)
    assert [r.ok for r in results] == [True, True, False, False]
    # Nothing handed out differs from what was stored: the flipped byte never left.
    for layer, c, data in rec.calls:
        assert data == chunk(c)[layer]
    # Layers before the bad one were verified and may have been handed out;
    # the bad layer and those after it never were, for that chunk or later ones.
    assert all(c < bad for layer, c, _ in rec.calls if layer >= bad_layer)
    assert rec.chunks_of(0) == list(range(CHUNKS))
    # The chunks before it are whole.
    for c in (0, 1):
        assert [lay for lay, cc, _ in rec.calls if cc == c] == list(range(LAYERS))
    # The corrupt object is a miss from now on (its entry dropped).
    assert client.lookup([key(i) for i in range(CHUNKS)]) == bad


def test_cancel_stops_before_the_next_layer(
    client: SidecarClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[str] = []

    def cancelled(self: Reads, tenant: str) -> bool:
        asked.append(tenant)
        return len(asked) > 2  # layers 0 and 1 go through, then the tenant is cut off

    monkeypatch.setattr(Reads, "load_cancelled", cancelled)
    rec = Recorder()
    results = client.load_layerwise([key(i) for i in range(CHUNKS)], rec)
    assert not any(r.ok for r in results)
    assert asked == [TENANT] * 3
    assert {lay for lay, _, _ in rec.calls} == {0, 1}
    # The handle was released: a normal load afterwards gets everything.
    monkeypatch.undo()
    assert all(r.ok for r in client.load([key(i) for i in range(CHUNKS)]))


def test_a_purge_or_revocation_between_layers_stops_a_layerwise_load(
    client: SidecarClient, real_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's load generation (what a purge or a revocation bumps) stops a
    layer-wise load before its next layer, like a whole-chunk load: layer 0 was
    handed out, layer 1 never is, and every chunk is a miss."""
    asked: list[int] = []

    def hook(self: Reads, tenant: str) -> bool:
        asked.append(len(asked))
        if len(asked) == 2:  # before layer 1: as Store.purge_* and a revocation do
            real_store.cancel_loads(tenant)
        return False

    monkeypatch.setattr(Reads, "load_cancelled", hook)
    rec = Recorder()
    results = client.load_layerwise([key(i) for i in range(CHUNKS)], rec)
    assert not any(r.ok for r in results)
    assert {lay for lay, _, _ in rec.calls} == {0}
    monkeypatch.undo()
    assert all(r.ok for r in client.load([key(i) for i in range(CHUNKS)]))


def test_wire_frames(server: ServerThread, client: SidecarClient) -> None:
    raw = Raw(server)
    hello = raw.call(p.Hello(1, 1, "raw", (TENANT,)))
    assert isinstance(hello, p.HelloReply) and hello.layerwise
    from kvoffload.staging import StagingBuffer

    staging = StagingBuffer(1 << 20)
    try:
        assert isinstance(raw.call(p.RegisterStaging(staging.size), [staging.fd]), p.Ack)
        keys = (key(0), key(1), b"\x7f" * 32)
        raw.t.send(p.request_message(50, p.PrepareLoad(TENANT, keys, layerwise=True)))
        frames: list[Any] = []
        while True:
            rid, reply = p.parse_reply(raw.t.recv().msg)
            assert rid == 50
            frames.append(reply)
            if not isinstance(reply, p.LoadProgress):
                break
        plan, *layers, final = frames
        assert isinstance(plan, p.LoadProgress) and plan.layers_done == 0
        assert [c.layers for c in plan.chunks] == [tuple(map(len, chunk(i))) for i in (0, 1)]
        assert [(f.layers_done, f.verified) for f in layers] == [(n, 2) for n in range(1, 6)]
        assert isinstance(final, p.PrepareLoadReply)
        assert final.verified == 2 and final.stop is p.ErrorCode.NOT_FOUND
        for slot, i in zip(plan.chunks, (0, 1), strict=True):
            got = bytes(staging.view[slot.offset : slot.offset + sum(slot.layers)])
            assert got == b"".join(chunk(i))
        assert isinstance(raw.call(p.CompleteLoad(final.handle)), p.Ack)
    finally:
        raw.t.close()
        staging.close()


def test_layerwise_flag_is_sent_only_when_set() -> None:
    plain = p.request_message(3, p.PrepareLoad(TENANT, (key(0),)))
    assert "layerwise" not in plain
    lw = p.request_message(3, p.PrepareLoad(TENANT, (key(0),), layerwise=True))
    assert lw["layerwise"] is True
    _, back = p.parse_request(lw)
    assert isinstance(back, p.PrepareLoad) and back.layerwise


def test_progress_frame_refuses_inconsistent_plans() -> None:
    msg = {
        "op": "load_progress",
        "id": 7,
        "code": 0,
        "layers_done": 1,
        "verified": 1,
        "chunks": [{"verified": True, "offset": 0, "layers": [4]}],
    }
    with pytest.raises(p.ProtocolError):
        p.parse_reply(msg)
    msg |= {"layers_done": 0, "verified": 2}
    with pytest.raises(p.ProtocolError):
        p.parse_reply(msg)


def test_older_server_gets_whole_chunk_loads(
    server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server whose hello does not announce revision 9 is never sent ``layerwise``:
    the client loads whole chunks and hands their layers out chunk by chunk."""
    import msgspec

    from kvoffload.sidecar.session import Session

    real_hello = Session.hello

    def old_hello(self: Session, req: p.Hello) -> p.Reply:
        reply = real_hello(self, req)
        assert isinstance(reply, p.HelloReply)
        return msgspec.structs.replace(reply, layerwise=False)

    monkeypatch.setattr(Session, "hello", old_hello)
    sent: list[bool] = []
    real_prepare = Reads.prepare_load

    def spy(self: Reads, req: p.PrepareLoad, emit: Any = None, **kw: Any) -> p.Reply:
        sent.append(req.layerwise)  # on the pool or the loop (inline=True) alike
        return real_prepare(self, req, emit, **kw)

    monkeypatch.setattr(Reads, "prepare_load", spy)
    path = server.server.config.socket_path
    assert path is not None
    with SidecarClient(path, TENANT, staging_bytes=1 << 20) as c:
        assert c.save(NS, [(key(i), chunk(i)) for i in range(2)]) == [True, True]
        rec = Recorder()
        results = c.load_layerwise([key(0), key(1)], rec)
    assert [r.ok for r in results] == [True, True]
    assert sent == [False]
    assert [(lay, ch) for lay, ch, _ in rec.calls] == [(i, 0) for i in range(LAYERS)] + [
        (i, 1) for i in range(LAYERS)
    ]
    for layer, ch, data in rec.calls:
        assert data == chunk(ch)[layer]


@pytest.mark.parametrize("counts", [(1, 2), (2, 1), (1, 2, 3, 1, 2)])
def test_a_batch_of_mixed_layer_counts_hands_out_every_layer(counts: tuple[int, ...]) -> None:
    """Issue 28 item 9, through a real sidecar process: chunks of 1 and 2 (and
    3) layers in one layer-wise load. Every layer of every chunk is handed out
    exactly once, with its own bytes, and only then is the chunk ``ok``; a
    chunk with fewer layers never stops the layers of the chunks after it."""
    from tests.sidecar_proc import dev_sidecar

    rng = random.Random(str(counts))
    data = [[rng.randbytes(2000 + 700 * j + i) for j in range(n)] for i, n in enumerate(counts)]
    keys = [bytes([0x40 + i]) * 32 for i in range(len(counts))]
    with dev_sidecar() as sc, SidecarClient(sc.socket_path, TENANT, staging_bytes=1 << 20) as c:
        assert c.save(NS, list(zip(keys, data, strict=True))) == [True] * len(counts)
        info = c.server_info
        assert info is not None and info.layerwise
        rec = Recorder()
        results = c.load_layerwise(keys, rec)
        assert [r.ok for r in results] == [True] * len(counts)
        handed = sorted((chunk_i, layer) for layer, chunk_i, _ in rec.calls)
        assert handed == sorted((i, j) for i, n in enumerate(counts) for j in range(n))
        for layer, chunk_i, got in rec.calls:
            assert got == data[chunk_i][layer], (chunk_i, layer)
        # Layer-major still: no layer l+1 before every chunk's layer l.
        assert [lay for lay, _, _ in rec.calls] == sorted(lay for lay, _, _ in rec.calls)


def test_a_plan_of_no_chunks_carries_its_chunks_key(server: ServerThread) -> None:
    """§5.26: the plan frame has ``chunks`` (n may be 0) even when no chunk is
    planned; the progress frames after it have none (issue 28 item 10)."""
    from kvoffload.staging import StagingBuffer

    raw = Raw(server)
    staging = StagingBuffer(1 << 20)
    try:
        assert isinstance(raw.call(p.Hello(1, 1, "raw", (TENANT,))), p.HelloReply)
        assert isinstance(raw.call(p.RegisterStaging(staging.size), [staging.fd]), p.Ack)
        raw.t.send(p.request_message(9, p.PrepareLoad(TENANT, (b"\x7e" * 32,), layerwise=True)))
        msgs = []
        while True:
            msg = raw.t.recv().msg
            msgs.append(msg)
            if msg["op"] != "load_progress":
                break
        plan, *rest = msgs
        assert plan["layers_done"] == 0 and plan["verified"] == 0
        assert plan["chunks"] == []
        assert all("chunks" not in m for m in rest if m["op"] == "load_progress")
        assert rest[-1]["op"] == "prepare_load" and rest[-1]["code"] == 0
    finally:
        raw.t.close()
        staging.close()
