"""Wire protocol v1 between a worker and the sidecar: framing, messages, validation.

``docs/spec/protocol-v1.md`` is normative; this package implements it and holds
no I/O, so the client (``kvoffload.client``) and the server
(``kvoffload.sidecar.server``) share every byte-level rule.

Receiving side, in order::

    bytes ──▶ FrameDecoder.feed() ──▶ Frame(msg: dict, fds)          framing
          ──▶ parse_request(msg) / parse_reply(msg) ──▶ typed message  codec

The modules: :mod:`.limits` (constants, ``Op``, ``StoreStatus``),
:mod:`.framing` (magic, length prefix, msgpack bodies, descriptors),
:mod:`.fields` (the wire types as ``msgspec.Meta`` constraints, and the one
place a map becomes a typed message), :mod:`.requests` and :mod:`.replies`
(the messages, frozen ``msgspec.Struct`` classes, each naming its verb in
``OP``; the op → class tables ``REQUEST_TYPES`` and ``REPLY_TYPES`` are made
from the unions ``Request`` and ``ResultReply`` by ``fields.op_table``), :mod:`.codec`
(envelopes), :mod:`.packing` (staging layout, fake salt). The bytes are packed by the
``msgpack`` library exactly as before the messages were typed;
``tests/data/frames`` holds golden frames that prove it.

Anything malformed raises :class:`ProtocolError` with an :class:`ErrorCode`
(both from :mod:`kvoffload.errors`); no ``KeyError``/``TypeError``/
``UnicodeDecodeError`` escapes from peer input. A ``ProtocolError`` with a
``request_id`` concerns one request (the stream is still in sync); one
without is fatal for the connection.
"""

from __future__ import annotations

from kvoffload.errors import ErrorCode, ProtocolError

from .codec import (
    ACK_OPS,
    error_message,
    parse_reply,
    parse_request,
    reply_message,
    request_message,
)
from .fields import TENANT_PATTERN
from .framing import (
    _LENGTH as _LENGTH,
)
from .framing import (
    LENGTH_SIZE,
    Frame,
    FrameDecoder,
    check_magic,
    close_fds,
    decode_body,
    encode_frame,
    negotiate_version,
    with_fds,
)
from .limits import (
    ALIGNMENT,
    CLIENT_MAGIC,
    KEY_SIZE,
    MAGIC_SIZE,
    MAX_BATCH,
    MAX_CLIENT_NAME,
    MAX_FDS,
    MAX_FRAME,
    MAX_LAYERS,
    MAX_MESSAGE,
    MAX_PATH,
    MAX_PROTOCOL_VERSION,
    MAX_REQUEST_ID,
    MAX_TENANTS,
    MAX_U64,
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    SALT_SIZE,
    SERVER_MAGIC,
    Op,
    StoreStatus,
)
from .packing import align_up, fake_salt, packed_layout, region_size
from .replies import (
    REPLY_TYPES,
    Ack,
    CompleteStoreReply,
    DropCacheReply,
    ErrorReply,
    FsckReply,
    HelloReply,
    InspectReply,
    InvalidateReply,
    LayerExtent,
    LeaseLoadReply,
    LeaseSlot,
    LeaseStoreReply,
    LoadPlan,
    LoadProgress,
    LoadSlot,
    LookupReply,
    LsReply,
    NamespacesReply,
    PrepareLoadReply,
    PrepareStoreReply,
    PurgeOlderReply,
    PurgeReply,
    ReadSlot,
    Reply,
    ResultReply,
    StatsReply,
    StoreReply,
    StoreSlot,
)
from .requests import (
    REQUEST_TYPES,
    Abort,
    Bye,
    ChunkSpec,
    CompleteLoad,
    CompleteStore,
    DropCache,
    EngineBlocks,
    Fsck,
    Hello,
    Inspect,
    Invalidate,
    LeaseLoad,
    LeaseStore,
    Lookup,
    Ls,
    Namespaces,
    PrepareLoad,
    PrepareStore,
    Purge,
    PurgeOlder,
    RegisterStaging,
    Request,
    Stats,
    StoreBatch,
    StoreChunk,
    Touch,
)

__all__ = [
    "ACK_OPS",
    "ALIGNMENT",
    "CLIENT_MAGIC",
    "KEY_SIZE",
    "LENGTH_SIZE",
    "MAGIC_SIZE",
    "MAX_BATCH",
    "MAX_CLIENT_NAME",
    "MAX_FDS",
    "MAX_FRAME",
    "MAX_LAYERS",
    "MAX_MESSAGE",
    "MAX_PATH",
    "MAX_PROTOCOL_VERSION",
    "MAX_REQUEST_ID",
    "MAX_TENANTS",
    "MAX_U64",
    "MIN_PROTOCOL_VERSION",
    "PROTOCOL_VERSION",
    "REPLY_TYPES",
    "REQUEST_TYPES",
    "SALT_SIZE",
    "SERVER_MAGIC",
    "TENANT_PATTERN",
    "Abort",
    "Ack",
    "Bye",
    "ChunkSpec",
    "CompleteLoad",
    "CompleteStore",
    "CompleteStoreReply",
    "DropCache",
    "DropCacheReply",
    "EngineBlocks",
    "ErrorCode",
    "ErrorReply",
    "Frame",
    "FrameDecoder",
    "Fsck",
    "FsckReply",
    "Hello",
    "HelloReply",
    "Inspect",
    "InspectReply",
    "Invalidate",
    "InvalidateReply",
    "LayerExtent",
    "LeaseLoad",
    "LeaseLoadReply",
    "LeaseSlot",
    "LeaseStore",
    "LeaseStoreReply",
    "LoadPlan",
    "LoadProgress",
    "LoadSlot",
    "Lookup",
    "LookupReply",
    "Ls",
    "LsReply",
    "Namespaces",
    "NamespacesReply",
    "Op",
    "PrepareLoad",
    "PrepareLoadReply",
    "PrepareStore",
    "PrepareStoreReply",
    "ProtocolError",
    "Purge",
    "PurgeOlder",
    "PurgeOlderReply",
    "PurgeReply",
    "ReadSlot",
    "RegisterStaging",
    "Reply",
    "Request",
    "ResultReply",
    "Stats",
    "StatsReply",
    "StoreBatch",
    "StoreChunk",
    "StoreReply",
    "StoreSlot",
    "StoreStatus",
    "Touch",
    "align_up",
    "check_magic",
    "close_fds",
    "decode_body",
    "encode_frame",
    "error_message",
    "fake_salt",
    "negotiate_version",
    "packed_layout",
    "parse_reply",
    "parse_request",
    "region_size",
    "reply_message",
    "request_message",
    "with_fds",
]
