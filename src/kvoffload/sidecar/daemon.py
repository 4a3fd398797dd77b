"""Running a :class:`~.server.Server` as a daemon: signals and systemd's notify protocol.

* SIGTERM or SIGINT: ``STOPPING=1``, then drain (``Server.shutdown``); a
  second SIGINT stops at once, without draining.
* ``READY=1`` once the socket is listening, and ``WATCHDOG=1`` at half the
  interval systemd asks for (``sidecar/notify.py``).
* :func:`reload_policy` is where a SIGHUP policy reload will hang; it is not
  wired yet (:data:`RELOAD_SIGNALS` is empty), so SIGHUP keeps its default
  action.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import TYPE_CHECKING

from . import notify

if TYPE_CHECKING:
    from .server import Server

log = logging.getLogger("kvoffload.server")

#: Signals that call :func:`reload_policy`. Empty until a reload exists: add
#: ``signal.SIGHUP`` here when it does.
RELOAD_SIGNALS: tuple[signal.Signals, ...] = ()


def reload_policy(server: Server) -> None:
    """The hook for a policy reload (SIGHUP). Not implemented.

    A reload would load the policy file anew and assign ``server.policy``;
    every session reads the policy per request (protocol-v1.md §6), so a
    revoked grant would apply from the next request of an open connection.
    It would tell systemd ``RELOADING=1`` before and ``READY=1`` after.
    """
    log.warning("policy reload is not implemented; restart the sidecar to apply a new policy")


def run(server: Server) -> None:
    """Run until SIGTERM or SIGINT (a second SIGINT stops without draining)."""

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
        for sig in RELOAD_SIGNALS:
            loop.add_signal_handler(sig, reload_policy, server)
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


__all__ = ["RELOAD_SIGNALS", "reload_policy", "run"]
