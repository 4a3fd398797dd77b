"""One connection to the sidecar: request ids, replies, error handling, logging.

A :class:`Session` is what a save or load strategy talks through. It never
decides to reconnect itself: :meth:`Session.lose` closes the transport and
tells the owner (the :class:`~kvoffload.client.SidecarClient`), which backs
off and opens a fresh session on a later call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..protocol import (
    MAX_PIGGYBACK,
    MAX_PROTOCOL_VERSION,
    MIN_PROTOCOL_VERSION,
    Ack,
    Bye,
    CompleteLoad,
    ErrorCode,
    ErrorReply,
    Hello,
    HelloReply,
    LookupLoad,
    Op,
    PrepareLoad,
    PrepareLoadReply,
    ProtocolError,
    Reply,
    Request,
    SealedLoad,
    Stats,
    StatsReply,
    close_fds,
    parse_reply,
    request_message,
)
from ..staging import StagingError
from ..transport import Transport, TransportError, TransportTimeout, UnixTransport

#: Every module of the client logs as ``kvoffload.client``.
log = logging.getLogger("kvoffload.client")
_R = TypeVar("_R")


#: Tenants this process was told it may not use (logged once each).
_FORBIDDEN_TENANTS: set[str] = set()
_FORBIDDEN_LOCK = threading.Lock()


class _Unavailable(Exception):
    """The sidecar answered, but the session cannot continue (refused hello, draining)."""


#: What "the sidecar is not usable right now" looks like from here.
CONNECTION_ERRORS = (TransportError, ProtocolError, _Unavailable, StagingError, OSError)


class RateLimitedLog:
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


def expect(reply: Reply, cls: type[_R]) -> _R:
    """``reply`` as a ``cls``; anything else is a protocol error."""
    if not isinstance(reply, cls):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"unexpected reply {reply!r}")
    return reply


def read_reply(
    transport: Transport, rid: int, req: Request, posted: dict[int, Request] | None = None
) -> tuple[int, Reply]:
    """The reply to request ``rid`` (``req``), checked for id and op; or, where
    it comes first, the reply to one of the ``posted`` requests (sent without
    waiting), checked against that request and removed from ``posted``."""
    got, reply, _fds = read_reply_fds(transport, rid, req, posted)
    return got, reply


def read_reply_fds(
    transport: Transport, rid: int, req: Request, posted: dict[int, Request] | None = None
) -> tuple[int, Reply, list[int]]:
    """:func:`read_reply`, and the descriptors that came with the reply to a
    ``sealed_load`` (§5.33; the caller's to close). Any other frame that carries
    descriptors is a protocol error."""
    frame = transport.recv()
    try:
        got, reply = parse_reply(frame.msg)
    except BaseException:
        close_fds(frame.fds)
        raise
    if frame.fds and not (got == rid and isinstance(req, SealedLoad)):
        close_fds(frame.fds)
        raise ProtocolError(ErrorCode.BAD_REQUEST, "server sent descriptors")
    if got == 0 and isinstance(reply, ErrorReply):
        raise _Unavailable(f"sidecar closed the connection: {reply.code.name}: {reply.message}")
    if got != rid:
        if posted is None or got not in posted:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"reply to request {got}, expected {rid}")
        req = posted.pop(got)
    op = reply.op if isinstance(reply, ErrorReply | Ack) else reply.OP
    if op is Op.LOAD_PROGRESS and isinstance(req, PrepareLoad) and (req.layerwise or req.chunkwise):
        return got, reply, []  # §5.26, §5.30: an interim frame of this request
    if op != req.OP:
        close_fds(frame.fds)
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"reply for {op}, expected {req.OP}")
    return got, reply, frame.fds


#: ``on_lost(session, exc)``: the owner forgets the session and backs off.
LostFn = Callable[["Session", BaseException], None]


@dataclass(eq=False)
class Session:
    """A connection that said hello and registered its staging buffer."""

    transport: Transport
    hello: HelloReply
    salt: bytes
    tenant: str
    warn: RateLimitedLog
    on_lost: LostFn
    next_id: int = 1
    #: Lost or closed: a strategy stops at the next batch boundary.
    ended: bool = False
    #: Namespace → contract fields the client knows (shared with the client, §5.19).
    contracts: dict[bytes, dict[str, Any]] = field(default_factory=dict)
    #: Namespaces whose contract this connection has registered.
    contracts_sent: set[bytes] = field(default_factory=set)
    #: Requests sent without waiting (:meth:`post`) whose replies are still to
    #: come, by id: read on the way to the next reply this session waits for.
    posted: dict[int, Request] = field(default_factory=dict)
    #: §5.32: load handles whose data is copied out, to be completed by the
    #: next ``prepare_load`` or ``lookup_load`` (its ``complete``), or by a
    #: ``complete_load`` sent before any other request.
    deferred: list[int] = field(default_factory=list)

    def contract_for(self, namespace: bytes) -> dict[str, Any] | None:
        """§5.19: the fields to send with a write of ``namespace``: once per connection."""
        if namespace in self.contracts_sent:
            return None
        return self.contracts.get(namespace)

    def contract_sent(self, namespace: bytes, reply: Reply) -> None:
        """A write that carried the contract was answered without an error: registered."""
        if not isinstance(reply, ErrorReply):
            self.contracts_sent.add(namespace)

    @property
    def alive(self) -> bool:
        return not self.ended

    def take_id(self) -> int:
        rid = self.next_id
        self.next_id = rid % (2**32 - 1) + 1
        return rid

    def send(self, req: Request) -> int:
        """Send ``req`` without waiting; its id, for :func:`read_reply`."""
        self._flush_deferred(req)
        rid = self.take_id()
        self.transport.send(request_message(rid, req))
        return rid

    def call(self, req: Request, fds: Sequence[int] = ()) -> Reply:
        self._flush_deferred(req)
        rid = self.take_id()
        self.transport.send(request_message(rid, req), fds)
        return self.reply_to(rid, req)

    def post(self, req: Request) -> None:
        """Send ``req`` and go on without its reply, which is checked when it comes
        (on the way to the next reply waited for): for a verb whose success
        changes nothing here (:meth:`complete_load`). Saves a round trip."""
        self._flush_deferred(req)
        rid = self.take_id()
        self.transport.send(request_message(rid, req))
        self.posted[rid] = req

    def complete_load(self, handle: int) -> None:
        """§5.8 for a staged load whose bytes are copied out: deferred to the
        next load request's ``complete`` where the server takes it
        (``lookup_load``, §5.32: no frame of its own), else posted where the
        server answers it before the next request (``complete_in_order``,
        §5.29), else a call whose error reply is handled here."""
        if self.hello.lookup_load:
            self.deferred.append(handle)
            if len(self.deferred) >= MAX_PIGGYBACK:
                self._flush_deferred(None)
            return
        self._complete_now(handle)

    def take_deferred(self) -> tuple[int, ...]:
        """§5.32: the deferred handles, for the ``complete`` of the request about
        to be sent (which then owns them)."""
        handles = tuple(self.deferred)
        self.deferred.clear()
        return handles

    def _flush_deferred(self, req: Request | None) -> None:
        """Complete the deferred handles with frames of their own before ``req``,
        unless ``req`` carries them (a load request built with :meth:`take_deferred`)."""
        if not self.deferred or (isinstance(req, PrepareLoad | LookupLoad) and req.complete):
            return
        for handle in self.take_deferred():
            self._complete_now(handle)

    def _complete_now(self, handle: int) -> None:
        if self.hello.complete_in_order:
            self.post(CompleteLoad(handle))
            return
        done = self.call(CompleteLoad(handle))
        if isinstance(done, ErrorReply):
            self.on_error_reply(done)

    def call_fds(self, req: SealedLoad) -> tuple[Reply, list[int]]:
        """:meth:`call`, and the descriptors its reply carried (§5.33; the caller's)."""
        rid = self.take_id()
        self.transport.send(request_message(rid, req))
        while True:
            got, reply, fds = read_reply_fds(self.transport, rid, req, self.posted)
            if got == rid:
                return reply, fds
            if isinstance(reply, ErrorReply):
                self.on_error_reply(reply)

    def reply_to(self, rid: int, req: Request) -> Reply:
        """The reply to ``rid`` (``req``); replies to posted requests that arrive
        first are taken on the way, an error among them handled as any error."""
        while True:
            got, reply = read_reply(self.transport, rid, req, self.posted)
            if isinstance(reply, PrepareLoadReply) and reply.complete_failed:
                # §5.32: a handle that expired while deferred; nothing is lost.
                self.warn(
                    logging.WARNING,
                    "complete-failed",
                    f"kvoffload sidecar had no load handle {list(reply.complete_failed)} "
                    "to complete (expired while idle?)",
                )
            if got == rid:
                return reply
            if isinstance(reply, ErrorReply):
                self.on_error_reply(reply)

    def lose(self, exc: BaseException) -> None:
        """Drop the session; the server releases everything it held for it."""
        self.ended = True
        self.transport.close()
        self.on_lost(self, exc)

    def close(self) -> None:
        """Say bye and disconnect (``SidecarClient.close``); never raises a connection error."""
        self.ended = True
        with contextlib.suppress(*CONNECTION_ERRORS):
            self.call(Bye())
        self.transport.close()

    def on_error_reply(self, reply: ErrorReply) -> None:
        if reply.code is ErrorCode.SHUTTING_DOWN:
            self.lose(_Unavailable("sidecar is shutting down"))
        elif reply.code in (
            ErrorCode.BAD_REQUEST,
            ErrorCode.BAD_HANDLE,
            ErrorCode.NOT_REGISTERED,
            ErrorCode.UNSUPPORTED,
        ):
            # One side has a bug: start over with fresh state on both ends.
            self.lose(_Unavailable(f"{reply.code.name}: {reply.message}"))
        elif reply.code is ErrorCode.FORBIDDEN:
            # The policy does not grant this tenant to this process: it only ever
            # misses (protocol-v1.md §6). Said once per process and tenant, plainly.
            with _FORBIDDEN_LOCK:
                first = self.tenant not in _FORBIDDEN_TENANTS
                _FORBIDDEN_TENANTS.add(self.tenant)
            if first:
                log.warning(
                    "kvoffload sidecar refused %s: FORBIDDEN: the sidecar's policy does not "
                    "grant tenant %r to this process (uid %d): its lookups and loads always "
                    "miss and nothing is saved; grant it in the policy file (`kvoffload "
                    "policy check FILE` shows who may use what) and reload the sidecar",
                    reply.op,
                    self.tenant,
                    os.getuid(),
                )
        else:
            self.warn(
                logging.WARNING,
                f"reply-{reply.code.name}",
                f"kvoffload sidecar refused {reply.op}: {reply.code.name}: {reply.message}",
            )


#: How a ``call_tenantless`` timeout before the ``hello`` reply starts its message.
NO_HELLO = "no answer to hello"


def call_tenantless(
    socket_path: str | os.PathLike[str],
    requests: Sequence[Request],
    *,
    client: str = "kvoffload",
    timeout_s: float = 5.0,
    hello_timeout_s: float | None = None,
) -> tuple[HelloReply, list[Reply]]:
    """``requests`` on one connection that names no tenant: the ``hello`` reply and
    the requests' replies, in order.

    What the operator's commands use (``stats``, and the admin verbs of
    ``inspect``, ``ls``, ``purge``, ``fsck``): no tenant's keys are created and
    no staging buffer is registered. Raises ``TransportError`` if the sidecar
    is unreachable and ``ProtocolError`` (with the reply's code) if it refuses
    a request.

    ``hello_timeout_s`` (default ``timeout_s``) bounds the connect and the
    ``hello``: a sidecar that accepts connections but serves none (wedged)
    is told from one running a long request, which ``timeout_s`` bounds. A
    timeout is ``TransportTimeout``, its message starting with
    :data:`NO_HELLO` or naming the request.
    """
    first = timeout_s if hello_timeout_s is None else hello_timeout_s
    transport = UnixTransport.connect(os.fspath(socket_path), timeout_s=first)
    try:
        exchanges: list[Request] = [
            Hello(MIN_PROTOCOL_VERSION, MAX_PROTOCOL_VERSION, client[:128], ()),
            *requests,
        ]
        replies: list[Reply] = []
        for rid, req in enumerate(exchanges, start=1):
            transport.send(request_message(rid, req))
            wait = first if rid == 1 else timeout_s
            try:
                frame = transport.recv(wait)
            except TransportTimeout as exc:
                what = NO_HELLO if rid == 1 else f"no reply to {req.OP.value}"
                raise TransportTimeout(f"{what} within {wait:g} s") from exc
            close_fds(frame.fds)
            got, reply = parse_reply(frame.msg)
            if isinstance(reply, ErrorReply):
                raise ProtocolError(reply.code, f"{req.OP.value} refused: {reply.message}")
            if got != rid:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"reply to {got}, expected {rid}")
            replies.append(reply)
        with contextlib.suppress(*CONNECTION_ERRORS):
            transport.send(request_message(len(exchanges) + 1, Bye()))
        return expect(replies[0], HelloReply), replies[1:]
    finally:
        transport.close()


def fetch_stats(socket_path: str | os.PathLike[str], timeout_s: float = 5.0) -> dict[str, Any]:
    """The sidecar's counters, over a connection that names no tenant.

    Unlike ``SidecarClient.stats`` this neither creates a tenant's keys nor
    registers a staging buffer, so an operator's `kvoffload stats` has no side
    effects. Raises ``TransportError``/``ProtocolError`` if the sidecar is unreachable.
    """
    _, (reply,) = call_tenantless(
        socket_path, [Stats()], client="kvoffload stats", timeout_s=timeout_s
    )
    return dict(expect(reply, StatsReply).stats)
