"""Protocol v1: framing, message validation and the handshake rules of protocol-v1.md."""

from __future__ import annotations

import contextlib
import copy
import os
import socket
import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload import protocol as p
from kvoffload.protocol import (
    CLIENT_MAGIC,
    MAX_FRAME,
    SERVER_MAGIC,
    ErrorCode,
    FrameDecoder,
    ProtocolError,
    encode_frame,
    parse_reply,
    parse_request,
)
from kvoffload.staging import PAGE, StagingBuffer
from kvoffload.transport import TransportClosed, TransportError, TransportTimeout, UnixTransport

K = [bytes([i]) * 32 for i in range(8)]
NS = b"\xaa" * 32

REQUESTS: list[p.Request] = [
    p.Hello(1, 3, "worker-0", ("acme", "beta.team")),
    p.RegisterStaging(1 << 20),
    p.Lookup("acme", (K[0], K[1])),
    p.PrepareStore(
        "acme", NS, (p.ChunkSpec(K[0], (4096, 10)), p.ChunkSpec(K[1], (1,))), ttl_s=3600.0
    ),
    p.PrepareStore("acme", NS, (p.ChunkSpec(K[2], (5,)),)),
    p.CompleteStore(7),
    p.Abort(7),
    p.PrepareLoad("acme", (K[0],)),
    p.CompleteLoad(9),
    p.Touch("acme", tuple(K)),
    p.Stats(),
    p.Purge("acme"),
    p.Purge("acme", NS),
    p.Fsck(repair=True),
    p.Bye(),
]

REPLIES: list[p.Reply] = [
    p.HelloReply(1, "srv-1", "store-1", {"acme": b"s" * 32}, handle_ttl_s=5.0, max_batch=16),
    p.Ack(p.Op.REGISTER_STAGING),
    p.Ack(p.Op.BYE),
    p.LookupReply(2),
    p.PrepareStoreReply(
        3,
        (
            p.StoreSlot(p.StoreStatus.WRITE, offset=8192),
            p.StoreSlot(p.StoreStatus.EXISTS),
            p.StoreSlot(p.StoreStatus.REJECTED, code=ErrorCode.NO_SPACE),
        ),
    ),
    p.PrepareStoreReply(0, (p.StoreSlot(p.StoreStatus.EXISTS),)),
    p.CompleteStoreReply((True, False)),
    p.PrepareLoadReply(
        4,
        ErrorCode.NOT_FOUND,
        (p.LoadSlot(True, 0, (10, 20)), p.LoadSlot(False), p.LoadSlot(False)),
    ),
    p.PrepareLoadReply(0, ErrorCode.NOT_FOUND, (p.LoadSlot(False),)),
    p.StatsReply({"chunks": 3, "tenants": {"acme": {"bytes": 1}}}),
    p.PurgeReply(12),
    p.FsckReply({"ok": True, "problems": []}),
    p.ErrorReply("prepare_store", ErrorCode.FORBIDDEN, "tenant beta is not yours"),
    p.ErrorReply("hello", ErrorCode.UNSUPPORTED_VERSION, "no common version", (2, 4)),
]


def roundtrip(msg: dict[str, Any]) -> dict[str, Any]:
    frames = FrameDecoder().feed(encode_frame(msg))
    assert len(frames) == 1
    return frames[0].msg


@pytest.mark.parametrize("req", REQUESTS, ids=lambda r: type(r).__name__)
def test_request_roundtrip(req: p.Request) -> None:
    rid, back = parse_request(roundtrip(p.request_message(41, req)))
    assert rid == 41
    assert back == req


@pytest.mark.parametrize("reply", REPLIES, ids=lambda r: type(r).__name__)
def test_reply_roundtrip(reply: p.Reply) -> None:
    rid, back = parse_reply(roundtrip(p.reply_message(41, reply)))
    assert rid == 41
    assert back == reply


def test_frame_layout_is_u32le_length_then_msgpack_map() -> None:
    data = encode_frame({"op": "bye", "id": 5})
    (n,) = struct.unpack_from("<I", data)
    assert n == len(data) - 4
    assert msgpack.unpackb(data[4:]) == {"op": "bye", "id": 5}


def test_decoder_handles_every_split_point_and_merged_frames() -> None:
    msgs = [p.request_message(i + 1, r) for i, r in enumerate(REQUESTS)]
    stream = CLIENT_MAGIC + b"".join(encode_frame(m) for m in msgs)
    for cut in range(len(stream) + 1):
        dec = FrameDecoder(expect_magic=CLIENT_MAGIC)
        got = dec.feed(stream[:cut]) + dec.feed(stream[cut:])
        assert [f.msg for f in got] == msgs
        assert dec.buffered == 0


