"""The nonce budget of each tenant's data key (DEK) epoch.

NIST SP 800-38D allows at most 2**32 random 96-bit nonces per key; every
sealed layer segment draws one. The store counts the segments sealed per
(tenant, epoch) and rotates the tenant's DEK before the bound
(``StoreConfig.max_segments_per_epoch``). The count is persisted in the index's
meta table a block ahead of use, so a crash can only over-count, never
under-count; an index rebuilt from the files has lost the counts
(:data:`SEAL_COUNTS_LOST`), so each tenant's next seal starts a fresh epoch.
"""

from __future__ import annotations

import logging
import threading

from ..index import Index
from ..shared.root import SHARED_NONCE_SHARES
from .keyring import Keyring

log = logging.getLogger("kvoffload.store")

#: Segments drawn from the persisted count at once (one meta write per block).
SEAL_COUNT_BLOCK = 1 << 16
#: Index meta set when the index was rebuilt from the files: the persisted seal
#: counts are gone, so each tenant's next seal starts a fresh DEK epoch.
SEAL_COUNTS_LOST = "seal_counts_lost"


class NonceBudget:
    """Segments left per (tenant, epoch) in this process, drawn from the
    persisted counts a block at a time; the only writer of those counts."""

    def __init__(self, index: Index, keyring: Keyring, max_segments: int, *, shared: bool) -> None:
        self._index = index
        self._keyring = keyring
        # Every node of a shared root seals under the same DEK epochs, and no
        # node sees the others' counts: each gets a share of the bound
        # (shared-root-v1.md §5).
        self.limit = max_segments // SHARED_NONCE_SHARES if shared else max_segments
        self._mu = threading.Lock()
        self._left: dict[tuple[str, int], int] = {}

    def draw(self, tenant: str, epoch: int, segments: int) -> int:
        """Count ``segments`` sealed segments against (tenant, epoch); the epoch
        to seal under (a newer one where the DEK was rotated first)."""
        limit = self.limit
        block = max(segments, min(SEAL_COUNT_BLOCK, limit // 4))
        with self._mu:
            while True:
                left = self._left.get((tenant, epoch), 0)
                if left >= segments:
                    self._left[(tenant, epoch)] = left - segments
                    return epoch
                name = f"seal_count/{tenant}/{epoch}"
                raw = self._index.get_meta(name)
                if raw is None and self._index.get_meta(SEAL_COUNTS_LOST) is not None:
                    # The index was rebuilt: this epoch's count is unknown. A fresh
                    # epoch's is not (it starts at 0).
                    epoch = self._keyring.rotate_dek(tenant)
                    self._index.set_meta(f"seal_count/{tenant}/{epoch}", b"0")
                    continue
                done = int(raw.decode()) if raw else 0
                if done + block > limit:
                    epoch = self._keyring.rotate_dek(tenant)
                    log.info("tenant %s: nonce budget spent, DEK epoch now %d", tenant, epoch)
                    continue
                self._index.set_meta(name, str(done + block).encode())
                self._left[(tenant, epoch)] = left + block


__all__ = ["SEAL_COUNTS_LOST", "SEAL_COUNT_BLOCK", "NonceBudget"]
