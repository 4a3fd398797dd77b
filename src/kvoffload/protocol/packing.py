"""How chunks lie in the staging buffer (protocol-v1.md §5 "Packing"), and the fake salt (§5.1)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from .limits import ALIGNMENT


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


def packed_layout(layer_sizes: Sequence[int]) -> tuple[list[int], int]:
    """(offset of each layer inside its region, payload): protocol-v1.md §5 "Packing".

    Layers lie back to back; the region is the payload rounded up to the
    alignment (:func:`region_size`).
    """
    offsets: list[int] = []
    pos = 0
    for n in layer_sizes:
        offsets.append(pos)
        pos += n
    return offsets, pos


def region_size(layer_sizes: Sequence[int], alignment: int = ALIGNMENT) -> int:
    """Staging bytes one chunk occupies."""
    return align_up(sum(layer_sizes), alignment)


def fake_salt(server_secret: bytes, tenant: str) -> bytes:
    """Stable salt shown for a tenant the connection may not use (protocol-v1.md §5.1)."""
    return hmac.new(
        server_secret, b"kvo-fake-salt-v1" + tenant.encode("utf-8"), hashlib.sha256
    ).digest()