def test_decoder_byte_by_byte() -> None:
    msgs = [p.request_message(i + 1, r) for i, r in enumerate(REQUESTS)]
    stream = b"".join(encode_frame(m) for m in msgs)
    dec = FrameDecoder()
    got = [f.msg for b in stream for f in dec.feed(bytes([b]))]
    assert got == msgs


def test_oversize_length_fails_before_the_body_arrives() -> None:
    dec = FrameDecoder()
    with pytest.raises(ProtocolError) as ei:
        dec.feed(struct.pack("<I", MAX_FRAME + 1))
    assert ei.value.code is ErrorCode.FRAME_TOO_LARGE
    assert ei.value.fatal
    # Poisoned: the stream is out of sync, later bytes are not parsed.
    with pytest.raises(ProtocolError):
        dec.feed(encode_frame({"op": "bye", "id": 1}))


def test_zero_length_frame_is_rejected() -> None:
    with pytest.raises(ProtocolError) as ei:
        FrameDecoder().feed(b"\0\0\0\0")
    assert ei.value.code is ErrorCode.BAD_REQUEST


def test_encode_refuses_oversize_body() -> None:
    with pytest.raises(ProtocolError) as ei:
        encode_frame({"blob": b"x" * MAX_FRAME})
    assert ei.value.code is ErrorCode.FRAME_TOO_LARGE


@pytest.mark.parametrize(
    "body",
    [
        msgpack.packb([1, 2]),  # not a map
        msgpack.packb({1: 2}),  # non-string key
        msgpack.packb({"a": 1}) + b"\x01",  # trailing data
        b"\xc1",  # never-used msgpack byte
        b"\xa2\xff\xfe",  # invalid UTF-8 str
        b"\xd4\x05\x00",  # extension type
    ],
)
def test_bad_bodies_are_fatal_bad_request(body: bytes) -> None:
    with pytest.raises(ProtocolError) as ei:
        FrameDecoder().feed(struct.pack("<I", len(body)) + body)
    assert ei.value.code is ErrorCode.BAD_REQUEST
    assert ei.value.fatal


def test_wrong_magic_is_bad_magic_even_when_split() -> None:
    dec = FrameDecoder(expect_magic=CLIENT_MAGIC)
    assert dec.feed(b"KVO") == []
    with pytest.raises(ProtocolError) as ei:
        dec.feed(b"FFSRV")  # a server's magic sent to a server
    assert ei.value.code is ErrorCode.BAD_MAGIC
    with pytest.raises(ProtocolError) as ei:
        FrameDecoder(expect_magic=CLIENT_MAGIC).feed(b"GET / HTTP/1.1\r\n")
    assert ei.value.code is ErrorCode.BAD_MAGIC
    with pytest.raises(ProtocolError) as ei:
        p.check_magic(b"KVOFFSRV", CLIENT_MAGIC)
    assert ei.value.code is ErrorCode.BAD_MAGIC


@given(st.binary(max_size=300))
@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
def test_random_bytes_give_frames_or_protocol_error(data: bytes) -> None:
    dec = FrameDecoder(max_frame=256)
    try:
        frames = dec.feed(data)
    except ProtocolError as exc:
        assert exc.fatal
        return
    for f in frames:
        assert isinstance(f.msg, dict)
        # Whatever a frame holds, parsing it must not raise anything else.
        for parse in (parse_request, parse_reply):
            with contextlib.suppress(ProtocolError):
                parse(f.msg)


msgpack_values = st.recursive(
    st.sampled_from([None, True, False, 0, -1, 1, 2**64 - 1, 1.5, "", "acme", b"", b"k" * 32])
    | st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=8)
    | st.binary(max_size=40),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=8,
)
field_names = st.sampled_from(
    [
        "min_version",
        "max_version",
        "client",
        "tenants",
        "size",
        "tenant",
        "keys",
        "namespace",
        "chunks",
        "ttl_s",
        "handle",
        "repair",
        "key",
        "layers",
        "version",
        "server_id",
        "store_id",
        "alignment",
        "max_frame",
        "max_batch",
        "max_inflight",
        "max_staging",
        "handle_ttl_s",
        "salts",
        "found",
        "status",
        "offset",
        "stored",
        "verified",
        "stop",
        "stats",
        "removed",
        "report",
        "message",
    ]
)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutations(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    """``base`` with a few values anywhere in it replaced, deleted or added."""
    msg = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = [q for q in _paths(msg) if q]
        if not paths:
            msg[draw(field_names)] = draw(msgpack_values)
            continue
        path = draw(st.sampled_from(paths))
        parent: Any = msg
        for step in path[:-1]:
            parent = parent[step]
        action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        if action == "delete":
            del parent[path[-1]]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(field_names)] = draw(msgpack_values)
        else:
            parent[path[-1]] = draw(msgpack_values)
    return msg


