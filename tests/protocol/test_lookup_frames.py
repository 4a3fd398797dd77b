"""The lookup's frames without the generic codec (protocol/lookup_frames.py, issue 30).

``read_lookup`` must take exactly the lookups the generic path reads as
``Lookup``, as the same message, and leave every other body to it (which then
answers or names the fault); ``lookup_reply_frame`` must make the very bytes
the generic encoder makes, the golden frames included.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import msgpack
import pytest

from kvoffload import protocol as p
from kvoffload.protocol import MAX_BATCH, MAX_REQUEST_ID, lookup_reply_frame, read_lookup
from tests.helpers.paths import DATA

KEYS = [bytes([i]) * 32 for i in range(64)]
TENANTS = frozenset({"acme", "beta"})


def _body(msg: dict[str, Any]) -> bytes:
    return bytes(msgpack.packb(msg, use_bin_type=True))


def _lookup(**over: Any) -> dict[str, Any]:
    return {"op": "lookup", "id": 9, "tenant": "acme", "keys": KEYS[:3], **over}


def _generic(body: bytes) -> tuple[int, p.Request]:
    return p.parse_request(p.decode_body(body))


@pytest.mark.parametrize(
    "msg",
    [
        _lookup(),
        _lookup(id=1, keys=KEYS[:1]),
        _lookup(id=MAX_REQUEST_ID, tenant="beta", keys=KEYS),
        _lookup(keys=[KEYS[0]] * MAX_BATCH),
        _lookup(fds=0),
        {"keys": KEYS[:2], "tenant": "acme", "id": 4, "op": "lookup"},  # any key order
    ],
)
def test_a_lookup_is_read_as_the_generic_path_reads_it(msg: dict[str, Any]) -> None:
    body = _body(msg)
    rid, req = _generic(body)
    assert isinstance(req, p.Lookup)
    assert read_lookup(body, TENANTS) == (rid, req.tenant, req.keys)
    assert read_lookup(memoryview(body), TENANTS) == (rid, req.tenant, req.keys)


def _duplicate(key: str, first: Any, last: Any) -> bytes:
    """A map naming ``key`` twice (msgpack-python keeps the last)."""
    pk = msgpack.Packer(use_bin_type=True)
    rest = {k: v for k, v in _lookup().items() if k != key}
    out = b"\x85" + pk.pack(key) + pk.pack(first)
    for k, v in rest.items():
        out += pk.pack(k) + pk.pack(v)
    return out + pk.pack(key) + pk.pack(last)


@pytest.mark.parametrize(
    "body",
    [
        _body(_lookup(extra=1)),  # a key it does not know: the generic path decides
        _body(_lookup(fds=1)),  # declares a descriptor: the generic path refuses it
        _body(_lookup(fds=True)),
        _body(_lookup(tenant="gamma")),  # not named in hello
        _body(_lookup(tenant="acme\n")),
        _body(_lookup(op="touch")),
        _body(_lookup(id=0)),
        _body(_lookup(id=MAX_REQUEST_ID + 1)),
        _body(_lookup(id=True)),
        _body(_lookup(id=9.0)),
        _body(_lookup(keys=[])),
        _body(_lookup(keys=[KEYS[0]] * (MAX_BATCH + 1))),
        _body(_lookup(keys=[b"\x00" * 31])),
        _body(_lookup(keys=["A" * 32])),
        _body({"op": "lookup", "id": 9, "tenant": "acme"}),
        _body(_lookup()) + b"\x00",  # trailing bytes: fatal on the generic path
        _body([1, 2, 3]),
        b"\x84\xa2op\xa6lookup\xa2id\x09\xa6tenant\xa2\xff\xfe\xa4keys\x90",  # not UTF-8
        _duplicate("op", "lookup", "touch"),  # the generic path reads a touch
        b"",
        b"\xc1",
    ],
)
def test_anything_else_is_left_to_the_generic_path(body: bytes) -> None:
    assert read_lookup(body, TENANTS) is None


def test_a_repeated_key_is_read_as_msgpack_reads_it() -> None:
    body = _duplicate("tenant", "acme", "beta")
    assert msgpack.unpackb(body)["tenant"] == "beta"
    assert read_lookup(body, TENANTS) == (9, "beta", tuple(KEYS[:3]))


@pytest.mark.parametrize("rid", [1, 127, 128, 255, 256, 65535, 65536, MAX_REQUEST_ID])
@pytest.mark.parametrize("found", [0, 1, 127, 128, MAX_BATCH])
def test_the_reply_frame_is_the_generic_encoders(rid: int, found: int) -> None:
    want = p.encode_frame(p.reply_message(rid, p.LookupReply(found)))
    assert lookup_reply_frame(rid, found) == want
    (length,) = struct.unpack_from("<I", want)
    assert p.parse_reply(p.decode_body(want[4 : 4 + length])) == (rid, p.LookupReply(found))


@pytest.mark.parametrize(("name", "rid", "found"), [("lookup_reply", 3, 2),
                                                    ("lookup_reply_none", 3, 0)])  # fmt: skip
def test_the_reply_frame_is_the_golden_frame(name: str, rid: int, found: int) -> None:
    frames = json.loads((DATA / "frames" / "frames.json").read_text())["frames"]
    assert lookup_reply_frame(rid, found).hex() == frames[name]
