"""The sidecar's server: protocol v1 (``docs/spec/protocol-v1.md``) over a Unix socket.

::

    accept ─▶ _Connection.run(): magic, hello, register_staging, then requests
                 │  hello/register_staging/bye inline; every other request is a
                 │  task whose store work runs on the thread pool, so replies
                 │  may leave in any order
                 └─ on close: wait for its tasks (pool threads may still touch
                    the staging mapping), then release handles, pins,
                    reservations and the mapping

Isolation (protocol-v1.md §6) is decided per request from the peer's
``SO_PEERCRED`` credentials and the *current* policy, so a policy reload that
revokes a grant applies to the next request of an open connection. A tenant
the connection may not use gets the empty-tenant answer without the store
being consulted, so neither content nor timing tells whether it exists.

The store is reached only through :class:`StoreAPI`, the subset of
``kvoffload.sidecar.store.Store`` the protocol needs; tests use fakes.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import functools
import logging
import os
import signal
import socket
import stat
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from kvoffload.protocol import (
    ALIGNMENT,
    CLIENT_MAGIC,
    MAX_BATCH,
    MAX_FDS,
    MAX_FRAME,
    MAX_PROTOCOL_VERSION,
    MIN_PROTOCOL_VERSION,
    SERVER_MAGIC,
    Abort,
    Ack,
    Bye,
    CompleteLoad,
    CompleteStore,
    CompleteStoreReply,
    ErrorCode,
    ErrorReply,
    Frame,
    FrameDecoder,
    Fsck,
    FsckReply,
    Hello,
    HelloReply,
    LayerExtent,
    LeaseLoad,
    LeaseLoadReply,
    LeaseSlot,
    LeaseStore,
    LeaseStoreReply,
    LoadSlot,
    Lookup,
    LookupReply,
    Op,
    PrepareLoad,
    PrepareLoadReply,
    PrepareStore,
    PrepareStoreReply,
    ProtocolError,
    Purge,
    PurgeReply,
    ReadSlot,
    RegisterStaging,
    Reply,
    Request,
    Stats,
    StatsReply,
    StoreSlot,
    StoreStatus,
    Touch,
    align_up,
    close_fds,
    encode_frame,
    error_message,
    fake_salt,
    negotiate_version,
    packed_layout,
    parse_request,
    region_size,
    reply_message,
)
from kvoffload.staging import RegionAllocator, StagingBuffer, StagingError

from ..layouts import v1
from .errors import LeaseInvalid, StoreError, StoreFull, StoreIOError
from .metrics import Metrics

log = logging.getLogger("kvoffload.server")

_T = TypeVar("_T")

RECV_SIZE = 256 * 1024
#: Linux SO_PEERGROUPS (4.13+); Python's socket module has no name for it.
_SO_PEERGROUPS = 59
_UCRED = struct.Struct("iII")
SECRET_SIZE = 32


# ---------------------------------------------------------------------------
# What the server needs of the store and the policy


class ReservationAPI(Protocol):
    def release(self) -> None: ...


class StoreAPI(Protocol):
    def tenant_salt(self, tenant: str) -> bytes: ...

    def put(
        self,
        tenant: str,
        namespace: bytes,
        chunk_key: bytes,
        layers: Sequence[memoryview],
        *,
        encrypt: bool = ...,
        ttl_s: float | None = ...,
        reservation: Any = ...,
    ) -> bool: ...

    def reserve(self, tenant: str, nbytes: int, *, quota: int | None = ...) -> ReservationAPI: ...

    def put_many(
        self,
        tenant: str,
        namespace: bytes,
        chunks: Sequence[tuple[bytes, Sequence[memoryview]]],
        *,
        encrypt: bool = ...,
        ttl_s: float | None = ...,
        reservations: Sequence[Any] | None = ...,
    ) -> list[bool]: ...

    def get_many_into(
        self, tenant: str, keys: Sequence[bytes], outs: Sequence[memoryview]
    ) -> list[list[int] | None]: ...

    def get_into(self, tenant: str, chunk_key: bytes, out: memoryview) -> list[int] | None: ...

    def payload_info(self, tenant: str, chunk_key: bytes) -> Any: ...

    def lookup(self, tenant: str, keys: Sequence[bytes]) -> int: ...

    def lookup_cached(self, tenant: str, keys: Sequence[bytes]) -> int | None: ...

    def pin(self, tenant: str, keys: Sequence[bytes]) -> None: ...

    def unpin(self, tenant: str, keys: Sequence[bytes]) -> None: ...

    def touch(self, tenant: str, keys: Sequence[bytes]) -> None: ...

    def purge_tenant(self, tenant: str) -> int: ...

    def purge_namespace(self, tenant: str, namespace: bytes) -> int: ...

    def fsck(self, repair: bool = ...) -> Any: ...

    def stats(self) -> dict[str, Any]: ...

    def maintain(self) -> dict[str, int]: ...

    # The direct path (protocol-v1.md 5.14, 5.15; sidecar/store.py).
    def lease_store(
        self,
        tenant: str,
        namespace: bytes,
        chunk_key: bytes,
        lengths: Sequence[int],
        *,
        ttl_s: float | None = ...,
        gid: int | None = ...,
        quota: int | None = ...,
    ) -> Any: ...

    def publish_lease(self, lease: Any) -> bool: ...

    def cancel_lease(self, lease: Any) -> None: ...

    def lease_load(self, tenant: str, key: bytes) -> Any: ...

    def check_reported(self, tenant: str, key: bytes) -> bool: ...


class TenantSettings(Protocol):
    @property
    def encryption(self) -> bool: ...

    @property
    def ttl_s(self) -> float | None: ...

    @property
    def direct(self) -> bool: ...

    @property
    def direct_gid(self) -> int | None: ...

    @property
    def quota_bytes(self) -> int | None: ...


class PolicyAPI(Protocol):
    def may_use(self, uid: int, gids: Sequence[int], tenant: str) -> bool: ...

    def is_admin(self, uid: int, gids: Sequence[int]) -> bool: ...

    def tenant(self, tenant: str) -> TenantSettings: ...


def _payload_of(info: Any) -> int | None:
    """Plaintext bytes of a chunk from ``payload_info``: an index record or layer sizes."""
    if info is None:
        return None
    if isinstance(info, list | tuple):
        return sum(int(n) for n in info)
    payload = getattr(info, "payload", None)
    return int(payload) if isinstance(payload, int) else None


# ---------------------------------------------------------------------------
# Configuration and peers


def load_or_create_secret(path: str | os.PathLike[str]) -> bytes:
    """The persistent secret behind fake salts (protocol-v1.md §5.1), created 0600 on first use.

    It must persist: a fake salt that changed on restart would tell a prober
    the tenant is not real, since real salts never change.
    """
    p = Path(path)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        data = p.read_bytes()
        if len(data) != SECRET_SIZE:
            raise ValueError(f"{p}: server secret must be {SECRET_SIZE} bytes") from None
        return data
    secret = os.urandom(SECRET_SIZE)
    try:
        os.write(fd, secret)
        os.fsync(fd)
    finally:
        os.close(fd)
    return secret


class ByteBudget:
    """Payload bytes the pool may be sealing, writing, reading or opening at once.

    Data verbs wait here (in a pool thread) until their bytes fit, so a burst
    of large requests queues as small control messages, never as payload
    copies: the payload itself stays in the clients' staging buffers. A
    request larger than the whole budget waits until it runs alone.
    """

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError("the in-flight byte budget must be positive")
        self.limit = limit
        self.in_use = 0
        self._cv = threading.Condition()

    @contextlib.contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        n = min(nbytes, self.limit)
        with self._cv:
            self._cv.wait_for(lambda: self.in_use + n <= self.limit)
            self.in_use += n
        try:
            yield
        finally:
            with self._cv:
                self.in_use -= n
                self._cv.notify_all()


@dataclass
class ServerConfig:
    socket_path: Path | None = None
    #: An inherited listening socket (systemd socket activation) instead of socket_path.
    socket_fd: int | None = None
    socket_mode: int = 0o660
    socket_group: str | None = None
    #: Key of the fake salts; use load_or_create_secret() in production.
    secret: bytes = field(default_factory=lambda: os.urandom(SECRET_SIZE))
    server_id: str = field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    )
    store_id: str | None = None
    workers: int = 0
    alignment: int = ALIGNMENT
    max_staging: int = 64 << 30
    max_batch: int = MAX_BATCH
    max_inflight: int = 64
    max_handles: int = 256
    handle_ttl_s: float = 60.0
    drain_timeout_s: float = 10.0
    maintenance_interval_s: float = 30.0
    max_inflight_bytes: int = 1 << 30

    @property
    def worker_threads(self) -> int:
        return self.workers or max(2, os.cpu_count() or 2)


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gids: tuple[int, ...]


def _supplementary_groups(sock: socket.socket, pid: int) -> list[int]:
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * 1024)
        return list(array.array("I", raw[: len(raw) // 4 * 4]))
    except OSError:
        pass
    # Older kernels: racy (the pid may be gone or reused) but better than nothing.
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return [int(g) for g in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return []


def peer_credentials(sock: socket.socket) -> Peer:
    pid, uid, gid = _UCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    )
    gids = dict.fromkeys([gid, *_supplementary_groups(sock, pid)])
    return Peer(pid, uid, tuple(gids))


# ---------------------------------------------------------------------------
# Per-connection state


class _Reject(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _Closed(Exception):
    pass


@dataclass
class _HeldWrite:
    index: int
    key: bytes
    layers: tuple[int, ...]
    offset: int
    reservation: ReservationAPI


@dataclass
class _StoreHandle:
    tenant: str
    namespace: bytes
    encrypt: bool
    ttl_s: float | None
    slots: tuple[StoreSlot, ...]
    held: list[_HeldWrite]
    created: float


@dataclass
class _LoadHandle:
    tenant: str
    keys: list[bytes]
    offsets: list[int]
    created: float


@dataclass
class _LeaseHandle:
    """A ``lease_store``: the leased temp files, until completed, aborted or expired."""

    tenant: str
    slots: tuple[LeaseSlot, ...]
    leases: list[tuple[int, Any]]  # (chunk index, store lease)
    created: float


_Handle = _StoreHandle | _LoadHandle | _LeaseHandle
_H = TypeVar("_H", _StoreHandle, _LoadHandle, _LeaseHandle)
#: Reply bytes besides a lease's path and layers (msgpack keys, sizes, slack).
_LEASE_ENTRY_BYTES = 96
_EXTENT_BYTES = 40


class _Connection:
    def __init__(self, server: Server, sock: socket.socket, peer: Peer) -> None:
        self.server = server
        self.sock = sock
        self.peer = peer
        self.decoder = FrameDecoder(expect_magic=CLIENT_MAGIC, max_frame=MAX_FRAME)
        self.version: int | None = None
        self.tenants: frozenset[str] = frozenset()
        self.staging: StagingBuffer | None = None
        self.alloc: RegionAllocator | None = None
        # Pool threads and the loop both touch alloc and handles.
        self.mu = threading.Lock()
        self.handles: dict[int, _Handle] = {}
        self.next_handle = 1
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.write_lock = asyncio.Lock()
        self.closing = False

    def __repr__(self) -> str:
        return f"<connection pid={self.peer.pid} uid={self.peer.uid}>"

    # -- I/O -------------------------------------------------------------------

    async def _wait_readable(self) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        fd = self.sock.fileno()

        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        loop.add_reader(fd, wake)
        try:
            await fut
        finally:
            loop.remove_reader(fd)

    async def _read_frames(self) -> list[Frame]:
        while True:
            try:
                data, fds, flags, _ = socket.recv_fds(
                    self.sock, RECV_SIZE, MAX_FDS + 1, socket.MSG_CMSG_CLOEXEC
                )
            except (BlockingIOError, InterruptedError):
                await self._wait_readable()
                continue
            if flags & socket.MSG_CTRUNC:
                close_fds(fds)
                raise ProtocolError(ErrorCode.BAD_REQUEST, "too many descriptors in one message")
            if not data:
                close_fds(fds)
                raise _Closed
            frames = self.decoder.feed(data, fds)
            if frames:
                return frames

    async def _send(self, data: bytes) -> None:
        async with self.write_lock:
            await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def _reply(self, rid: int, reply: Reply) -> None:
        metrics = self.server.metrics
        if metrics is not None and isinstance(reply, ErrorReply):
            metrics.error(reply.code.name)
        try:
            data = encode_frame(reply_message(rid, reply))
        except ProtocolError:
            op = reply.op if isinstance(reply, ErrorReply | Ack) else reply.OP.value
            log.error("%r: reply to %s exceeds the frame limit", self, op)
            data = encode_frame(
                reply_message(rid, ErrorReply(str(op), ErrorCode.INTERNAL, "reply too large"))
            )
        with contextlib.suppress(OSError):
            await self._send(data)

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self.server.pool, fn, *args)

    # -- main loop -----------------------------------------------------------

    def _closing(self) -> bool:
        # A method, not the attribute, so type narrowing does not assume
        # that awaiting _dispatch() leaves it unchanged.
        return self.closing

    async def run(self) -> None:
        try:
            await self._send(SERVER_MAGIC)
            while not self._closing():
                for frame in await self._read_frames():
                    if self._closing():
                        close_fds(frame.fds)
                        continue
                    await self._dispatch(frame)
                self.decoder.raise_if_failed()
        except ProtocolError as exc:
            if self.server.metrics is not None:
                self.server.metrics.error(exc.code.name)
            if exc.code is not ErrorCode.BAD_MAGIC:
                log.warning("%r: protocol error, closing: %s", self, exc)
                with contextlib.suppress(OSError):
                    await self._send(encode_frame(error_message(exc.code, exc.message)))
        except (_Closed, ConnectionError):
            pass
        except OSError as exc:
            log.info("%r: connection failed: %s", self, exc)
        finally:
            await self._teardown()

    async def _dispatch(self, frame: Frame) -> None:
        try:
            rid, req = parse_request(frame.msg)
        except ProtocolError as exc:
            close_fds(frame.fds)
            if exc.fatal or exc.request_id is None:
                raise
            await self._reply(exc.request_id, ErrorReply(exc.op or "error", exc.code, exc.message))
            return
        op = req.OP.value
        if rid in self.tasks:
            close_fds(frame.fds)
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"request id {rid} is already in use")
        if frame.fds and not isinstance(req, RegisterStaging):
            close_fds(frame.fds)
            await self._reply(rid, ErrorReply(op, ErrorCode.BAD_REQUEST, f"{op} takes no fds"))
            return
        if self.version is None:
            if not isinstance(req, Hello):
                close_fds(frame.fds)
                await self._reply(rid, ErrorReply(op, ErrorCode.BAD_REQUEST, "hello first"))
                self.closing = True
                return
            await self._hello(rid, req)
            return
        if isinstance(req, Hello):
            await self._reply(rid, ErrorReply(op, ErrorCode.BAD_REQUEST, "second hello"))
        elif isinstance(req, RegisterStaging):
            await self._register(rid, req, frame.fds)
        elif isinstance(req, Bye):
            await self._drain_tasks()
            await self._reply(rid, Ack(Op.BYE))
            self.closing = True
        elif len(self.tasks) >= self.server.config.max_inflight:
            await self._reply(rid, ErrorReply(op, ErrorCode.BUSY, "too many requests in flight"))
        elif isinstance(req, Lookup) and req.tenant in self.tenants and self._may_use(req.tenant):
            # The engine's scheduler calls lookup per request: answer it on the event
            # loop when the index alone can (an LMDB read of microseconds, less than
            # the hop to a pool thread and back, which was most of its latency).
            # Anything needing the disk (a miss that probes for another node's file)
            # goes to the pool, so a slow filesystem never stalls the loop.
            started = time.perf_counter()
            found = self.server.store.lookup_cached(req.tenant, req.keys)
            if found is None:
                await self._spawn(rid, req)
            else:
                await self._reply(rid, LookupReply(found))
                if self.server.metrics is not None:
                    self.server.metrics.observe(op, time.perf_counter() - started)
        else:
            await self._spawn(rid, req)

    async def _spawn(self, rid: int, req: Request) -> None:
        task = asyncio.create_task(self._serve_request(rid, req))
        self.tasks[rid] = task
        task.add_done_callback(functools.partial(self._task_done, rid))

    def _task_done(self, rid: int, _task: asyncio.Task[None]) -> None:
        self.tasks.pop(rid, None)

    async def _drain_tasks(self) -> None:
        while self.tasks:
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    async def _serve_request(self, rid: int, req: Request) -> None:
        started = time.perf_counter()
        try:
            reply = await self._run(self._execute, req)
        except Exception:
            log.exception("%r: %s failed", self, req.OP.value)
            reply = ErrorReply(req.OP.value, ErrorCode.INTERNAL, "internal error")
        await self._reply(rid, reply)
        if self.server.metrics is not None:
            self.server.metrics.observe(req.OP.value, time.perf_counter() - started)

    async def _teardown(self) -> None:
        self.closing = True
        # Pool threads cannot be cancelled and may be writing into the
        # staging mapping: it must outlive them.
        await self._drain_tasks()
        with self.mu:
            handles = list(self.handles.values())
            self.handles.clear()
        if handles:
            await self._run(self._release_all, handles)
        self.decoder.close()
        if self.staging is not None:
            self.staging.close()
        self.sock.close()
        self.server._forget(self)

    # -- handshake -----------------------------------------------------------

    async def _hello(self, rid: int, req: Hello) -> None:
        cfg = self.server.config
        try:
            version = negotiate_version(req.min_version, req.max_version)
        except ProtocolError as exc:
            await self._reply(
                rid,
                ErrorReply(
                    "hello", exc.code, exc.message, (MIN_PROTOCOL_VERSION, MAX_PROTOCOL_VERSION)
                ),
            )
            self.closing = True
            return
        try:
            salts = await self._run(self._salts, req.tenants)
        except Exception:
            log.exception("%r: hello failed", self)
            await self._reply(rid, ErrorReply("hello", ErrorCode.INTERNAL, "keyring failure"))
            self.closing = True
            return
        self.version = version
        self.tenants = frozenset(req.tenants)
        log.info("%r: hello from %r, tenants %s", self, req.client, sorted(req.tenants))
        await self._reply(
            rid,
            HelloReply(
                version=version,
                server_id=cfg.server_id,
                store_id=self.server.store_id,
                salts=salts,
                alignment=cfg.alignment,
                max_frame=MAX_FRAME,
                max_batch=cfg.max_batch,
                max_inflight=cfg.max_inflight,
                max_staging=cfg.max_staging,
                handle_ttl_s=cfg.handle_ttl_s,
                direct={t: self._direct_ok(t) for t in req.tenants},
            ),
        )

    def _salts(self, tenants: Sequence[str]) -> dict[str, bytes]:
        secret = self.server.config.secret
        return {
            t: self.server.store.tenant_salt(t) if self._may_use(t) else fake_salt(secret, t)
            for t in tenants
        }

    async def _register(self, rid: int, req: RegisterStaging, fds: list[int]) -> None:
        op = Op.REGISTER_STAGING.value
        problem = None
        if self.staging is not None:
            problem = "a staging buffer is already registered"
        elif len(fds) != 1:
            problem = f"register_staging takes exactly one fd, got {len(fds)}"
        elif req.size > self.server.config.max_staging:
            problem = f"staging of {req.size} bytes exceeds {self.server.config.max_staging}"
        if problem is not None:
            close_fds(fds)
            await self._reply(rid, ErrorReply(op, ErrorCode.BAD_REQUEST, problem))
            return
        try:
            staging = StagingBuffer.from_fd(fds[0], req.size)
        except StagingError as exc:
            await self._reply(rid, ErrorReply(op, ErrorCode.BAD_REQUEST, str(exc)))
            return
        self.staging = staging
        self.alloc = RegionAllocator(staging.size, self.server.config.alignment)
        await self._reply(rid, Ack(Op.REGISTER_STAGING))

    # -- request execution (pool threads) ------------------------------------

    def _may_use(self, tenant: str) -> bool:
        return self.server.policy.may_use(self.peer.uid, self.peer.gids, tenant)

    def _direct_ok(self, tenant: str) -> bool:
        """May this connection use the direct path for ``tenant``?

        The policy must allow it (``direct = true``, which implies no
        encryption), and the peer must be able to open the leased files: a
        member of the tenant's ``direct_group``, or the sidecar's own uid, or
        root. Handing out paths a worker cannot open would only turn every
        save into a failure.
        """
        if not self._may_use(tenant):
            return False
        settings = self.server.policy.tenant(tenant)
        if not settings.direct:
            return False
        uid = self.peer.uid
        if uid in (0, os.geteuid()):
            return True
        return settings.direct_gid is not None and settings.direct_gid in self.peer.gids

    def _is_admin(self) -> bool:
        return self.server.policy.is_admin(self.peer.uid, self.peer.gids)

    def _listed(self, tenant: str) -> None:
        if tenant not in self.tenants:
            raise _Reject(ErrorCode.BAD_REQUEST, f"tenant {tenant!r} was not named in hello")

    def _registered(self) -> tuple[StagingBuffer, RegionAllocator]:
        if self.staging is None or self.alloc is None:
            raise _Reject(ErrorCode.NOT_REGISTERED, "register a staging buffer first")
        return self.staging, self.alloc

    def _open_handle_slot(self) -> None:
        if self.server.draining:
            raise _Reject(ErrorCode.SHUTTING_DOWN, "the sidecar is shutting down")
        with self.mu:
            if len(self.handles) >= self.server.config.max_handles:
                raise _Reject(ErrorCode.BUSY, "too many open handles")

    def _add_handle(self, handle: _Handle) -> int:
        with self.mu:
            h = self.next_handle
            self.next_handle += 1
            self.handles[h] = handle
        return h

    def _take_handle(self, h: int, kind: type[_H]) -> _H:
        """Remove and return the handle: whoever takes it (a complete, an abort,
        the expiry sweep) is the only one to release it."""
        with self.mu:
            handle = self.handles.get(h)
            if not isinstance(handle, kind):
                raise _Reject(ErrorCode.BAD_HANDLE, f"no such handle {h}")
            del self.handles[h]
        return handle

    def _take_any_handle(self, h: int) -> _Handle:
        with self.mu:
            handle = self.handles.pop(h, None)
        if handle is None:
            raise _Reject(ErrorCode.BAD_HANDLE, f"no such handle {h}")
        return handle

    def _free(self, offset: int) -> None:
        assert self.alloc is not None
        with self.mu:
            self.alloc.free(offset)

    def _execute(self, req: Request) -> Reply:
        op = req.OP.value
        try:
            match req:
                case Lookup():
                    return self._lookup(req)
                case Touch():
                    self._listed(req.tenant)
                    if self._may_use(req.tenant):
                        self.server.store.touch(req.tenant, req.keys)
                    return Ack(Op.TOUCH)
                # The lease verbs subclass the prepare verbs: match them first.
                case LeaseStore():
                    return self._lease_store(req)
                case LeaseLoad():
                    return self._lease_load(req)
                case PrepareStore():
                    return self._prepare_store(req)
                case CompleteStore():
                    with self.mu:
                        lease = isinstance(self.handles.get(req.handle), _LeaseHandle)
                    if lease:
                        return self._complete_lease(req)
                    return self._complete_store(req)
                case PrepareLoad():
                    return self._prepare_load(req)
                case CompleteLoad():
                    h = self._take_handle(req.handle, _LoadHandle)
                    try:
                        self._reported_corrupt(h, req.corrupt)
                    finally:
                        self._release(h)
                    return Ack(Op.COMPLETE_LOAD)
                case Abort():
                    self._release(self._take_any_handle(req.handle))
                    return Ack(Op.ABORT)
                case Stats():
                    return self._stats()
                case Purge():
                    return self._purge(req)
                case Fsck():
                    if not self._is_admin():
                        raise _Reject(ErrorCode.FORBIDDEN, "fsck needs the admin right")
                    report = self.server.store.fsck(repair=req.repair)
                    return FsckReply(_plainify(report.to_dict()))
                case _:
                    raise _Reject(ErrorCode.UNSUPPORTED, f"{op} is not served here")
        except _Reject as exc:
            return ErrorReply(op, exc.code, exc.message)

    def _lookup(self, req: Lookup) -> Reply:
        self._listed(req.tenant)
        if not self._may_use(req.tenant):
            return LookupReply(0)
        found = self.server.store.lookup(req.tenant, req.keys)
        return LookupReply(max(0, min(found, len(req.keys))))

    def _prepare_store(self, req: PrepareStore) -> Reply:
        self._open_handle_slot()
        staging, alloc = self._registered()
        self._listed(req.tenant)
        if not self._may_use(req.tenant):
            raise _Reject(
                ErrorCode.FORBIDDEN, f"this connection may not write tenant {req.tenant!r}"
            )
        store = self.server.store
        settings = self.server.policy.tenant(req.tenant)
        encrypt = settings.encryption
        ttl_s = req.ttl_s if req.ttl_s is not None else settings.ttl_s
        align = self.server.config.alignment
        slots: list[StoreSlot] = []
        held: list[_HeldWrite] = []
        try:
            for i, c in enumerate(req.chunks):
                if store.lookup(req.tenant, [c.key]) == 1:
                    slots.append(StoreSlot(StoreStatus.EXISTS))
                    continue
                need = region_size(c.layers, align)
                if need > staging.size:
                    slots.append(StoreSlot(StoreStatus.REJECTED, code=ErrorCode.TOO_LARGE))
                    continue
                with self.mu:
                    off = alloc.alloc(need)
                if off is None:
                    slots.append(StoreSlot(StoreStatus.REJECTED, code=ErrorCode.BUSY))
                    continue
                try:
                    res = store.reserve(
                        req.tenant, v1.object_size(c.layers, encrypt), quota=settings.quota_bytes
                    )
                except StoreFull:
                    self._free(off)
                    slots.append(StoreSlot(StoreStatus.REJECTED, code=ErrorCode.NO_SPACE))
                    continue
                except Exception:
                    log.exception("%r: reserving space failed", self)
                    self._free(off)
                    slots.append(StoreSlot(StoreStatus.REJECTED, code=ErrorCode.INTERNAL))
                    continue
                held.append(_HeldWrite(i, c.key, c.layers, off, res))
                slots.append(StoreSlot(StoreStatus.WRITE, offset=off))
        except BaseException:
            for hw in held:
                hw.reservation.release()
                self._free(hw.offset)
            raise
        if not held:
            return PrepareStoreReply(0, tuple(slots))
        handle = _StoreHandle(
            req.tenant, req.namespace, encrypt, ttl_s, tuple(slots), held, time.monotonic()
        )
        return PrepareStoreReply(self._add_handle(handle), tuple(slots))

    def _complete_store(self, req: CompleteStore) -> Reply:
        h = self._take_handle(req.handle, _StoreHandle)
        staging, _ = self._registered()
        store = self.server.store
        stored = [s.status is StoreStatus.EXISTS for s in h.slots]
        views: list[list[memoryview]] = []
        for hw in h.held:
            offs, _ = packed_layout(hw.layers)
            views.append(
                [
                    staging.view[hw.offset + lo : hw.offset + lo + n]
                    for lo, n in zip(offs, hw.layers, strict=True)
                ]
            )
        try:
            # One batch: the store seals chunk n+1 while chunk n is written.
            with self.server.budget.hold(sum(sum(hw.layers) for hw in h.held)):
                store.put_many(
                    h.tenant,
                    h.namespace,
                    [(hw.key, v) for hw, v in zip(h.held, views, strict=True)],
                    encrypt=h.encrypt,
                    ttl_s=h.ttl_s,
                    reservations=[hw.reservation for hw in h.held],
                )
            for hw in h.held:
                stored[hw.index] = True  # False from put means "already present": success
        except Exception as exc:
            if isinstance(exc, StoreFull):
                log.info("%r: chunks not stored: %s", self, exc)
            else:
                log.exception("%r: storing chunks failed", self)
            # The chunks before the failing one are stored; ask the index which.
            for hw in h.held:
                stored[hw.index] = store.payload_info(h.tenant, hw.key) is not None
        finally:
            for hw, v in zip(h.held, views, strict=True):
                for m in v:
                    m.release()
                hw.reservation.release()
                self._free(hw.offset)
        return CompleteStoreReply(tuple(stored))

    def _prepare_load(self, req: PrepareLoad) -> Reply:
        self._open_handle_slot()
        staging, alloc = self._registered()
        self._listed(req.tenant)
        misses = [LoadSlot(False)] * len(req.keys)
        if not self._may_use(req.tenant):
            return PrepareLoadReply(0, ErrorCode.NOT_FOUND, tuple(misses))
        store = self.server.store
        align = self.server.config.alignment
        loaded: list[LoadSlot] = []
        stop = ErrorCode.OK
        planned: list[tuple[bytes, int, int]] = []  # key, staging offset, payload bytes
        try:
            # Plan: regions for the leading chunks the index has, pinned before any
            # read so eviction cannot remove a file under it.
            for key in req.keys:
                payload = _payload_of(store.payload_info(req.tenant, key))
                if not payload:
                    stop = ErrorCode.NOT_FOUND
                    break
                need = align_up(payload, align)
                if need > staging.size:
                    stop = ErrorCode.TOO_LARGE
                    break
                with self.mu:
                    off = alloc.alloc(need)
                if off is None:
                    stop = ErrorCode.BUSY
                    break
                store.pin(req.tenant, [key])
                planned.append((key, off, payload))
            # Read: one batch, so chunk n+1 is read while chunk n is verified.
            outs = [staging.view[off : off + n] for _, off, n in planned]
            try:
                with self.server.budget.hold(sum(n for _, _, n in planned)):
                    results = store.get_many_into(req.tenant, [k for k, _, _ in planned], outs)
            except Exception:
                log.exception("%r: reading chunks failed", self)
                results = [None] * len(planned)
                stop = ErrorCode.INTERNAL
            finally:
                for o in outs:
                    o.release()
            for (_key, off, payload), lengths in zip(planned, results, strict=True):
                if not lengths or sum(lengths) != payload:
                    break  # a miss ends the prefix: this chunk and all after it
                loaded.append(LoadSlot(True, off, tuple(lengths)))
            if len(loaded) < len(planned):
                if stop is ErrorCode.OK:
                    stop = ErrorCode.NOT_FOUND
                for key, off, _ in planned[len(loaded) :]:
                    store.unpin(req.tenant, [key])
                    self._free(off)
        except BaseException:
            keys = list(req.keys[: len(loaded)])
            self._release(_LoadHandle(req.tenant, keys, [s.offset for s in loaded], 0))
            for key, off, _ in planned[len(loaded) :]:
                store.unpin(req.tenant, [key])
                self._free(off)
            raise
        if not loaded:
            return PrepareLoadReply(0, stop, tuple(misses))
        handle = _LoadHandle(
            req.tenant,
            list(req.keys[: len(loaded)]),
            [s.offset for s in loaded],
            time.monotonic(),
        )
        slots = tuple(loaded) + tuple(misses[len(loaded) :])
        return PrepareLoadReply(self._add_handle(handle), stop, slots)

    # -- the direct path (protocol-v1.md 5.14, 5.15) --------------------------------

    def _lease_store(self, req: LeaseStore) -> Reply:
        self._open_handle_slot()
        self._listed(req.tenant)
        if not self._direct_ok(req.tenant):
            raise _Reject(
                ErrorCode.FORBIDDEN,
                f"this connection may not use the direct path for tenant {req.tenant!r}",
            )
        store = self.server.store
        settings = self.server.policy.tenant(req.tenant)
        ttl_s = req.ttl_s if req.ttl_s is not None else settings.ttl_s
        budget = MAX_FRAME - 4096
        used = 64
        slots: list[LeaseSlot] = []
        leases: list[tuple[int, Any]] = []
        try:
            for i, c in enumerate(req.chunks):
                if store.lookup(req.tenant, [c.key]) == 1:
                    slots.append(LeaseSlot(StoreStatus.EXISTS))
                    continue
                need = _LEASE_ENTRY_BYTES + 9 * len(c.layers) + 256
                if used + need > budget:  # the reply must fit one frame
                    slots.append(LeaseSlot(StoreStatus.REJECTED, code=ErrorCode.BUSY))
                    continue
                try:
                    lease = store.lease_store(
                        req.tenant,
                        req.namespace,
                        c.key,
                        c.layers,
                        ttl_s=ttl_s,
                        gid=settings.direct_gid,
                        quota=settings.quota_bytes,
                    )
                except StoreFull:
                    slots.append(LeaseSlot(StoreStatus.REJECTED, code=ErrorCode.NO_SPACE))
                    continue
                except StoreIOError as exc:
                    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
                    log.log(logging.INFO if full else logging.ERROR, "%r: lease: %s", self, exc)
                    code = ErrorCode.NO_SPACE if full else ErrorCode.INTERNAL
                    slots.append(LeaseSlot(StoreStatus.REJECTED, code=code))
                    continue
                if lease is None:
                    slots.append(LeaseSlot(StoreStatus.EXISTS))
                    continue
                data_offset, offsets = lease.offsets
                path = str(lease.tmp)
                used += need + len(path.encode())
                slots.append(
                    LeaseSlot(StoreStatus.WRITE, path, lease.size, data_offset, tuple(offsets))
                )
                leases.append((i, lease))
        except BaseException:
            for _, lease in leases:
                store.cancel_lease(lease)
            raise
        durability = str(getattr(store, "durability", ""))
        if not leases:
            return LeaseStoreReply(0, v1.ALIGN, tuple(slots), durability)
        handle = _LeaseHandle(req.tenant, tuple(slots), leases, time.monotonic())
        return LeaseStoreReply(self._add_handle(handle), v1.ALIGN, tuple(slots), durability)

    def _complete_lease(self, req: CompleteStore) -> Reply:
        h = self._take_handle(req.handle, _LeaseHandle)
        store = self.server.store
        stored = [s.status is StoreStatus.EXISTS for s in h.slots]
        try:
            for i, lease in h.leases:
                with self.server.budget.hold(lease.size):
                    try:
                        stored[i] = store.publish_lease(lease)
                    except LeaseInvalid as exc:
                        log.warning("%r: direct-path object refused: %s", self, exc)
                    except StoreError as exc:
                        log.error("%r: direct-path object not stored: %s", self, exc)
        finally:
            for _, lease in h.leases:
                store.cancel_lease(lease)  # a no-op for those published
        return CompleteStoreReply(tuple(stored))

    def _lease_load(self, req: LeaseLoad) -> Reply:
        self._open_handle_slot()
        self._listed(req.tenant)
        misses = [ReadSlot(False)] * len(req.keys)
        if not self._may_use(req.tenant):
            return LeaseLoadReply(0, ErrorCode.NOT_FOUND, tuple(misses))
        if not self._direct_ok(req.tenant):
            raise _Reject(
                ErrorCode.FORBIDDEN,
                f"this connection may not use the direct path for tenant {req.tenant!r}",
            )
        store = self.server.store
        budget = MAX_FRAME - 4096
        used = 64
        found: list[ReadSlot] = []
        stop = ErrorCode.OK
        try:
            for key in req.keys:
                # Pinned before the header is read, so eviction cannot remove
                # the file between this reply and the worker's read.
                store.pin(req.tenant, [key])
                try:
                    lease = store.lease_load(req.tenant, key)
                except Exception:
                    store.unpin(req.tenant, [key])
                    log.exception("%r: lease_load failed", self)
                    stop = ErrorCode.INTERNAL
                    break
                if lease is None:
                    store.unpin(req.tenant, [key])
                    stop = ErrorCode.NOT_FOUND
                    break
                path = str(lease.path)
                need = (
                    _LEASE_ENTRY_BYTES
                    + len(path.encode())
                    + _EXTENT_BYTES * len(lease.header.layers)
                )
                if used + need > budget:
                    store.unpin(req.tenant, [key])
                    stop = ErrorCode.BUSY
                    break
                used += need
                extents = tuple(
                    LayerExtent(le.offset, le.length, le.check) for le in lease.header.layers
                )
                found.append(ReadSlot(True, path, lease.size, extents))
        except BaseException:
            store.unpin(req.tenant, list(req.keys[: len(found)]))
            raise
        if not found:
            return LeaseLoadReply(0, stop, tuple(misses))
        handle = _LoadHandle(req.tenant, list(req.keys[: len(found)]), [], time.monotonic())
        slots = tuple(found) + tuple(misses[len(found) :])
        return LeaseLoadReply(self._add_handle(handle), stop, slots)

    def _reported_corrupt(self, h: _LoadHandle, corrupt: Sequence[int]) -> None:
        """complete_load's ``corrupt``: the worker's checksums failed; check here."""
        if h.offsets:
            return  # a staging load: the sidecar verified those bytes itself
        for i in corrupt:
            if i < len(h.keys) and self.server.store.check_reported(h.tenant, h.keys[i]):
                log.warning("%r: chunk %s reported and found corrupt", self, h.keys[i].hex()[:16])

    def _release(self, h: _Handle) -> None:
        if isinstance(h, _LeaseHandle):
            for _, lease in h.leases:
                self.server.store.cancel_lease(lease)
            return
        if isinstance(h, _StoreHandle):
            for hw in h.held:
                hw.reservation.release()
                self._free(hw.offset)
        else:
            for off in h.offsets:
                self._free(off)
            if h.keys:
                self.server.store.unpin(h.tenant, h.keys)

    def _release_all(self, handles: Sequence[_Handle]) -> None:
        for h in handles:
            try:
                self._release(h)
            except Exception:
                log.exception("%r: releasing a handle failed", self)

    def expire_handles(self, cutoff: float) -> list[_Handle]:
        with self.mu:
            old = [h for h, v in self.handles.items() if v.created < cutoff]
            return [self.handles.pop(h) for h in old]

    def _stats(self) -> Reply:
        stats = dict(self.server.store.stats())
        if not self._is_admin():
            # The number of tenants is about other tenants: not this peer's business.
            stats.pop("tenants", None)
        stats["server"] = {
            "server_id": self.server.config.server_id,
            "connections": len(self.server.connections),
            "protocol_version": self.version,
        }
        if self.server.metrics is not None:
            stats.update(self.server.metrics.summary())
        return StatsReply(_plainify(stats))

    def _purge(self, req: Purge) -> Reply:
        if not self._is_admin():
            raise _Reject(ErrorCode.FORBIDDEN, "purge needs the admin right")
        store = self.server.store
        if req.namespace is not None:
            return PurgeReply(store.purge_namespace(req.tenant, req.namespace))
        return PurgeReply(store.purge_tenant(req.tenant))


def _plainify(value: Any, depth: int = 0) -> Any:
    """Make a stats or fsck value msgpack-safe (paths, enums and such become strings)."""
    if depth > 16:
        return str(value)
    if value is None or isinstance(value, bool | int | float | str | bytes):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**63:
            return str(value)
        return value
    if isinstance(value, Mapping):
        return {str(k): _plainify(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plainify(v, depth + 1) for v in value]
    return str(value)


# ---------------------------------------------------------------------------
# The server


class Server:
    """Serves one store on one listening socket. ``start()``, ``serve_forever()``, ``shutdown()``.

    ``policy`` may be replaced at any time (a reload); it applies from the next request.
    """

    def __init__(
        self,
        store: StoreAPI,
        policy: PolicyAPI,
        config: ServerConfig | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.policy = policy
        self.config = config or ServerConfig()
        self.store_id = self.config.store_id or str(store.stats().get("store_id", "unknown"))
        self.pool = ThreadPoolExecutor(self.config.worker_threads, "kvoffload-io")
        self.budget = ByteBudget(self.config.max_inflight_bytes)
        self.connections: set[_Connection] = set()
        self.draining = False
        self._listener: socket.socket | None = None
        self._owns_path = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._accept_task: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()

    @property
    def address(self) -> str | None:
        return None if self._listener is None else str(self._listener.getsockname())

    # -- life ----------------------------------------------------------------

    async def start(self) -> None:
        self._listener = self._listen()
        self._listener.setblocking(False)
        self._accept_task = asyncio.create_task(self._accept_loop())
        self._sweeper = asyncio.create_task(self._sweep_loop())
        log.info("serving on %s (server id %s)", self.address, self.config.server_id)

    def _listen(self) -> socket.socket:
        cfg = self.config
        if cfg.socket_fd is not None:
            sock = socket.socket(fileno=cfg.socket_fd)
            if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
                raise ValueError("the inherited socket is not a Unix stream socket")
            return sock
        if cfg.socket_path is None:
            raise ValueError("ServerConfig needs socket_path or socket_fd")
        path = Path(cfg.socket_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._remove_stale(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # The umask makes the socket appear with its final mode: no window in
        # which it is connectable by everyone.
        old = os.umask(0o777 & ~cfg.socket_mode)
        try:
            sock.bind(os.fspath(path))
        finally:
            os.umask(old)
        self._owns_path = True
        os.chmod(path, cfg.socket_mode)
        if cfg.socket_group is not None:
            import grp

            os.chown(path, -1, grp.getgrnam(cfg.socket_group).gr_gid)
        sock.listen(128)
        return sock

    @staticmethod
    def _remove_stale(path: Path) -> None:
        try:
            st = path.lstat()
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise FileExistsError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(os.fspath(path))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)  # left behind by a server that died
            return
        finally:
            probe.close()
        raise RuntimeError(f"another sidecar is already serving {path}")

    async def serve_forever(self) -> None:
        await self._stopped.wait()

    async def _accept_loop(self) -> None:
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(self._listener)
            except asyncio.CancelledError:
                raise
            except OSError as exc:
                # EMFILE and friends: back off rather than spin.
                log.warning("accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            try:
                sock.setblocking(False)
                peer = peer_credentials(sock)
            except OSError as exc:
                log.warning("rejecting a connection without credentials: %s", exc)
                sock.close()
                continue
            conn = _Connection(self, sock, peer)
            self.connections.add(conn)
            task = asyncio.create_task(conn.run())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _sweep_loop(self) -> None:
        ttl = self.config.handle_ttl_s
        next_maintenance = time.monotonic() + self.config.maintenance_interval_s
        while True:
            await asyncio.sleep(max(0.05, ttl / 4))
            if time.monotonic() >= next_maintenance:
                # TTL expiry and temp files of cancelled or crashed writers.
                next_maintenance = time.monotonic() + self.config.maintenance_interval_s
                try:
                    done = await asyncio.get_running_loop().run_in_executor(
                        self.pool, self.store.maintain
                    )
                    if any(done.values()):
                        log.info("maintenance: %s", done)
                except Exception:
                    log.exception("maintenance failed")
            cutoff = time.monotonic() - ttl
            for conn in list(self.connections):
                expired = conn.expire_handles(cutoff)
                if expired:
                    log.warning("%r: %d handle(s) expired", conn, len(expired))
                    await asyncio.get_running_loop().run_in_executor(
                        self.pool, conn._release_all, expired
                    )

    def _forget(self, conn: _Connection) -> None:
        self.connections.discard(conn)

    async def shutdown(self) -> None:
        """Drain: refuse new work, let in-flight requests finish, then close everything."""
        if self._stopped.is_set():
            return
        self.draining = True
        for t in (self._accept_task, self._sweeper):
            if t is not None:
                t.cancel()
        if self._listener is not None:
            self._listener.close()
        deadline = time.monotonic() + self.config.drain_timeout_s
        while any(c.tasks for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        notice = encode_frame(error_message(ErrorCode.SHUTTING_DOWN, "the sidecar is stopping"))
        for conn in list(self.connections):
            with contextlib.suppress(OSError):
                await conn._send(notice)
            with contextlib.suppress(OSError):
                # Wakes the connection's reader with EOF; its teardown does the rest.
                conn.sock.shutdown(socket.SHUT_RDWR)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._owns_path and self.config.socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                Path(self.config.socket_path).unlink()
        self.pool.shutdown(wait=True)
        self._stopped.set()
        log.info("stopped")


def run(server: Server) -> None:
    """Run until SIGTERM or SIGINT (a second SIGINT stops without draining)."""
    from . import notify

    async def main() -> None:
        loop = asyncio.get_running_loop()
        await server.start()
        stop = asyncio.Event()
        forced = False

        def on_signal(signum: int) -> None:
            nonlocal forced
            if stop.is_set() and signum == signal.SIGINT:
                forced = True
                log.warning("second interrupt: stopping without draining")
                for task in asyncio.all_tasks(loop):
                    task.cancel()
                return
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        notify.ready()
        interval = notify.watchdog_interval_s()

        async def watchdog() -> None:
            assert interval is not None
            while True:
                notify.watchdog()
                await asyncio.sleep(interval / 2)

        dog = asyncio.create_task(watchdog()) if interval else None
        await stop.wait()
        notify.stopping()
        if dog is not None:
            dog.cancel()
        if not forced:
            await server.shutdown()

    with contextlib.suppress(asyncio.CancelledError):
        asyncio.run(main())


__all__ = [
    "Peer",
    "PolicyAPI",
    "Server",
    "ServerConfig",
    "StoreAPI",
    "load_or_create_secret",
    "peer_credentials",
    "run",
]