BASES = [p.request_message(3, r) for r in REQUESTS] + [p.reply_message(3, r) for r in REPLIES]


@pytest.mark.parametrize("base", BASES, ids=lambda m: f"{m['op']}-{len(m)}")
@given(data=st.data())
@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
def test_malformed_messages_raise_only_protocol_error(
    base: dict[str, Any], data: st.DataObject
) -> None:
    """Every malformed field is a ProtocolError, never KeyError/TypeError/ValueError."""
    try:
        decoded = roundtrip(data.draw(mutations(base)))
    except ProtocolError:
        return
    for parse in (parse_request, parse_reply):
        try:
            parse(decoded)
        except ProtocolError as exc:
            assert isinstance(exc.code, ErrorCode)


@pytest.mark.parametrize(
    ("msg", "code", "fatal"),
    [
        ({"op": "lookup"}, ErrorCode.BAD_REQUEST, True),  # no id: nothing to answer
        ({"op": "lookup", "id": True}, ErrorCode.BAD_REQUEST, True),
        ({"op": "lookup", "id": 0}, ErrorCode.BAD_REQUEST, True),  # id 0 is the server's
        ({"op": "lookup", "id": 2**32}, ErrorCode.BAD_REQUEST, True),
        ({"op": 3, "id": 4}, ErrorCode.BAD_REQUEST, False),
        ({"op": "frobnicate", "id": 4}, ErrorCode.UNSUPPORTED, False),
        ({"op": "lookup", "id": 4, "tenant": "acme"}, ErrorCode.BAD_REQUEST, False),
        ({"op": "lookup", "id": 4, "tenant": "acme", "keys": []}, ErrorCode.BAD_REQUEST, False),
        ({"op": "lookup", "id": 4, "tenant": "acme", "keys": [b"x"]}, ErrorCode.BAD_REQUEST, False),
        (
            {"op": "lookup", "id": 4, "tenant": "../etc", "keys": [K[0]]},
            ErrorCode.BAD_REQUEST,
            False,
        ),
        (
            {"op": "lookup", "id": 4, "tenant": "a", "keys": [K[0]] * 1025},
            ErrorCode.BAD_REQUEST,
            False,
        ),
        ({"op": "register_staging", "id": 4, "size": 4097}, ErrorCode.BAD_REQUEST, False),
        ({"op": "complete_store", "id": 4, "handle": 0}, ErrorCode.BAD_REQUEST, False),
        ({"op": "fsck", "id": 4, "repair": 1}, ErrorCode.BAD_REQUEST, False),
    ],
)
def test_request_validation(msg: dict[str, Any], code: ErrorCode, fatal: bool) -> None:
    with pytest.raises(ProtocolError) as ei:
        parse_request(msg)
    assert ei.value.code is code
    assert ei.value.fatal is fatal
    if not fatal:
        assert ei.value.request_id == 4


def test_prepare_store_rejects_duplicate_keys_and_empty_layers() -> None:
    base = p.request_message(1, p.PrepareStore("acme", NS, (p.ChunkSpec(K[0], (1,)),)))
    dup = {**base, "chunks": [{"key": K[0], "layers": [1]}, {"key": K[0], "layers": [2]}]}
    zero = {**base, "chunks": [{"key": K[0], "layers": [0]}]}
    none = {**base, "chunks": [{"key": K[0], "layers": []}]}
    for msg in (dup, zero, none):
        with pytest.raises(ProtocolError) as ei:
            parse_request(msg)
        assert ei.value.code is ErrorCode.BAD_REQUEST


def test_unknown_keys_are_ignored() -> None:
    msg = {**p.request_message(3, p.Lookup("acme", (K[0],))), "future_option": [1, 2]}
    assert parse_request(msg) == (3, p.Lookup("acme", (K[0],)))


