"""The layout layer's errors; defined, with the whole tree, in :mod:`kvoffload.errors`."""

from __future__ import annotations

from kvoffload.errors import (
    CorruptObject,
    LayoutError,
    ObjectMismatch,
    UnknownKeyEpoch,
    UnknownLayoutVersion,
)

__all__ = [
    "CorruptObject",
    "LayoutError",
    "ObjectMismatch",
    "UnknownKeyEpoch",
    "UnknownLayoutVersion",
]
