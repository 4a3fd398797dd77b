"""The staging path: chunk bytes pass through the shared staging buffer.

Save: ``prepare_store`` reserves regions of the buffer, the worker copies the
layers in, ``complete_store`` has the sidecar verify and write them. Load:
``prepare_load`` has the sidecar read and verify chunks into the buffer, the
worker copies them out (or hands views to ``into``), ``complete_load``
releases the regions. Each call starts with the whole buffer free (the
client serializes calls), which is what sizes the batches.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from ..protocol import (
    Abort,
    ChunkSpec,
    EngineBlocks,
    ErrorCode,
    ErrorReply,
    LoadProgress,
    LoadSlot,
    LookupLoad,
    LookupLoadReply,
    PrepareLoad,
    PrepareLoadReply,
    PrepareStore,
    PrepareStoreReply,
    ProtocolError,
    Reply,
    StoreBatch,
    StoreChunk,
    StoreReply,
    StoreStatus,
    packed_layout,
    region_size,
)
from ..staging import StagingBuffer
from . import direct as direct_io
from .buffers import (
    CopyInFn,
    DestCallback,
    LayerCallback,
    LoadCallback,
    LoadedChunk,
    check_dests,
    check_regions,
)
from .paths import complete_store
from .session import CONNECTION_ERRORS, Session, expect

#: Conservative msgpack size of one chunk entry in prepare_store: key (34),
#: map keys and headers (~24), one u64 (≤ 9 bytes) per layer size.
#: (+ 16: a ``store`` chunk's ``offset``).
_CHUNK_ENTRY_BYTES = 80
_LAYER_ENTRY_BYTES = 9
#: Batches of at most this many payload bytes are saved with ``store`` (one
#: round trip, protocol-v1.md §5.21), which copies every chunk before asking;
#: larger ones with prepare_store/complete_store, which copies only the chunks
#: the sidecar lacks, where the copy saved outweighs the round trip.
STORE_VERB_MAX_BYTES = 4 << 20
_FRAME_SLACK = 4096


class StagedPath:
    """Saves and loads through ``staging`` (registered with the session's sidecar)."""

    name = "staged"

    def __init__(self, staging: StagingBuffer, copy_in: CopyInFn) -> None:
        self._staging = staging
        self._copy_in = copy_in
        self._blocks: list[EngineBlocks | None] | None = None

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
        self._blocks = blocks
        views = [[direct_io.to_host(v) if direct_io.is_device(v) else v for v in lv] for lv in srcs]
        cap = self._staging.size
        fits = [region_size([v.nbytes for v in lv]) <= cap for lv in views]
        if not all(fits):
            # Only a client that asked for the direct path gets this far with
            # such chunks (otherwise ChunkTooLarge was raised up front).
            s.warn(
                logging.WARNING,
                "direct-unavailable",
                "kvoffload: the direct path is not offered for tenant "
                f"{s.tenant!r}; {fits.count(False)} chunk(s) exceed the staging "
                "buffer and are not saved",
            )
        for batch in self._store_batches(s, views):
            batch = [i for i in batch if fits[i]]
            if batch:
                self._save_batch(s, namespace, keys, views, batch, ttl_s, results)
            if not s.alive:
                break

    def _store_batches(self, s: Session, views: list[list[memoryview]]) -> list[list[int]]:
        """Consecutive chunk indices that fit the staging buffer, max_batch and max_frame."""
        cap = self._staging.size
        frame_budget = s.hello.max_frame - _FRAME_SLACK
        batches: list[list[int]] = []
        cur: list[int] = []
        cur_bytes = cur_frame = 0
        for i, lv in enumerate(views):
            packed = region_size([v.nbytes for v in lv], s.hello.alignment)
            entry = _CHUNK_ENTRY_BYTES + _LAYER_ENTRY_BYTES * len(lv)
            b = self._blocks[i] if self._blocks else None
            if b is not None:
                entry += blocks_wire_bytes(b)
            if cur and (
                cur_bytes + packed > cap
                or len(cur) >= s.hello.max_batch
                or cur_frame + entry > frame_budget
            ):
                batches.append(cur)
                cur, cur_bytes, cur_frame = [], 0, 0
            cur.append(i)
            cur_bytes += packed
            cur_frame += entry
        if cur:
            batches.append(cur)
        return batches

    def _save_batch(
        self,
        s: Session,
        namespace: bytes,
        keys: list[bytes],
        views: list[list[memoryview]],
        batch: list[int],
        ttl_s: float | None,
        results: list[bool],
    ) -> None:
        staging = self._staging
        bl = self._blocks
        specs = tuple(
            ChunkSpec(keys[i], tuple(v.nbytes for v in views[i]), bl[i] if bl else None)
            for i in batch
        )
        contract = s.contract_for(namespace)
        # store (5.21) carries no contract: a namespace's first batch on this
        # connection registers it through prepare_store (5.19), later ones take store.
        small = sum(sp.payload for sp in specs) <= STORE_VERB_MAX_BYTES
        if (
            small
            and contract is None
            and s.hello.store
            and self._store_batch(s, namespace, views, batch, specs, ttl_s, results)
        ):
            return
        reply = s.call(PrepareStore(s.tenant, namespace, specs, ttl_s, contract))
        if contract is not None:
            s.contract_sent(namespace, reply)
        if isinstance(reply, ErrorReply):
            s.on_error_reply(reply)
            return
        prep = expect(reply, PrepareStoreReply)
        if len(prep.chunks) != len(batch):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "prepare_store reply has wrong length")
        regions: list[tuple[int, int]] = []
        for slot, sp in zip(prep.chunks, specs, strict=True):
            if slot.status is StoreStatus.WRITE:
                regions.append((slot.offset, sp.payload))
        check_regions(regions, staging.size)
        try:
            for slot, i in zip(prep.chunks, batch, strict=True):
                if slot.status is StoreStatus.WRITE:
                    self._copy_in(staging, slot.offset, views[i])
        except BaseException:
            with contextlib.suppress(*CONNECTION_ERRORS):
                s.call(Abort(prep.handle))
            raise
        complete_store(s, prep.chunks, prep.handle, batch, results)

    def _store_batch(
        self,
        s: Session,
        namespace: bytes,
        views: list[list[memoryview]],
        batch: list[int],
        specs: tuple[ChunkSpec, ...],
        ttl_s: float | None,
        results: list[bool],
    ) -> bool:
        """One round trip (``store``, protocol-v1.md §5.21): the layers go to regions
        of the staging buffer packed from offset 0 (the client serializes its calls,
        so the whole buffer is free and the batch fits it), then one request.
        False: the server would not take it (``BUSY``, ``UNSUPPORTED``); use the
        two-step path for this batch."""
        align = s.hello.alignment
        chunks: list[StoreChunk] = []
        at = 0
        for sp, i in zip(specs, batch, strict=True):
            self._copy_in(self._staging, at, views[i])
            chunks.append(StoreChunk(sp.key, sp.layers, sp.blocks, offset=at))
            at += region_size(sp.layers, align)
        reply = s.call(StoreBatch(s.tenant, namespace, tuple(chunks), ttl_s))
        if isinstance(reply, ErrorReply):
            if reply.code in (ErrorCode.BUSY, ErrorCode.UNSUPPORTED):
                return False
            s.on_error_reply(reply)
            return True
        done = expect(reply, StoreReply)
        if len(done.stored) != len(batch):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "store reply has wrong length")
        refused = sorted({ErrorCode.from_wire(c).name for c in done.codes if c})
        if refused:
            s.warn(
                logging.WARNING,
                "store-rejected",
                f"kvoffload sidecar did not store {sum(1 for c in done.codes if c)} "
                f"chunk(s): {', '.join(refused)}",
            )
        for ok, i in zip(done.stored, batch, strict=True):
            results[i] = ok
        return True

    # -- load ----------------------------------------------------------------

    def load(
        self,
        s: Session,
        keys: list[bytes],
        results: list[LoadedChunk],
        into: LoadCallback | None,
        dest_for: DestCallback | None,
    ) -> None:
        if dest_for is not None:
            pick = dest_for

            def copy(idx: int, key: bytes, views: Sequence[memoryview]) -> None:
                sizes = [v.nbytes for v in views]
                for v, d in zip(views, check_dests(pick(idx, key, sizes), sizes), strict=True):
                    direct_io.copy_into(v, d)

            into = copy
        pos = 0
        while pos < len(keys):
            n, more = self._load_batch(s, keys, pos, into, results)
            pos += n
            if not more or not s.alive:
                break

    def load_layerwise(
        self, s: Session, keys: list[bytes], results: list[LoadedChunk], on_layer: LayerCallback
    ) -> None:
        """Load ``keys`` handing out each layer as the server reports it verified (§5.26)."""
        pos = 0
        while pos < len(keys):
            n, more = self._load_batch_layerwise(s, keys, pos, on_layer, results)
            pos += n
            if not more or not s.alive:
                break

    def _load_batch_layerwise(
        self,
        s: Session,
        keys: list[bytes],
        pos: int,
        on_layer: LayerCallback,
        results: list[LoadedChunk],
    ) -> tuple[int, bool]:
        batch = keys[pos : pos + s.hello.max_batch]
        lw = _Layerwise(self._staging, pos, on_layer)
        handle = 0
        try:
            reply = _with_frames(
                s,
                PrepareLoad(s.tenant, tuple(batch), layerwise=True, complete=s.take_deferred()),
                lw.progress,
            )
            if isinstance(reply, ErrorReply):
                s.on_error_reply(reply)
                return 0, False
            prep = expect(reply, PrepareLoadReply)
            handle = prep.handle
            if len(prep.chunks) != len(batch) or prep.verified > lw.live:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "prepare_load reply disagrees")
            n = 0
            while n < prep.verified and lw.complete(n):
                results[pos + n] = LoadedChunk(keys[pos + n], True)
                n += 1
        finally:
            if handle:
                try:
                    s.complete_load(handle)
                except CONNECTION_ERRORS as exc:
                    s.lose(exc)
        return n, prep.stop is ErrorCode.BUSY and n > 0

    def lookup_load(
        self, s: Session, keys: list[bytes], results: list[LoadedChunk], into: LoadCallback | None
    ) -> int:
        """§5.32: ``lookup`` and ``load`` of ``keys`` with one ``lookup_load`` per
        batch (a server that announced it); how many leading keys it holds."""
        found = 0
        pos = 0
        while pos < len(keys) and s.alive:
            got: list[int] = []
            n, more = self._load_batch(s, keys, pos, into, results, got)
            if not got:
                break
            found += got[0]
            batch = min(len(keys) - pos, s.hello.max_batch)
            # The rest of a batch answered in part is loaded the ordinary way.
            while more and n < batch and s.alive:
                m, more = self._load_batch(s, keys, pos + n, into, results)
                n += m
            if got[0] < batch or n < batch:
                break
            pos += batch
        return found

    def _load_batch(
        self,
        s: Session,
        keys: list[bytes],
        pos: int,
        into: LoadCallback | None,
        results: list[LoadedChunk],
        found: list[int] | None = None,
    ) -> tuple[int, bool]:
        """Load keys[pos:] up to one batch; (chunks loaded, worth asking for more).

        To a server with chunk-wise loads (§5.30) each chunk is handed out as its
        frame arrives, while the server still reads the chunks after it. With
        ``found`` (a server with ``lookup_load``, §5.32): one ``lookup_load``,
        whose ``found`` is appended to it."""
        batch = keys[pos : pos + s.hello.max_batch]
        out = _Handout(self._staging, keys, pos, into, results)
        prep: PrepareLoadReply | None = None
        try:
            if found is not None:
                reply = s.call(LookupLoad(s.tenant, tuple(batch), s.take_deferred()))
                if isinstance(reply, LookupLoadReply):
                    found.append(reply.found)
            elif s.hello.chunkwise:
                req = PrepareLoad(
                    s.tenant, tuple(batch), chunkwise=True, complete=s.take_deferred()
                )
                reply = _with_frames(s, req, out.frame)
            else:
                reply = s.call(PrepareLoad(s.tenant, tuple(batch), complete=s.take_deferred()))
            if isinstance(reply, ErrorReply):
                s.on_error_reply(reply)
                return out.done, False
            prep = expect(reply, PrepareLoadReply)
            if len(prep.chunks) != len(batch):
                raise ProtocolError(ErrorCode.BAD_REQUEST, "prepare_load reply has wrong length")
            out.reply(prep)
        finally:
            if prep is not None and prep.handle:
                # Everything verified is already copied out: a failure from
                # here on cannot unmake those results, and a disconnect
                # releases the handle anyway. Its Ack is read on the way to the
                # next reply (Session.post): one round trip less per batch.
                try:
                    s.complete_load(prep.handle)
                except CONNECTION_ERRORS as exc:
                    s.lose(exc)
        out.raise_failure()
        n = out.done
        # OK and NOT_FOUND are ordinary outcomes; BUSY after progress means "ask again".
        quiet = prep.stop in (ErrorCode.OK, ErrorCode.NOT_FOUND) or (
            prep.stop is ErrorCode.BUSY and n > 0
        )
        if not quiet:
            s.warn(
                logging.WARNING,
                f"load-{prep.stop.name}",
                f"kvoffload load stopped early: {prep.stop.name}",
            )
        return n, prep.stop is ErrorCode.BUSY and n > 0