def test_load_reply_must_be_a_verified_prefix_matching_stop_and_handle() -> None:
    good = p.PrepareLoadReply(
        5, ErrorCode.NOT_FOUND, (p.LoadSlot(True, 0, (1,)), p.LoadSlot(False))
    )
    msg = p.reply_message(1, good)
    holes = {**msg, "chunks": [{"verified": False}, {"verified": True, "offset": 0, "layers": [1]}]}
    wrong_stop = {**msg, "stop": 0}
    no_handle = {**msg, "handle": 0}
    unaligned = {**msg, "chunks": [{"verified": True, "offset": 100, "layers": [1]}]}
    for bad in (holes, wrong_stop, no_handle, unaligned):
        with pytest.raises(ProtocolError):
            parse_reply(bad)


def test_error_replies_and_unknown_codes() -> None:
    rid, r = parse_reply({"op": "lookup", "id": 3, "code": 999, "message": "new"})
    assert rid == 3
    assert isinstance(r, p.ErrorReply)
    assert r.code is ErrorCode.INTERNAL  # unknown codes read as INTERNAL
    rid, r = parse_reply(p.error_message(ErrorCode.SHUTTING_DOWN, "draining"))
    assert rid == 0
    assert isinstance(r, p.ErrorReply)
    assert r.code is ErrorCode.SHUTTING_DOWN
    assert r.message == "draining"


def test_version_negotiation() -> None:
    assert p.negotiate_version(1, 1) == 1
    assert p.negotiate_version(1, 5, 1, 3) == 3
    assert p.negotiate_version(2, 4, 1, 9) == 4
    with pytest.raises(ProtocolError) as ei:
        p.negotiate_version(2, 3, 1, 1)
    assert ei.value.code is ErrorCode.UNSUPPORTED_VERSION
    assert "2..3" in ei.value.message and "1..1" in ei.value.message


def test_hello_with_inverted_version_range_is_bad_request() -> None:
    msg = p.request_message(1, p.Hello(1, 1, "x", ()))
    msg["min_version"], msg["max_version"] = 3, 2
    with pytest.raises(ProtocolError) as ei:
        parse_request(msg)
    assert ei.value.code is ErrorCode.BAD_REQUEST


def test_error_code_values_are_frozen() -> None:
    # protocol-v1.md §4: these numbers are on the wire and must never change.
    assert {c.name: c.value for c in ErrorCode} == {
        "OK": 0,
        "BAD_REQUEST": 1,
        "UNSUPPORTED_VERSION": 2,
        "FRAME_TOO_LARGE": 3,
        "BAD_MAGIC": 4,
        "NOT_REGISTERED": 5,
        "FORBIDDEN": 6,
        "NO_SPACE": 7,
        "BUSY": 8,
        "TOO_LARGE": 9,
        "NOT_FOUND": 10,
        "BAD_HANDLE": 11,
        "INTERNAL": 12,
        "SHUTTING_DOWN": 13,
        "UNSUPPORTED": 14,
    }


def test_packing_is_back_to_back_in_aligned_regions() -> None:
    offsets, total = p.packed_layout([1, 4096, 4097, 10])
    assert offsets == [0, 1, 4097, 8194]
    assert total == 8204
    assert p.packed_layout([]) == ([], 0)
    assert p.region_size([1, 4096, 4097, 10]) == 12288
    assert p.region_size([4096]) == 4096
    assert p.region_size([10], alignment=1 << 16) == 1 << 16


def test_fake_salt_is_stable_per_secret_and_tenant() -> None:
    a = p.fake_salt(b"k" * 32, "acme")
    assert len(a) == 32
    assert a == p.fake_salt(b"k" * 32, "acme")
    assert a != p.fake_salt(b"k" * 32, "acme2")
    assert a != p.fake_salt(b"j" * 32, "acme")


def _pipe_fd() -> int:
    r, w = os.pipe()
    os.close(w)
    return r


def test_fds_go_to_the_frame_that_declares_them() -> None:
    f1 = encode_frame({"op": "stats", "id": 1})
    f2 = encode_frame({"op": "register_staging", "id": 2, "size": 4096, "fds": 1})
    f3 = encode_frame({"op": "stats", "id": 3})
    dec = FrameDecoder()
    fd = _pipe_fd()
    # As Linux may deliver it: bytes of f1 glued to the receive with f2's descriptor.
    got = dec.feed(f1[:3])
    got += dec.feed(f1[3:] + f2[:5], [fd])
    got += dec.feed(f2[5:] + f3)
    assert [(g.msg["id"], g.fds) for g in got] == [(1, []), (2, [fd]), (3, [])]
    assert dec.pending_fds == 0
    os.close(fd)


