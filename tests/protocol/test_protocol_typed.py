"""The typed messages of kvoffload.protocol: msgspec structs, and the rules msgspec alone misses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvoffload import protocol as p
from kvoffload.errors import ErrorCode as ErrorsErrorCode
from kvoffload.errors import ProtocolError as ErrorsProtocolError
from kvoffload.protocol import ErrorCode, ProtocolError, parse_reply, parse_request

K = bytes(range(32))
SALT = b"s" * 32


def _lookup(tenant: Any) -> dict[str, Any]:
    return {"op": "lookup", "id": 4, "tenant": tenant, "keys": [K]}


def _bad_request(msg: dict[str, Any]) -> ProtocolError:
    with pytest.raises(ProtocolError) as ei:
        parse_request(msg)
    assert ei.value.code is ErrorCode.BAD_REQUEST
    assert ei.value.request_id == msg["id"]
    return ei.value


@pytest.mark.parametrize("tenant", ["acme\n", "\nacme", "ac\nme", "acme ", "", "-a", "a" * 65])
def test_tenant_must_match_in_full(tenant: str) -> None:
    err = _bad_request(_lookup(tenant))
    assert "tenant" in err.message
    hello = p.request_message(1, p.Hello(1, 1, "w", ("acme",)))
    _bad_request({**hello, "tenants": [tenant]})
    reply = p.reply_message(1, p.HelloReply(1, "s", "t", {"acme": SALT}))
    with pytest.raises(ProtocolError):
        parse_reply({**reply, "salts": {tenant: SALT}})


@pytest.mark.parametrize("tenant", ["acme", "a", "beta.team", "A-9_x", "a" * 64])
def test_valid_tenants_pass(tenant: str) -> None:
    assert parse_request(_lookup(tenant)) == (4, p.Lookup(tenant, (K,)))


def test_u64_bound_is_checked_where_msgspec_cannot() -> None:
    assert parse_request({"op": "abort", "id": 2, "handle": 2**64 - 1}) == (2, p.Abort(2**64 - 1))
    _bad_request({"op": "abort", "id": 2, "handle": 2**64})
    _bad_request({"op": "complete_store", "id": 2, "handle": 2**70})
    reply = p.reply_message(3, p.PurgeReply(1))
    with pytest.raises(ProtocolError):
        parse_reply({**reply, "removed": 2**64})


def test_bin_str_bool_int_and_float_are_not_confused() -> None:
    _bad_request({**_lookup("acme"), "keys": ["A" * 44]})  # base64 of 32 bytes: still a str
    _bad_request({"op": "register_staging", "id": 2, "size": True})
    _bad_request({"op": "fsck", "id": 2, "repair": 0})
    store = p.request_message(5, p.PrepareStore("acme", K, (p.ChunkSpec(K, (1,)),)))
    for ttl in (float("inf"), float("nan"), -1.0, True, "1"):
        _bad_request({**store, "ttl_s": ttl})
    _, req = parse_request({**store, "ttl_s": 30})
    assert isinstance(req, p.PrepareStore) and req.ttl_s == 30.0 and type(req.ttl_s) is float


def test_optional_keys_absent_or_nil() -> None:
    msg = p.reply_message(1, p.HelloReply(1, "s", "t", {"acme": SALT}, direct={"acme": True}))
    del msg["direct"]  # a server older than the direct path
    _, hello = parse_reply(msg)
    assert isinstance(hello, p.HelloReply) and hello.direct == {}
    with pytest.raises(ProtocolError):
        parse_reply({**msg, "direct": None})
    assert parse_request({"op": "complete_load", "id": 3, "handle": 1, "corrupt": None}) == (
        3,
        p.CompleteLoad(1),
    )
    lease = p.LeaseStoreReply(0, 4096, (p.LeaseSlot(p.StoreStatus.EXISTS),), "batch")
    wire = p.reply_message(2, lease)
    assert parse_reply(wire) == (2, lease)
    for absent in (
        {k: v for k, v in wire.items() if k != "durability"},
        {**wire, "durability": None},
    ):
        _, back = parse_reply(absent)
        assert isinstance(back, p.LeaseStoreReply) and back.durability == ""


def test_wire_required_keys_with_python_defaults() -> None:
    hello = p.request_message(1, p.Hello())
    for key in ("min_version", "max_version", "client", "tenants"):
        err = _bad_request({k: v for k, v in hello.items() if k != key})
        assert repr(key) in err.message
    _bad_request({"op": "fsck", "id": 9})
    reply = p.reply_message(1, p.HelloReply(1, "s", "t", {}))
    with pytest.raises(ProtocolError, match="max_inflight"):
        parse_reply({k: v for k, v in reply.items() if k != "max_inflight"})


def test_unknown_keys_are_ignored_at_every_level() -> None:
    store = p.request_message(5, p.PrepareStore("acme", K, (p.ChunkSpec(K, (1,)),)))
    store["chunks"][0]["future"] = {"x": 1}
    store["future"] = [1]
    assert parse_request(store) == (5, p.PrepareStore("acme", K, (p.ChunkSpec(K, (1,)),)))
    slot = p.StoreSlot(p.StoreStatus.EXISTS)
    reply = p.reply_message(5, p.PrepareStoreReply(0, (slot,)))
    reply["chunks"][0]["offset"] = "ignored for exists"
    assert parse_reply(reply) == (5, p.PrepareStoreReply(0, (slot,)))


def test_unknown_codes_in_entries_read_as_internal() -> None:
    rejected = p.StoreSlot(p.StoreStatus.REJECTED, code=ErrorCode.NO_SPACE)
    reply = p.reply_message(5, p.PrepareStoreReply(0, (rejected,)))
    reply["chunks"][0]["code"] = 999
    _, back = parse_reply(reply)
    assert isinstance(back, p.PrepareStoreReply) and back.chunks[0].code is ErrorCode.INTERNAL


def test_messages_are_frozen_msgspec_structs() -> None:
    for name in p.__all__:
        obj = getattr(p, name)
        if isinstance(obj, type) and issubclass(obj, msgspec.Struct):
            assert obj.__struct_config__.frozen, name
    req = p.Lookup("acme", (K,))
    with pytest.raises(AttributeError):
        req.tenant = "beta"  # type: ignore[misc]
    assert p.LeaseStore("a", K, (p.ChunkSpec(K, (1,)),)) != p.PrepareStore(
        "a", K, (p.ChunkSpec(K, (1,)),)
    )


def test_errors_live_in_kvoffload_errors() -> None:
    assert p.ErrorCode is ErrorsErrorCode
    assert p.ProtocolError is ErrorsProtocolError


def test_no_module_of_the_package_is_over_600_lines() -> None:
    pkg = Path(p.__file__).parent
    for f in pkg.glob("*.py"):
        assert len(f.read_text().splitlines()) <= 600, f.name


def test_a_batch_of_keys_is_checked_whole_and_still_checks_every_number() -> None:
    """Tuples of keys skip the per-element walk (encode and the u64 check): every
    other tuple is still walked, and a key of the wrong type or size anywhere in
    a batch is refused."""
    keys = tuple(bytes([i]) * 32 for i in range(64))
    msg = p.request_message(9, p.Lookup("acme", keys))
    assert msg["keys"] == list(keys)
    assert parse_request(msg) == (9, p.Lookup("acme", keys))
    for bad in (b"\x00" * 31, "A" * 44, 7, None):
        _bad_request({**msg, "keys": [*keys[:40], bad, *keys[41:]]})
    # A tuple of numbers next to it is still bounded (layer sizes past u64).
    store = {
        "op": "prepare_store",
        "id": 5,
        "tenant": "acme",
        "namespace": K,
        "chunks": [{"key": K, "layers": [1, 2**64]}],
    }
    _bad_request(store)
