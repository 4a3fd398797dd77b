"""Golden frames: every request and reply of protocol v1, byte for byte.

``tests/data/frames/frames.json`` holds the exact frames (length prefix and
msgpack body, hex) that the encoder produced for :data:`CATALOGUE` when the
file was recorded (``scripts/record_frames.py``). The wire must never change
by accident: building each message in code must give those bytes, and
decoding each frame to a typed message and encoding it again must too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import pytest

from kvoffload import protocol as p
from kvoffload.protocol import (
    ErrorCode,
    FrameDecoder,
    close_fds,
    encode_frame,
    parse_reply,
    parse_request,
)
from tests.helpers.paths import DATA

FRAMES_FILE = DATA / "frames" / "frames.json"

K = [bytes([0x10 + i]) * 32 for i in range(4)]
NS = bytes(range(32))
SALT = bytes(range(32, 64))
CHECK = bytes(range(16))
MAX_ID = 2**32 - 1


def _req(rid: int, req: p.Request) -> Callable[[], dict[str, Any]]:
    return lambda: p.request_message(rid, req)


def _rep(rid: int, reply: p.Reply) -> Callable[[], dict[str, Any]]:
    return lambda: p.reply_message(rid, reply)


#: name → (kind, how to build the message). ``kind`` is "request" or "reply";
#: the fatal error frame is a reply with id 0.
CATALOGUE: dict[str, tuple[str, Callable[[], dict[str, Any]]]] = {
    # -- requests -------------------------------------------------------------
    "hello": ("request", _req(1, p.Hello(1, 1, "vllm-worker-0", ("acme", "beta.team")))),
    "hello_range": ("request", _req(1, p.Hello(1, 3, "w", ("a",)))),
    "hello_defaults": ("request", _req(1, p.Hello())),
    "register_staging": ("request", _req(2, p.RegisterStaging(64 << 20))),
    "register_staging_fds": (
        "request",
        lambda: dict(p.with_fds(p.request_message(2, p.RegisterStaging(4096)), 1)),
    ),
    "lookup": ("request", _req(3, p.Lookup("acme", (K[0], K[1], K[2])))),
    "lookup_max_id": ("request", _req(MAX_ID, p.Lookup("a", (K[3],)))),
    "prepare_store": (
        "request",
        _req(
            4,
            p.PrepareStore(
                "acme",
                NS,
                (p.ChunkSpec(K[0], (4096, 10, 2**40)), p.ChunkSpec(K[1], (1,))),
                ttl_s=3600.5,
            ),
        ),
    ),
    "prepare_store_no_ttl": (
        "request",
        _req(5, p.PrepareStore("beta.team", NS, (p.ChunkSpec(K[2], (65536,) * 3),))),
    ),
    "complete_store": ("request", _req(6, p.CompleteStore(7))),
    "complete_store_u64": ("request", _req(6, p.CompleteStore(2**64 - 1))),
    "abort": ("request", _req(7, p.Abort(300))),
    "prepare_load": ("request", _req(8, p.PrepareLoad("acme", (K[0], K[1])))),
    "prepare_load_layerwise": (
        "request",
        _req(8, p.PrepareLoad("acme", (K[0], K[1]), layerwise=True)),
    ),
    "complete_load": ("request", _req(9, p.CompleteLoad(9))),
    "complete_load_corrupt": ("request", _req(9, p.CompleteLoad(2**33, (0, 2, 1023)))),
    "touch": ("request", _req(10, p.Touch("acme", tuple(K)))),
    "stats": ("request", _req(11, p.Stats())),
    "purge": ("request", _req(12, p.Purge("acme"))),
    "purge_namespace": ("request", _req(12, p.Purge("acme", NS))),
    "fsck": ("request", _req(13, p.Fsck())),
    "fsck_repair": ("request", _req(13, p.Fsck(repair=True))),
    "fsck_verify_data": ("request", _req(13, p.Fsck(repair=False, verify_data=True))),
    "inspect": ("request", _req(16, p.Inspect())),
    "ls": ("request", _req(17, p.Ls())),
    "ls_filtered": ("request", _req(17, p.Ls("acme", NS, 3600.0, 60.5, 100, 200))),
    "purge_older": ("request", _req(18, p.PurgeOlder(86400.0))),
    "purge_older_tenant": ("request", _req(18, p.PurgeOlder(0.5, "acme"))),
    "drop_cache": ("request", _req(24, p.DropCache())),
    # revision 5 (gov-keys): §5.19, §5.20
    "prepare_store_contract": (
        "request",
        _req(
            5,
            p.PrepareStore(
                "acme",
                NS,
                (p.ChunkSpec(K[2], (4096,)),),
                contract={"model_revision": "m@r1", "rope_config": {"theta": 1e4}, "lora_id": None},
            ),
        ),
    ),
    "invalidate": ("request", _req(19, p.Invalidate(model_revision="m@r1"))),
    "invalidate_all_keys": (
        "request",
        _req(19, p.Invalidate("r2", "tok", "v3", "m", "acme", dry_run=True)),
    ),
    "namespaces": ("request", _req(20, p.Namespaces())),
    "namespaces_tenant": ("request", _req(20, p.Namespaces("acme"))),
    "namespaces_page": ("request", _req(20, p.Namespaces(None, 500))),
    "bye": ("request", _req(14, p.Bye())),
    "lease_store": (
        "request",
        _req(
            15,
            p.LeaseStore(
                "acme", NS, (p.ChunkSpec(K[0], (4096, 4096)), p.ChunkSpec(K[1], (7,))), 30.0
            ),
        ),
    ),
    "lease_store_no_ttl": (
        "request",
        _req(15, p.LeaseStore("acme", NS, (p.ChunkSpec(K[3], (1,)),))),
    ),
    "lease_load": ("request", _req(16, p.LeaseLoad("acme", (K[0], K[1], K[2])))),
    "sealed_load": ("request", _req(17, p.SealedLoad("acme", (K[0], K[1])))),
    "store": (
        "request",
        _req(
            19,
            p.StoreBatch(
                "acme",
                NS,
                (p.StoreChunk(K[0], (4096, 10), offset=0), p.StoreChunk(K[1], (1,), offset=8192)),
                ttl_s=60.0,
            ),
        ),
    ),
    # -- replies --------------------------------------------------------------
    "hello_reply": (
        "reply",
        _rep(1, p.HelloReply(1, "srv-1a2b", "store-0001", {"acme": SALT, "beta.team": NS})),
    ),
    "hello_reply_no_tenants": (
        "reply",
        _rep(
            1,
            p.HelloReply(
                1,
                "s",
                "t",
                {},
                alignment=8192,
                max_frame=4096,
                max_batch=16,
                max_inflight=2,
                max_staging=1 << 30,
                handle_ttl_s=5.0,
            ),
        ),
    ),
    "hello_reply_direct": (
        "reply",
        _rep(
            1,
            p.HelloReply(
                1,
                "srv",
                "store",
                {"acme": SALT, "beta.team": NS},
                handle_ttl_s=2.5,
                direct={"acme": True, "beta.team": False},
            ),
        ),
    ),
    "ack_register_staging": ("reply", _rep(2, p.Ack(p.Op.REGISTER_STAGING))),
    "ack_abort": ("reply", _rep(7, p.Ack(p.Op.ABORT))),
    "ack_complete_load": ("reply", _rep(9, p.Ack(p.Op.COMPLETE_LOAD))),
    "ack_touch": ("reply", _rep(10, p.Ack(p.Op.TOUCH))),
    "ack_bye": ("reply", _rep(MAX_ID, p.Ack(p.Op.BYE))),
    "lookup_reply": ("reply", _rep(3, p.LookupReply(2))),
    "lookup_reply_none": ("reply", _rep(3, p.LookupReply(0))),
    "prepare_store_reply": (
        "reply",
        _rep(
            4,
            p.PrepareStoreReply(
                2**40 + 1,
                (
                    p.StoreSlot(p.StoreStatus.WRITE, offset=0),
                    p.StoreSlot(p.StoreStatus.WRITE, offset=1 << 33),
                    p.StoreSlot(p.StoreStatus.EXISTS),
                    p.StoreSlot(p.StoreStatus.REJECTED, code=ErrorCode.NO_SPACE),
                    p.StoreSlot(p.StoreStatus.REJECTED, code=ErrorCode.BUSY),
                ),
            ),
        ),
    ),
    "prepare_store_reply_no_handle": (
        "reply",
        _rep(5, p.PrepareStoreReply(0, (p.StoreSlot(p.StoreStatus.EXISTS),))),
    ),
    "complete_store_reply": ("reply", _rep(6, p.CompleteStoreReply((True, False, True)))),
    "prepare_load_reply": (
        "reply",
        _rep(
            8,
            p.PrepareLoadReply(
                5,
                ErrorCode.OK,
                (p.LoadSlot(True, 0, (10, 20)), p.LoadSlot(True, 4096, (2**33,))),
            ),
        ),
    ),
    "prepare_load_reply_partial": (
        "reply",
        _rep(
            8,
            p.PrepareLoadReply(
                6,
                ErrorCode.BUSY,
                (p.LoadSlot(True, 8192, (1,)), p.LoadSlot(False), p.LoadSlot(False)),
            ),
        ),
    ),
    "prepare_load_reply_miss": (
        "reply",
        _rep(8, p.PrepareLoadReply(0, ErrorCode.NOT_FOUND, (p.LoadSlot(False),))),
    ),
    # revision 9 (§5.26): the interim frames of a layer-wise prepare_load
    "load_progress_plan": (
        "reply",
        _rep(
            8,
            p.LoadProgress(0, 2, (p.LoadSlot(True, 0, (10, 20)), p.LoadSlot(True, 4096, (30, 40)))),
        ),
    ),
    "load_progress": ("reply", _rep(8, p.LoadProgress(2, 1))),
    "stats_reply": (
        "reply",
        _rep(
            11,
            p.StatsReply(
                {
                    "chunks": 3,
                    "bytes": 2**50,
                    "ratio": 0.25,
                    "name": "n",
                    "none": None,
                    "tenants": {"acme": {"bytes": 1, "flags": [True, False, b"\x00"]}},
                }
            ),
        ),
    ),
    "purge_reply": ("reply", _rep(12, p.PurgeReply(12))),
    "inspect_reply": (
        "reply",
        _rep(16, p.InspectReply({"store_id": "s", "chunks": 2, "tenants": {"acme": {}}})),
    ),
    "ls_reply": (
        "reply",
        _rep(17, p.LsReply({"chunks": [{"tenant": "acme", "bytes": 5}], "more": False})),
    ),
    "purge_older_reply": ("reply", _rep(18, p.PurgeOlderReply(3))),
    "drop_cache_reply": ("reply", _rep(24, p.DropCacheReply(2, 64 << 20))),
    "invalidate_reply": (
        "reply",
        _rep(19, p.InvalidateReply({"dry_run": False, "removed_chunks": 6, "namespaces": []})),
    ),
    "namespaces_reply": (
        "reply",
        _rep(
            20,
            p.NamespacesReply(
                {"namespaces": [{"tenant": "acme", "contract": None}], "more": False}
            ),
        ),
    ),
    "store_reply": ("reply", _rep(19, p.StoreReply((True, False, True), (0, 7, 0)))),
    "hello_reply_store": (
        "reply",
        _rep(1, p.HelloReply(1, "srv", "store", {"acme": SALT}, store=True)),
    ),
    "fsck_reply": ("reply", _rep(13, p.FsckReply({"ok": True, "problems": [], "checked": 7}))),
    "lease_store_reply": (
        "reply",
        _rep(
            15,
            p.LeaseStoreReply(
                77,
                4096,
                (
                    p.LeaseSlot(
                        p.StoreStatus.WRITE,
                        path="/var/lib/kvoffload/tmp/lease-77-0",
                        size=12288,
                        data_offset=4096,
                        offsets=(4096, 8192),
                    ),
                    p.LeaseSlot(p.StoreStatus.EXISTS),
                    p.LeaseSlot(p.StoreStatus.REJECTED, code=ErrorCode.INTERNAL),
                ),
                durability="object",
            ),
        ),
    ),
    "lease_store_reply_no_durability": (
        "reply",
        _rep(
            15,
            p.LeaseStoreReply(
                0, 4096, (p.LeaseSlot(p.StoreStatus.REJECTED, code=ErrorCode.NO_SPACE),)
            ),
        ),
    ),
    "lease_load_reply": (
        "reply",
        _rep(
            16,
            p.LeaseLoadReply(
                78,
                ErrorCode.NOT_FOUND,
                (
                    p.ReadSlot(
                        True,
                        "/store/ab/cd/obj",
                        8192,
                        (p.LayerExtent(4096, 10, CHECK), p.LayerExtent(8192, 3000, CHECK[::-1])),
                    ),
                    p.ReadSlot(False),
                ),
            ),
        ),
    ),
    "lease_load_reply_all": (
        "reply",
        _rep(
            16,
            p.LeaseLoadReply(
                79,
                ErrorCode.OK,
                (p.ReadSlot(True, "/s/o", 4096, (p.LayerExtent(0, 1, CHECK),)),),
            ),
        ),
    ),
    "sealed_load_reply": (
        "reply",
        _rep(
            17,
            p.SealedLoadReply(
                80,
                ErrorCode.UNSUPPORTED,
                (
                    p.SealedSlot(True, 8192, SALT, NS),
                    p.SealedSlot(True, 4096, b"", NS),
                    p.SealedSlot(False),
                ),
            ),
        ),
    ),
    "hello_reply_sealed_load": (
        "reply",
        _rep(1, p.HelloReply(1, "srv", "store", {"acme": SALT}, sealed_load=True)),
    ),
    "error_reply": (
        "reply",
        _rep(4, p.ErrorReply("prepare_store", ErrorCode.FORBIDDEN, "tenant beta is not yours")),
    ),
    "error_reply_no_message": (
        "reply",
        _rep(6, p.ErrorReply("complete_store", ErrorCode.BAD_HANDLE)),
    ),
    "error_reply_versions": (
        "reply",
        _rep(1, p.ErrorReply("hello", ErrorCode.UNSUPPORTED_VERSION, "no common version", (1, 1))),
    ),
    "error_reply_unsupported": (
        "reply",
        _rep(9, p.ErrorReply("frobnicate", ErrorCode.UNSUPPORTED, "unknown op 'frobnicate'")),
    ),
    "error_frame": ("reply", lambda: p.error_message(ErrorCode.SHUTTING_DOWN, "draining")),
    "error_frame_unicode": ("reply", lambda: p.error_message(ErrorCode.INTERNAL, "défaut ✗")),
    # revision 15 (§5.32): lookup_load, and completes on the way
    "lookup_load": ("request", _req(21, p.LookupLoad("acme", (K[0], K[1])))),
    "lookup_load_complete": ("request", _req(21, p.LookupLoad("acme", (K[2],), (5, 2**40)))),
    "prepare_load_complete": ("request", _req(8, p.PrepareLoad("acme", (K[0],), complete=(7,)))),
    "lookup_load_reply": (
        "reply",
        _rep(
            21,
            p.LookupLoadReply(
                9, ErrorCode.NOT_FOUND, (p.LoadSlot(True, 0, (10, 20)), p.LoadSlot(False)), (), 1
            ),
        ),
    ),
    "lookup_load_reply_failed": (
        "reply",
        _rep(21, p.LookupLoadReply(0, ErrorCode.NOT_FOUND, (p.LoadSlot(False),), (5,), 0)),
    ),
    "prepare_load_reply_failed": (
        "reply",
        _rep(8, p.PrepareLoadReply(0, ErrorCode.NOT_FOUND, (p.LoadSlot(False),), (7, 8))),
    ),
    "hello_reply_lookup_load": (
        "reply",
        _rep(1, p.HelloReply(1, "srv", "store", {"acme": SALT}, lookup_load=True)),
    ),
    # revision 17 (§5.34): in-place transfers
    "hello_revision": ("request", _req(1, p.Hello(1, 1, "vllm", ("acme",), revision=17))),
    "hello_reply_max_region": (
        "reply",
        _rep(1, p.HelloReply(1, "srv", "store", {"acme": SALT}, max_region=1 << 40)),
    ),
    "register_region_fds": (
        "request",
        lambda: dict(p.with_fds(p.request_message(3, p.RegisterRegion(1 << 30)), 1)),
    ),
    "register_region_reply": ("reply", _rep(3, p.RegisterRegionReply(1))),
    "region_store": (
        "request",
        _req(
            22,
            p.RegionStore(
                "acme",
                NS,
                (
                    p.RegionChunk(K[0], (4096, 4096), region=1, offset=0),
                    p.RegionChunk(K[1], (8192,), region=1, offset=8192),
                ),
                30.0,
            ),
        ),
    ),
    "region_store_contract": (
        "request",
        _req(
            22,
            p.RegionStore(
                "acme", NS, (p.RegionChunk(K[2], (1,), region=2, offset=7),), None, {"a": 1}
            ),
        ),
    ),
    "region_store_reply": (
        "reply",
        _rep(22, p.RegionStoreReply((True, False), (0, int(ErrorCode.NO_SPACE)))),
    ),
    "region_load": (
        "request",
        _req(
            23,
            p.RegionLoad(
                "acme",
                (K[0], K[1]),
                (p.RegionDest(1, 0, (4096, 4096)), p.RegionDest(1, 1 << 33, (8192,))),
            ),
        ),
    ),
    "region_load_reply": (
        "reply",
        _rep(23, p.RegionLoadReply(1, int(ErrorCode.NOT_FOUND))),
    ),
    # -- revision 18: a tenant's delete (§5.35) --------------------------------
    "delete": ("request", _req(25, p.Delete("acme", (K[0], K[2])))),
    "delete_reply": ("reply", _rep(25, p.DeleteReply((True, False)))),
}


def encode_catalogue() -> dict[str, str]:
    """name → hex of the frame the current encoder gives."""
    return {name: encode_frame(build()).hex() for name, (_, build) in CATALOGUE.items()}


def _golden() -> dict[str, str]:
    frames: dict[str, str] = json.loads(FRAMES_FILE.read_text())["frames"]
    return frames


def test_every_catalogue_entry_has_a_golden_frame_and_back() -> None:
    assert set(_golden()) == set(CATALOGUE)


def test_every_op_is_covered() -> None:
    ops = {CATALOGUE[n][1]()["op"] for n in CATALOGUE}
    assert ops >= {op.value for op in p.Op}


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_building_in_code_gives_the_golden_bytes(name: str) -> None:
    _, build = CATALOGUE[name]
    assert encode_frame(build()).hex() == _golden()[name]


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_golden_frame_decodes_to_a_typed_message_that_encodes_the_same(name: str) -> None:
    kind, _ = CATALOGUE[name]
    data = bytes.fromhex(_golden()[name])
    r, w = os.pipe()
    os.close(w)
    dec = FrameDecoder()
    frames = dec.feed(data, [r])
    assert len(frames) == 1
    msg = frames[0].msg
    close_fds(frames[0].fds)
    dec.close()
    if kind == "request":
        rid, req = parse_request(msg)
        again = p.request_message(rid, req)
        if "fds" in msg:
            again = dict(p.with_fds(again, msg["fds"]))
    else:
        rid, reply = parse_reply(msg)
        again = p.reply_message(rid, reply)
    assert encode_frame(again) == data
