"""A lookup frame's body read, and its OK reply's frame made, in one C call each.

The engine scheduler asks ``lookup`` once per request, and the sidecar
answers most from its index on the event loop, so the request's envelope
costs as much as the lookup itself: a generic decode (msgpack to a map, then
the map to a typed message) and a generic encode (a map, then msgpack). Here
the body of a ``lookup`` request is decoded by msgspec straight into its
fields, and the OK reply is encoded the same way, byte for byte what the
generic path makes (``tests/protocol/test_lookup_frames.py`` and the golden
frames hold it to that).

The shortcut accepts a strict subset of what the generic path does, as the
same message, and leaves everything else to it (which then answers or names
the fault): a body with any key besides ``op``, ``id``, ``tenant``, ``keys``
and a zero ``fds``, any value of another type or out of its range, or a
tenant not among those the caller names. The tenant is matched against that
set (the tenants a connection named in ``hello``, each checked there against
the tenant pattern) instead of against the pattern again.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from .fields import Keys
from .framing import _LENGTH
from .limits import MAX_REQUEST_ID


class _LookupBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A ``lookup`` request's body (protocol-v1.md §3.3, §5.3) and nothing else."""

    op: Literal["lookup"]
    id: Annotated[int, Meta(ge=1, le=MAX_REQUEST_ID)]
    tenant: Annotated[str, Meta(max_length=64)]
    keys: Keys
    #: §3.3: a frame declaring descriptors is not a lookup's; the generic path refuses it.
    fds: Annotated[int, Meta(ge=0, le=0)] = 0


class _LookupOk(msgspec.Struct):
    """An OK ``lookup`` reply (§5.3), its keys in the generic encoder's order."""

    op: str
    id: int
    code: int
    found: int


_DECODER = msgspec.msgpack.Decoder(_LookupBody)
_ENCODER = msgspec.msgpack.Encoder()


def read_lookup(
    body: bytes | bytearray | memoryview, tenants: Container[str]
) -> tuple[int, str, tuple[bytes, ...]] | None:
    """``(request id, tenant, keys)`` of a ``lookup`` frame body whose tenant is in
    ``tenants`` (valid tenant ids only), or None: the generic path reads it."""
    try:
        req = _DECODER.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if req.tenant not in tenants:
        return None
    return req.id, req.tenant, req.keys


def lookup_reply_frame(request_id: int, found: int) -> bytes:
    """The whole frame (length prefix and body) of an OK lookup reply: what
    ``encode_frame(reply_message(request_id, LookupReply(found)))`` makes."""
    body = _ENCODER.encode(_LookupOk("lookup", request_id, 0, found))
    return _LENGTH.pack(len(body)) + body


__all__ = ["lookup_reply_frame", "read_lookup"]
