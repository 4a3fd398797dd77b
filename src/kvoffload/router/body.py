"""A request body: parsed once, and forwarded as the client's own bytes where it can be.

The router reads a body to route it (its prompt, ``model``, ``cache_salt``)
and forwards it to a worker. Parsing is msgspec's (a base dependency; about
3× the standard library's speed on a prompt of token ids); what msgspec
refuses and the standard library accepts (UTF-16/32, a byte-order mark,
``NaN``, a lone surrogate escape) is read by ``json`` as before and, being
no plain UTF-8 JSON, forwarded re-encoded.

Forwarding, :func:`forwarded`:

- a body the router did not change goes out as the bytes that came in (no
  re-encoding, which cost as much as the parse);
- a body that only gains the tenant's ``cache_salt`` gets it spliced in as
  the object's first member. That is only done when the parsed body has no
  ``cache_salt`` member at all, so the bytes forwarded hold exactly one, the
  router's, whatever the engine's JSON parser does with duplicate keys; a
  body that names its own salt (which the router prefixes with the
  tenant's) is re-encoded whole;
- anything else is re-encoded (``json.dumps``: UTF-8, ASCII-escaped).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from ..errors import BadBody

__all__ = ["BadBody", "Body", "forwarded", "parse_body"]

_decode = msgspec.json.Decoder().decode
_WS = b" \t\r\n"


class Body:
    """A parsed request body and the bytes it came as."""

    __slots__ = ("data", "plain", "raw", "salted")

    def __init__(self, raw: bytes, data: dict[str, Any], plain: bool) -> None:
        self.raw = raw
        self.data = data
        #: ``raw`` is UTF-8 JSON exactly as parsed into ``data``: forwardable as it is.
        self.plain = plain
        #: The parsed body had a ``cache_salt`` member (of any value).
        self.salted = "cache_salt" in data


def parse_body(raw: bytes) -> Body:
    """The JSON object of a request body; :class:`BadBody` with one line if it is none."""
    try:
        data = _decode(raw)
        plain = True
    except (msgspec.DecodeError, RecursionError):
        plain = False
        try:
            # bytes: json detects UTF-8/16/32 itself, whatever charset the header claims
            data = json.loads(raw)
        except RecursionError:
            raise BadBody("the request body is nested too deeply") from None
        except ValueError:  # not JSON, not UTF-8, an integer of too many digits
            raise BadBody("the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise BadBody("the request body must be a JSON object")
    return Body(raw, data, plain)


def forwarded(body: Body, salt: str | None) -> bytes:
    """The bytes sent to the worker: ``body`` with ``cache_salt`` set to ``salt`` (if not None).

    Raises :class:`BadBody` if the body must be re-encoded and is nested too
    deeply for that.
    """
    data = body.data
    if salt is None or (body.salted and data["cache_salt"] == salt):
        if body.plain:
            return body.raw
    elif body.plain and not body.salted and data:
        raw = body.raw
        at = 0
        while raw[at] in _WS:  # to the object's "{": it was parsed, so it is there
            at += 1
        data["cache_salt"] = salt
        member = b'"cache_salt":' + json.dumps(salt).encode() + b","
        return b"".join((raw[: at + 1], member, memoryview(raw)[at + 1 :]))
    else:
        data["cache_salt"] = salt
    try:
        return json.dumps(data).encode()
    except RecursionError:
        raise BadBody("the request body is nested too deeply") from None
