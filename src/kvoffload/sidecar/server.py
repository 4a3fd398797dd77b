"""The sidecar's server: protocol v1 (``docs/spec/protocol-v1.md``) over a Unix socket.

::

    Server                    listen (socket mode and group, stale socket
      │                       removal, or an inherited socket), accept, sweep
      │                       expired handles and run store maintenance, drain
      └─ Connection           the frame loop of one socket (connection.py)
           └─ Session         every verb, synchronous (session.py)
                └─ Service    store, policy, secret, byte budget (service.py)

``run`` (daemon.py) adds signals and systemd notification. The store and
the policy are reached only through :class:`StoreAPI` and :class:`PolicyAPI`
(ports.py), the subsets the protocol needs; tests use fakes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvoffload.errors import ConfigError, ListenError
from kvoffload.protocol import ErrorCode, encode_frame, error_message

from .access.revocation import RevokedSet
from .config import ServerConfig
from .connection import Connection
from .metrics import Metrics
from .peer import peer_credentials
from .ports import PolicyAPI, StoreAPI
from .service import ByteBudget, EventsAPI, Service

log = logging.getLogger("kvoffload.server")

#: sun_path holds 108 bytes, the terminating NUL included.
MAX_SUN_PATH = 108


def check_socket_path(path: Path) -> None:
    """:class:`ListenError` (one line) when the server cannot listen on ``path``,
    found before anything is bound; ``kvoffload config check`` runs it too."""
    size = len(os.fsencode(path))
    if size >= MAX_SUN_PATH:
        raise ListenError(
            f"socket path {path} is {size} bytes long; a Unix socket path must be "
            f"shorter than {MAX_SUN_PATH} bytes: choose a shorter [server] socket"
        )
    if path.parent.exists() and not path.parent.is_dir():
        raise ListenError(f"cannot listen on {path}: {path.parent} is not a directory")
    try:
        mode: int | None = path.lstat().st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISSOCK(mode):
        raise ListenError(
            f"cannot listen on {path}: it exists and is not a socket (remove it, "
            "or choose another [server] socket)"
        )


def socket_gid(group: str | None) -> int | None:
    """The gid of ``[server] socket_group`` (None when unset); :class:`ConfigError`
    when no such group exists (the socket, and the events' ipc files, get it)."""
    if group is None:
        return None
    import grp

    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(
            f"[server] socket_group {group!r}: no such group (create it first: "
            "systemd-sysusers kvoffload.sysusers.conf, or groupadd)"
        ) from None


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
        events: EventsAPI | None = None,
        revoked: RevokedSet | None = None,
    ) -> None:
        self.config = config or ServerConfig()
        self.service = Service(store, policy, self.config, metrics, events, revoked)
        self.pool = ThreadPoolExecutor(self.config.worker_threads, "kvoffload-io")
        self.connections: set[Connection] = set()
        self._listener: socket.socket | None = None
        self._owns_path = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._accept_task: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()

    @property
    def store(self) -> StoreAPI:
        return self.service.store

    @property
    def policy(self) -> PolicyAPI:
        return self.service.policy

    @policy.setter
    def policy(self, policy: PolicyAPI) -> None:
        self.service.policy = policy

    @property
    def metrics(self) -> Metrics | None:
        return self.service.metrics

    @property
    def store_id(self) -> str:
        return self.service.store_id

    @property
    def budget(self) -> ByteBudget:
        return self.service.budget

    @property
    def draining(self) -> bool:
        return self.service.draining

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
        """The listening socket; :class:`ListenError` (one line) when there can be none."""
        cfg = self.config
        if cfg.socket_fd is not None:
            sock = socket.socket(fileno=cfg.socket_fd)
            if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
                raise ListenError("the inherited socket is not a Unix stream socket")
            return sock
        if cfg.socket_path is None:
            raise ValueError("ServerConfig needs socket_path or socket_fd")
        path = Path(cfg.socket_path)
        check_socket_path(path)
        gid = socket_gid(cfg.socket_group)
        try:
            return self._bind(path, gid)
        except ListenError:
            raise
        except OSError as exc:
            raise ListenError(f"cannot listen on {path}: {exc.strerror or exc}") from exc

    def _bind(self, path: Path, gid: int | None) -> socket.socket:
        cfg = self.config
        path.parent.mkdir(parents=True, exist_ok=True)
        self._remove_stale(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # The umask makes the socket appear with its final mode: no window in
        # which it is connectable by everyone.
        old = os.umask(0o777 & ~cfg.socket_mode)
        try:
            sock.bind(os.fspath(path))
        except BaseException:
            sock.close()
            raise
        finally:
            os.umask(old)
        try:
            os.chmod(path, cfg.socket_mode)
            if gid is not None:
                os.chown(path, -1, gid)
            sock.listen(128)
        except BaseException:
            # A start that fails leaves no socket file behind (nor one that looks
            # like a live sidecar's to the next start).
            sock.close()
            path.unlink(missing_ok=True)
            raise
        self._owns_path = True
        return sock

    @staticmethod
    def _remove_stale(path: Path) -> None:
        try:
            st = path.lstat()
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            return  # never removed: check_socket_path refuses it
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(os.fspath(path))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)  # left behind by a server that died
            return
        finally:
            probe.close()
        raise ListenError(
            f"cannot listen on {path}: another sidecar is already serving it "
            "(stop that one, or give this one another [server] socket)"
        )

    async def serve_forever(self) -> None:
        await self._stopped.wait()

    async def _accept_loop(self) -> None:
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        listener = self._listener
        while True:
            # accept(2) here, in this task's own step, and only wait (for the
            # listener to be readable) while nothing is accepted: a shutdown that
            # cancels this task never finds a connection accepted but not yet
            # handed to a Connection (loop.sock_accept's can be lost so, its
            # socket left to the garbage collector).
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                await _readable(loop, listener)
                continue
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
            conn = Connection(self.service, self.pool, sock, peer, self.connections.discard)
            self.connections.add(conn)
            if self.metrics is not None:
                self.metrics.connections.inc()
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
            for session in self.service.sessions():
                expired = session.expire_handles(cutoff)
                if expired:
                    log.warning("%r: %d handle(s) expired", session, len(expired))
                    await asyncio.get_running_loop().run_in_executor(
                        self.pool, session.release_all, expired
                    )

    async def shutdown(self) -> None:
        """Drain: refuse new work, let in-flight requests finish, then close everything."""
        if self._stopped.is_set():
            return
        self.service.draining = True
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
                await conn.send(notice)
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


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    """Wait until ``sock`` is readable (for a listener: a connection to accept)."""
    ready: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        loop.remove_reader(fd)


__all__ = ["Server", "check_socket_path", "socket_gid"]
