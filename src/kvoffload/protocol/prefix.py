"""The found-prefix shape every load-type reply shares (protocol-v1.md §5.7, §5.15, §5.32)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any, TypeVar

from msgspec import Meta

from kvoffload.errors import ErrorCode

from .fields import Message, UInt, WireCode, code, decode
from .framing import bad
from .limits import MAX_BATCH

#: Checked entry by entry: a miss's other keys are not read.
LoadEntries = Annotated[tuple[Any, ...], Meta(min_length=1, max_length=MAX_BATCH)]


class LoadWire(Message, frozen=True):
    handle: UInt
    stop: WireCode
    chunks: LoadEntries


class Found(Message, frozen=True):
    found: bool


_S = TypeVar("_S")


def prefix_reply(
    m: Mapping[str, Any],
    w: str,
    flag: str,
    hit: Callable[[Any, str], _S | None],
    miss: _S,
) -> tuple[int, ErrorCode, tuple[_S, ...]]:
    """(handle, stop, slots) of a load-type reply: the chunks whose ``flag`` is
    true form a prefix, ``stop`` is OK exactly when there is no miss, and the
    handle is 0 exactly when nothing was found. ``hit`` returns None for a miss."""
    wire = decode(LoadWire, m, w)
    slots: list[_S] = []
    seen_miss = False
    for i, c in enumerate(wire.chunks):
        cw = f"{w}.chunks[{i}]"
        got = hit(c, cw)
        if got is None:
            seen_miss = True
            slots.append(miss)
            continue
        if seen_miss:
            raise bad(f"{cw}: {flag} chunk after a miss")
        slots.append(got)
    stop = code(wire.stop)
    if (stop is ErrorCode.OK) != (not seen_miss):
        raise bad(f"{w}: stop {stop.name} does not match the chunks")
    if (wire.handle == 0) == (slots[0] is not miss):  # the found chunks are a prefix
        raise bad(f"{w}: handle {wire.handle} does not match the {flag} chunks")
    return wire.handle, stop, tuple(slots)