def test_frame_declaring_missing_fds_is_fatal() -> None:
    dec = FrameDecoder()
    with pytest.raises(ProtocolError) as ei:
        dec.feed(encode_frame({"op": "register_staging", "id": 2, "size": 4096, "fds": 1}))
    assert ei.value.code is ErrorCode.BAD_REQUEST
    with pytest.raises(ProtocolError):
        FrameDecoder().feed(encode_frame({"op": "stats", "id": 2, "fds": "one"}))


def test_undeclared_fds_beyond_the_limit_are_fatal_and_closed() -> None:
    dec = FrameDecoder()
    fds = [_pipe_fd() for _ in range(p.MAX_FDS + 1)]
    # The complete frame before the violation is still delivered; the error follows.
    frames = dec.feed(encode_frame({"op": "stats", "id": 1}), fds)
    assert [f.fds for f in frames] == [[]]
    with pytest.raises(ProtocolError):
        dec.raise_if_failed()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


def test_decoder_close_releases_unclaimed_fds() -> None:
    dec = FrameDecoder()
    fd = _pipe_fd()
    dec.feed(b"\x10\x00", [fd])  # a frame header that never completes
    assert dec.pending_fds == 1
    dec.close()
    with pytest.raises(OSError):
        os.fstat(fd)


# -- the real Unix-socket transport ---------------------------------------------


def _unix_pair(timeout_s: float = 5.0) -> tuple[UnixTransport, UnixTransport]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    client = UnixTransport(
        a, send_magic=CLIENT_MAGIC, expect_magic=SERVER_MAGIC, timeout_s=timeout_s
    )
    return client, UnixTransport.accept(b, timeout_s=timeout_s)


def test_unix_transport_frames_and_descriptor() -> None:
    client, server = _unix_pair()
    with StagingBuffer(PAGE) as buf:
        buf.view[:4] = b"kvo!"
        client.send(p.request_message(1, p.Stats()))
        client.send(p.request_message(2, p.RegisterStaging(PAGE)), fds=[buf.fd])
        client.send(p.request_message(3, p.Bye()))
        frames = [server.recv() for _ in range(3)]
        assert [f.msg["id"] for f in frames] == [1, 2, 3]
        assert [len(f.fds) for f in frames] == [0, 1, 0]
        assert frames[1].fds[0] != buf.fd  # a new descriptor in the receiver
        mapped = StagingBuffer.from_fd(frames[1].fds[0], PAGE)
        assert bytes(mapped.view[:4]) == b"kvo!"
        mapped.close()
    server.send(p.reply_message(3, p.Ack(p.Op.BYE)))
    assert parse_reply(client.recv().msg) == (3, p.Ack(p.Op.BYE))
    client.close()
    with pytest.raises(TransportClosed):
        server.recv()


def test_unix_transport_timeout_keeps_the_stream_usable() -> None:
    client, server = _unix_pair()
    data = encode_frame(p.request_message(7, p.Stats()))
    client.socket.sendall(data[:3])  # half a frame, then silence
    with pytest.raises(TransportTimeout):
        server.recv(timeout_s=0.05)
    client.socket.sendall(data[3:])
    assert server.recv().msg["id"] == 7
    client.close()
    server.close()


def test_unix_transport_wrong_magic_is_protocol_error() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    server = UnixTransport.accept(b)
    a.sendall(b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(ProtocolError) as ei:
        server.recv()
    assert ei.value.code is ErrorCode.BAD_MAGIC
    assert server.closed
    a.close()


def test_unix_connect_to_missing_socket_is_transport_error(tmp_path: Path) -> None:
    with pytest.raises(TransportError):
        UnixTransport.connect(tmp_path / "nope.sock", timeout_s=1)


def test_good_frame_before_garbage_is_delivered_then_error_raised() -> None:
    # One read holding a valid frame and then garbage: the valid frame must not
    # be lost (whether it was would depend on how the kernel split the reads).
    from kvoffload.protocol import FrameDecoder, ProtocolError, encode_frame

    good = encode_frame({"id": 1, "op": "bye"})
    dec = FrameDecoder()
    frames = dec.feed(good + b"\xff\xff\xff\x7f" + b"junk")
    assert [f.msg["op"] for f in frames] == ["bye"]
    with pytest.raises(ProtocolError):
        dec.raise_if_failed()
    with pytest.raises(ProtocolError):
        dec.feed(b"")
