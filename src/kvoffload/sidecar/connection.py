"""The frame loop of one sidecar connection (``docs/spec/protocol-v1.md`` §3).

::

    Connection.run(): magic, then frames until bye, EOF or a fatal error
       │  the socket stays registered with the loop for the connection's life:
       │  each readable event reads once, decodes every whole frame and
       │  dispatches them in order, from the loop's callback itself
       │  lookups that begin a read, of a listed unpadded tenant, that the
       │  index answers, are read, answered and counted there without the
       │  generic decode, dispatch or encode (_lookups; issue 30)
       │  hello, register_staging, bye and a lookup the index answers run
       │  inline; every other request goes to the thread pool, and its
       │  completion comes back through the connection's completion queue,
       │  so replies may leave in any order (§3.3); a lookup of a tenant with
       │  a lookup_floor is held until its deadline on a timerfd the loop
       │  watches (releasetimer.py: exact, whatever the lookup cost; §5.28)
       ├─ replies are written straight to the socket when nothing waits
       │  before them, else queued in order behind what does (§3.3, §5.26)
       └─ on close: wait for its requests (pool threads may still touch the
          staging mapping), then release handles, pins, reservations and the
          mapping (§7)

Every verb is delegated to the connection's :class:`~.session.Session`;
this module only reads and writes frames, passes descriptors and keeps
the dispatch rules.

Flow control: reading pauses while a step that must finish before the next
frame runs (hello on the pool, bye's barrier) and while more than
:data:`WRITE_HIGH` bytes of replies wait for a client that does not read,
so neither the frames read nor the replies queued grow without bound.
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from typing import Any, TypeVar

import msgspec

from kvoffload.protocol import (
    _LENGTH,
    CLIENT_MAGIC,
    LENGTH_SIZE,
    MAX_FDS,
    MAX_FRAME,
    SERVER_MAGIC,
    Ack,
    Bye,
    CompleteLoad,
    ErrorCode,
    ErrorReply,
    Frame,
    FrameDecoder,
    Hello,
    LoadProgress,
    Lookup,
    LookupLoad,
    Op,
    PrepareLoad,
    PrepareLoadReply,
    ProtocolError,
    RegisterRegion,
    RegisterStaging,
    Reply,
    Request,
    SealedLoadReply,
    close_fds,
    encode_frame,
    error_message,
    lookup_reply_frame,
    parse_request,
    read_lookup,
    reply_message,
)

from .access.padding import Pad
from .outbox import Outbox
from .peer import Peer
from .releasetimer import Cancellable, ReleaseTimer
from .service import Service
from .session import Session

log = logging.getLogger("kvoffload.server")

_T = TypeVar("_T")

RECV_SIZE = 256 * 1024
#: Room for one descriptor more than a frame may carry: the decoder refuses the
#: extra one, and more than that truncates the ancillary data (MSG_CTRUNC).
_ANCILLARY = socket.CMSG_LEN((MAX_FDS + 1) * array.array("i").itemsize)
# Plain ints: a flag enum's ``&`` costs a call on every read.
_MSG_CTRUNC = int(socket.MSG_CTRUNC)
_MSG_CMSG_CLOEXEC = int(socket.MSG_CMSG_CLOEXEC)
#: Reading pauses while more reply bytes than this wait to be written, and
#: resumes below WRITE_LOW.
WRITE_HIGH = 4 << 20
WRITE_LOW = 1 << 20

#: What a pool thread hands back: the verb's reply, or the exception it raised.
_Outcome = tuple[Reply | None, BaseException | None]

_LOOKUP = Op.LOOKUP.value
# Tuples, not ``A | B``: a union is built anew on every evaluation, per request.
_TAKE_FDS = (RegisterStaging, RegisterRegion)
_COMPLETES = (PrepareLoad, LookupLoad)
_LOOKUPS = (Lookup, LookupLoad)

#: Verbs Session.execute_inline may answer on the loop (the rest go to the pool).
_INLINE_VERBS = (PrepareLoad, CompleteLoad)


class _Closed(Exception):
    pass


class _InFlight:
    """One request answered on the pool: what its reply needs once it is back."""

    __slots__ = ("arrived", "done", "pad", "req", "rid", "started", "timer")

    def __init__(
        self, rid: int, req: Request, pad: Pad | None, arrived: float, done: asyncio.Future[None]
    ) -> None:
        self.rid = rid
        self.req = req
        self.pad = pad
        self.arrived = arrived
        self.started = time.perf_counter()
        self.done = done
        self.timer: Cancellable | None = None


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
        #: Requests in flight (on the pool, or held for their floor), by request
        #: id; each future is done once its reply is queued or dropped.
        self.tasks: dict[int, asyncio.Future[None]] = {}
        #: Padded replies waiting for their deadline (§5.28), by request id.
        self.held: dict[int, tuple[_InFlight, Reply]] = {}
        #: Releases held replies at their exact deadline; made at the first one.
        self._timer: ReleaseTimer | None = None
        self.closing = False
        self._on_close = on_close
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = sock.fileno()
        self._rbuf = bytearray(RECV_SIZE)
        #: Frames read and not yet dispatched (while a step blocks), with the
        #: loop time they were read.
        self._inbox: collections.deque[tuple[Frame, float]] = collections.deque()
        self._reading = False
        self._step: asyncio.Task[None] | None = None
        self._end: asyncio.Future[None] | None = None
        # The write side: replies in order, as the socket takes them (outbox.py).
        self.out = Outbox(sock, WRITE_HIGH, WRITE_LOW, self._update_reading)
        # Pool completions, drained on the loop with one wake-up per batch.
        self._completions: collections.deque[tuple[_InFlight, _Outcome]] = collections.deque()
        self._drain_scheduled = False
        #: §5.32: the handles of a request's ``complete`` that failed, by request id.
        self._complete_failed: dict[int, tuple[int, ...]] = {}

    def __repr__(self) -> str:
        return repr(self.session)

    async def send(self, data: bytes) -> None:
        """Queue ``data`` in order and return once the kernel has all of it;
        OSError if the socket broke first."""
        if self.out.loop is None:
            self.out.loop = self._loop or asyncio.get_running_loop()
        await self.out.send(data)

    def _reply(self, rid: int, reply: Reply) -> None:
        failed = self._complete_failed.pop(rid, None) if self._complete_failed else None
        if failed and isinstance(reply, PrepareLoadReply):
            reply = msgspec.structs.replace(reply, complete_failed=failed)
        metrics = self.service.metrics
        if metrics is not None and isinstance(reply, ErrorReply):
            metrics.error(reply.code.name)
        fds = list(reply.fds) if isinstance(reply, SealedLoadReply) else []
        try:
            msg = reply_message(rid, reply)
            data = encode_frame({**msg, "fds": len(fds)} if fds else msg)
        except ProtocolError:
            close_fds(fds)
            fds = []
            op = reply.op if isinstance(reply, ErrorReply | Ack) else reply.OP.value
            log.error("%r: reply to %s exceeds the frame limit", self, op)
            data = encode_frame(
                reply_message(rid, ErrorReply(str(op), ErrorCode.INTERNAL, "reply too large"))
            )
        if fds:
            self.out.write_with_fds(data, fds)
        else:
            self.out.write(data)

    async def _run(self, fn: Callable[..., _T], *args: object) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # -- the read side -------------------------------------------------------------

    def _update_reading(self) -> None:
        """Read while the connection runs, no step blocks the frames and the
        client takes its replies."""
        want = (
            not self.closing
            and self._end is not None
            and not self._end.done()
            and self._step is None
            and self.out.queued <= (WRITE_LOW if not self._reading else WRITE_HIGH)
        )
        if want == self._reading or self._loop is None:
            return
        self._reading = want
        if want:
            self._loop.add_reader(self._fd, self._on_readable)
        else:
            self._loop.remove_reader(self._fd)

    def _finish(self, outcome: BaseException | None) -> None:
        """End run(): None after bye or a refused hello, else what ended it."""
        end = self._end
        if end is not None and not end.done():
            if outcome is None:
                end.set_result(None)
            else:
                end.set_exception(outcome)
        self._update_reading()

    def _on_readable(self) -> None:
        """§3.2, §3.3: one read; every frame it completes, each with the
        descriptors it declared, is dispatched in order."""
        try:
            n, ancdata, flags, _ = self.sock.recvmsg_into(
                [self._rbuf], _ANCILLARY, _MSG_CMSG_CLOEXEC
            )
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._finish(exc)
            return
        fds: list[int] = []
        for level, kind, cdata in ancdata:  # empty but for register_staging
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(cdata[: len(cdata) - len(cdata) % got.itemsize])
                fds.extend(got)
        if flags & _MSG_CTRUNC:
            close_fds(fds)
            self._finish(
                ProtocolError(ErrorCode.BAD_REQUEST, "too many descriptors in one message")
            )
            return
        if not n:
            close_fds(fds)
            self._finish(_Closed())
            return
        start = 0
        if not fds and not self._inbox and self._step is None and self.decoder.idle:
            start = self._lookups(n)
            if start == n:
                return
        try:
            frames = self.decoder.feed(memoryview(self._rbuf)[start:n], fds)
        except ProtocolError as exc:
            self._finish(exc)
            return
        if frames:
            assert self._loop is not None
            arrived = self._loop.time()  # what a lookup's floor counts from (§5.28)
            self._inbox.extend((f, arrived) for f in frames)
            self._pump()

    def _lookups(self, n: int) -> int:
        """§5.3 on the scheduler's path: answer the lookups at the start of the
        ``n`` bytes read that the index answers, each read, decided and replied
        to without the generic decode, dispatch or encode (the decoder is idle,
        so these bytes begin a frame, and nothing read before waits). How many
        bytes they took: from the first frame that is anything else (another
        verb, a lookup of an unlisted or padded tenant, one the index cannot
        answer, a malformed or incomplete frame) the generic path reads on, so
        it decides, orders and names faults as ever."""
        buf, pos = self._rbuf, 0
        session, tasks = self.session, self.tasks
        tenants, room = session.tenants, self.service.config.max_inflight
        metrics = self.service.metrics
        with memoryview(buf) as view:
            while n - pos > LENGTH_SIZE and not self.closing:
                started = time.perf_counter()
                end = pos + LENGTH_SIZE + _LENGTH.unpack_from(buf, pos)[0]
                if end > n:
                    break
                with view[pos + LENGTH_SIZE : end] as body:
                    req = read_lookup(body, tenants)
                if req is None or req[0] in tasks or len(tasks) >= room:
                    break
                rid, tenant, keys = req
                found = session.lookup_fast(tenant, keys)
                if found is None:
                    break
                self.out.write(lookup_reply_frame(rid, found))
                if metrics is not None:
                    metrics.observe(_LOOKUP, time.perf_counter() - started)
                pos = end
        return pos

    def _pump(self) -> None:
        """Dispatch the frames read, in order, until one needs a step of its own."""
        inbox = self._inbox
        while inbox and self._step is None:
            frame, arrived = inbox.popleft()
            if self.closing:
                close_fds(frame.fds)
                continue
            try:
                step = self._dispatch(frame, arrived)
            except ProtocolError as exc:
                self._finish(exc)
                return
            except Exception as exc:
                log.exception("%r: dispatch failed", self)
                self._finish(exc)
                return
            if step is not None:
                assert self._loop is not None
                self._step = self._loop.create_task(step)
                self._step.add_done_callback(self._step_done)
                self._update_reading()
                return
        if self.closing:
            self._finish(None)
            return
        if self._step is None:
            try:
                self.decoder.raise_if_failed()
            except ProtocolError as exc:
                self._finish(exc)

    def _step_done(self, task: asyncio.Task[None]) -> None:
        self._step = None
        if not task.cancelled() and task.exception() is not None:
            self._finish(task.exception())
            return
        self._pump()
        self._update_reading()

    # -- main loop -----------------------------------------------------------

    async def run(self) -> None:
        loop = self._loop = self.out.loop = asyncio.get_running_loop()
        self._end = loop.create_future()
        try:
            await self.send(SERVER_MAGIC)
            self._update_reading()
            await self._end
        except ProtocolError as exc:
            if self.service.metrics is not None:
                self.service.metrics.error(exc.code.name)
            if exc.code is not ErrorCode.BAD_MAGIC:
                log.warning("%r: protocol error, closing: %s", self, exc)
                self.out.write(encode_frame(error_message(exc.code, exc.message)))
        except (_Closed, ConnectionError):
            pass
        except OSError as exc:
            log.info("%r: connection failed: %s", self, exc)
        except Exception:
            log.exception("%r: connection failed", self)
        finally:
            await self._teardown()

    def _dispatch(self, frame: Frame, arrived: float) -> Coroutine[Any, Any, None] | None:
        """§3.3: parse, check the envelope and the order rules, then run the verb
        (``arrived``: the loop time its frame was read). A step that must finish
        before the next frame (hello, bye) is returned for the caller to run."""
        try:
            rid, req = parse_request(frame.msg)
        except ProtocolError as exc:
            self._refuse_unparsed(frame, exc)
            return None
        op = req.OP.value
        session = self.session
        if rid in self.tasks:
            close_fds(frame.fds)
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"request id {rid} is already in use")
        if frame.fds and not isinstance(req, _TAKE_FDS):
            close_fds(frame.fds)
            self._reply(rid, ErrorReply(op, ErrorCode.BAD_REQUEST, f"{op} takes no fds"))
            if session.version is None and not isinstance(req, Hello):
                self.closing = True  # §3.3 rule 1
            return None
        if session.version is None:
            if not isinstance(req, Hello):
                close_fds(frame.fds)
                self._reply(rid, ErrorReply(op, ErrorCode.BAD_REQUEST, "hello first"))
                self.closing = True
                return None
            return self._hello(rid, req)
        if isinstance(req, _COMPLETES) and req.complete:
            # §5.32: completed before anything else of the request, on the loop
            # (as an inline complete_load), whatever the request's own answer.
            self._complete_failed[rid] = session.complete_piggyback(req.complete)
        room = len(self.tasks) < self.service.config.max_inflight
        if isinstance(req, _LOOKUPS) and room:
            self._lookup(rid, req, arrived)
        elif isinstance(req, Hello):
            self._reply(rid, ErrorReply(op, ErrorCode.BAD_REQUEST, "second hello"))
        elif isinstance(req, RegisterStaging):
            self._reply(rid, session.register_staging(req, frame.fds))
        elif isinstance(req, RegisterRegion):  # §5.34: an fstat, on the loop
            self._reply(rid, session.register_region(req, frame.fds))
        elif isinstance(req, Bye):
            return self._bye(rid)
        elif not room:
            self._reply(rid, ErrorReply(op, ErrorCode.BUSY, "too many requests in flight"))
        elif not self._inline(rid, req):
            self._spawn(rid, req, None, arrived)
        return None

    def _refuse_unparsed(self, frame: Frame, exc: ProtocolError) -> None:
        """A frame that does not parse: its error reply, or (fatal, no id) re-raised."""
        close_fds(frame.fds)
        if exc.fatal or exc.request_id is None:
            raise exc
        code, why = exc.code, exc.message
        if self.session.version is None and exc.op != Op.HELLO.value:
            # §3.3 rule 1: anything but hello first — an op this server does
            # not know too — is BAD_REQUEST, and closes the connection.
            code, why = ErrorCode.BAD_REQUEST, f"hello first ({exc.message})"
            self.closing = True
        self._reply(exc.request_id, ErrorReply(exc.op or "error", code, why))

    def _lookup(self, rid: int, req: Lookup | LookupLoad, arrived: float) -> None:
        """§5.3, §5.32: from the index on the loop where it can; a padded lookup
        always takes the pool's path, hit or miss (§5.28)."""
        started = time.perf_counter()
        session = self.session
        pad = session.lookup_pad(req.tenant)
        reply: Reply | None = None
        if pad is None and isinstance(req, Lookup):
            reply = session.lookup_inline(req)
        elif pad is None:
            try:
                reply = session.execute_inline(req)
            except Exception:
                log.exception("%r: %s failed", self, req.OP.value)
                reply = ErrorReply(req.OP.value, ErrorCode.INTERNAL, "internal error")
        if reply is None:
            self._spawn(rid, req, pad, arrived)
        else:
            self._reply(rid, reply)
            self._observe(req.OP.value, started)

    def _inline(self, rid: int, req: Request) -> bool:
        """Answer ``req`` here on the loop if it needs no wait (Session.execute_inline):
        a small cached load and its complete_load cost less than the two thread
        hops of the pool. False: the pool runs it."""
        if not isinstance(req, _INLINE_VERBS):
            return False
        started = time.perf_counter()
        try:
            reply = self.session.execute_inline(req)
        except Exception:
            log.exception("%r: %s failed", self, req.OP.value)
            reply = ErrorReply(req.OP.value, ErrorCode.INTERNAL, "internal error")
        if reply is None:
            return False
        self._reply(rid, reply)
        self._observe(req.OP.value, started)
        return True

    def _observe(self, op: str, started: float) -> None:
        metrics = self.service.metrics
        if metrics is not None:
            metrics.observe(op, time.perf_counter() - started)

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
        self._reply(rid, reply)

    async def _bye(self, rid: int) -> None:
        await self._drain_tasks()  # the barrier: every earlier request has its reply
        self._reply(rid, self.session.bye())
        self.closing = True

    # -- requests on the pool ----------------------------------------------------

    def _spawn(self, rid: int, req: Request, pad: Pad | None, arrived: float) -> None:
        assert self._loop is not None
        work = _InFlight(rid, req, pad, arrived, self._loop.create_future())
        interim = isinstance(req, PrepareLoad) and (req.layerwise or req.chunkwise)
        emit = self._emitter(rid) if interim else None
        # Registered after a submit that did not raise (its completion is
        # handled on this thread, later): no entry the teardown would wait on forever.
        self.pool.submit(self._on_pool, work, emit)
        self.tasks[rid] = work.done

    def _on_pool(self, work: _InFlight, emit: Callable[[LoadProgress], bool] | None) -> None:
        """On a pool thread: run the verb, then hand the outcome to the loop
        through the completion queue, waking the loop only if the queue was
        not already due to be drained."""
        outcome: _Outcome
        try:
            outcome = (self.session.execute(work.req, emit), None)
        except BaseException as exc:
            outcome = (None, exc)
        self._completions.append((work, outcome))
        if not self._drain_scheduled:
            self._drain_scheduled = True
            assert self._loop is not None
            # A closed loop: nobody waits any more.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._drain_completions)

    def _drain_completions(self) -> None:
        # Cleared before draining: a completion appended after this line
        # schedules another drain, one appended before it is drained here.
        self._drain_scheduled = False
        completions = self._completions
        while completions:
            work, (reply, exc) = completions.popleft()
            if exc is not None or reply is None:
                log.error("%r: %s failed", self, work.req.OP.value, exc_info=exc)
                reply = ErrorReply(work.req.OP.value, ErrorCode.INTERNAL, "internal error")
            if work.pad is None:
                self._answer(work, reply)
            else:
                self._hold(work, reply)

    def _answer(self, work: _InFlight, reply: Reply | None) -> None:
        """Send ``reply`` (None: drop it) and end the request, whatever happens."""
        try:
            if reply is not None:
                self._reply(work.rid, reply)
            self._observe(work.req.OP.value, work.started)
        except Exception:
            log.exception("%r: the reply to %s failed", self, work.req.OP.value)
        finally:
            self.tasks.pop(work.rid, None)
            if not work.done.done():
                work.done.set_result(None)

    def _hold(self, work: _InFlight, reply: Reply) -> None:
        """§5.28: hold ``reply`` on a loop timer until ``arrived`` + the pad's
        delay; count an overrun if it was ready only after the floor. A reply
        still held when the connection closes is dropped, never sent early."""
        assert self._loop is not None and work.pad is not None
        now = self._loop.time()
        self.service.padding.count(work.pad, overrun=now > work.arrived + work.pad.floor)
        deadline = work.arrived + work.pad.delay
        if now >= deadline or self.closing:
            self._answer(work, None if self.closing else reply)
            return
        self.held[work.rid] = (work, reply)
        if self._timer is None:
            self._timer = ReleaseTimer(self._loop)
        work.timer = self._timer.call_at(deadline, self._release, work.rid)

    def _release(self, rid: int) -> None:
        work, reply = self.held.pop(rid)
        self._answer(work, None if self.closing else reply)

    async def _drain_tasks(self) -> None:
        while self.tasks:
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    def _emitter(self, rid: int) -> Callable[[LoadProgress], bool]:
        """§5.26, §5.30: interim frames of request ``rid``, sent from its pool thread.

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

    async def _teardown(self) -> None:
        """§7: a disconnect releases everything the connection holds."""
        self.closing = True
        if self._end is not None and not self._end.done():
            self._end.cancel()  # run() ended before it waited on it (the magic failed)
        self._update_reading()
        if self._step is not None:
            await asyncio.wait([self._step])
        # A padded reply still held is dropped, never sent early: a peer that
        # only shut down its writing side could otherwise time it (§5.28).
        for work, _reply in list(self.held.values()):
            if work.timer is not None:
                work.timer.cancel()
            self._release(work.rid)
        if self._timer is not None:
            self._timer.close()
        # Pool threads cannot be cancelled and may be writing into the
        # staging mapping: it must outlive them.
        await self._drain_tasks()
        if self.session.open_handles():
            await self._run(self.session.release_all)
        with contextlib.suppress(OSError):
            await self.out.flushed(self.out.total)  # the last replies, then close
        # Unregistered before the close, whatever the state: a descriptor
        # closed while registered stays in the loop's table under a number
        # that the next accepted socket reuses.
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
            self._loop.remove_writer(self._fd)
        self._reading = False
        self.out.forget_writer()
        while self._inbox:
            close_fds(self._inbox.popleft()[0].fds)
        self.out.drop_fds()
        self.decoder.close()
        self.session.close()
        self.sock.close()
        self._on_close(self)


__all__ = ["Connection"]
