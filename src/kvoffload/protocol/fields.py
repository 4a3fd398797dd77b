"""Field types of protocol v1 and the one place a received map becomes a typed message.

Each wire type of protocol-v1.md §5 is an ``Annotated`` type whose
``msgspec.Meta`` states its constraints (lengths, bounds, the tenant
pattern); :func:`decode` converts a received map into a message
``msgspec.Struct`` with ``msgspec.convert`` and then applies, in one place,
what msgspec cannot express:

- keys the wire requires although the Python class has a default
  (``Message.WIRE_REQUIRED``), and optional keys whose nil means "absent"
  (``Message.WIRE_NULLABLE``);
- the u64 upper bound of every integer (msgspec bounds stop at int64) and
  the finiteness of every float;
- the cross-field rules of each message (``Message.validate_wire``).

Unknown keys are ignored at every level (§3.2 "Extensibility"); a str is
never taken for a bin, nor an int for a bool. Any failure is a
``ProtocolError(BAD_REQUEST)`` naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from enum import Enum
from itertools import repeat
from typing import Annotated, Any, ClassVar, Self, TypeVar, get_args

import msgspec
from msgspec import Meta

from kvoffload.errors import ErrorCode, ProtocolError

from .framing import bad
from .limits import (
    ALIGNMENT,
    KEY_SIZE,
    MAX_BATCH,
    MAX_LAYERS,
    MAX_MESSAGE,
    MAX_PATH,
    MAX_U16,
    MAX_U64,
    SALT_SIZE,
    Op,
)

#: protocol-v1.md §5: ``^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`` as a full match. ``\Z``,
#: not ``$``: Python's ``$`` also matches before a trailing newline.
TENANT_PATTERN = r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z"

#: A non-negative integer; the u64 upper bound is checked by :func:`decode`.
UInt = Annotated[int, Meta(ge=0)]
U16 = Annotated[int, Meta(ge=0, le=MAX_U16)]
#: A handle a request names: never 0.
Handle = Annotated[int, Meta(ge=1)]
#: An offset or size in units of the alignment.
Aligned = Annotated[int, Meta(ge=0, multiple_of=ALIGNMENT)]
LayerSize = Annotated[int, Meta(ge=1)]
Seconds = Annotated[float, Meta(ge=0.0)]
Tenant = Annotated[str, Meta(max_length=64, pattern=TENANT_PATTERN)]
Key = Annotated[bytes, Meta(min_length=KEY_SIZE, max_length=KEY_SIZE)]
Namespace = Key
Salt = Annotated[bytes, Meta(min_length=SALT_SIZE, max_length=SALT_SIZE)]
Check = Annotated[bytes, Meta(min_length=16, max_length=16)]
Keys = Annotated[tuple[Key, ...], Meta(min_length=1, max_length=MAX_BATCH)]
LayerSizes = Annotated[tuple[LayerSize, ...], Meta(min_length=1, max_length=MAX_LAYERS)]
#: An absolute path without NUL.
Path = Annotated[str, Meta(max_length=MAX_PATH, pattern=r"\A/[^\x00]*\Z")]
ShortStr = Annotated[str, Meta(max_length=16)]
#: An error code as sent; :func:`code` reads unknown ones as INTERNAL.
WireCode = U16

#: Types the wire carries as themselves: no str is base64-decoded into a bin.
NATIVE_TYPES = (bytes, bytearray, memoryview)

S = TypeVar("S", bound="Message")


class Message(msgspec.Struct, frozen=True):
    """Base of every typed message and of its parts."""

    #: Keys that must be on the wire although the class has a default for them.
    WIRE_REQUIRED: ClassVar[tuple[str, ...]] = ()
    #: Optional keys for which nil means absent (the default).
    WIRE_NULLABLE: ClassVar[tuple[str, ...]] = ()

    def validate_wire(self, where: str) -> None:
        """Cross-field rules; raise ``bad(...)``. The constraints of the fields hold."""

    def to_wire(self) -> dict[str, Any]:
        """The fields in order, as msgpack takes them (overridden where the wire differs)."""
        return {name: _out(getattr(self, name)) for name in self.__struct_fields__}


def _out(v: Any) -> Any:
    if type(v) in _AS_IS:  # most fields: no isinstance walk
        return v
    if isinstance(v, Message):
        return v.to_wire()
    if isinstance(v, tuple | list):
        # keys, sizes, offsets: no per-item Python calls (an int enum packs as its int)
        if all(map(isinstance, v, repeat(bytes))) or all(map(isinstance, v, repeat(int))):
            return list(v)
        return [_out(x) for x in v]
    if isinstance(v, Enum):
        return v.value
    return v


#: Field values msgpack takes as they are.
_AS_IS = frozenset({int, str, bytes, bool, float, type(None)})


def decode(cls: type[S], m: Any, where: str) -> S:
    """The typed ``cls`` a received map stands for, or ProtocolError(BAD_REQUEST)."""
    if isinstance(m, Mapping):
        for k in cls.WIRE_REQUIRED:
            if k not in m:
                raise bad(f"{where}: missing field {k!r}")
        if cls.WIRE_NULLABLE:
            m = {k: v for k, v in m.items() if not (v is None and k in cls.WIRE_NULLABLE)}
    try:
        obj = msgspec.convert(m, cls, builtin_types=NATIVE_TYPES)
    except msgspec.ValidationError as exc:
        raise bad(f"{where}: {exc}") from None
    _check_numbers(obj, where)
    obj.validate_wire(where)
    return obj


def _check_numbers(v: Any, where: str) -> None:
    """Every integer of a typed message is ≤ u64, every float finite (free-form maps aside).

    The common cases are settled without a call or a string per field: a
    message's int, str and bytes fields in its own loop, a tuple of keys or of
    ints in C; ``where`` grows only on the way into a part."""
    if isinstance(v, bool):
        return
    if isinstance(v, int):
        if v > MAX_U64:
            raise bad(f"{where}: {v} out of range [0, {MAX_U64}]")
    elif isinstance(v, float):
        if not math.isfinite(v):
            raise bad(f"{where}: {v!r} is not a finite number")
    elif isinstance(v, tuple):
        if all(map(isinstance, v, repeat(bytes))):  # keys: nothing to check, in C
            return
        if all(map(isinstance, v, repeat(int))):  # sizes, offsets (bools are ints)
            if max(v) > MAX_U64:
                _check_each(v, where)
            return
        _check_each(v, where)
    elif isinstance(v, msgspec.Struct):
        for name in v.__struct_fields__:
            x = getattr(v, name)
            t = type(x)
            if t is int:
                if x > MAX_U64:
                    raise bad(f"{where}.{name}: {x} out of range [0, {MAX_U64}]")
            elif t not in _NO_NUMBERS:
                _check_numbers(x, f"{where}.{name}")


#: Field values that hold no number to check.
_NO_NUMBERS = frozenset({str, bytes, bool, type(None)})


def _check_each(v: tuple[Any, ...], where: str) -> None:
    for x in v:
        _check_numbers(x, where)


def code(v: int) -> ErrorCode:
    return ErrorCode.from_wire(v)


def distinct(items: tuple[Any, ...], where: str, what: str) -> None:
    if len(set(items)) != len(items):
        raise bad(f"{where}: duplicate {what}")


def plain(v: Any, where: str, depth: int = 0) -> Any:
    """Check a free-form value (stats, fsck report) holds only plain msgpack types."""
    if depth > 16:
        raise bad(f"{where}: nested too deep")
    if v is None or isinstance(v, bool | int | float | str | bytes):
        return v
    if isinstance(v, list):
        return [plain(x, f"{where}[]", depth + 1) for x in v]
    if isinstance(v, dict):
        out: dict[str, Any] = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise bad(f"{where} key: expected a string, got {type(k).__name__}")
            if len(k) > MAX_MESSAGE:
                raise bad(f"{where} key: longer than {MAX_MESSAGE} characters")
            out[k] = plain(x, f"{where}.{k}", depth + 1)
        return out
    raise bad(f"{where}: unsupported value of type {type(v).__name__}")


def free_form(m: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    """The free-form map under ``key`` (``stats``, ``report``), checked by :func:`plain`."""
    if key not in m:
        raise bad(f"{where}: missing field {key!r}")
    v = m[key]
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise bad(f"{where}.{key}: expected a map with string keys")
    out: dict[str, Any] = plain(v, f"{where}.{key}")
    return out


class ReplyMessage(Message, frozen=True):
    """Base of the OK replies that have result keys: ``OP`` is the verb."""

    OP: ClassVar[Op]

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Self:
        return decode(cls, m, f"{cls.OP.value} reply")


def op_table(messages: Any) -> dict[Op, Any]:
    """The op → class table of a union of message classes, each naming its verb
    in ``OP``: the request table and the reply table are both made this way, so
    a class is reachable exactly when it is in its union. Two classes that claim
    one op are a bug, refused here, when the module is imported."""
    table: dict[Op, Any] = {}
    for cls in get_args(messages):
        op = getattr(cls, "OP", None)
        if not isinstance(op, Op):
            raise TypeError(f"{cls.__name__} names no op")
        seen = table.setdefault(op, cls)
        if seen is not cls:
            raise TypeError(f"{seen.__name__} and {cls.__name__} both claim op {op.value!r}")
    return table


__all__ = [
    "NATIVE_TYPES",
    "TENANT_PATTERN",
    "U16",
    "Aligned",
    "Check",
    "Handle",
    "Key",
    "Keys",
    "LayerSize",
    "LayerSizes",
    "Message",
    "Namespace",
    "Path",
    "ProtocolError",
    "ReplyMessage",
    "Salt",
    "Seconds",
    "ShortStr",
    "Tenant",
    "UInt",
    "WireCode",
    "code",
    "decode",
    "distinct",
    "free_form",
    "op_table",
    "plain",
]
