"""Errors of the layout layer.

LayoutError
├── UnknownLayoutVersion   a version this build does not implement (refuse, never guess)
├── CorruptObject          an object fails a structural or integrity check
│   └── ObjectMismatch     a valid object, but not the one asked for (key/tenant/namespace)
"""

from __future__ import annotations


class LayoutError(Exception):
    """Base class of everything the layout layer raises."""


class UnknownLayoutVersion(LayoutError):
    def __init__(self, version: object, where: str = "") -> None:
        from .store_root import MAX_LAYOUT_VERSION, MIN_LAYOUT_VERSION

        self.version = version
        loc = f" in {where}" if where else ""
        super().__init__(
            f"unknown layout version {version!r}{loc}: this kvoffload reads versions "
            f"{MIN_LAYOUT_VERSION}..{MAX_LAYOUT_VERSION}; upgrade kvoffload or migrate the store"
        )


class CorruptObject(LayoutError):
    """The bytes are not a valid object (torn, truncated, flipped, tampered)."""


class ObjectMismatch(CorruptObject):
    """A structurally valid object that is not the one requested (e.g. swapped files)."""
