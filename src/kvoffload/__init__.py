"""kvoffload: what an inference worker imports.

Kept light on purpose: importing it loads no LMDB, no key material and no
daemon code (those live in ``kvoffload.sidecar``, imported only by the
sidecar process).
"""

from __future__ import annotations

from .contract import CompatContract, LayerLayout, Shard
from .errors import ContractError, KVOffloadError
from .keys import chunk_keys, next_key, root_key

__version__ = "0.1.0"

__all__ = [
    "CompatContract",
    "ContractError",
    "KVOffloadError",
    "LayerLayout",
    "Shard",
    "__version__",
    "chunk_keys",
    "next_key",
    "root_key",
]
