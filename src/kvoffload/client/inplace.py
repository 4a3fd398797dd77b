"""In-place transfers (protocol-v1.md §5.34, revision 17): chunks addressed by
(region, offset, layer sizes) in a file the client registered, so that the
sidecar reads a store's plaintext from it and writes a load's verified
plaintext into it, and this process copies nothing through staging.

:class:`RegionTable` keeps the client's region files (its own duplicates of
the caller's descriptors) across reconnects and registers them once per
connection, on first use. Against a server that does not announce
``max_region`` (older than revision 17) or that refuses a region, every call
answers None and the caller takes the staging path.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..protocol import (
    MAX_REGIONS,
    EngineBlocks,
    ErrorCode,
    ErrorReply,
    ProtocolError,
    RegionChunk,
    RegionDest,
    RegionLoad,
    RegionLoadReply,
    RegionStore,
    RegionStoreReply,
    RegisterRegion,
    RegisterRegionReply,
)
from .session import Session, expect

log = logging.getLogger("kvoffload.client")

#: ``(region, offset, layer sizes)``: where one chunk's packed layers lie.
Span = tuple[int, int, Sequence[int]]


@dataclass
class RegionTable:
    """The client's region files, and their ids on the current connection."""

    fds: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    #: The connection the ids below belong to, and local index → server id.
    session: Session | None = None
    ids: dict[int, int] = field(default_factory=dict)
    refused: bool = False

    def add(self, fd: int, size: int) -> int:
        """Keep a duplicate of ``fd`` (a regular file of at least ``size`` bytes,
        ``size`` a positive multiple of 4096); its local id."""
        if len(self.fds) >= MAX_REGIONS:
            raise ValueError(f"at most {MAX_REGIONS} regions")
        if size <= 0 or size % 4096:
            raise ValueError(f"region size {size} is not a positive multiple of 4096")
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < size:
            raise ValueError(f"region fd {fd} is not a regular file of at least {size} bytes")
        self.fds.append(os.dup(fd))
        self.sizes.append(size)
        return len(self.fds) - 1

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds, self.sizes, self.ids, self.session = [], [], {}, None

    def server_ids(self, s: Session) -> dict[int, int] | None:
        """Local id → this connection's region id, registering on first use; None:
        in-place transfers are not available on this connection."""
        if self.session is not s:
            self.session, self.ids, self.refused = s, {}, False
        if self.refused or not self.fds or not s.hello.max_region:
            return None
        for local, (fd, size) in enumerate(zip(self.fds, self.sizes, strict=True)):
            if local in self.ids:
                continue
            if size > s.hello.max_region:
                self.refused = True
                return None
            reply = s.call(RegisterRegion(size), fds=[fd])
            if isinstance(reply, ErrorReply):
                s.warn(
                    logging.WARNING,
                    "region",
                    f"kvoffload sidecar refused the region ({reply.code.name}: "
                    f"{reply.message}); using staging",
                )
                self.refused = True
                return None
            self.ids[local] = expect(reply, RegisterRegionReply).region
        return self.ids


def save(
    s: Session,
    ids: dict[int, int],
    namespace: bytes,
    keys: Sequence[bytes],
    spans: Sequence[Span],
    ttl_s: float | None,
    blocks: Sequence[EngineBlocks | None] | None,
) -> list[bool] | None:
    """``region_store`` of the chunks, in batches; True per stored chunk. None:
    the server would not serve it (the caller uses staging for all of them)."""
    results = [False] * len(keys)
    step = s.hello.max_batch
    for at in range(0, len(keys), step):
        chunks = tuple(
            RegionChunk(
                k,
                tuple(layers),
                blocks[i] if blocks is not None else None,
                region=ids[r],
                offset=off,
            )
            for i, (k, (r, off, layers)) in enumerate(
                zip(keys[at : at + step], spans[at : at + step], strict=True), start=at
            )
        )
        contract = s.contract_for(namespace)
        reply = s.call(RegionStore(s.tenant, namespace, chunks, ttl_s, contract))
        if contract is not None:
            s.contract_sent(namespace, reply)
        if isinstance(reply, ErrorReply):
            if reply.code is ErrorCode.UNSUPPORTED and at == 0:
                return None
            s.on_error_reply(reply)
            return results
        done = expect(reply, RegionStoreReply)
        if len(done.stored) != len(chunks):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "region_store reply has wrong length")
        results[at : at + len(chunks)] = done.stored
    return results


def load(
    s: Session, ids: dict[int, int], keys: Sequence[bytes], spans: Sequence[Span]
) -> list[bool] | None:
    """``region_load`` of the keys, in batches; the True entries are a prefix.
    None: the server would not serve it (the caller uses staging)."""
    results = [False] * len(keys)
    step = s.hello.max_batch
    for at in range(0, len(keys), step):
        batch = keys[at : at + step]
        dests = tuple(RegionDest(ids[r], off, tuple(ls)) for r, off, ls in spans[at : at + step])
        reply = s.call(RegionLoad(s.tenant, tuple(batch), dests))
        if isinstance(reply, ErrorReply):
            if reply.code is ErrorCode.UNSUPPORTED and at == 0:
                return None
            s.on_error_reply(reply)
            return results
        got = expect(reply, RegionLoadReply)
        if got.loaded > len(batch):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "region_load reply loaded too many")
        results[at : at + got.loaded] = [True] * got.loaded
        if got.loaded < len(batch):
            break
    return results


__all__ = ["RegionTable", "Span", "load", "save"]
