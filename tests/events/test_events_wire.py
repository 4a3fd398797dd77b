"""kvoffload.events.wire: vLLM 0.33's KV-event encoding, both event forms, frames and seqs.

The byte-level comparison with vLLM's own msgspec classes is in the vLLM tier
(tests/vllm/test_events_vllm.py); here the format is checked against msgpack
read independently of msgspec.
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from kvoffload.errors import EventDecodeError, KVOffloadError
from kvoffload.events.wire import (
    END_SEQ,
    END_SEQ_BYTES,
    MAX_INCARNATION,
    MAX_SEQ_IN_INCARNATION,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Frame,
    UnknownEvent,
    decode_batch,
    decode_replay_request,
    encode_batch,
    encode_replay_request,
    is_end_marker,
    make_seq,
    pack_frames,
    split_seq,
    unpack_frames,
)

#: The batch vLLM v0.26 published in volcano-sh/kthena issue #1535 (GPU tier,
#: int hashes, map-tagged events), as its publisher packed it.
KTHENA_1535: list[Any] = [
    1789095808.84,
    [
        {
            "type": "BlockStored",
            "block_hashes": [15760518052499183552],
            "parent_block_hash": None,
            "token_ids": list(range(100, 116)),
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [None],
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
    ],
    0,
]


def _stored(**kw: Any) -> BlockStored:
    base: dict[str, Any] = {
        "block_hashes": (b"\x01" * 32, b"\x02" * 32),
        "parent_block_hash": b"\x00" * 32,
        "token_ids": (),
        "block_size": 16,
        "lora_id": None,
        "medium": "STORAGE",
        "lora_name": None,
    }
    base.update(kw)
    return BlockStored(**base)


def test_the_recorded_vllm_batch_decodes() -> None:
    batch = decode_batch(msgpack.packb(KTHENA_1535))
    assert batch.ts == 1789095808.84
    assert batch.data_parallel_rank == 0
    (ev,) = batch.events
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == (15760518052499183552,)
    assert ev.parent_block_hash is None
    assert ev.token_ids == tuple(range(100, 116))
    assert ev.medium == "GPU" and ev.group_idx == 0
    assert ev.kv_cache_spec_kind == "full_attention"
    assert ev.extra_keys == (None,)
    assert ev.locality is None


def test_the_encoding_is_vllm_0_33_maps_with_defaults_omitted() -> None:
    batch = EventBatch(
        2.5,
        (
            _stored(locality="LOCAL", extra_keys=(None, ("salt",))),
            BlockRemoved((7,), "STORAGE", locality="REMOTE"),
            AllBlocksCleared(),
        ),
        3,
    )
    raw = msgpack.unpackb(encode_batch(batch))
    assert raw[0] == 2.5 and raw[2] == 3
    stored, removed, cleared = raw[1]
    # The tag comes first; required fields are always present (None as nil);
    # defaulted fields only when set.
    assert list(stored) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "locality",
    ]
    assert stored["type"] == "BlockStored" and stored["extra_keys"] == [None, ["salt"]]
    assert removed == {
        "type": "BlockRemoved",
        "block_hashes": [7],
        "medium": "STORAGE",
        "locality": "REMOTE",
    }
    assert cleared == {"type": "AllBlocksCleared"}


def test_an_unset_rank_is_nil_and_short_or_long_batches_decode() -> None:
    raw = msgpack.unpackb(encode_batch(EventBatch(1.0, ())))
    assert raw == [1.0, [], None]  # what vLLM's msgspec writes for an unset rank
    assert decode_batch(msgpack.packb([1.0, []])) == EventBatch(1.0, (), None)
    # A trailing element of a newer engine is skipped, as vLLM's own decoder does.
    assert decode_batch(msgpack.packb([1.0, [], 2, "new"])) == EventBatch(1.0, (), 2)


@pytest.mark.parametrize("positional", [False, True])
def test_round_trip_in_both_forms(positional: bool) -> None:
    batch = EventBatch(
        9.0,
        (
            _stored(token_ids=(1, 2, 3), lora_name="ad", extra_keys=(("ad", ("mm", 4)), None)),
            _stored(block_hashes=(2**64 - 1,), parent_block_hash=None, session_id="s"),
            BlockRemoved((b"\x09" * 32,), None, group_idx=1),
            AllBlocksCleared(),
        ),
        0,
    )
    assert decode_batch(encode_batch(batch, positional=positional)) == batch


def test_positional_events_of_an_older_engine_decode() -> None:
    # vLLM 0.9's array_like events: [tag, hashes, parent, tokens, block_size, lora_id, medium].
    old = [1.0, [["BlockStored", [5, 6], 4, [1, 2], 16, None, "GPU"], ["BlockRemoved", [5]]], 0]
    with pytest.raises(EventDecodeError, match="BlockStored"):
        decode_batch(msgpack.packb(old))  # lora_name is required in 0.33: say so
    old[1][0].append(None)  # ...with lora_name (vLLM 0.10)
    old[1][1].append("GPU")
    batch = decode_batch(msgpack.packb(old))
    stored, removed = batch.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == (5, 6)
    assert stored.parent_block_hash == 4 and stored.medium == "GPU"
    assert removed == BlockRemoved((5,), "GPU")


def test_newer_fields_and_unknown_types_are_kept_apart() -> None:
    raw = [
        1.0,
        [
            {"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU", "future": 1},
            {"type": "BlockMoved", "block_hashes": [1]},
            ["BlockRemoved", [2], "CPU", None, None, None, "a-field-of-vllm-0.40"],
        ],
    ]
    batch = decode_batch(msgpack.packb(raw))
    assert batch.events == (
        BlockRemoved((1,), "CPU"),
        UnknownEvent("BlockMoved"),
        BlockRemoved((2,), "CPU"),
    )
    with pytest.raises(TypeError):
        encode_batch(batch)


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xc1", "not msgpack"),
        (msgpack.packb({"ts": 1}), r"\[ts, events, dp_rank\]"),
        (msgpack.packb([1.0]), r"\[ts, events, dp_rank\]"),
        (msgpack.packb(["x", []]), "ts"),
        (msgpack.packb([True, []]), "ts"),
        (msgpack.packb([1.0, {}]), "events"),
        (msgpack.packb([1.0, [], "0"]), "dp_rank"),
        (msgpack.packb([1.0, [7]]), "map or a tagged array"),
        (msgpack.packb([1.0, [[]]]), "map or a tagged array"),
        (msgpack.packb([1.0, [{"block_hashes": [1]}]]), "type tag"),
        (msgpack.packb([1.0, [{"type": "BlockRemoved", "medium": "GPU"}]]), "block_hashes"),
        (
            msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"], "medium": None}]]),
            "BlockRemoved",
        ),
        (msgpack.packb([1.0, [["BlockStored", [1], None, [1], "16", None, "GPU", None]]]), "int"),
    ],
)
def test_malformed_payloads_fail_with_one_clear_error(payload: bytes, reason: str) -> None:
    with pytest.raises(EventDecodeError, match=reason) as info:
        decode_batch(payload)
    assert isinstance(info.value, KVOffloadError) and isinstance(info.value, ValueError)
    assert "\n" not in str(info.value)


def test_frames_seq_and_end_marker() -> None:
    frames = pack_frames("kv@n1@m", 258, b"p")
    assert frames == [b"kv@n1@m", b"\x00" * 6 + b"\x01\x02", b"p"]
    assert unpack_frames(frames) == Frame(b"kv@n1@m", 258, b"p")
    assert unpack_frames([memoryview(b"t"), b"\x00" * 8, b""]).topic == b"t"
    end = unpack_frames([b"", END_SEQ_BYTES, b""])
    assert is_end_marker(end) and end.seq == END_SEQ == 2**64 - 1
    assert not is_end_marker(unpack_frames(frames))
    for bad in ([b"t", b"\x00" * 8], [b"t", b"\x00" * 7, b"p"], [b"t", b"\x00" * 8, b"p", b"x"]):
        with pytest.raises(EventDecodeError):
            unpack_frames(bad)
    with pytest.raises(ValueError):
        pack_frames(b"t", -1, b"")
    assert decode_replay_request(encode_replay_request(77)) == 77
    with pytest.raises(EventDecodeError):
        decode_replay_request(b"\x01")


def test_seqs_carry_the_incarnation_and_rise_across_restarts() -> None:
    assert split_seq(make_seq(5, 9)) == (5, 9)
    assert make_seq(1, 0) > make_seq(0, MAX_SEQ_IN_INCARNATION)
    top = make_seq(MAX_INCARNATION, MAX_SEQ_IN_INCARNATION)
    assert top < 2**63  # positive for a signed 64-bit reader (Go, Rust)
    assert split_seq(41) == (0, 41)  # a vLLM publisher's seqs are incarnation 0
    for bad in ((-1, 0), (MAX_INCARNATION + 1, 0), (0, MAX_SEQ_IN_INCARNATION + 1)):
        with pytest.raises(ValueError):
            make_seq(*bad)
