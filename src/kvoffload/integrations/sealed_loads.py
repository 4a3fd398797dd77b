"""Whole-chunk loads as sealed direct reads (protocol-v1.md §5.33), engine side.

Engine-agnostic (the vLLM connector's worker uses it, ``bench_ttft`` measures it).

With ``sealed_direct`` the sidecar hands the worker each object's descriptor
and the key of that object alone (keys-v1.md §14); the client verifies and
decrypts it in this process, into destinations the worker names
(``SidecarClient.load_to``). A stored chunk's layer is its K block then its V
block, while vLLM's paged blocks interleave K and V per token and head, so no
layer can be decrypted into the blocks as it lies in the object: the worker
names a scratch buffer of its own, reused across loads (no allocation, no
sidecar pass over the bytes), and scatters each verified chunk from there, as
it does from staging. The scratch holds ``capacity // chunk_bytes`` chunks; a
longer load runs in batches of that many.

A chunk that fails verification (torn, flipped, foreign) is not ``ok``: the
chunks before it are placed, it and every later one are a miss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

#: Per chunk of a batch: the layer views its decryption went to.
_Dests = dict[int, list[memoryview]]


class SealedLoader:
    """Loads through one reused scratch buffer of ``capacity`` bytes."""

    def __init__(self, chunk_bytes: int, capacity: int) -> None:
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        self.chunk_bytes = chunk_bytes
        self._per_batch = max(1, capacity // chunk_bytes)
        self._scratch: memoryview | None = None

    def _buffer(self) -> memoryview:
        if self._scratch is None:
            self._scratch = memoryview(bytearray(self._per_batch * self.chunk_bytes))
        return self._scratch

    def load(
        self,
        client: Any,
        keys: Sequence[bytes],
        place: Callable[[int, Sequence[memoryview]], bool],
    ) -> int:
        """Load ``keys`` in order; ``place(i, layers)`` puts verified chunk ``i``
        where it belongs (False: unusable). The number of leading chunks placed."""
        buf = self._buffer()
        done = 0
        for lo in range(0, len(keys), self._per_batch):
            batch = list(keys[lo : lo + self._per_batch])
            dests: _Dests = {}

            def dest_for(
                j: int, _key: bytes, sizes: Sequence[int], dests: _Dests = dests
            ) -> list[memoryview]:
                off = j * self.chunk_bytes
                if sum(sizes) > self.chunk_bytes:
                    # Not this engine's shape: decrypted aside, refused by place().
                    dests[j] = [memoryview(bytearray(n)) for n in sizes]
                    return dests[j]
                views = []
                for n in sizes:
                    views.append(buf[off : off + n])
                    off += n
                dests[j] = views
                return views

            oks = client.load_to(batch, dest_for)
            for j, ok in enumerate(oks):
                if not ok or not place(lo + j, dests[j]):
                    return done
                done += 1
        return done


def sealed_loader(settings: Any, chunk_bytes: int) -> SealedLoader | None:
    """The worker's loader where ``sealed_direct`` is set (a scratch of staging's size)."""
    if not settings.sealed_direct:
        return None
    return SealedLoader(chunk_bytes, settings.staging_bytes)


__all__ = ["SealedLoader", "sealed_loader"]
