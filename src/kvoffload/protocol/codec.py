"""Envelopes (protocol-v1.md §3.3): typed messages to and from the maps of frames.

``request_message``/``reply_message``/``error_message`` give the map that
:func:`kvoffload.protocol.framing.encode_frame` packs; ``parse_request`` and
``parse_reply`` read a decoded map back into a typed message. A request whose
``id`` could be read fails with a ProtocolError naming that ``request_id``
(the connection stays usable); anything else is fatal.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from kvoffload.errors import ErrorCode, ProtocolError

from .fields import NATIVE_TYPES
from .fields import code as wire_code
from .framing import bad
from .limits import MAX_BATCH, MAX_MESSAGE, MAX_REQUEST_ID, Op
from .replies import REPLY_TYPES, Ack, ErrorReply, LookupReply, Reply
from .request_table import REQUEST_TYPES, Request
from .requests import Lookup

ACK_OPS = frozenset({Op.REGISTER_STAGING, Op.ABORT, Op.COMPLETE_LOAD, Op.TOUCH, Op.BYE})


def request_message(request_id: int, req: Request) -> dict[str, Any]:
    if not 1 <= request_id <= MAX_REQUEST_ID:
        raise ValueError(f"request id {request_id} out of range")
    return {"op": req.OP.value, "id": request_id, **req.to_wire()}


def reply_message(request_id: int, reply: Reply) -> dict[str, Any]:
    if type(reply) is LookupReply:  # the scheduler's path: no generic dispatch
        return {"op": "lookup", "id": request_id, "code": 0, "found": reply.found}
    if isinstance(reply, ErrorReply):
        if reply.code is ErrorCode.OK:
            raise ValueError("an ErrorReply needs a non-zero code")
        op, code = reply.op, int(reply.code)
    elif isinstance(reply, Ack):
        op, code = reply.op.value, 0
    else:
        op, code = reply.OP.value, 0
    return {"op": op, "id": request_id, "code": code, **reply.to_wire()}


def error_message(code: ErrorCode, message: str) -> dict[str, Any]:
    """The server-initiated fatal error frame (id 0)."""
    return reply_message(0, ErrorReply(Op.ERROR.value, code, message))


def _envelope_id(msg: Mapping[str, Any], lo: int) -> int:
    rid = msg.get("id")
    if not isinstance(rid, int) or isinstance(rid, bool) or not lo <= rid <= MAX_REQUEST_ID:
        raise bad(f"missing or invalid request id {rid!r}")
    return rid


def _u16(v: Any, where: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 0xFFFF:
        raise bad(f"{where}: {v!r} is not an integer in [0, 65535]")
    return v


def _lookup_request(msg: Mapping[str, Any]) -> tuple[int, Lookup] | None:
    """``fields.decode`` of a ``lookup`` request, less its steps that have nothing
    to check in one (it is on the engine scheduler's path): a lookup has no
    number, no cross-field rule and no key the wire requires beyond its
    fields (``tests/protocol/test_protocol_typed.py`` holds it to that), so msgspec's
    conversion is the whole check. None for anything it refuses: the generic
    path then names the fault."""
    rid = msg.get("id")
    if type(rid) is not int or not 1 <= rid <= MAX_REQUEST_ID:
        return None
    try:
        return rid, msgspec.convert(msg, Lookup, builtin_types=NATIVE_TYPES)
    except msgspec.ValidationError:
        return None


def parse_request(msg: Mapping[str, Any]) -> tuple[int, Request]:
    """Validate one received request. Raises ProtocolError (see its ``fatal``)."""
    if msg.get("op") == "lookup":
        fast = _lookup_request(msg)
        if fast is not None:
            return fast
    rid = _envelope_id(msg, 1)
    op = msg.get("op")
    if not isinstance(op, str):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "missing or invalid op", request_id=rid)
    try:
        cls = REQUEST_TYPES[Op(op)]
    except (ValueError, KeyError):
        raise ProtocolError(
            ErrorCode.UNSUPPORTED, f"unknown op {op[:64]!r}", request_id=rid, op=op[:64]
        ) from None
    try:
        return rid, cls.from_wire(msg)
    except ProtocolError as exc:
        raise ProtocolError(exc.code, exc.message, request_id=rid, op=op) from None


def _lookup_reply(msg: Mapping[str, Any]) -> tuple[int, LookupReply] | None:
    """An OK ``lookup`` reply whose every field holds a valid value, checked
    without the generic decoder; None for anything else (the generic path
    then accepts it or names the fault). Every check is one the generic path
    makes: the id, the code (OK, so not an error frame), ``found``."""
    rid = msg.get("id")
    code = msg.get("code")
    found = msg.get("found")
    if (
        type(rid) is int
        and 1 <= rid <= MAX_REQUEST_ID
        and type(code) is int
        and code == 0
        and type(found) is int
        and 0 <= found <= MAX_BATCH
    ):
        return rid, LookupReply(found)
    return None


def parse_reply(msg: Mapping[str, Any]) -> tuple[int, Reply]:
    """Validate one received reply or server-initiated error (id 0).

    A malformed reply is fatal: the client cannot trust the server's state.
    """
    if msg.get("op") == "lookup":
        fast = _lookup_reply(msg)
        if fast is not None:
            return fast
    rid = _envelope_id(msg, 0)
    op_raw = msg.get("op")
    if not isinstance(op_raw, str):
        raise bad("reply: missing or invalid op")
    if "code" not in msg:
        raise bad("reply: missing field 'code'")
    code = wire_code(_u16(msg["code"], "reply.code"))
    if code is not ErrorCode.OK or rid == 0:
        if code is ErrorCode.OK:
            raise bad("error frame with code OK")
        message = msg.get("message", "")
        versions: tuple[int, int] | None = None
        if code is ErrorCode.UNSUPPORTED_VERSION and "min_version" in msg:
            versions = (
                _u16(msg["min_version"], "reply.min_version"),
                _u16(msg.get("max_version"), "reply.max_version"),
            )
        return rid, ErrorReply(
            op_raw[:64],
            code,
            message[:MAX_MESSAGE] if isinstance(message, str) else "",
            versions,
        )
    try:
        op = Op(op_raw)
    except ValueError:
        raise bad(f"reply: unknown op {op_raw[:64]!r}") from None
    if op in ACK_OPS:
        return rid, Ack(op)
    cls = REPLY_TYPES.get(op)
    if cls is None:
        raise bad(f"reply: op {op.value!r} has no reply")
    return rid, cls.from_wire(msg)


__all__ = [
    "ACK_OPS",
    "error_message",
    "parse_reply",
    "parse_request",
    "reply_message",
    "request_message",
]
