"""The worker's client of the sidecar: lookup, save and load chunks through staging memory.

A cache must never take its user down with it. Every connection problem —
sidecar absent, restarting, hung, or speaking garbage — turns into the
answer for an empty cache: ``lookup`` 0, ``save`` all False, ``load`` all
misses, ``stats`` ``{}``; it is logged at warning level (rate-limited) and the
client reconnects on a later call, with exponential backoff so that a dead
sidecar costs one failed ``connect`` per backoff period, not one per call.
Only programming errors raise: bad arguments, a chunk that can never fit the
staging buffer, use after ``close()``, or an exception from the caller's own
``into`` callback.

Calls are serialized by a lock: each call starts with the whole staging
buffer free, which is what lets ``save`` and ``load`` size their batches.

With ``direct=True``, a tenant the sidecar offers the direct path for
(``hello``'s ``direct``: policy ``encryption = "none"``, ``direct = true``)
is saved and loaded without the staging buffer: the worker writes and reads
sidecar-leased layout-v1 files itself (:mod:`kvoffload.direct`, GDS from and
to GPU memory where the node has it). Results and failure handling are the
same as on the staging path; any other tenant, or a sidecar that does not
offer it, quietly uses staging.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvoffload.errors import ChunkTooLarge

from . import direct as direct_io
from .contract import validate_tenant
from .layouts import v1
from .protocol import (
    ALIGNMENT,
    KEY_SIZE,
    MAX_LAYERS,
    MAX_PROTOCOL_VERSION,
    MIN_PROTOCOL_VERSION,
    Abort,
    Ack,
    Bye,
    ChunkSpec,
    CompleteLoad,
    CompleteStore,
    CompleteStoreReply,
    ErrorCode,
    ErrorReply,
    Hello,
    HelloReply,
    LeaseLoad,
    LeaseLoadReply,
    LeaseSlot,
    LeaseStore,
    LeaseStoreReply,
    Lookup,
    LookupReply,
    PrepareLoad,
    PrepareLoadReply,
    PrepareStore,
    PrepareStoreReply,
    ProtocolError,
    RegisterStaging,
    Reply,
    Request,
    Stats,
    StatsReply,
    StoreSlot,
    StoreStatus,
    Touch,
    close_fds,
    packed_layout,
    parse_reply,
    region_size,
    request_message,
)
from .staging import StagingBuffer, StagingError
from .transport import DEFAULT_TIMEOUT_S, Transport, TransportError, UnixTransport

log = logging.getLogger(__name__)
_R = TypeVar("_R")

DEFAULT_SOCKET_PATH = "/run/kvoffload/kvoffload.sock"
#: Four chunks of 32 layers × 1 MiB.
DEFAULT_STAGING_BYTES = 128 << 20

#: Conservative msgpack size of one chunk entry in prepare_store: key (34),
#: map keys and headers (~24), one u64 (≤ 9 bytes) per layer size.
_CHUNK_ENTRY_BYTES = 64
_LAYER_ENTRY_BYTES = 9
_FRAME_SLACK = 4096
#: Chunks per lease_store / lease_load request: bounds the leased files, pins
#: and reply size a single call holds.
DIRECT_BATCH = 32

#: A layer argument: anything with the buffer protocol (bytes, bytearray,
#: memoryview, numpy array), or a contiguous CPU torch tensor.
BufferLike = Any
LoadCallback = Callable[[int, bytes, Sequence[memoryview]], None]
#: ``dest_for(index, key, layer_sizes)``: where ``load_to`` puts a chunk's
#: layers: writable host buffers or GPU tensors, one per layer, each at least
#: its layer's size.
DestCallback = Callable[[int, bytes, Sequence[int]], Sequence[Any]]


class _Unavailable(Exception):
    """The sidecar answered, but the session cannot continue (refused hello, draining)."""


#: What "the sidecar is not usable right now" looks like from here.
_CONNECTION_ERRORS = (TransportError, ProtocolError, _Unavailable, StagingError, OSError)


@dataclass
class LoadedChunk:
    """One requested key's outcome. ``layers`` holds copies, unless an ``into``
    callback received the data, in which case it is empty."""

    key: bytes
    ok: bool
    layers: list[memoryview] = field(default_factory=list)


def as_byte_view(obj: BufferLike) -> memoryview:
    """A flat, read-only byte view of a layer, without copying."""
    if type(obj).__module__.partition(".")[0] == "torch":
        # torch tensors have no buffer protocol; importing torch here costs
        # nothing since the caller already has it loaded.
        import torch

        if obj.device.type != "cpu":
            raise ValueError(f"layer tensor must be on the CPU, not {obj.device}")
        if not obj.is_contiguous():
            raise ValueError("layer tensor must be contiguous")
        obj = obj.reshape(-1).view(torch.uint8).numpy()
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError(f"layer of type {type(obj).__name__} is not a buffer") from None
    if not mv.c_contiguous:
        raise ValueError("layer buffer must be C-contiguous")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv.toreadonly()


def _check_keys(keys: Sequence[bytes]) -> list[bytes]:
    out = list(keys)
    for i, k in enumerate(out):
        if not isinstance(k, bytes) or len(k) != KEY_SIZE:
            raise ValueError(f"keys[{i}] must be {KEY_SIZE} bytes")
    return out


class _RateLimitedLog:
    """One warning per category per interval; the next one says how many were dropped."""

    def __init__(self, interval_s: float, clock: Callable[[], float]) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._next: dict[str, float] = {}
        self._dropped: dict[str, int] = {}

    def __call__(self, level: int, category: str, msg: str) -> None:
        now = self._clock()
        if now < self._next.get(category, float("-inf")):
            self._dropped[category] = self._dropped.get(category, 0) + 1
            return
        dropped = self._dropped.pop(category, 0)
        suffix = f" ({dropped} similar messages suppressed)" if dropped else ""
        log.log(level, "%s%s", msg, suffix)
        self._next[category] = now + self._interval_s


@dataclass
class _Session:
    transport: Transport
    hello: HelloReply
    salt: bytes
    next_id: int = 1

    def take_id(self) -> int:
        rid = self.next_id
        self.next_id = rid % (2**32 - 1) + 1
        return rid


class SidecarClient:
    """Client of one tenant's cache on the node's sidecar.

    ``connect`` replaces the Unix-socket connection (tests pass an in-memory
    transport); ``clock`` drives backoff and log rate limits.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        tenant: str,
        *,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        name: str | None = None,
        connect: Callable[[], Transport] | None = None,
        clock: Callable[[], float] = time.monotonic,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        log_interval_s: float = 60.0,
        direct: bool = False,
    ) -> None:
        self._tenant = validate_tenant(tenant)
        if staging_bytes < ALIGNMENT:
            raise ValueError(f"staging_bytes must be at least {ALIGNMENT}")
        self._socket_path = os.fspath(socket_path)
        self._staging_bytes = -(-staging_bytes // ALIGNMENT) * ALIGNMENT
        self._timeout_s = timeout_s
        self._name = (name or f"kvoffload-client pid={os.getpid()}")[:128]
        self._connect = connect or self._connect_unix
        self._clock = clock
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._backoff_s = backoff_initial_s
        self._retry_at = float("-inf")
        self._warn = _RateLimitedLog(log_interval_s, clock)
        self._rng = random.Random()
        self._lock = threading.RLock()
        self._session: _Session | None = None
        self._staging: StagingBuffer | None = None
        self._closed = False
        self._salt: bytes | None = None
        self._direct = direct

    # -- public API ----------------------------------------------------------

    @property
    def tenant(self) -> str:
        return self._tenant

    @property
    def staging_bytes(self) -> int:
        """Capacity of the staging buffer: no chunk may pack to more than this."""
        return self._staging_bytes

    @property
    def connected(self) -> bool:
        return self._session is not None

    @property
    def salt(self) -> bytes | None:
        """The tenant's salt for ``chunk_keys``; connects if needed. None: sidecar unavailable.

        It can change after a reconnect to a different store; keys computed
        with an old salt then simply miss.
        """
        with self._lock:
            s = self._ensure_session()
            return s.salt if s is not None else None

    @property
    def server_info(self) -> HelloReply | None:
        s = self._session
        return s.hello if s is not None else None

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the sidecar holds (advisory: a load may still miss)."""
        keys = _check_keys(keys)
        if not keys:
            return 0
        with self._lock:
            s = self._ensure_session()
            if s is None:
                return 0
            total = 0
            try:
                for i in range(0, len(keys), s.hello.max_batch):
                    batch = keys[i : i + s.hello.max_batch]
                    reply = self._call(s, Lookup(self._tenant, tuple(batch)))
                    if isinstance(reply, ErrorReply):
                        self._on_error_reply(s, reply)
                        break
                    found = self._expect(reply, LookupReply).found
                    if found > len(batch):
                        raise ProtocolError(ErrorCode.BAD_REQUEST, "lookup found > keys asked")
                    total += found
                    if found < len(batch):
                        break
            except _CONNECTION_ERRORS as exc:
                self._lose(s, exc)
            return total

    def uses_direct(self) -> bool:
        """Whether saves and loads take the direct path now (connects if needed)."""
        with self._lock:
            s = self._ensure_session()
            return s is not None and self._direct_on(s)

    def _direct_on(self, s: _Session) -> bool:
        return self._direct and bool(s.hello.direct.get(self._tenant, False))

    def save(
        self,
        namespace: bytes,
        chunks: Sequence[tuple[bytes, Sequence[BufferLike]]],
        *,
        ttl_s: float | None = None,
    ) -> list[bool]:
        """Store chunks; True for each stored (or already present), False otherwise.

        Layers are host buffers (or CPU tensors); with ``direct=True`` they may
        also be GPU tensors, which the staging path copies to the host first.
        Raises :class:`ChunkTooLarge` for a chunk that packs to more than
        :attr:`staging_bytes`, before anything is sent (not with ``direct``,
        which needs no staging; such a chunk is not saved if the direct path
        turns out to be unavailable).
        """
        if not isinstance(namespace, bytes) or len(namespace) != KEY_SIZE:
            raise ValueError(f"namespace must be a {KEY_SIZE}-byte fingerprint")
        keys = _check_keys([k for k, _ in chunks])
        if len(set(keys)) != len(keys):
            raise ValueError("duplicate key in one save")
        srcs: list[list[Any]] = []
        for i, (_, layers) in enumerate(chunks):
            if not 1 <= len(layers) <= MAX_LAYERS:
                raise ValueError(f"chunk {i}: 1..{MAX_LAYERS} layers expected, got {len(layers)}")
            lv = [b if direct_io.is_device(b) else as_byte_view(b) for b in layers]
            sizes = [direct_io.nbytes(v) for v in lv]
            if any(n == 0 for n in sizes):
                raise ValueError(f"chunk {i}: empty layer")
            packed = region_size(sizes)
            if packed > self._staging_bytes and not self._direct:
                raise ChunkTooLarge(
                    f"chunk {i} needs {packed} bytes of staging, the buffer holds "
                    f"{self._staging_bytes}: raise staging_bytes"
                )
            srcs.append(lv)
        results = [False] * len(keys)
        if not keys:
            return results
        with self._lock:
            s = self._ensure_session()
            if s is None:
                return results
            try:
                if self._direct_on(s):
                    self._save_direct(s, namespace, keys, srcs, ttl_s, results)
                    return results
                views = [
                    [direct_io.to_host(v) if direct_io.is_device(v) else v for v in lv]
                    for lv in srcs
                ]
                fits = [region_size([v.nbytes for v in lv]) <= self._staging_bytes for lv in views]
                if not all(fits):
                    self._warn(
                        logging.WARNING,
                        "direct-unavailable",
                        "kvoffload: the direct path is not offered for tenant "
                        f"{self._tenant!r}; {fits.count(False)} chunk(s) exceed the staging "
                        "buffer and are not saved",
                    )
                for batch in self._store_batches(s, keys, views):
                    batch = [i for i in batch if fits[i]]
                    if batch:
                        self._save_batch(s, namespace, keys, views, batch, ttl_s, results)
                    if self._session is not s:
                        break
            except _CONNECTION_ERRORS as exc:
                self._lose(s, exc)
            return results

    def load(self, keys: Sequence[bytes], into: LoadCallback | None = None) -> list[LoadedChunk]:
        """Load chunks; the ``ok`` ones form a prefix of ``keys``.

        Without ``into``, each loaded chunk's layers are copied out of staging
        into fresh memory. With ``into``, ``into(index, key, layers)`` is
        called for each loaded chunk with read-only views of the staging
        buffer, valid only during the call (they are released afterwards), and
        the returned chunks carry no layers. An exception from ``into``
        propagates after the server was told the loads are complete.
        """
        keys = _check_keys(keys)
        results = [LoadedChunk(k, False) for k in keys]
        if not keys:
            return results
        with self._lock:
            s = self._ensure_session()
            if s is None:
                return results
            if self._direct_on(s):
                try:
                    self._load_direct(s, keys, results, into, None)
                except _CONNECTION_ERRORS as exc:
                    self._lose(s, exc)
                return results
            pos = 0
            try:
                while pos < len(keys):
                    n, more = self._load_batch(s, keys, pos, into, results)
                    pos += n
                    if not more or self._session is not s:
                        break
            except _CONNECTION_ERRORS as exc:
                self._lose(s, exc)
            return results

    def load_to(self, keys: Sequence[bytes], dest_for: DestCallback) -> list[bool]:
        """Load chunks straight into destinations the caller names; True per loaded key.

        ``dest_for(index, key, layer_sizes)`` returns one writable buffer (or
        GPU tensor) per layer. On the direct path the layers are read into
        them (GDS for GPU tensors where the node has it); on the staging path
        they are copied from staging. The True entries form a prefix of
        ``keys``; a destination of a key that is not loaded may hold garbage.
        """
        keys = _check_keys(keys)
        results = [LoadedChunk(k, False) for k in keys]
        if not keys:
            return []
        with self._lock:
            s = self._ensure_session()
            if s is None:
                return [False] * len(keys)
            if self._direct_on(s):
                try:
                    self._load_direct(s, keys, results, None, dest_for)
                except _CONNECTION_ERRORS as exc:
                    self._lose(s, exc)
                return [r.ok for r in results]

        def copy(idx: int, key: bytes, views: Sequence[memoryview]) -> None:
            dests = dest_for(idx, key, [v.nbytes for v in views])
            for v, d in zip(views, _check_dests(dests, [v.nbytes for v in views]), strict=True):
                direct_io.copy_into(v, d)

        return [r.ok for r in self.load(keys, into=copy)]

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark chunks recently used. Best effort: failures are only logged."""
        keys = _check_keys(keys)
        if not keys:
            return
        with self._lock:
            s = self._ensure_session()
            if s is None:
                return
            try:
                for i in range(0, len(keys), s.hello.max_batch):
                    reply = self._call(
                        s, Touch(self._tenant, tuple(keys[i : i + s.hello.max_batch]))
                    )
                    if isinstance(reply, ErrorReply):
                        self._on_error_reply(s, reply)
                        return
                    self._expect(reply, Ack)
            except _CONNECTION_ERRORS as exc:
                self._lose(s, exc)

    def stats(self) -> dict[str, Any]:
        """The sidecar's statistics, or ``{}`` when it is unavailable."""
        with self._lock:
            s = self._ensure_session()
            if s is None:
                return {}
            try:
                reply = self._call(s, Stats())
                if isinstance(reply, ErrorReply):
                    self._on_error_reply(s, reply)
                    return {}
                return dict(self._expect(reply, StatsReply).stats)
            except _CONNECTION_ERRORS as exc:
                self._lose(s, exc)
                return {}

    def close(self) -> None:
        """Say bye, disconnect and unmap the staging buffer. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            s, self._session = self._session, None
            if s is not None:
                with contextlib.suppress(*_CONNECTION_ERRORS):
                    self._call(s, Bye())
                s.transport.close()
            if self._staging is not None:
                self._staging.close()
                self._staging = None

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- connection ----------------------------------------------------------

    def _connect_unix(self) -> Transport:
        return UnixTransport.connect(self._socket_path, timeout_s=self._timeout_s)

    def _ensure_session(self) -> _Session | None:
        if self._closed:
            raise RuntimeError("SidecarClient is closed")
        if self._session is not None:
            return self._session
        if self._clock() < self._retry_at:
            return None
        transport: Transport | None = None
        try:
            transport = self._connect()
            session = self._handshake(transport)
        except _CONNECTION_ERRORS as exc:
            if transport is not None:
                transport.close()
            self._failed(f"kvoffload sidecar at {self._socket_path} unavailable: {exc}")
            return None
        if self._salt is not None and session.salt != self._salt:
            log.info(
                "tenant %s: salt changed (different store?); cached keys will miss", self._tenant
            )
        self._salt = session.salt
        self._session = session
        self._backoff_s = self._backoff_initial_s
        log.info(
            "connected to kvoffload sidecar %s (store %s, protocol %d)",
            session.hello.server_id,
            session.hello.store_id,
            session.hello.version,
        )
        return session

    def _handshake(self, transport: Transport) -> _Session:
        hello_req = Hello(MIN_PROTOCOL_VERSION, MAX_PROTOCOL_VERSION, self._name, (self._tenant,))
        transport.send(request_message(1, hello_req))
        _, reply = self._read_reply(transport, 1, hello_req)
        if isinstance(reply, ErrorReply):
            raise _Unavailable(f"hello refused: {reply.code.name}: {reply.message}")
        hello = self._expect(reply, HelloReply)
        if not MIN_PROTOCOL_VERSION <= hello.version <= MAX_PROTOCOL_VERSION:
            raise _Unavailable(f"server chose protocol version {hello.version}, not offered")
        salt = hello.salts.get(self._tenant)
        if salt is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "hello reply lacks the tenant's salt")
        if self._staging is None:
            size = min(self._staging_bytes, hello.max_staging // ALIGNMENT * ALIGNMENT)
            self._staging = StagingBuffer(size, name=f"kvoffload-staging-{self._tenant}")
        elif self._staging.size > hello.max_staging:
            raise _Unavailable(
                f"staging buffer of {self._staging.size} bytes exceeds the server's "
                f"limit of {hello.max_staging}"
            )
        self._staging_bytes = self._staging.size
        session = _Session(transport, hello, salt, next_id=2)
        reply = self._call(session, RegisterStaging(self._staging.size), fds=[self._staging.fd])
        if isinstance(reply, ErrorReply):
            raise _Unavailable(f"staging registration refused: {reply.code.name}: {reply.message}")
        self._expect(reply, Ack)
        return session

    def _failed(self, msg: str) -> None:
        # Jitter spreads the reconnects of every worker on a node after a
        # sidecar restart.
        self._retry_at = self._clock() + self._backoff_s * self._rng.uniform(0.5, 1.0)
        self._backoff_s = min(self._backoff_s * 2, self._backoff_max_s)
        self._warn(logging.WARNING, "connection", msg)

    def _lose(self, session: _Session, exc: BaseException) -> None:
        """Drop the session; the server releases everything it held for it."""
        if self._session is session:
            self._session = None
        session.transport.close()
        self._failed(f"lost the kvoffload sidecar connection: {exc}")

    def _on_error_reply(self, session: _Session, reply: ErrorReply) -> None:
        if reply.code is ErrorCode.SHUTTING_DOWN:
            self._lose(session, _Unavailable("sidecar is shutting down"))
        elif reply.code in (
            ErrorCode.BAD_REQUEST,
            ErrorCode.BAD_HANDLE,
            ErrorCode.NOT_REGISTERED,
            ErrorCode.UNSUPPORTED,
        ):
            # One side has a bug: start over with fresh state on both ends.
            self._lose(session, _Unavailable(f"{reply.code.name}: {reply.message}"))
        else:
            self._warn(
                logging.WARNING,
                f"reply-{reply.code.name}",
                f"kvoffload sidecar refused {reply.op}: {reply.code.name}: {reply.message}",
            )

    def _read_reply(self, transport: Transport, rid: int, req: Request) -> tuple[int, Reply]:
        frame = transport.recv()
        if frame.fds:
            close_fds(frame.fds)
            raise ProtocolError(ErrorCode.BAD_REQUEST, "server sent descriptors")
        got, reply = parse_reply(frame.msg)
        if got == 0 and isinstance(reply, ErrorReply):
            raise _Unavailable(f"sidecar closed the connection: {reply.code.name}: {reply.message}")
        if got != rid:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"reply to request {got}, expected {rid}")
        op = reply.op if isinstance(reply, ErrorReply | Ack) else reply.OP
        if op != req.OP:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"reply for {op}, expected {req.OP}")
        return got, reply

    def _call(self, session: _Session, req: Request, fds: Sequence[int] = ()) -> Reply:
        rid = session.take_id()
        session.transport.send(request_message(rid, req), fds)
        return self._read_reply(session.transport, rid, req)[1]

    @staticmethod
    def _expect(reply: Reply, cls: type[_R]) -> _R:
        if not isinstance(reply, cls):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"unexpected reply {reply!r}")
        return reply

    # -- save ----------------------------------------------------------------

    def _store_batches(
        self, s: _Session, keys: list[bytes], views: list[list[memoryview]]
    ) -> list[list[int]]:
        """Consecutive chunk indices that fit the staging buffer, max_batch and max_frame."""
        cap = self._staging_bytes
        frame_budget = s.hello.max_frame - _FRAME_SLACK
        batches: list[list[int]] = []
        cur: list[int] = []
        cur_bytes = cur_frame = 0
        for i, lv in enumerate(views):
            packed = region_size([v.nbytes for v in lv], s.hello.alignment)
            entry = _CHUNK_ENTRY_BYTES + _LAYER_ENTRY_BYTES * len(lv)
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
        s: _Session,
        namespace: bytes,
        keys: list[bytes],
        views: list[list[memoryview]],
        batch: list[int],
        ttl_s: float | None,
        results: list[bool],
    ) -> None:
        staging = self._staging
        assert staging is not None  # a session implies a registered buffer
        specs = tuple(ChunkSpec(keys[i], tuple(v.nbytes for v in views[i])) for i in batch)
        reply = self._call(s, PrepareStore(self._tenant, namespace, specs, ttl_s))
        if isinstance(reply, ErrorReply):
            self._on_error_reply(s, reply)
            return
        prep = self._expect(reply, PrepareStoreReply)
        if len(prep.chunks) != len(batch):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "prepare_store reply has wrong length")
        regions: list[tuple[int, int]] = []
        for slot, sp in zip(prep.chunks, specs, strict=True):
            if slot.status is StoreStatus.WRITE:
                regions.append((slot.offset, sp.payload))
        self._check_regions(regions, staging.size)
        try:
            for slot, i in zip(prep.chunks, batch, strict=True):
                if slot.status is StoreStatus.WRITE:
                    self._copy_in(staging, slot.offset, views[i])
        except BaseException:
            with contextlib.suppress(*_CONNECTION_ERRORS):
                self._call(s, Abort(prep.handle))
            raise
        self._complete_batch(s, prep.chunks, prep.handle, batch, results)

    def _complete_batch(
        self,
        s: _Session,
        slots: Sequence[StoreSlot | LeaseSlot],
        handle: int,
        batch: list[int],
        results: list[bool],
    ) -> bool:
        """After the data is in place: report rejections, complete the handle and
        record each chunk's outcome. False if the session failed on the way."""
        rejected = [sl for sl in slots if sl.status is StoreStatus.REJECTED]
        if rejected:
            self._warn(
                logging.WARNING,
                "store-rejected",
                f"kvoffload sidecar rejected {len(rejected)} chunk(s): "
                + ", ".join(sorted({sl.code.name for sl in rejected})),
            )
        if handle == 0:
            for slot, i in zip(slots, batch, strict=True):
                results[i] = slot.status is StoreStatus.EXISTS
            return True
        reply = self._call(s, CompleteStore(handle))
        if isinstance(reply, ErrorReply):
            self._on_error_reply(s, reply)
            return False
        done = self._expect(reply, CompleteStoreReply)
        if len(done.stored) != len(batch):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "complete_store reply has wrong length")
        for ok, i in zip(done.stored, batch, strict=True):
            results[i] = ok
        return True

    @staticmethod
    def _copy_in(staging: StagingBuffer, offset: int, layers: list[memoryview]) -> None:
        dst = staging.view
        offs, _ = packed_layout([v.nbytes for v in layers])
        for lo, v in zip(offs, layers, strict=True):
            start = offset + lo
            dst[start : start + v.nbytes] = v

    @staticmethod
    def _check_regions(regions: list[tuple[int, int]], size: int) -> None:
        """The server's offsets must stay inside the buffer and apart: a slice past
        the end of a memoryview would silently truncate instead of failing."""
        end = 0
        for off, n in sorted(regions):
            if off < end or off + n > size:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"bad staging region {off}+{n}")
            end = off + n

    # -- the direct path (protocol-v1.md 5.14, 5.15) --------------------------------

    def _save_direct(
        self,
        s: _Session,
        namespace: bytes,
        keys: list[bytes],
        srcs: list[list[Any]],
        ttl_s: float | None,
        results: list[bool],
    ) -> None:
        io = direct_io.select()
        step = min(DIRECT_BATCH, s.hello.max_batch)
        for start in range(0, len(keys), step):
            batch = list(range(start, min(start + step, len(keys))))
            specs = tuple(
                ChunkSpec(keys[i], tuple(direct_io.nbytes(v) for v in srcs[i])) for i in batch
            )
            reply = self._call(s, LeaseStore(self._tenant, namespace, specs, ttl_s))
            if isinstance(reply, ErrorReply):
                self._on_error_reply(s, reply)
                return
            prep = self._expect(reply, LeaseStoreReply)
            if len(prep.chunks) != len(batch):
                raise ProtocolError(ErrorCode.BAD_REQUEST, "lease_store reply has wrong length")
            try:
                for slot, sp, i in zip(prep.chunks, specs, batch, strict=True):
                    if slot.status is StoreStatus.WRITE:
                        self._write_leased(
                            io,
                            slot,
                            namespace,
                            sp,
                            srcs[i],
                            o_direct=prep.durability in ("object", ""),
                        )
            except BaseException:
                with contextlib.suppress(*_CONNECTION_ERRORS):
                    self._call(s, Abort(prep.handle))
                raise
            if not self._complete_batch(s, prep.chunks, prep.handle, batch, results):
                return

    def _write_leased(
        self,
        io: direct_io.DirectIO,
        slot: Any,
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
            tenant=self._tenant,
            namespace=namespace,
            chunk_key=spec.key,
            lengths=spec.layers,
            checks=direct_io.checks_of(layers),
            created_ns=time.time_ns(),
        )
        try:
            io.write_object(slot.path, header, layers, offsets, o_direct=o_direct)
        except OSError as exc:
            self._warn(logging.WARNING, "direct-write", f"kvoffload direct write failed: {exc}")

    def _load_direct(
        self,
        s: _Session,
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
            reply = self._call(s, LeaseLoad(self._tenant, tuple(batch)))
            if isinstance(reply, ErrorReply):
                self._on_error_reply(s, reply)
                return
            prep = self._expect(reply, LeaseLoadReply)
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
                        dests = _check_dests(dest_for(idx, keys[idx], sizes), sizes)
                    else:
                        buf = memoryview(bytearray(sum(sizes)))
                        bounds = [0, *itertools.accumulate(sizes)]
                        dests = [buf[a:b] for a, b in itertools.pairwise(bounds)]
                    try:
                        ok = io.read_layers(slot.path, extents, dests)
                    except OSError as exc:
                        self._warn(
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
                        done = self._call(s, CompleteLoad(prep.handle, tuple(bad)))
                        if isinstance(done, ErrorReply):
                            self._on_error_reply(s, done)
                    except _CONNECTION_ERRORS as exc:
                        self._lose(s, exc)
            if bad or not (prep.stop is ErrorCode.BUSY and n > 0) or self._session is not s:
                return
            pos += n

    # -- load ----------------------------------------------------------------

    def _load_batch(
        self,
        s: _Session,
        keys: list[bytes],
        pos: int,
        into: LoadCallback | None,
        results: list[LoadedChunk],
    ) -> tuple[int, bool]:
        """Load keys[pos:] up to one batch; (chunks loaded, worth asking for more)."""
        staging = self._staging
        assert staging is not None
        batch = keys[pos : pos + s.hello.max_batch]
        reply = self._call(s, PrepareLoad(self._tenant, tuple(batch)))
        if isinstance(reply, ErrorReply):
            self._on_error_reply(s, reply)
            return 0, False
        prep = self._expect(reply, PrepareLoadReply)
        if len(prep.chunks) != len(batch):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "prepare_load reply has wrong length")
        n = prep.verified
        loaded = prep.chunks[:n]
        try:
            self._check_regions(
                [(c.offset, sum(c.layers)) for c in loaded],
                staging.size,
            )
            for j, slot in enumerate(loaded):
                offs, _ = packed_layout(slot.layers)
                src = [
                    staging.view[slot.offset + lo : slot.offset + lo + size].toreadonly()
                    for lo, size in zip(offs, slot.layers, strict=True)
                ]
                idx = pos + j
                if into is None:
                    buf = memoryview(bytearray(sum(slot.layers)))
                    layers: list[memoryview] = []
                    at = 0
                    for v in src:
                        buf[at : at + v.nbytes] = v
                        layers.append(buf[at : at + v.nbytes])
                        at += v.nbytes
                    results[idx] = LoadedChunk(keys[idx], True, layers)
                else:
                    try:
                        into(idx, keys[idx], src)
                    finally:
                        for v in src:
                            with contextlib.suppress(BufferError):
                                v.release()
                    results[idx] = LoadedChunk(keys[idx], True)
        finally:
            if prep.handle:
                # Everything verified is already copied out: a failure from
                # here on cannot unmake those results, and a disconnect
                # releases the handle anyway.
                try:
                    done = self._call(s, CompleteLoad(prep.handle))
                    if isinstance(done, ErrorReply):
                        self._on_error_reply(s, done)
                except _CONNECTION_ERRORS as exc:
                    self._lose(s, exc)
        # OK and NOT_FOUND are ordinary outcomes; BUSY after progress means "ask again".
        quiet = prep.stop in (ErrorCode.OK, ErrorCode.NOT_FOUND) or (
            prep.stop is ErrorCode.BUSY and n > 0
        )
        if not quiet:
            self._warn(
                logging.WARNING,
                f"load-{prep.stop.name}",
                f"kvoffload load stopped early: {prep.stop.name}",
            )
        return n, prep.stop is ErrorCode.BUSY and n > 0


def _check_dests(dests: Sequence[Any], sizes: Sequence[int]) -> list[Any]:
    out = list(dests)
    if len(out) != len(sizes):
        raise ValueError(f"dest_for returned {len(out)} destinations for {len(sizes)} layers")
    for i, (d, n) in enumerate(zip(out, sizes, strict=True)):
        if direct_io.nbytes(d) < n:
            raise ValueError(f"destination of layer {i} holds fewer than {n} bytes")
    return out


__all__ = [
    "DEFAULT_SOCKET_PATH",
    "DEFAULT_STAGING_BYTES",
    "BufferLike",
    "ChunkTooLarge",
    "DestCallback",
    "LoadCallback",
    "LoadedChunk",
    "SidecarClient",
    "as_byte_view",
]


def fetch_stats(socket_path: str | os.PathLike[str], timeout_s: float = 5.0) -> dict[str, Any]:
    """The sidecar's counters, over a connection that names no tenant.

    Unlike ``SidecarClient.stats`` this neither creates a tenant's keys nor
    registers a staging buffer, so an operator's `kvoffload stats` has no side
    effects. Raises ``TransportError``/``ProtocolError`` if the sidecar is unreachable.
    """
    transport = UnixTransport.connect(os.fspath(socket_path), timeout_s=timeout_s)
    try:
        exchanges: list[tuple[int, Request]] = [
            (1, Hello(MIN_PROTOCOL_VERSION, MAX_PROTOCOL_VERSION, "kvoffload stats", ())),
            (2, Stats()),
        ]
        result: dict[str, Any] = {}
        for rid, req in exchanges:
            transport.send(request_message(rid, req))
            frame = transport.recv()
            close_fds(frame.fds)
            got, reply = parse_reply(frame.msg)
            if isinstance(reply, ErrorReply):
                raise ProtocolError(reply.code, f"{req.OP.value} refused: {reply.message}")
            if got != rid:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"reply to {got}, expected {rid}")
            if isinstance(reply, StatsReply):
                result = dict(reply.stats)
        with contextlib.suppress(*_CONNECTION_ERRORS):
            transport.send(request_message(3, Bye()))
        return result
    finally:
        transport.close()
