"""SidecarClient against a fake sidecar over the in-memory test transport.

``FakeSidecar`` is a test double: it speaks protocol v1 through
``MemoryTransport`` with the real framing and validation, keeps chunks in a
dict, and can be told to misbehave (go down, hang, refuse, send garbage).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from kvoffload import protocol as p
from kvoffload.client import ChunkTooLarge, LoadedChunk
from tests.helpers.client_memory import (
    NS,
    SALT,
    FakeClock,
    FakeSidecar,
    key,
    layers_of,
    make_client,
)

PAGE = 4096


@pytest.fixture
def fake() -> Iterator[FakeSidecar]:
    f = FakeSidecar()
    yield f
    f.kill_connections()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def as_kind(data: bytes, kind: str) -> Any:
    if kind == "bytes":
        return data
    if kind == "numpy":
        return np.frombuffer(data, dtype=np.uint8).copy()
    if kind == "numpy-f16":
        assert len(data) % 2 == 0
        return np.frombuffer(data, dtype=np.float16).reshape(2, -1).copy()
    if kind == "torch-bf16":
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(torch.bfloat16)
        return t.reshape(2, -1).clone()
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["bytes", "numpy", "numpy-f16", "torch-bf16"])
def test_save_then_load_roundtrip(fake: FakeSidecar, clock: FakeClock, kind: str) -> None:
    sizes = (4000, 8196, 4)  # 2-D 16-bit views need multiples of 4 bytes
    with make_client(fake, clock) as c:
        assert c.salt == SALT
        data = {key(i): layers_of(i, sizes) for i in range(3)}
        chunks = [(k, [as_kind(x, kind) for x in v]) for k, v in data.items()]
        assert c.save(NS, chunks) == [True, True, True]
        assert fake.chunks == data
        assert c.lookup(list(data)) == 3
        got = c.load(list(data))
        assert [g.ok for g in got] == [True] * 3
        for g in got:
            assert [bytes(v) for v in g.layers] == data[g.key]


def test_load_into_callback_gets_views_valid_only_during_the_call(
    fake: FakeSidecar, clock: FakeClock
) -> None:
    with make_client(fake, clock) as c:
        data = {key(i): layers_of(i) for i in range(2)}
        assert all(c.save(NS, list(data.items())))
        seen: list[tuple[int, bytes, list[bytes]]] = []
        kept: list[memoryview] = []

        def into(idx: int, k: bytes, views: Any) -> None:
            seen.append((idx, k, [bytes(v) for v in views]))
            assert all(v.readonly for v in views)
            kept.extend(views)

        got = c.load(list(data), into=into)
        assert [g.ok for g in got] == [True, True]
        assert all(g.layers == [] for g in got)
        assert seen == [(i, k, v) for i, (k, v) in enumerate(data.items())]
        with pytest.raises(ValueError):
            bytes(kept[0])  # released: staging may be reused by now


def test_load_callback_exception_propagates_after_complete_load(
    fake: FakeSidecar, clock: FakeClock
) -> None:
    with make_client(fake, clock) as c:
        assert c.save(NS, [(key(1), layers_of(1))]) == [True]

        def boom(idx: int, k: bytes, views: Any) -> None:
            raise RuntimeError("caller bug")

        with pytest.raises(RuntimeError, match="caller bug"):
            c.load([key(1)], into=boom)
        c.stats()  # a round trip: the fake has read every request sent before it
        assert len(fake.of_type(p.CompleteLoad)) == 1
        assert c.load([key(1)])[0].ok  # the connection and staging are still fine


def test_save_splits_batches_to_fit_staging(fake: FakeSidecar, clock: FakeClock) -> None:
    sizes = (PAGE * 3, 100)  # packs to 4 pages
    with make_client(fake, clock, staging_bytes=10 * PAGE) as c:  # room for 2 chunks
        data = {key(i): layers_of(i, sizes) for i in range(7)}
        assert c.save(NS, list(data.items())) == [True] * 7
        prepares = fake.of_type(p.PrepareStore)
        assert [len(r.chunks) for r in prepares] == [2, 2, 2, 1]
        assert all(sum(p.region_size(ch.layers) for ch in r.chunks) <= 10 * PAGE for r in prepares)
        assert fake.chunks == data


def test_load_continues_after_busy_until_all_loaded(fake: FakeSidecar, clock: FakeClock) -> None:
    sizes = (PAGE * 3, 100)
    with make_client(fake, clock, staging_bytes=10 * PAGE) as c:
        data = {key(i): layers_of(i, sizes) for i in range(7)}
        fake.chunks.update(data)
        got = c.load(list(data))
        assert [g.ok for g in got] == [True] * 7
        assert [[bytes(v) for v in g.layers] for g in got] == list(data.values())
        c.stats()  # a round trip: the fake has read every request sent before it
        loads = fake.of_type(p.PrepareLoad)
        assert [len(r.keys) for r in loads] == [7, 5, 3, 1]
        assert len(fake.of_type(p.CompleteLoad)) == 4


def test_requests_respect_the_servers_max_batch(clock: FakeClock) -> None:
    fake = FakeSidecar(max_batch=2)
    try:
        with make_client(fake, clock) as c:
            keys = [key(i) for i in range(5)]
            fake.chunks.update({k: [b"x"] for k in keys})
            assert c.lookup(keys) == 5
            assert [len(r.keys) for r in fake.of_type(p.Lookup)] == [2, 2, 1]
            assert (
                c.save(NS, [(key(9), [b"a"]), (key(10), [b"b"]), (key(11), [b"c"])]) == [True] * 3
            )
            assert [len(r.chunks) for r in fake.of_type(p.PrepareStore)] == [2, 1]
            c.touch(keys)
            assert [len(r.keys) for r in fake.of_type(p.Touch)] == [2, 2, 1]
    finally:
        fake.kill_connections()


def test_lookup_stops_at_a_short_batch(clock: FakeClock) -> None:
    fake = FakeSidecar(max_batch=2)
    try:
        with make_client(fake, clock) as c:
            fake.chunks.update({key(0): [b"x"], key(3): [b"x"]})
            assert c.lookup([key(0), key(1), key(2), key(3)]) == 1
            assert len(fake.of_type(p.Lookup)) == 1
    finally:
        fake.kill_connections()


def test_load_stops_at_first_miss(fake: FakeSidecar, clock: FakeClock) -> None:
    with make_client(fake, clock) as c:
        fake.chunks.update({key(i): layers_of(i) for i in (0, 1, 3)})
        got = c.load([key(0), key(1), key(2), key(3)])
        assert [g.ok for g in got] == [True, True, False, False]
        assert got[3] == LoadedChunk(key(3), False, [])


def test_chunk_larger_than_staging_is_rejected_before_sending(
    fake: FakeSidecar, clock: FakeClock
) -> None:
    with make_client(fake, clock, staging_bytes=2 * PAGE) as c:
        with pytest.raises(ChunkTooLarge):
            c.save(NS, [(key(0), [b"a"]), (key(1), [b"x" * PAGE, b"y" * (PAGE + 1)])])
        assert fake.of_type(p.PrepareStore) == []


def test_exists_and_rejected_statuses(fake: FakeSidecar, clock: FakeClock) -> None:
    with make_client(fake, clock) as c:
        fake.chunks[key(0)] = [b"old"]
        fake.reject_no_space.add(key(1))
        res = c.save(NS, [(key(0), [b"new"]), (key(1), [b"a"]), (key(2), [b"b"])])
        assert res == [True, False, True]
        assert fake.chunks[key(0)] == [b"old"]  # "exists" means nothing was rewritten
        assert key(1) not in fake.chunks


def test_only_existing_chunks_need_no_complete(fake: FakeSidecar, clock: FakeClock) -> None:
    with make_client(fake, clock) as c:
        fake.chunks[key(0)] = [b"old"]
        assert c.save(NS, [(key(0), [b"new"])]) == [True]
        assert fake.of_type(p.CompleteStore) == []


def test_forbidden_store_is_false_and_keeps_the_connection(
    fake: FakeSidecar, clock: FakeClock
) -> None:
    with make_client(fake, clock) as c:
        fake.forbid_store = True
        assert c.save(NS, [(key(0), [b"a"])]) == [False]
        assert c.connected
        assert c.lookup([key(0)]) == 0
        assert fake.connects == 1


def test_sidecar_down_gives_empty_answers_and_one_warning(
    fake: FakeSidecar, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    fake.down = True
    caplog.set_level(logging.WARNING, logger="kvoffload.client")
    with make_client(fake, clock) as c:
        for _ in range(3):
            assert c.salt is None
            assert c.lookup([key(0)]) == 0
            assert c.save(NS, [(key(0), [b"a"])]) == [False]
            assert [g.ok for g in c.load([key(0), key(1)])] == [False, False]
            assert c.stats() == {}
            c.touch([key(0)])
            clock.t += 5  # past the backoff, well within the log interval
        assert fake.connects == 3
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert "unavailable" in warnings[0].getMessage()


def test_backoff_limits_connect_attempts(fake: FakeSidecar, clock: FakeClock) -> None:
    fake.down = True
    with make_client(fake, clock, backoff_initial_s=1.0, backoff_max_s=4.0) as c:
        assert c.lookup([key(0)]) == 0
        assert fake.connects == 1
        clock.t += 0.4  # jitter keeps the wait within [0.5, 1.0] × backoff
        assert c.lookup([key(0)]) == 0
        assert fake.connects == 1
        clock.t += 0.7
        assert c.lookup([key(0)]) == 0
        assert fake.connects == 2
        clock.t += 0.9  # backoff doubled to 2 s: at least 1 s before the next try
        assert c.lookup([key(0)]) == 0
        assert fake.connects == 2
        fake.down = False
        clock.t += 10
        fake.chunks[key(0)] = [b"x"]
        assert c.lookup([key(0)]) == 1
        assert fake.connects == 3


def test_sidecar_restart_mid_session(fake: FakeSidecar, clock: FakeClock) -> None:
    with make_client(fake, clock) as c:
        assert c.save(NS, [(key(0), layers_of(0))]) == [True]
        fake.kill_connections()
        assert c.load([key(0)])[0].ok is False  # the dead connection, not an exception
        assert not c.connected
        clock.t += 60
        got = c.load([key(0)])
        assert got[0].ok
        assert [bytes(v) for v in got[0].layers] == layers_of(0)
        assert fake.connects == 2
        assert len(fake.of_type(p.RegisterStaging)) == 2  # staging re-registered


def test_hung_sidecar_times_out_into_misses(clock: FakeClock) -> None:
    fake = FakeSidecar(timeout_s=0.2)
    try:
        with make_client(fake, clock) as c:
            assert c.salt == SALT
            fake.hang = True
            assert c.lookup([key(0)]) == 0
            assert c.save(NS, [(key(0), [b"a"])]) == [False]
            assert not c.connected
    finally:
        fake.kill_connections()


def test_garbage_reply_drops_the_connection(fake: FakeSidecar, clock: FakeClock) -> None:
    with make_client(fake, clock) as c:
        fake.chunks[key(0)] = [b"x"]
        fake.garbage = True
        assert c.lookup([key(0)]) == 0
        assert not c.connected
        fake.garbage = False
        clock.t += 60
        assert c.lookup([key(0)]) == 1


def test_out_of_bounds_region_from_server_is_a_miss(fake: FakeSidecar, clock: FakeClock) -> None:
    with make_client(fake, clock) as c:
        fake.chunks[key(0)] = layers_of(0)
        fake.bad_offsets = True
        got = c.load([key(0)])
        assert got[0].ok is False
        assert not c.connected


def test_an_error_to_a_posted_complete_load_is_handled_on_the_next_call(
    fake: FakeSidecar, clock: FakeClock
) -> None:
    """complete_load is posted (its Ack read later): a BAD_HANDLE answer to it
    still drops the connection, on the next call, and the client starts over."""
    with make_client(fake, clock) as c:
        fake.chunks[key(0)] = layers_of(0)
        fake.bad_complete = True
        assert c.load([key(0)])[0].ok  # its bytes were verified and copied out
        assert c.connected
        assert c.lookup([key(0)]) == 0  # the error came first: a miss, never a wrong hit
        assert not c.connected
        fake.bad_complete = False
        clock.t += 60  # past the reconnect backoff
        assert c.lookup([key(0)]) == 1
        assert fake.connects == 2


def test_a_server_that_does_not_answer_complete_load_in_order_gets_it_as_a_call(
    fake: FakeSidecar, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ``complete_in_order`` in its hello (an older server, §5.29) the
    client waits for each complete_load's reply before its next request."""
    from kvoffload.client.session import Session

    fake.complete_in_order = False
    posted: list[str] = []
    real_post = Session.post

    def post(self_: Session, req: p.Request) -> None:
        posted.append(req.OP.value)
        real_post(self_, req)

    monkeypatch.setattr(Session, "post", post)
    with make_client(fake, clock) as c:
        fake.chunks[key(0)] = layers_of(0)
        assert c.load([key(0)])[0].ok
        assert len(fake.of_type(p.CompleteLoad)) == 1  # answered before load returned
        fake.complete_in_order = True
    assert posted == []


