"""An in-process store for a benchmark: its KEK and its RAM tier."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchlib.chunks import NAMESPACE, TENANT
from kvoffload.store import Store
from kvoffload.store.keys.keyring import Kek


def new_kek(base: Path) -> Kek:
    """A fresh KEK in the file ``base/kek`` (mode 0600)."""
    path = base / "kek"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, os.urandom(32))
    finally:
        os.close(fd)
    return Kek.from_file(path)


def settle_ram_tier(store: Store, layers: Sequence[memoryview]) -> None:
    """Where ``store`` keeps a RAM tier (sealed images of large objects), put one
    throwaway chunk of ``layers``, untimed, and wait until the tier has mapped its
    memory, as bench_sidecar does for a sidecar: a store does that once, at its
    first large object, and the rows measure the running state, not that
    start-up cost. Cold rows empty the tier (``Store.drop_cache``) as they drop
    the page cache."""
    if not store.has_ram_tier:
        return
    key = hashlib.blake2b(b"bench ram-tier fill", digest_size=32).digest()
    store.put(TENANT, NAMESPACE, key, layers)
    wait_ram_tier_filled(store.stats, "the store's")


def wait_ram_tier_filled(stats: Callable[[], dict[str, Any]], whose: str) -> None:
    """Poll ``stats()`` (a store's or a sidecar's) until its ``ram_tier`` no longer
    fills; RuntimeError naming ``whose`` tier after 120 s."""
    deadline = time.monotonic() + 120
    while (stats().get("ram_tier") or {}).get("filling"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{whose} RAM tier still fills after 120 s")
        time.sleep(0.05)