def _with_frames(s: Session, req: PrepareLoad, on_frame: Callable[[LoadProgress], None]) -> Reply:
    """Send ``req`` and pass each of its interim frames (§5.26, §5.30) to
    ``on_frame``; its reply. A failure on the way drops the connection: frames
    of this request may still be coming, and the server stops and releases
    what it held once the connection is gone."""
    rid = s.send(req)
    try:
        while True:
            reply = s.reply_to(rid, req)
            if not isinstance(reply, LoadProgress):
                return reply
            on_frame(reply)
    except BaseException as exc:
        if s.alive:
            s.lose(exc)
        raise


class _Handout:
    """The verified chunks of one ``prepare_load`` batch, handed out in order:
    copied into ``results`` or passed to ``into`` as read-only views of staging,
    from chunk frames (§5.30) as they arrive, then from the reply."""

    def __init__(
        self,
        staging: StagingBuffer,
        keys: list[bytes],
        pos: int,
        into: LoadCallback | None,
        results: list[LoadedChunk],
    ) -> None:
        self.staging = staging
        self.keys = keys
        self.pos = pos
        self.into = into
        self.results = results
        self.given: list[tuple[int, tuple[int, ...]]] = []  # (offset, layers) handed out
        self.failure: BaseException | None = None  # from ``into``: raised after the reply

    @property
    def done(self) -> int:
        return len(self.given)

    def frame(self, p: LoadProgress) -> None:
        if p.first != self.done or not p.chunks:  # (chunks come only with layers_done 0)
            raise ProtocolError(ErrorCode.BAD_REQUEST, "chunk frame out of order")
        self._hand_out(p.chunks)

    def reply(self, prep: PrepareLoadReply) -> None:
        n = prep.verified
        if n < self.done or any(
            (c.offset, c.layers) != g for c, g in zip(prep.chunks, self.given, strict=False)
        ):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "prepare_load reply unsays a chunk frame")
        self._hand_out(prep.chunks[self.done : n])

    def _hand_out(self, slots: Sequence[LoadSlot]) -> None:
        check_regions([(c.offset, sum(c.layers)) for c in slots], self.staging.size)
        view = self.staging.view
        for slot in slots:
            idx = self.pos + self.done
            offs, _ = packed_layout(slot.layers)
            src = [
                view[slot.offset + lo : slot.offset + lo + size].toreadonly()
                for lo, size in zip(offs, slot.layers, strict=True)
            ]
            self.given.append((slot.offset, slot.layers))
            if self.into is None:
                buf = memoryview(bytearray(sum(slot.layers)))
                layers: list[memoryview] = []
                at = 0
                for v in src:
                    buf[at : at + v.nbytes] = v
                    layers.append(buf[at : at + v.nbytes])
                    at += v.nbytes
                self.results[idx] = LoadedChunk(self.keys[idx], True, layers)
                continue
            try:
                if self.failure is None:
                    self.into(idx, self.keys[idx], src)
            except BaseException as exc:  # raised once the server was told (load())
                self.failure = exc
            finally:
                for v in src:
                    with contextlib.suppress(BufferError):
                        v.release()
            if self.failure is None:
                self.results[idx] = LoadedChunk(self.keys[idx], True)

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure


