"""The lookup's round trip without generic work (issue 12): every field still checked.

A lookup request and its OK reply are read without the generic decoder, the
reply is built and packed without the generic encoder, and the Unix transport
sends and receives without a Python-level poll (the kernel keeps the timeout).
Each shortcut must accept exactly what the generic path accepts, as the same
message, and leave everything else to the generic path, which names the fault.
"""

from __future__ import annotations

import signal
import socket
import struct
import threading
from typing import Any

import msgpack
import pytest

from kvoffload import protocol as p
from kvoffload.protocol import (
    CLIENT_MAGIC,
    MAX_BATCH,
    SERVER_MAGIC,
    ErrorCode,
    FrameDecoder,
    ProtocolError,
    encode_frame,
    parse_reply,
    parse_request,
)
from kvoffload.protocol import fields as fields_mod
from kvoffload.protocol import requests as requests_mod
from kvoffload.transport import TransportClosed, TransportTimeout, UnixTransport

KEYS = [bytes([i]) * 32 for i in range(64)]


def _lookup(**over: Any) -> dict[str, Any]:
    return {"op": "lookup", "id": 9, "tenant": "acme", "keys": list(KEYS), **over}


def _generic_decode(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record each call of the generic decoder (requests and replies)."""
    calls: list[str] = []
    real = fields_mod.decode

    def spy(cls: Any, m: Any, where: str) -> Any:
        calls.append(where)
        return real(cls, m, where)

    monkeypatch.setattr(requests_mod, "decode", spy)
    monkeypatch.setattr(fields_mod, "decode", spy)
    return calls


# -- the request ------------------------------------------------------------------


def test_a_valid_lookup_is_read_without_the_generic_decoder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _generic_decode(monkeypatch)
    assert parse_request(_lookup()) == (9, p.Lookup("acme", tuple(KEYS)))
    assert parse_request(_lookup(keys=KEYS[:1], extra={"x": 1})) == (
        9,
        p.Lookup("acme", (KEYS[0],)),
    )
    assert calls == []
    # Anything else still goes the generic way (and is refused there).
    with pytest.raises(ProtocolError):
        parse_request(_lookup(tenant="a\n"))
    assert calls == ["lookup"]


def test_the_lookup_shortcut_has_nothing_to_skip() -> None:
    """The shortcut is msgspec's conversion alone: right only while a lookup has
    no number, no cross-field rule and no wire-required or nullable key."""
    assert p.Lookup.__struct_fields__ == ("tenant", "keys")
    assert p.Lookup.WIRE_REQUIRED == () and p.Lookup.WIRE_NULLABLE == ()
    assert p.Lookup.validate_wire is fields_mod.Message.validate_wire


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"tenant": "acme\n"}, "tenant"),
        ({"tenant": ""}, "tenant"),
        ({"tenant": "a" * 65}, "tenant"),
        ({"tenant": 7}, "tenant"),
        ({"tenant": b"acme"}, "tenant"),
        ({"keys": []}, "keys"),
        ({"keys": [KEYS[0]] * (MAX_BATCH + 1)}, "keys"),
        ({"keys": [*KEYS[:10], b"\x00" * 31, *KEYS[11:]]}, "keys"),
        ({"keys": [*KEYS[:10], b"\x00" * 33]}, "keys"),
        ({"keys": [*KEYS[:63], "A" * 44]}, "keys"),
        ({"keys": [None]}, "keys"),
        ({"keys": KEYS[0]}, "keys"),
        ({"keys": {"a": KEYS[0]}}, "keys"),
    ],
)
def test_a_bad_lookup_is_refused_naming_its_field(over: dict[str, Any], field: str) -> None:
    with pytest.raises(ProtocolError) as ei:
        parse_request(_lookup(**over))
    assert ei.value.code is ErrorCode.BAD_REQUEST
    assert ei.value.request_id == 9
    assert field in ei.value.message


@pytest.mark.parametrize("missing", ["tenant", "keys"])
def test_a_lookup_without_a_field_is_refused(missing: str) -> None:
    msg = _lookup()
    del msg[missing]
    with pytest.raises(ProtocolError) as ei:
        parse_request(msg)
    assert ei.value.request_id == 9 and missing in ei.value.message


@pytest.mark.parametrize("rid", [0, -1, 2**32, True, 1.0, "9", None])
def test_a_lookup_with_a_bad_id_is_fatal(rid: Any) -> None:
    with pytest.raises(ProtocolError) as ei:
        parse_request(_lookup(id=rid))
    assert ei.value.request_id is None and ei.value.fatal


# -- the reply ----------------------------------------------------------------------


def test_an_ok_lookup_reply_is_read_without_the_generic_decoder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _generic_decode(monkeypatch)
    for found in (0, 1, 64, MAX_BATCH):
        assert parse_reply(p.reply_message(7, p.LookupReply(found))) == (
            7,
            p.LookupReply(found),
        )
    assert calls == []


@pytest.mark.parametrize(
    "over",
    [
        {"found": -1},
        {"found": MAX_BATCH + 1},
        {"found": True},
        {"found": 3.0},
        {"found": "3"},
        {"found": None},
        {"id": 0},  # an error frame cannot say OK
        {"id": 2**32},
        {"id": False},
        {"code": True},
        {"code": -1},
        {"code": 0.0},
    ],
)
def test_a_bad_lookup_reply_is_fatal(over: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError) as ei:
        parse_reply({**p.reply_message(7, p.LookupReply(3)), **over})
    assert ei.value.code is ErrorCode.BAD_REQUEST


@pytest.mark.parametrize("missing", ["found", "code", "id"])
def test_a_lookup_reply_without_a_field_is_fatal(missing: str) -> None:
    msg = p.reply_message(7, p.LookupReply(3))
    del msg[missing]
    with pytest.raises(ProtocolError):
        parse_reply(msg)


def test_an_error_reply_to_a_lookup_is_still_an_error_reply() -> None:
    msg = {"op": "lookup", "id": 7, "code": int(ErrorCode.FORBIDDEN), "message": "no"}
    assert parse_reply(msg) == (7, p.ErrorReply("lookup", ErrorCode.FORBIDDEN, "no"))


def test_a_lookup_reply_is_packed_as_the_generic_encoder_packs_it() -> None:
    reply = p.LookupReply(64)
    generic = {"op": "lookup", "id": 300, "code": 0, **fields_mod.Message.to_wire(reply)}
    assert p.reply_message(300, reply) == generic
    assert list(p.reply_message(300, reply)) == ["op", "id", "code", "found"]
    body = msgpack.packb(generic, use_bin_type=True)
    assert encode_frame(p.reply_message(300, reply)) == struct.pack("<I", len(body)) + body


def test_frames_are_packed_alike_from_many_threads() -> None:
    """One packer per thread: frames packed at once by several threads are each whole."""
    msgs = [p.request_message(i + 1, p.Lookup("acme", tuple(KEYS[: i + 1]))) for i in range(32)]
    want = [encode_frame(m) for m in msgs]
    bad: list[int] = []

    def run() -> None:
        for _ in range(200):
            for i, m in enumerate(msgs):
                if encode_frame(m) != want[i]:
                    bad.append(i)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []
    with pytest.raises(TypeError):
        encode_frame({"op": object()})
    assert encode_frame(msgs[0]) == want[0]  # a failed pack leaves nothing behind


# -- the decoder ------------------------------------------------------------------


def test_frames_are_decoded_from_the_callers_buffer_and_the_tail_kept() -> None:
    """A read's whole frames are decoded in place; the incomplete tail is copied,
    so the caller may reuse its receive buffer at once."""
    one = encode_frame(_lookup())
    two = encode_frame(_lookup(id=10))
    rbuf = bytearray(one + two[:5])
    dec = FrameDecoder()
    frames = dec.feed(memoryview(rbuf))
    assert [f.msg["id"] for f in frames] == [9] and dec.buffered == 5
    rbuf[:] = b"\xff" * len(rbuf)  # the next recv overwrites it
    assert [f.msg["id"] for f in dec.feed(two[5:])] == [10] and dec.buffered == 0


def test_a_bad_frame_after_a_good_one_in_a_buffered_read_is_deferred() -> None:
    good = encode_frame(_lookup())
    garbage = struct.pack("<I", 5) + b"\xc1" * 5
    dec = FrameDecoder()
    assert dec.feed(good[:3]) == []
    frames = dec.feed(good[3:] + garbage)
    assert [f.msg["id"] for f in frames] == [9]
    with pytest.raises(ProtocolError):
        dec.raise_if_failed()


# -- the transport ------------------------------------------------------------------


def _pair(timeout_s: float | None = 5.0) -> tuple[UnixTransport, UnixTransport]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    client = UnixTransport(
        a, send_magic=CLIENT_MAGIC, expect_magic=SERVER_MAGIC, timeout_s=timeout_s
    )
    return client, UnixTransport.accept(b, timeout_s=timeout_s)


def test_the_transport_has_no_python_timeout_and_still_times_out() -> None:
    """A socket with a Python timeout polls before every send and every receive:
    the transport's is blocking, sends without waiting, and keeps the timeout
    itself, per receive and as a deadline that signals do not extend."""
    client, server = _pair(timeout_s=0.25)
    assert client.socket.gettimeout() is None and server.socket.gettimeout() is None
    # The default timeout holds without a per-call one; the stream stays usable.
    with pytest.raises(TransportTimeout):
        server.recv()
    assert not server.closed
    with pytest.raises(TransportTimeout):
        server.recv(timeout_s=0.01)
    client.send(p.request_message(3, p.Lookup("acme", tuple(KEYS))))
    assert parse_request(server.recv(timeout_s=30).msg) == (3, p.Lookup("acme", tuple(KEYS)))
    assert client.socket.gettimeout() is None and server.socket.gettimeout() is None
    # A signal every 5 ms, for at most 10 s: each would restart a timeout
    # kept per system call, so the wait would never end.
    ticks: list[int] = []

    def tick(_sig: int, _frame: object) -> None:
        ticks.append(1)
        if len(ticks) > 2000:
            raise RuntimeError("the receive timeout never fired")

    old = signal.signal(signal.SIGALRM, tick)
    signal.setitimer(signal.ITIMER_REAL, 0.005, 0.005)
    try:
        with pytest.raises(TransportTimeout):
            server.recv(timeout_s=0.2)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert ticks  # the wait was interrupted, and resumed
    client.close()
    server.close()


def test_no_timeout_means_waiting_for_a_frame() -> None:
    client, server = _pair(timeout_s=None)
    threading.Timer(0.05, lambda: client.send(p.request_message(2, p.Stats()))).start()
    assert server.recv().msg["id"] == 2
    client.close()
    server.close()


def test_a_frame_larger_than_the_socket_buffer_goes_out_whole() -> None:
    client, server = _pair()
    blob = {"op": "stats", "id": 4, "blob": b"x" * 900_000}
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(server.recv(timeout_s=30).msg))
    reader.start()
    client.send(blob)
    reader.join()
    assert got == [blob]
    # Back to the blocking socket after the polling path.
    assert client.socket.gettimeout() is None
    client.send(p.request_message(5, p.Stats()))
    assert server.recv(timeout_s=30).msg["id"] == 5
    client.close()
    server.close()


def test_a_send_to_a_peer_that_never_reads_times_out_and_closes() -> None:
    client, server = _pair(timeout_s=0.2)
    with pytest.raises(TransportTimeout):
        for i in range(1, 1000):  # fills both socket buffers, then waits
            client.send({"op": "stats", "id": i, "blob": b"x" * 200_000})
    assert client.closed
    with pytest.raises(TransportClosed):
        client.send(p.request_message(1, p.Stats()))
    server.close()
