"""Helpers shared by the tests (moved out of test_shared_store.py)."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

from kvoffload.store import Store, StoreConfig
from kvoffload.store.keys.keyring import Kek

NS = bytes(range(32))


def key(i: int) -> bytes:
    return hashlib.blake2b(f"k/{i}".encode(), digest_size=32).digest()


def layers(seed: int, n: int = 3, size: int = 3000) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(size) for _ in range(n)]


class Nodes:
    def __init__(self, tmp: Path, kek_file: Path) -> None:
        self.tmp = tmp
        self.kek = Kek.from_file(kek_file)
        self.open: list[Store] = []

    def node(self, name: str, **kw: object) -> Store:
        # No probing by default: prove that the journal, not a stat, finds a chunk.
        kw.setdefault("probe_files_on_miss", False)
        cfg = StoreConfig(
            root=self.tmp / "root",
            index_dir=self.tmp / f"index-{name}",
            durability="none",  # type: ignore[arg-type]
            shared=True,
            journal_poll_s=3600,
            **kw,  # type: ignore[arg-type]
        )
        s = Store(cfg, self.kek, create=True)
        self.open.append(s)
        return s

    def close(self) -> None:
        for s in self.open:
            s.close()