class _Layerwise:
    """One layer-wise ``prepare_load`` batch (§5.26) as its frames arrive.

    Chunks of one batch may have different layer counts: layer l is handed
    out for every reported chunk that has one, in runs of consecutive chunks
    (``on_layer(l, first, views)``: ``views[j]`` is chunk ``first + j``), and
    a chunk is complete only once each of its layers was handed out."""

    def __init__(self, staging: StagingBuffer, first: int, on_layer: LayerCallback) -> None:
        self.staging = staging
        self.first = first
        self.on_layer = on_layer
        self.planned: list[tuple[int, tuple[int, ...]]] | None = None
        self.starts: list[list[int]] = []
        self.handed: list[int] = []  # per planned chunk: its layers handed out
        self.done = 0  # layers reported so far
        self.live = 0  # leading planned chunks still verified

    def progress(self, p: LoadProgress) -> None:
        if self.planned is None:
            if p.layers_done != 0:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "load_progress before the plan")
            check_regions([(c.offset, sum(c.layers)) for c in p.chunks], self.staging.size)
            self.planned = [(c.offset, c.layers) for c in p.chunks]
            self.starts = [packed_layout(c.layers)[0] for c in p.chunks]
            self.handed = [0] * len(self.planned)
            self.live = len(self.planned)
            return
        if p.layers_done < self.done or p.verified > self.live or p.chunks:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "load_progress out of order")
        self.live = p.verified
        for layer in range(self.done, p.layers_done):
            self._deliver(layer)
        self.done = p.layers_done

    def _deliver(self, layer: int) -> None:
        """Hand out ``layer`` of every live chunk that has it, one call per run."""
        assert self.planned is not None
        run: list[int] = []
        for c in range(self.live):
            if layer < len(self.planned[c][1]):
                run.append(c)
                continue
            self._hand_out(layer, run)  # a chunk without this layer ends a run
            run = []
        self._hand_out(layer, run)

    def _hand_out(self, layer: int, run: list[int]) -> None:
        if not run:
            return
        assert self.planned is not None
        views: list[memoryview] = []
        try:
            for c in run:
                off, sizes = self.planned[c]
                lo = off + self.starts[c][layer]
                views.append(self.staging.view[lo : lo + sizes[layer]].toreadonly())
            self.on_layer(layer, self.first + run[0], views)
            for c in run:
                self.handed[c] = layer + 1
        finally:
            for v in views:
                with contextlib.suppress(BufferError):
                    v.release()

    def complete(self, c: int) -> bool:
        """Whether planned chunk ``c`` was handed out with every one of its layers."""
        return (
            self.planned is not None and c < self.live and self.handed[c] == len(self.planned[c][1])
        )


def blocks_wire_bytes(b: EngineBlocks) -> int:
    """An upper bound of the bytes ``blocks`` adds to a prepare_store frame."""
    extra = 0 if b.extra_keys is None else 64 * len(b.extra_keys)
    return 128 + 72 * len(b.hashes) + extra + len(b.lora_name or "") + len(b.kind or "")
