"""Running a :class:`~.server.Server` as a daemon: signals and systemd's notify protocol.

* SIGTERM or SIGINT: ``STOPPING=1``, then drain (``Server.shutdown``); a
  second SIGINT stops at once, without draining.
* SIGHUP: :func:`reload_policy` (``RELOADING=1`` … ``READY=1``): the policy
  file is read anew and, if valid, replaces the policy; every session reads
  the policy per request (protocol-v1.md §6), so the new grants apply from
  the next request of every connection (handles and leases already given out
  run to their end). An invalid file keeps the old policy and is logged; a
  sidecar without a policy file (``--dev``) logs that there is nothing to
  reload. SIGHUP never stops the daemon.
* ``READY=1`` once the socket is listening, ``WATCHDOG=1`` at half the
  interval systemd asks for, and a one-line ``STATUS=`` (serving, chunks,
  bytes, connections) at start, after each reload and every
  :data:`STATUS_INTERVAL_S` (``sidecar/notify.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import notify

if TYPE_CHECKING:
    from .ports import PolicyAPI
    from .server import Server

log = logging.getLogger("kvoffload.server")

#: Signals that call :func:`reload_policy`.
RELOAD_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGHUP,)
#: How often ``STATUS=`` is refreshed.
STATUS_INTERVAL_S = 10.0

PolicyLoader = Callable[[], "PolicyAPI"]


def reload_policy(server: Server, load: PolicyLoader | None = None) -> bool:
    """SIGHUP: replace the server's policy with ``load()``; True if it was replaced.

    ``load`` is None when the policy is not read from a file (the development
    policy): then nothing changes. A ``load`` that raises (an invalid or
    unreadable file) keeps the current policy: a typo in a reload must not
    take the node's grants away.
    """
    if load is None:
        log.warning("SIGHUP: this sidecar has no policy file to reload; nothing changed")
        return False
    notify.reloading()
    try:
        policy = load()
    except Exception as exc:
        log.error("SIGHUP: the policy was not reloaded, the current one stays in force: %s", exc)
        return False
    finally:
        notify.ready()
    server.policy = policy
    log.info("SIGHUP: policy reloaded")
    publish_status(server)
    return True


def status_line(server: Server) -> str:
    """``serving <store id>: N chunks, SIZE of CAP, K connections`` (for ``STATUS=``)."""
    from ..units import format_size

    try:
        stats = server.store.stats()
    except Exception as exc:  # the status must never stop the daemon
        return f"serving; store stats unavailable: {exc}"
    cap = stats.get("capacity_bytes")
    return (
        f"serving {stats.get('store_id', '?')}: {stats.get('chunks', 0)} chunks, "
        f"{format_size(stats.get('used_bytes', 0))}"
        + (f" of {format_size(cap)}" if cap else "")
        + f", {len(server.connections)} connections"
    )


def publish_status(server: Server) -> bool:
    return notify.status(status_line(server))


def run(
    server: Server,
    *,
    on_listening: Callable[[], None] | None = None,
    load_policy: PolicyLoader | None = None,
) -> None:
    """Run until SIGTERM or SIGINT (a second SIGINT stops without draining).

    ``on_listening`` runs once the socket is bound and listening (before
    ``READY=1``); ``load_policy`` is what SIGHUP reloads (see :func:`reload_policy`).
    Errors of ``server.start()`` (the socket cannot be bound) propagate.
    """

    async def main() -> None:
        loop = asyncio.get_running_loop()
        await server.start()
        if on_listening is not None:
            on_listening()
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

        def on_reload() -> None:
            # The file is small; a pool thread would gain nothing but a race.
            reload_policy(server, load_policy)

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        for sig in RELOAD_SIGNALS:
            loop.add_signal_handler(sig, on_reload)
        notify.ready()
        interval = notify.watchdog_interval_s()

        async def watchdog() -> None:
            assert interval is not None
            while True:
                notify.watchdog()
                await asyncio.sleep(interval / 2)

        async def status() -> None:
            while True:
                publish_status(server)
                await asyncio.sleep(STATUS_INTERVAL_S)

        dog = asyncio.create_task(watchdog()) if interval else None
        reporter = asyncio.create_task(status())
        await stop.wait()
        if server.metrics is not None:
            server.metrics.ready = False  # /readyz: take this node out of rotation
        notify.stopping()
        notify.status("stopping: draining connections")
        reporter.cancel()
        if dog is not None:
            dog.cancel()
        if not forced:
            await server.shutdown()

    with contextlib.suppress(asyncio.CancelledError):
        asyncio.run(main())


__all__ = [
    "RELOAD_SIGNALS",
    "STATUS_INTERVAL_S",
    "publish_status",
    "reload_policy",
    "run",
    "status_line",
]
