"""The KV-event wire format of vLLM 0.33 (docs/spec/events-v1.md §2-§4).

A publisher sends one ZMQ multipart message per batch, three frames::

    [topic, seq (8 bytes, big-endian, unsigned), payload (msgpack)]

and the payload is the array ``[ts, events, dp_rank]`` (``dp_rank`` nil when
unset; a reader takes ``[ts, events]`` too, and skips trailing elements).
vLLM 0.33 encodes each event as a msgpack *map* whose first key ``type``
names the class (``msgspec`` ``tag=True``, fields equal to their default
omitted); vLLM before 0.10 encodes it as a *positional* array
``[type, field1, field2, ...]`` in declaration order. This module encodes
exactly as vLLM 0.33 does and decodes both.

The event classes mirror ``vllm.distributed.kv_events`` field for field and
in the same order (the positional form depends on it), with tuples instead of
lists so that events are hashable and immutable. The module imports neither
vLLM nor ZMQ: frames are ``bytes``, and the sockets live in
:mod:`kvoffload.events.publisher` and :mod:`kvoffload.events.consumer`.

Sequence numbers of a kvoffload publisher carry its incarnation in the high
bits (:func:`make_seq`), so they rise across restarts and a restart is told
from a gap by the number alone. A vLLM publisher restarts at 0: its numbers
are incarnation 0, and a falling number means that it restarted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import msgspec

from kvoffload.errors import EventDecodeError

__all__ = [
    "END_SEQ",
    "END_SEQ_BYTES",
    "INCARNATION_BITS",
    "LOCALITY_LOCAL",
    "LOCALITY_REMOTE",
    "MAX_INCARNATION",
    "MAX_SEQ_IN_INCARNATION",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "SNAPSHOT_REQUEST",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "EventBatch",
    "EventDecodeError",
    "Frame",
    "UnknownEvent",
    "decode_batch",
    "decode_event",
    "decode_replay_request",
    "encode_batch",
    "encode_replay_request",
    "is_end_marker",
    "make_seq",
    "pack_frames",
    "split_seq",
    "unpack_frames",
]

MEDIUM_GPU: Final = "GPU"
MEDIUM_CPU: Final = "CPU"
MEDIUM_STORAGE: Final = "STORAGE"
LOCALITY_LOCAL: Final = "LOCAL"
LOCALITY_REMOTE: Final = "REMOTE"

#: vLLM's ExternalBlockHash: the block hash as bytes, or as a 64-bit integer
#: under ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``.
BlockHash = bytes | int

_SEQ_LEN: Final = 8
#: The replay stream's end marker: seq -1 as a signed 8-byte integer.
END_SEQ_BYTES: Final = (-1).to_bytes(_SEQ_LEN, "big", signed=True)
END_SEQ: Final = int.from_bytes(END_SEQ_BYTES, "big")

#: The one frame that asks a kvoffload sidecar's ROUTER for a snapshot (events-v1 §6).
SNAPSHOT_REQUEST: Final = b"snapshot/1"

#: Bits of a kvoffload seq that hold the publisher's incarnation (the top
#: bits below the sign bit, so a signed 64-bit reader sees it positive too).
INCARNATION_BITS: Final = 23
_COUNTER_BITS: Final = 63 - INCARNATION_BITS
MAX_INCARNATION: Final = (1 << INCARNATION_BITS) - 1
MAX_SEQ_IN_INCARNATION: Final = (1 << _COUNTER_BITS) - 1


class BlockStored(msgspec.Struct, frozen=True, omit_defaults=True, tag=True, gc=False):
    """Blocks now held by ``medium``; vLLM 0.33's fields in its order."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None


