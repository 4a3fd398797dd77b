"""Sealed direct reads (protocol-v1.md §5.33): the sidecar hands each object's
descriptor and the key of that object alone; the worker verifies and decrypts
it in its own process, from the page cache (mapped) straight into the
destination, so no byte of the load crosses the sidecar.

:class:`SealedPath` is the staging path with loads replaced: saves, layer-wise
loads and every chunk the sidecar cannot hand out this way (a server without
revision 16, an object sealed before per-object keys) go through staging as
before, so a client asking for sealed reads never loses a hit by asking.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import CorruptObject
from ..layouts import objkey, v1
from ..protocol import (
    MAX_REPLY_FDS,
    CompleteLoad,
    ErrorCode,
    ErrorReply,
    ProtocolError,
    SealedLoad,
    SealedLoadReply,
    SealedSlot,
    close_fds,
)
from . import direct as direct_io
from .buffers import DestCallback, LoadCallback, LoadedChunk, check_dests
from .session import CONNECTION_ERRORS, Session, expect
from .staged import StagedPath

#: The object's AEAD from the handed key (None: a plaintext object has none).
_AeadFor = Callable[[v1.ObjectHeader], v1.Aead | None]


def _aead_of(key: bytes) -> _AeadFor:
    if not key:
        return lambda _h: None
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # the worker's only crypto

    aead = AESGCM(key)
    return lambda _h: aead


#: Objects smaller than this are read (one copy into a reused buffer) rather than
#: mapped: a mapping's set-up and teardown cost more than copying a small object.
MAP_MIN_BYTES = 1 << 20


class _Scratch(threading.local):
    def __init__(self) -> None:
        self.buf = bytearray()


_SCRATCH = _Scratch()


def _map(fd: int, size: int) -> mmap.mmap | memoryview:
    """The object's bytes: mapped from the page cache (populated in one go), or read
    into this thread's buffer where it is small or cannot be mapped."""
    if size >= MAP_MIN_BYTES:
        try:
            return mmap.mmap(
                fd,
                size,
                flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                prot=mmap.PROT_READ,
            )
        except (OSError, ValueError):
            pass
    if len(_SCRATCH.buf) < size:
        _SCRATCH.buf = bytearray(size)
    view = memoryview(_SCRATCH.buf)[:size]
    if os.preadv(fd, [view], 0) != size:
        raise CorruptObject("object ends early")
    return view


def open_handed(
    fd: int,
    slot: SealedSlot,
    tenant: str,
    key: bytes,
    dests_for: Callable[[list[int]], list[Any]],
) -> list[Any]:
    """Verify and decrypt one handed object into ``dests_for(layer sizes)``; the
    destinations. Raises on anything wrong (the caller counts it a miss)."""
    size = os.fstat(fd).st_size
    if size != slot.size or size == 0:
        raise CorruptObject(f"object is {size} bytes, {slot.size} handed")
    buf = _map(fd, size)
    try:
        with memoryview(buf) as mv:
            h = v1.decode_header(mv)
            sizes = [le.length for le in h.layers]
            dests = dests_for(sizes)
            device = [direct_io.is_device(d) for d in dests]
            outs = [
                memoryview(bytearray(n)) if dev else direct_io.writable_view(d)[:n]
                for d, n, dev in zip(dests, sizes, device, strict=True)
            ]
            try:
                objkey.open_layers_into(
                    mv,
                    outs,
                    tenant=tenant,
                    namespace=slot.namespace,
                    chunk_key=key,
                    object_aead=_aead_of(slot.key),
                    header=h,
                )
                for d, dev, o in zip(dests, device, outs, strict=True):
                    if dev:  # a GPU layer: decrypted on the host, then copied up
                        direct_io.copy_into(o, d)
            finally:
                with contextlib.suppress(BufferError):
                    for o in outs:
                        o.release()
            return dests
    finally:
        if isinstance(buf, mmap.mmap):
            # A failure's traceback may still hold views of the mapping: then it
            # is unmapped when they go, with the exception.
            with contextlib.suppress(BufferError):
                buf.close()