def test_version_refusal_is_unavailable_not_an_exception(
    fake: FakeSidecar, clock: FakeClock
) -> None:
    fake.refuse_version = True
    with make_client(fake, clock) as c:
        assert c.salt is None
        assert c.lookup([key(0)]) == 0


def test_close_says_bye_and_later_use_raises(fake: FakeSidecar, clock: FakeClock) -> None:
    c = make_client(fake, clock)
    assert c.stats() == {"chunks": 0}
    c.close()
    c.close()
    fake.join()
    assert isinstance(fake.requests[-1], p.Bye)
    with pytest.raises(RuntimeError):
        c.lookup([key(0)])


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.lookup([b"short"]),
        lambda c: c.save(b"ns", [(key(0), [b"a"])]),
        lambda c: c.save(NS, [(key(0), [b"a"]), (key(0), [b"b"])]),
        lambda c: c.save(NS, [(key(0), [])]),
        lambda c: c.save(NS, [(key(0), [b""])]),
        lambda c: c.save(NS, [(key(0), [np.zeros((4, 4))[:, ::2]])]),
        lambda c: c.save(NS, [(key(0), [object()])]),
    ],
)
def test_bad_arguments_raise_without_io(fake: FakeSidecar, clock: FakeClock, call: Any) -> None:
    with make_client(fake, clock) as c:
        with pytest.raises((ValueError, TypeError)):
            call(c)
        assert fake.connects == 0


