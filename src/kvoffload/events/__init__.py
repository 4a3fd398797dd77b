"""KV events in vLLM's ZMQ wire format (docs/spec/events-v1.md).

:mod:`~kvoffload.events.wire` is the codec (no sockets); the publisher and the
consumer need pyzmq and are imported from their own modules.
"""

from __future__ import annotations

from .wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    UnknownEvent,
    decode_batch,
    encode_batch,
)

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "EventBatch",
    "UnknownEvent",
    "decode_batch",
    "encode_batch",
]