def _read_ahead(fds: Sequence[int]) -> None:
    """Ask the kernel to read every handed object now: the later ones arrive while
    the first is decrypted (a cold batch overlaps its I/O with its AES)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    for fd in fds:
        with contextlib.suppress(OSError):
            advise(fd, 0, 0, os.POSIX_FADV_WILLNEED)


class _CallerError(Exception):
    """What ``dest_for`` raised (its cause): re-raised, never counted a miss."""


class SealedPath(StagedPath):
    """Staging, with loads taken as sealed direct reads where the server offers them."""

    name = "sealed"

    def load(
        self,
        s: Session,
        keys: list[bytes],
        results: list[LoadedChunk],
        into: LoadCallback | None,
        dest_for: DestCallback | None,
    ) -> None:
        if not s.hello.sealed_load:
            super().load(s, keys, results, into, dest_for)
            return
        pos = 0
        step = min(MAX_REPLY_FDS, s.hello.max_batch)
        while pos < len(keys) and s.alive:
            batch = keys[pos : pos + step]
            reply, fds = s.call_fds(SealedLoad(s.tenant, tuple(batch)))
            try:
                if isinstance(reply, ErrorReply):
                    if reply.code is ErrorCode.UNSUPPORTED:  # no §5.32 after all
                        break
                    s.on_error_reply(reply)
                    return
                prep = expect(reply, SealedLoadReply)
                if len(prep.chunks) != len(batch) or len(fds) != prep.found:
                    raise ProtocolError(ErrorCode.BAD_REQUEST, "sealed_load reply does not add up")
                ok = self._open_batch(s, keys, pos, prep, fds, results, into, dest_for)
            finally:
                close_fds(fds)
            if not ok:
                return
            pos += prep.found
            if prep.stop is ErrorCode.OK or (prep.stop is ErrorCode.BUSY and prep.found):
                continue  # the next batch, or the rest of this one
            if prep.stop is not ErrorCode.UNSUPPORTED:
                return  # a miss
            break  # an object only the sidecar opens: staging from here
        if pos < len(keys) and s.alive:
            self._staged_rest(s, keys, pos, results, into, dest_for)

    def _open_batch(
        self,
        s: Session,
        keys: list[bytes],
        pos: int,
        prep: SealedLoadReply,
        fds: list[int],
        results: list[LoadedChunk],
        into: LoadCallback | None,
        dest_for: DestCallback | None,
    ) -> bool:
        """Open the handed prefix in order; False at the first that fails (a miss,
        reported to the server as corrupt so it verifies the object itself)."""
        bad: list[int] = []
        _read_ahead(fds)
        try:
            for j, fd in enumerate(fds):
                idx = pos + j

                def dests_for(sizes: list[int], idx: int = idx) -> list[Any]:
                    if dest_for is not None:
                        try:
                            return check_dests(dest_for(idx, keys[idx], sizes), sizes)
                        except Exception as exc:
                            raise _CallerError from exc
                    buf = memoryview(bytearray(sum(sizes)))
                    bounds = [0, *itertools.accumulate(sizes)]
                    return [buf[a:b] for a, b in itertools.pairwise(bounds)]

                try:
                    dests = open_handed(fd, prep.chunks[j], s.tenant, keys[idx], dests_for)
                except _CallerError as exc:
                    assert exc.__cause__ is not None
                    raise exc.__cause__ from None  # the caller's mistake, not the object's
                except Exception as exc:  # a torn, flipped or foreign object: a miss
                    dests = None
                    s.warn(logging.WARNING, "sealed-read", f"kvoffload sealed read failed: {exc}")
                if dests is None:
                    bad.append(j)
                    return False
                if dest_for is not None:
                    results[idx] = LoadedChunk(keys[idx], True)
                elif into is None:
                    results[idx] = LoadedChunk(keys[idx], True, list(dests))
                else:
                    into(idx, keys[idx], [d.toreadonly() for d in dests])
                    results[idx] = LoadedChunk(keys[idx], True)
            return True
        finally:
            if prep.handle:
                try:
                    if bad:
                        done = s.call(CompleteLoad(prep.handle, tuple(bad)))
                        if isinstance(done, ErrorReply):
                            s.on_error_reply(done)
                    else:
                        s.complete_load(prep.handle)  # posted where the server allows (§5.29)
                except CONNECTION_ERRORS as exc:
                    s.lose(exc)

    def _staged_rest(
        self,
        s: Session,
        keys: list[bytes],
        pos: int,
        results: list[LoadedChunk],
        into: LoadCallback | None,
        dest_for: DestCallback | None,
    ) -> None:
        """``keys[pos:]`` through staging, the callbacks' indices kept."""
        rest = keys[pos:]
        sub = [LoadedChunk(k, False) for k in rest]
        sub_into = None if into is None else _shifted(into, pos)
        sub_dest = None if dest_for is None else _shifted(dest_for, pos)
        super().load(s, rest, sub, sub_into, sub_dest)
        results[pos:] = sub


def _shifted(fn: Callable[..., Any], by: int) -> Callable[..., Any]:
    def call(idx: int, *args: Sequence[Any]) -> Any:
        return fn(idx + by, *args)

    return call


__all__ = ["SealedPath", "open_handed"]
