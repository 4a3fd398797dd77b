"""The lease (direct) path, protocol-v1.md 5.14 and 5.15: no staging buffer.

For a tenant whose policy allows it, the sidecar leases layout-v1 files: on
save the worker writes each object (header block and layers) into a leased
temp file, and the sidecar checks it before naming it; on load the sidecar
checks the header and pins the object, and the worker reads the layers into
their destinations and verifies each one's XXH3-128. The I/O itself is
:mod:`kvoffload.client.direct`'s (GDS from and to GPU memory where the node has it).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from typing import Any

from ..layouts import v1
from ..protocol import (
    Abort,
    ChunkSpec,
    CompleteLoad,
    EngineBlocks,
    ErrorCode,
    ErrorReply,
    LeaseLoad,
    LeaseLoadReply,
    LeaseSlot,
    LeaseStore,
    LeaseStoreReply,
    ProtocolError,
    StoreStatus,
)
from . import direct as direct_io
from .buffers import DestCallback, LoadCallback, LoadedChunk, check_dests
from .paths import complete_store
from .session import CONNECTION_ERRORS, Session, expect

#: Chunks per lease_store / lease_load request: bounds the leased files, pins
#: and reply size a single call holds.
DIRECT_BATCH = 32


class LeasedPath:
    """Saves and loads through files the sidecar leases; the backend is
    :func:`kvoffload.client.direct.select`'s (decided once per process)."""

    name = "leased"

    # -- save ----------------------------------------------------------------

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
        io = direct_io.select()
        step = min(DIRECT_BATCH, s.hello.max_batch)
        for start in range(0, len(keys), step):
            batch = list(range(start, min(start + step, len(keys))))
            specs = tuple(
                ChunkSpec(
                    keys[i],
                    tuple(direct_io.nbytes(v) for v in srcs[i]),
                    blocks[i] if blocks else None,
                )
                for i in batch
            )
            contract = s.contract_for(namespace)
            reply = s.call(LeaseStore(s.tenant, namespace, specs, ttl_s, contract))
            if contract is not None:
                s.contract_sent(namespace, reply)
            if isinstance(reply, ErrorReply):
                s.on_error_reply(reply)
                return
            prep = expect(reply, LeaseStoreReply)
            if len(prep.chunks) != len(batch):
                raise ProtocolError(ErrorCode.BAD_REQUEST, "lease_store reply has wrong length")
            try:
                for slot, sp, i in zip(prep.chunks, specs, batch, strict=True):
                    if slot.status is StoreStatus.WRITE:
                        self._write_leased(
                            s,
                            io,
                            slot,
                            namespace,
                            sp,
                            srcs[i],
                            o_direct=prep.durability in ("object", ""),
                        )
            except BaseException:
                with contextlib.suppress(*CONNECTION_ERRORS):
                    s.call(Abort(prep.handle))
                raise
            if not complete_store(s, prep.chunks, prep.handle, batch, results):
                return

    @staticmethod
    def _write_leased(
        s: Session,
        io: direct_io.DirectIO,
        slot: LeaseSlot,
        namespace: bytes,
        spec: ChunkSpec,
        layers: list[Any],
        *,
        o_direct: bool,
    ) -> None:
        """Write one leased object; a failure only costs this chunk (the sidecar's
        check then refuses the file)."""
        data_offset, offsets = v1.plan_offsets(len(spec.layers), spec.layers, False)
        if (
            slot.data_offset != data_offset
            or list(slot.offsets) != offsets
            or slot.size != v1.object_size(spec.layers, False)
        ):
            # Not the object layout v1 describes: a sidecar speaking another layout.
            raise ProtocolError(ErrorCode.BAD_REQUEST, "lease does not match layout v1")
        layers = io.sources(layers)
        header = v1.plain_header_block(
            tenant=s.tenant,
            namespace=namespace,
            chunk_key=spec.key,
            lengths=spec.layers,
            checks=direct_io.checks_of(layers),
            created_ns=time.time_ns(),
        )
        try:
            io.write_object(slot.path, header, layers, offsets, o_direct=o_direct)
        except OSError as exc:
            s.warn(logging.WARNING, "direct-write", f"kvoffload direct write failed: {exc}")

    # -- load ----------------------------------------------------------------

    def load(
        self,
        s: Session,
        keys: list[bytes],
        results: list[LoadedChunk],
        into: LoadCallback | None,
        dest_for: DestCallback | None,
    ) -> None:
        io = direct_io.select()
        pos = 0
        step = min(DIRECT_BATCH, s.hello.max_batch)
        while pos < len(keys):
            batch = keys[pos : pos + step]
            reply = s.call(LeaseLoad(s.tenant, tuple(batch)))
            if isinstance(reply, ErrorReply):
                s.on_error_reply(reply)
                return
            prep = expect(reply, LeaseLoadReply)
            if len(prep.chunks) != len(batch):
                raise ProtocolError(ErrorCode.BAD_REQUEST, "lease_load reply has wrong length")
            n = prep.found
            bad: list[int] = []
            try:
                for j, slot in enumerate(prep.chunks[:n]):
                    idx = pos + j
                    sizes = [x.length for x in slot.layers]
                    extents = [direct_io.Extent(x.offset, x.length, x.check) for x in slot.layers]
                    if dest_for is not None:
                        dests = check_dests(dest_for(idx, keys[idx], sizes), sizes)
                    else:
                        buf = memoryview(bytearray(sum(sizes)))
                        bounds = [0, *itertools.accumulate(sizes)]
                        dests = [buf[a:b] for a, b in itertools.pairwise(bounds)]
                    try:
                        ok = io.read_layers(slot.path, extents, dests)
                    except OSError as exc:
                        s.warn(
                            logging.WARNING, "direct-read", f"kvoffload direct read failed: {exc}"
                        )
                        ok = False
                    if not ok:
                        bad.append(j)
                        break  # the loaded chunks stay a prefix
                    if dest_for is not None:
                        results[idx] = LoadedChunk(keys[idx], True)
                    elif into is None:
                        results[idx] = LoadedChunk(keys[idx], True, list(dests))
                    else:
                        into(idx, keys[idx], [d.toreadonly() for d in dests])
                        results[idx] = LoadedChunk(keys[idx], True)
            finally:
                if prep.handle:
                    try:
                        done = s.call(CompleteLoad(prep.handle, tuple(bad)))
                        if isinstance(done, ErrorReply):
                            s.on_error_reply(done)
                    except CONNECTION_ERRORS as exc:
                        s.lose(exc)
            if bad or not (prep.stop is ErrorCode.BUSY and n > 0) or not s.alive:
                return
            pos += n
