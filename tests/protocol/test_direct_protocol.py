"""The lease messages of protocol 1 (lease_store, lease_load, complete_load's corrupt list)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from kvoffload import protocol as p
from kvoffload.protocol import ErrorCode, ProtocolError, StoreStatus
from tests.direct_helpers import NS, TENANT

# --------------------------------------------------------------------- protocol

K = [bytes([i]) * 32 for i in range(4)]


def wire(msg: dict[str, Any]) -> dict[str, Any]:
    """Through real framing: encode_frame → (length, msgpack body) → decode_body."""
    frame = p.encode_frame(msg)
    (n,) = p._LENGTH.unpack_from(frame, 0)
    assert n == len(frame) - p.LENGTH_SIZE
    return p.decode_body(frame[p.LENGTH_SIZE :])


WRITE_SLOT = p.LeaseSlot(
    StoreStatus.WRITE,
    path="/srv/kvo/objects/acme/01/01/.tmp-0123456789abcdef-42",
    size=16384,
    data_offset=4096,
    offsets=(4096, 12288),
)
FOUND_SLOT = p.ReadSlot(
    True,
    "/srv/kvo/objects/acme/01/01/0101.kvo",
    12288,
    (p.LayerExtent(4096, 5000, b"c" * 16), p.LayerExtent(12288, 1, b"d" * 16)),
)

LEASE_REQUESTS: list[Any] = [
    p.LeaseStore(
        TENANT, NS, (p.ChunkSpec(K[0], (5000, 1)), p.ChunkSpec(K[1], (4096,))), ttl_s=60.0
    ),
    p.LeaseStore(TENANT, NS, (p.ChunkSpec(K[2], (7,)),)),
    p.LeaseLoad(TENANT, (K[0], K[1], K[2])),
    p.CompleteLoad(9, (0, 2)),
    p.CompleteLoad(9),
]

LEASE_REPLIES: list[Any] = [
    p.LeaseStoreReply(
        3,
        4096,
        (
            WRITE_SLOT,
            p.LeaseSlot(StoreStatus.EXISTS),
            p.LeaseSlot(StoreStatus.REJECTED, code=ErrorCode.NO_SPACE),
        ),
    ),
    p.LeaseStoreReply(0, 4096, (p.LeaseSlot(StoreStatus.EXISTS),)),
    p.LeaseLoadReply(5, ErrorCode.NOT_FOUND, (FOUND_SLOT, p.ReadSlot(False))),
    p.LeaseLoadReply(5, ErrorCode.OK, (FOUND_SLOT, FOUND_SLOT)),
    p.LeaseLoadReply(0, ErrorCode.NOT_FOUND, (p.ReadSlot(False), p.ReadSlot(False))),
    p.LeaseLoadReply(5, ErrorCode.BUSY, (FOUND_SLOT, p.ReadSlot(False))),
    p.HelloReply(1, "srv", "store", {TENANT: b"s" * 32}, direct={TENANT: True, "beta": False}),
    p.HelloReply(1, "srv", "store", {TENANT: b"s" * 32}),
]


@pytest.mark.parametrize("req", LEASE_REQUESTS, ids=lambda r: type(r).__name__)
def test_lease_request_roundtrip(req: Any) -> None:
    msg = wire(p.request_message(17, req))
    assert msg["op"] == req.OP.value
    rid, back = p.parse_request(msg)
    assert rid == 17 and back == req and type(back) is type(req)


def test_lease_requests_are_not_their_staging_twins() -> None:
    store = LEASE_REQUESTS[0]
    twin = p.PrepareStore(store.tenant, store.namespace, store.chunks, store.ttl_s)
    assert store != twin
    _, back = p.parse_request(wire(p.request_message(1, store)))
    assert isinstance(back, p.LeaseStore) and back.OP is p.Op.LEASE_STORE
    _, back = p.parse_request(wire(p.request_message(1, p.LeaseLoad(TENANT, (K[0],)))))
    assert isinstance(back, p.LeaseLoad) and back.OP is p.Op.LEASE_LOAD
    assert "corrupt" not in p.CompleteLoad(9).to_wire()


@pytest.mark.parametrize("reply", LEASE_REPLIES, ids=lambda r: type(r).__name__)
def test_lease_reply_roundtrip(reply: Any) -> None:
    rid, back = p.parse_reply(wire(p.reply_message(23, reply)))
    assert rid == 23 and back == reply and type(back) is type(reply)


def test_hello_reply_without_direct_reads_as_an_empty_map() -> None:
    msg = p.reply_message(1, p.HelloReply(1, "srv", "store", {TENANT: b"s" * 32}))
    del msg["direct"]  # an older sidecar
    _, back = p.parse_reply(wire(msg))
    assert isinstance(back, p.HelloReply) and dict(back.direct) == {}
    msg = p.reply_message(
        1, p.HelloReply(1, "srv", "store", {TENANT: b"s" * 32}, direct={TENANT: True})
    )
    _, back = p.parse_reply(wire(msg))
    assert isinstance(back, p.HelloReply) and dict(back.direct) == {TENANT: True}
    for bad in ({"bad tenant!": True}, {TENANT: 1}, [TENANT]):
        with pytest.raises(ProtocolError):
            p.parse_reply({**msg, "direct": bad})


def _store_reply() -> dict[str, Any]:
    return p.reply_message(1, LEASE_REPLIES[0])


def _load_reply() -> dict[str, Any]:
    return p.reply_message(1, LEASE_REPLIES[2])


def _with_write(**fields: Any) -> dict[str, Any]:
    msg = _store_reply()
    msg["chunks"] = [{**msg["chunks"][0], **fields}, *msg["chunks"][1:]]
    return msg


def _with_found(**fields: Any) -> dict[str, Any]:
    msg = _load_reply()
    msg["chunks"] = [{**msg["chunks"][0], **fields}, *msg["chunks"][1:]]
    return msg


def _with_extent(i: int, value: Any) -> dict[str, Any]:
    ext = list(_load_reply()["chunks"][0]["layers"][0])
    ext[i] = value
    return _with_found(layers=[ext])


MALFORMED_REPLIES: dict[str, Callable[[], dict[str, Any]]] = {
    "store-relative-path": lambda: _with_write(path="objects/acme/x"),
    "store-nul-in-path": lambda: _with_write(path="/srv/a\0b"),
    "store-path-not-a-string": lambda: _with_write(path=b"/srv/x"),
    "store-unaligned-offset": lambda: _with_write(offsets=[4096, 12289]),
    "store-no-offsets": lambda: _with_write(offsets=[]),
    "store-unaligned-size": lambda: _with_write(size=16385),
    "store-unaligned-data-offset": lambda: _with_write(data_offset=100),
    "store-missing-path": lambda: {
        **_store_reply(),
        "chunks": [{k: v for k, v in _store_reply()["chunks"][0].items() if k != "path"}],
    },
    "store-handle-0-with-write": lambda: {**_store_reply(), "handle": 0},
    "store-handle-without-write": lambda: {
        **_store_reply(),
        "chunks": [{"status": "exists"}],
    },
    "store-unknown-status": lambda: _with_write(status="maybe"),
    "store-alignment-too-small": lambda: {**_store_reply(), "alignment": 512},
    "load-relative-path": lambda: _with_found(path="relative.kvo"),
    "load-unaligned-size": lambda: _with_found(size=12289),
    "load-unaligned-offset": lambda: _with_extent(0, 4097),
    "load-short-check": lambda: _with_extent(2, b"c" * 15),
    "load-long-check": lambda: _with_extent(2, b"c" * 17),
    "load-check-not-bin": lambda: _with_extent(2, "c" * 16),
    "load-extent-of-two": lambda: _with_found(layers=[[4096, 10]]),
    "load-no-layers": lambda: _with_found(layers=[]),
    "load-found-after-miss": lambda: {
        **_load_reply(),
        "chunks": list(reversed(_load_reply()["chunks"])),
    },
    "load-stop-ok-with-a-miss": lambda: {**_load_reply(), "stop": 0},
    "load-stop-miss-all-found": lambda: {
        **_load_reply(),
        "chunks": [_load_reply()["chunks"][0]] * 2,
    },
    "load-handle-0-with-found": lambda: {**_load_reply(), "handle": 0},
    "load-handle-without-found": lambda: {
        **_load_reply(),
        "chunks": [{"found": False}],
    },
}


@pytest.mark.parametrize("name", list(MALFORMED_REPLIES), ids=list(MALFORMED_REPLIES))
def test_malformed_lease_replies_are_protocol_errors(name: str) -> None:
    msg = MALFORMED_REPLIES[name]()
    body = msgpack.packb(msg, use_bin_type=True)
    with pytest.raises(ProtocolError) as ei:
        p.parse_reply(p.decode_body(body))
    assert ei.value.code is ErrorCode.BAD_REQUEST


def test_the_malformed_replies_start_from_good_ones() -> None:
    # So each malformed case fails for its one change, not for its base.
    for base in (_store_reply(), _load_reply()):
        p.parse_reply(wire(base))


@pytest.mark.parametrize(
    "corrupt", [[1, 1], [-1], [p.MAX_BATCH], ["0"], 3, [True]], ids=lambda c: repr(c)
)
def test_complete_load_refuses_bad_corrupt_lists(corrupt: Any) -> None:
    msg = {**p.request_message(4, p.CompleteLoad(9, (1,))), "corrupt": corrupt}
    with pytest.raises(ProtocolError, match="corrupt"):
        p.parse_request(msg)


def test_complete_load_corrupt_bounds() -> None:
    msg = {**p.request_message(4, p.CompleteLoad(9)), "corrupt": [0, p.MAX_BATCH - 1]}
    assert p.parse_request(msg) == (4, p.CompleteLoad(9, (0, p.MAX_BATCH - 1)))
    assert p.parse_request({**msg, "corrupt": []}) == (4, p.CompleteLoad(9))
