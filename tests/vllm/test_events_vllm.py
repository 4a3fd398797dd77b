"""Our KV-event codec against vLLM 0.33's own classes (vllm.distributed.kv_events).

Byte for byte: a batch we encode is the batch vLLM's msgspec encoder writes for
the same events, vLLM's decoder reads ours, and ours reads vLLM's.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

import msgspec
from vllm.distributed import kv_events as vk

from kvoffload.events import wire


class _OldBase(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):  # type: ignore[call-arg]
    pass


class _OldRemoved(_OldBase, tag="BlockRemoved"):  # type: ignore[call-arg]
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class _OldBatch(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    """vLLM 0.9's batch of array-like events."""

    ts: float
    events: list[_OldRemoved]
    data_parallel_rank: int | None = None


def _pairs() -> list[tuple[Any, wire.Event]]:
    h = [bytes([i]) * 32 for i in range(3)]
    return [
        (
            vk.BlockStored(
                block_hashes=h[:2],
                parent_block_hash=None,
                token_ids=[],
                block_size=16,
                lora_id=None,
                medium=vk.MEDIUM_STORAGE,
                lora_name="adapter",
                extra_keys=[("adapter", "salt"), None],
                group_idx=0,
                kv_cache_spec_kind="full_attention",
                locality="REMOTE",
            ),
            wire.BlockStored(
                block_hashes=tuple(h[:2]),
                parent_block_hash=None,
                token_ids=(),
                block_size=16,
                lora_id=None,
                medium=wire.MEDIUM_STORAGE,
                lora_name="adapter",
                extra_keys=(("adapter", "salt"), None),
                group_idx=0,
                kv_cache_spec_kind="full_attention",
                locality="REMOTE",
            ),
        ),
        (
            vk.BlockStored(
                block_hashes=[2**64 - 1],
                parent_block_hash=12,
                token_ids=list(range(16)),
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                session_id="s1",
                lookahead_token_ids=[[1, 2]],
            ),
            wire.BlockStored(
                block_hashes=(2**64 - 1,),
                parent_block_hash=12,
                token_ids=tuple(range(16)),
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                session_id="s1",
                lookahead_token_ids=((1, 2),),
            ),
        ),
        (
            vk.BlockRemoved(block_hashes=[h[2]], medium="STORAGE", locality="LOCAL"),
            wire.BlockRemoved(block_hashes=(h[2],), medium="STORAGE", locality="LOCAL"),
        ),
        (vk.AllBlocksCleared(), wire.AllBlocksCleared()),
    ]


def test_the_classes_mirror_vllm_field_for_field_in_order() -> None:
    for theirs, ours in (
        (vk.BlockStored, wire.BlockStored),
        (vk.BlockRemoved, wire.BlockRemoved),
        (vk.AllBlocksCleared, wire.AllBlocksCleared),
    ):
        assert ours.__struct_fields__ == theirs.__struct_fields__
        assert len(ours.__struct_defaults__) == len(theirs.__struct_defaults__)
    assert wire.EventBatch.__struct_fields__ == vk.KVEventBatch.__struct_fields__
    assert wire.END_SEQ_BYTES == vk.ZmqEventPublisher.END_SEQ


@pytest.mark.parametrize("rank", [None, 0, 3])
def test_our_bytes_are_vllms_bytes_and_both_decoders_agree(rank: int | None) -> None:
    pairs = _pairs()
    theirs = vk.KVEventBatch(ts=123.25, events=[p[0] for p in pairs], data_parallel_rank=rank)
    ours = wire.EventBatch(123.25, tuple(p[1] for p in pairs), rank)
    vllm_bytes = msgspec.msgpack.Encoder().encode(theirs)
    assert wire.encode_batch(ours) == vllm_bytes
    assert wire.decode_batch(vllm_bytes) == ours
    back = msgspec.msgpack.Decoder(type=vk.KVEventBatch).decode(wire.encode_batch(ours))
    assert back == theirs


def test_the_positional_form_is_vllms_array_like_layout() -> None:
    """The pre-0.10 form: the same classes with ``array_like=True``."""
    old = msgspec.msgpack.encode(_OldBatch(1.0, [_OldRemoved([4, 5], "GPU")], 0))
    assert wire.decode_batch(old) == wire.EventBatch(1.0, (wire.BlockRemoved((4, 5), "GPU"),), 0)
    ours = wire.EventBatch(1.0, (wire.BlockRemoved((4, 5), "GPU", group_idx=2),), 0)
    assert msgspec.msgpack.decode(wire.encode_batch(ours, positional=True), type=_OldBatch).events[
        0
    ] == _OldRemoved([4, 5], "GPU", 2)