class BlockRemoved(msgspec.Struct, frozen=True, omit_defaults=True, tag=True, gc=False):
    """Blocks no longer held by ``medium``."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True, omit_defaults=True, tag=True, gc=False):
    """Everything the publisher announced before is gone."""


@dataclass(frozen=True)
class UnknownEvent:
    """An event of a type this build does not know: kept, never applied.

    A consumer counts it; dropping the whole batch for it would turn one new
    event type into a gap.
    """

    type: str


Event = BlockStored | BlockRemoved | AllBlocksCleared
_KNOWN: Final[dict[str, type[Event]]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


class EventBatch(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    """One published message: ``[ts, events, dp_rank]``."""

    ts: float
    events: tuple[Event | UnknownEvent, ...]
    data_parallel_rank: int | None = None


class Frame(NamedTuple):
    """The three frames of one message, decoded only as far as the seq."""

    topic: bytes
    seq: int
    payload: bytes


_encoder = msgspec.msgpack.Encoder()


def _enc_hook(obj: Any) -> Any:
    raise TypeError(f"cannot encode {type(obj).__name__} in a KV-event batch")


def _positional(event: Event) -> list[Any]:
    """``[type, field1, ...]`` with trailing defaults dropped (vLLM before 0.10)."""
    cls = type(event)
    values = list(msgspec.structs.astuple(event))
    defaults = cls.__struct_defaults__
    n_required = len(values) - len(defaults)
    while len(values) > n_required and values[-1] == defaults[len(values) - 1 - n_required]:
        values.pop()
    return [cls.__name__, *values]


def encode_batch(batch: EventBatch, *, positional: bool = False) -> bytes:
    """The msgpack payload of ``batch``, byte for byte as vLLM 0.33 writes it.

    ``positional=True`` writes events as tagged arrays (the pre-0.10 form),
    for peers and tests that need it. An :class:`UnknownEvent` cannot be
    encoded (it carries no fields).
    """
    if any(isinstance(e, UnknownEvent) for e in batch.events):
        raise TypeError("an UnknownEvent cannot be encoded")
    if not positional:
        return _encoder.encode(batch)
    body: list[Any] = [batch.ts, [_positional(e) for e in batch.events]]  # type: ignore[arg-type]
    if batch.data_parallel_rank is not None:
        body.append(batch.data_parallel_rank)
    return _encoder.encode(body)


def _freeze(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def decode_event(raw: Any) -> Event | UnknownEvent:
    """One event from its decoded msgpack form: a tagged map or a positional array."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        fields = None
    else:
        raise EventDecodeError(f"an event is a map or a tagged array, not {type(raw).__name__}")
    if not isinstance(tag, str):
        raise EventDecodeError("an event has no type tag")
    cls = _KNOWN.get(tag)
    if cls is None:
        return UnknownEvent(tag)
    if fields is None:
        assert isinstance(raw, list)
        names = cls.__struct_fields__
        if len(raw) - 1 > len(names):
            # A newer engine appended fields: keep the ones this build knows.
            raw = raw[: len(names) + 1]
        fields = {"type": tag, **dict(zip(names, raw[1:], strict=False))}
    try:
        event = msgspec.convert(fields, type=cls, strict=True)
    except msgspec.ValidationError as exc:
        raise EventDecodeError(f"{tag}: {exc}") from exc
    if isinstance(event, BlockStored) and event.extra_keys is not None:
        event = msgspec.structs.replace(event, extra_keys=_freeze(event.extra_keys))
    return event


def decode_batch(payload: bytes) -> EventBatch:
    """A batch from its msgpack payload; :class:`EventDecodeError` if it breaks the format."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"the payload is not msgpack: {exc}") from exc
    if not isinstance(raw, list) or len(raw) < 2:
        raise EventDecodeError("a batch is the array [ts, events, dp_rank]")
    # Trailing elements a newer engine may add are skipped, as vLLM's decoder does.
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) >= 3 else None
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise EventDecodeError("a batch's ts is not a number")
    if not isinstance(events, list):
        raise EventDecodeError("a batch's events are not an array")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise EventDecodeError("a batch's dp_rank is not an integer")
    return EventBatch(float(ts), tuple(decode_event(e) for e in events), rank)


def pack_frames(topic: bytes | str, seq: int, payload: bytes) -> list[bytes]:
    """``[topic, seq, payload]`` as sent on the PUB socket and in a replay."""
    if not 0 <= seq < 1 << 64:
        raise ValueError(f"seq {seq} does not fit 8 unsigned bytes")
    t = topic.encode() if isinstance(topic, str) else topic
    return [t, seq.to_bytes(_SEQ_LEN, "big"), payload]


def unpack_frames(frames: Sequence[bytes]) -> Frame:
    """The three frames of a message; :class:`EventDecodeError` for any other shape."""
    if len(frames) != 3:
        raise EventDecodeError(f"a KV-event message has 3 frames, not {len(frames)}")
    topic, seq, payload = (bytes(f) for f in frames)
    if len(seq) != _SEQ_LEN:
        raise EventDecodeError(f"the seq frame has {len(seq)} bytes, not {_SEQ_LEN}")
    return Frame(topic, int.from_bytes(seq, "big"), payload)


def is_end_marker(frame: Frame) -> bool:
    """The replay stream's last message: empty topic, seq -1, empty payload."""
    return frame.seq == END_SEQ


def encode_replay_request(start_seq: int) -> bytes:
    """The one frame a subscriber sends to the ROUTER: the first seq it wants."""
    if not 0 <= start_seq < 1 << 64:
        raise ValueError(f"seq {start_seq} does not fit 8 unsigned bytes")
    return start_seq.to_bytes(_SEQ_LEN, "big")


def decode_replay_request(frame: bytes) -> int:
    if len(frame) != _SEQ_LEN:
        raise EventDecodeError(f"a replay request is {_SEQ_LEN} bytes, not {len(frame)}")
    return int.from_bytes(frame, "big")


def make_seq(incarnation: int, counter: int) -> int:
    """A kvoffload seq: the incarnation in the top bits, the batch counter below."""
    if not 0 <= incarnation <= MAX_INCARNATION:
        raise ValueError(f"incarnation {incarnation} is out of range")
    if not 0 <= counter <= MAX_SEQ_IN_INCARNATION:
        raise ValueError(f"counter {counter} is out of range")
    return (incarnation << _COUNTER_BITS) | counter


def split_seq(seq: int) -> tuple[int, int]:
    """``(incarnation, counter)`` of a seq; a vLLM publisher's seqs are incarnation 0."""
    return seq >> _COUNTER_BITS, seq & MAX_SEQ_IN_INCARNATION