def test_lazy_connect(fake: FakeSidecar, clock: FakeClock) -> None:
    with make_client(fake, clock) as c:
        assert fake.connects == 0
        assert not c.connected
        assert c.load([]) == []
        assert fake.connects == 0


def test_chunk_frames_hand_each_chunk_out_before_the_reply(
    fake: FakeSidecar, clock: FakeClock
) -> None:
    """To a server that announces chunk-wise loads (§5.30) the client asks for
    them and hands out each chunk as its frame arrives; to one that does not,
    it never sends the key."""
    for i in range(3):
        fake.chunks[key(i)] = layers_of(i)
    got: list[tuple[int, bytes]] = []

    def into(idx: int, _k: bytes, views: Sequence[memoryview]) -> None:
        got.append((idx, b"".join(bytes(v) for v in views)))

    with make_client(fake, clock) as c:
        assert all(r.ok for r in c.load([key(i) for i in range(3)], into=into))
    assert fake.of_type(p.PrepareLoad)[-1].chunkwise is False  # not announced
    fake.chunkwise = True
    got.clear()
    with make_client(fake, clock) as c:
        res = c.load([key(i) for i in range(3)], into=into)
        assert [r.ok for r in res] == [True] * 3
        plain = c.load([key(i) for i in range(3)])  # copies out, from frames too
        assert [b"".join(bytes(v) for v in r.layers or []) for r in plain] == [
            b"".join(layers_of(i)) for i in range(3)
        ]
        assert c.connected
    assert fake.of_type(p.PrepareLoad)[-1].chunkwise is True
    assert got == [(i, b"".join(layers_of(i))) for i in range(3)]


def test_a_reply_that_unsays_a_chunk_frame_drops_the_connection(
    fake: FakeSidecar, clock: FakeClock
) -> None:
    """A chunk reported in a frame is loaded (§5.30): a reply that then says it
    is not breaks the protocol; the client drops the connection, and what the
    frames handed out (verified bytes) stays handed out."""
    for i in range(3):
        fake.chunks[key(i)] = layers_of(i)
    fake.chunkwise = fake.unsay = True
    with make_client(fake, clock) as c:
        res = c.load([key(i) for i in range(3)])
        assert [r.ok for r in res] == [True, True, False]
        assert b"".join(bytes(v) for v in res[1].layers or []) == b"".join(layers_of(1))
        assert not c.connected
