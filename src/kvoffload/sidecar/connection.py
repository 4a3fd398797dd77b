"""The asyncio frame loop of one sidecar connection (``docs/spec/protocol-v1.md`` §3).

::

    Connection.run(): magic, then frames until bye, EOF or a fatal error
       │  hello, register_staging, bye and a lookup the index answers run
       │  inline; every other request is a task whose verb runs on the thread
       │  pool, so replies may leave in any order (§3.3); a lookup of a tenant
       │  with a lookup_floor is held on a loop timer until its deadline (§5.28)
       └─ on close: wait for its tasks (pool threads may still touch the
          staging mapping), then release handles, pins, reservations and the
          mapping (§7)

Every verb is delegated to the connection's :class:`~.session.Session`;
this module only reads and writes frames, passes descriptors and keeps
the dispatch rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TypeVar

from kvoffload.protocol import (
    CLIENT_MAGIC,
    MAX_FDS,
    MAX_FRAME,
    SERVER_MAGIC,
    Ack,
    Bye,
    ErrorCode,
    ErrorReply,
    Frame,
    FrameDecoder,
    Hello,
    LoadProgress,
    Lookup,
    Op,
    PrepareLoad,
    ProtocolError,
    RegisterStaging,
    Reply,
    Request,
    close_fds,
    encode_frame,
    error_message,
    parse_request,
    reply_message,
)

from .padding import Pad
from .service import Peer, Service
from .session import Session

log = logging.getLogger("kvoffload.server")

_T = TypeVar("_T")

RECV_SIZE = 256 * 1024


class _Closed(Exception):
    pass


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Connection:
    """One accepted socket: frames in, replies out, verbs on its session."""

    def __init__(
        self,
        service: Service,
        pool: Executor,
        sock: socket.socket,
        peer: Peer,
        on_close: Callable[[Connection], None] = lambda _c: None,
    ) -> None:
        self.service = service
        self.pool = pool
        self.sock = sock
        self.peer = peer
        self.session = Session(service, peer)
        self.decoder = FrameDecoder(expect_magic=CLIENT_MAGIC, max_frame=MAX_FRAME)
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.write_lock = asyncio.Lock()
        #: Padded replies waiting for their deadline (§5.28), with their timers.
        self.held: dict[asyncio.Future[None], asyncio.TimerHandle] = {}
        self.closing = False
        self._on_close = on_close

    def __repr__(self) -> str:
        return repr(self.session)

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
        """§3.2, §3.3: the next complete frames, each with the descriptors it declared."""
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

    async def send(self, data: bytes) -> None:
        async with self.write_lock:
            await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def _reply(self, rid: int, reply: Reply) -> None:
        metrics = self.service.metrics
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
            await self.send(data)

    async def _run(self, fn: Callable[..., _T], *args: object) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # -- main loop -----------------------------------------------------------

    def _closing(self) -> bool:
        # A method, not the attribute, so type narrowing does not assume
        # that awaiting _dispatch() leaves it unchanged.
        return self.closing

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await self.send(SERVER_MAGIC)
            while not self._closing():
                frames = await self._read_frames()
                arrived = loop.time()  # what a lookup's floor counts from (§5.28)
                for frame in frames:
                    if self._closing():
                        close_fds(frame.fds)
                        continue
                    await self._dispatch(frame, arrived)
                self.decoder.raise_if_failed()
        except ProtocolError as exc:
            if self.service.metrics is not None:
                self.service.metrics.error(exc.code.name)
            if exc.code is not ErrorCode.BAD_MAGIC:
                log.warning("%r: protocol error, closing: %s", self, exc)
                with contextlib.suppress(OSError):
                    await self.send(encode_frame(error_message(exc.code, exc.message)))
        except (_Closed, ConnectionError):
            pass
        except OSError as exc:
            log.info("%r: connection failed: %s", self, exc)
        finally:
            await self._teardown()

    async def _dispatch(self, frame: Frame, arrived: float) -> None:
        """§3.3: parse, check the envelope and the order rules, then run the verb
        (``arrived``: the loop time its frame was read)."""
        try:
            rid, req = parse_request(frame.msg)
        except ProtocolError as exc:
            close_fds(frame.fds)
            if exc.fatal or exc.request_id is None:
                raise
            await self._reply(exc.request_id, ErrorReply(exc.op or "error", exc.code, exc.message))
            if self.session.version is None and exc.op != Op.HELLO.value:
                self.closing = True  # §3.3 rule 1: anything but hello first closes
            return
        op = req.OP.value
        session = self.session
        if rid in self.tasks:
            close_fds(frame.fds)
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"request id {rid} is already in use")
        if frame.fds and not isinstance(req, RegisterStaging):
            close_fds(frame.fds)
            await self._reply(rid, ErrorReply(op, ErrorCode.BAD_REQUEST, f"{op} takes no fds"))
            if session.version is None and not isinstance(req, Hello):
                self.closing = True  # §3.3 rule 1
            return
        if session.version is None:
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
            await self._reply(rid, session.register_staging(req, frame.fds))
        elif isinstance(req, Bye):
            await self._drain_tasks()  # the barrier: every earlier request has its reply
            await self._reply(rid, session.bye())
            self.closing = True
        elif len(self.tasks) >= self.service.config.max_inflight:
            await self._reply(rid, ErrorReply(op, ErrorCode.BUSY, "too many requests in flight"))
        elif isinstance(req, Lookup):
            started = time.perf_counter()
            pad = session.lookup_pad(req.tenant)
            # A padded lookup always takes the pool's path, hit or miss (§5.28).
            reply = session.lookup_inline(req) if pad is None else None
            if reply is None:
                await self._spawn(rid, req, (pad, arrived))
            else:
                await self._reply(rid, reply)
                if self.service.metrics is not None:
                    self.service.metrics.observe(op, time.perf_counter() - started)
        else:
            await self._spawn(rid, req)

    async def _hello(self, rid: int, req: Hello) -> None:
        """§3.3 rule 1, §5.1: inline (nothing else may be in flight); the salts may
        need the keyring's disk, so the verb itself runs on the pool."""
        try:
            reply = await self._run(self.session.hello, req)
        except Exception:
            log.exception("%r: hello failed", self)
            reply = ErrorReply("hello", ErrorCode.INTERNAL, "keyring failure")
        if isinstance(reply, ErrorReply):
            self.closing = True
        await self._reply(rid, reply)

    async def _spawn(
        self, rid: int, req: Request, padding: tuple[Pad | None, float] = (None, 0.0)
    ) -> None:
        task = asyncio.create_task(self._serve_request(rid, req, padding))
        self.tasks[rid] = task
        task.add_done_callback(functools.partial(self._task_done, rid))

    async def _hold(self, pad: Pad, arrived: float) -> bool:
        """§5.28: wait, on a loop timer, until ``arrived`` + the pad's delay; count an
        overrun if the reply was ready only after the floor. False: the connection
        closed meanwhile and the reply must not be sent (not even early)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        self.service.padding.count(pad, overrun=now > arrived + pad.floor)
        deadline = arrived + pad.delay
        if now >= deadline:
            return not self.closing
        fut: asyncio.Future[None] = loop.create_future()
        self.held[fut] = loop.call_at(deadline, _wake, fut)
        try:
            await fut
        finally:
            self.held.pop(fut).cancel()
        return not self.closing

    def _task_done(self, rid: int, _task: asyncio.Task[None]) -> None:
        self.tasks.pop(rid, None)

    async def _drain_tasks(self) -> None:
        while self.tasks:
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    def _emitter(self, rid: int) -> Callable[[LoadProgress], bool]:
        """§5.26: interim frames of request ``rid``, sent from its pool thread.

        Each waits until its frame is written, so frames leave in order, before
        the request's reply, and a slow client slows the load instead of
        queueing frames; False once the connection is closing or broken."""
        loop = asyncio.get_running_loop()

        def emit(msg: LoadProgress) -> bool:
            if self.closing:
                return False
            data = encode_frame(reply_message(rid, msg))
            try:
                asyncio.run_coroutine_threadsafe(self.send(data), loop).result()
            except (OSError, RuntimeError):
                return False
            return True

        return emit

    async def _serve_request(
        self, rid: int, req: Request, padding: tuple[Pad | None, float] = (None, 0.0)
    ) -> None:
        started = time.perf_counter()
        emit = self._emitter(rid) if isinstance(req, PrepareLoad) and req.layerwise else None
        try:
            reply = await self._run(self.session.execute, req, emit)
        except Exception:
            log.exception("%r: %s failed", self, req.OP.value)
            reply = ErrorReply(req.OP.value, ErrorCode.INTERNAL, "internal error")
        pad, arrived = padding
        if pad is None or await self._hold(pad, arrived):
            await self._reply(rid, reply)
        if self.service.metrics is not None:
            self.service.metrics.observe(req.OP.value, time.perf_counter() - started)

    async def _teardown(self) -> None:
        """§7: a disconnect releases everything the connection holds."""
        self.closing = True
        # A padded reply still held is dropped, never sent early: a peer that
        # only shut down its writing side could otherwise time it (§5.28).
        for fut in list(self.held):
            _wake(fut)  # with closing set: the reply is dropped
        # Pool threads cannot be cancelled and may be writing into the
        # staging mapping: it must outlive them.
        await self._drain_tasks()
        if self.session.open_handles():
            await self._run(self.session.release_all)
        self.decoder.close()
        self.session.close()
        self.sock.close()
        self._on_close(self)


__all__ = ["Connection"]
