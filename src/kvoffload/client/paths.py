"""How a session moves chunk bytes: the strategy interface and what both share.

:class:`~kvoffload.client.SidecarClient` picks one strategy per session,
right after the handshake: :class:`~.leased.LeasedPath` when it asked for the
direct path and the sidecar offers it for the tenant (``hello``'s
``direct``), :class:`~.staged.StagedPath` otherwise. The client checks the
arguments first and catches connection errors around each call; a strategy
only moves bytes and records outcomes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

from ..protocol import (
    CompleteStore,
    CompleteStoreReply,
    EngineBlocks,
    ErrorCode,
    ErrorReply,
    LeaseSlot,
    ProtocolError,
    StoreSlot,
    StoreStatus,
)
from .buffers import DestCallback, LoadCallback, LoadedChunk
from .session import Session, expect


class TransferPath(Protocol):
    """Save and load for one session. Both may raise any of
    :data:`~.session.CONNECTION_ERRORS` (the caller then loses the session)."""

    #: ``"staged"`` or ``"leased"``.
    name: str

    def save(
        self,
        s: Session,
        namespace: bytes,
        keys: list[bytes],
        srcs: list[list[Any]],
        ttl_s: float | None,
        results: list[bool],
        blocks: list[EngineBlocks | None] | None = None,
    ) -> None:
        """Store ``keys[i]`` with layers ``srcs[i]`` (and engine hashes ``blocks[i]``);
        set ``results[i]`` True for each stored."""

    def load(
        self,
        s: Session,
        keys: list[bytes],
        results: list[LoadedChunk],
        into: LoadCallback | None,
        dest_for: DestCallback | None,
    ) -> None:
        """Load a prefix of ``keys`` into ``results`` (copies), ``into`` or ``dest_for``."""


def complete_store(
    s: Session,
    slots: Sequence[StoreSlot | LeaseSlot],
    handle: int,
    batch: list[int],
    results: list[bool],
) -> bool:
    """After the data is in place: report rejections, complete the handle and
    record each chunk's outcome. False if the session failed on the way."""
    rejected = [sl for sl in slots if sl.status is StoreStatus.REJECTED]
    if rejected:
        s.warn(
            logging.WARNING,
            "store-rejected",
            f"kvoffload sidecar rejected {len(rejected)} chunk(s): "
            + ", ".join(sorted({sl.code.name for sl in rejected})),
        )
    if handle == 0:
        for slot, i in zip(slots, batch, strict=True):
            results[i] = slot.status is StoreStatus.EXISTS
        return True
    reply = s.call(CompleteStore(handle))
    if isinstance(reply, ErrorReply):
        s.on_error_reply(reply)
        return False
    done = expect(reply, CompleteStoreReply)
    if len(done.stored) != len(batch):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "complete_store reply has wrong length")
    for ok, i in zip(done.stored, batch, strict=True):
        results[i] = ok
    return True
