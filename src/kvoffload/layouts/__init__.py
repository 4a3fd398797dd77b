"""On-disk layouts of a kvoffload store, one module and one spec per version.

``docs/spec/layout-v1.md`` is the normative description of version 1. Readers
accept exactly the versions in ``[MIN_LAYOUT_VERSION, MAX_LAYOUT_VERSION]``
and refuse any other with :class:`UnknownLayoutVersion`.
"""

from __future__ import annotations

from ..errors import (
    CorruptObject,
    LayoutError,
    ObjectMismatch,
    UnknownKeyEpoch,
    UnknownLayoutVersion,
)
from .store_root import (
    LAYOUT_FILE,
    MAX_LAYOUT_VERSION,
    MIN_LAYOUT_VERSION,
    SUPPORTED_LAYOUT_VERSIONS,
    LayoutInfo,
    Migration,
    create_root,
    migrations,
    read_layout,
    record_kek_id,
)

__all__ = [
    "LAYOUT_FILE",
    "MAX_LAYOUT_VERSION",
    "MIN_LAYOUT_VERSION",
    "SUPPORTED_LAYOUT_VERSIONS",
    "CorruptObject",
    "LayoutError",
    "LayoutInfo",
    "Migration",
    "ObjectMismatch",
    "UnknownKeyEpoch",
    "UnknownLayoutVersion",
    "create_root",
    "migrations",
    "read_layout",
    "record_kek_id",
]
