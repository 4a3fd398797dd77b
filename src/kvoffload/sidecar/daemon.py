"""Running a :class:`~.server.Server` as a daemon: signals and systemd's notify protocol.

* SIGTERM or SIGINT: ``STOPPING=1``, then drain (``Server.shutdown``); a
  second SIGINT stops at once, without draining.
* The policy file changed (checked every :data:`POLICY_POLL_S`, see
  :class:`PolicyWatcher`): the same reload as SIGHUP.
* SIGHUP: :func:`reload_policy` (``RELOADING=1`` … ``READY=1``): the policy
  file is read anew and, if valid, replaces the policy; every session reads
  the policy per request (protocol-v1.md §6), so the new grants apply from
  the next request of every connection; handles of a tenant a connection
  lost are released and its loads in flight cancelled (§6.1). An invalid
  file keeps the old policy and is logged; a sidecar without a policy
  file (``--dev``) logs that there is nothing to reload. SIGHUP never stops the daemon.
* ``READY=1`` once the socket is listening, ``WATCHDOG=1`` at half the
  interval systemd asks for, and a one-line ``STATUS=`` (serving, chunks,
  bytes, connections) at start, after each reload and every
  :data:`STATUS_INTERVAL_S` (``sidecar/notify.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import notify
from .access.policy import Policy
from .access.revocation import format_diff, policy_diff

if TYPE_CHECKING:
    from .ports import PolicyAPI
    from .server import Server

log = logging.getLogger("kvoffload.server")

#: Signals that call :func:`reload_policy`.
RELOAD_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGHUP,)
#: How often ``STATUS=`` is refreshed.
STATUS_INTERVAL_S = 10.0

PolicyLoader = Callable[[], "PolicyAPI"]


#: How often the policy file is checked for a change (stat, then a content hash).
POLICY_POLL_S = 0.25


def _audit(server: Server, event: str, details: dict[str, Any]) -> None:
    try:
        server.store.record_audit(event, details)
    except Exception as exc:  # a full disk must not undo or block a reload
        log.error("audit record %s not written: %s", event, exc)


def reload_policy(server: Server, load: PolicyLoader | None = None, *, why: str = "SIGHUP") -> bool:
    """Replace the server's policy with ``load()``, atomically; True if it was replaced.

    ``load`` is None when the policy is not read from a file (the development
    policy): then nothing changes. A ``load`` that raises (an invalid or
    unreadable file) keeps the current policy: a typo in a reload must not
    take the node's grants away, and must not half-apply. Either outcome is
    logged, counted (``stats`` ``policy``, ``kvoffload_policy_reloads``) and
    audited (``policy_reload`` / ``policy_reload_refused``; ``revoke`` when
    the new policy took a tenant from a connection or revoked one).
    """
    if load is None:
        log.warning("%s: this sidecar has no policy file to reload; nothing changed", why)
        return False
    svc = server.service
    state = svc.policy_state
    metrics = server.metrics
    notify.reloading()
    try:
        policy = load()
    except Exception as exc:
        state.last_reload_at = time.time()
        state.last_reload_ok = False
        state.last_error = str(exc)
        state.reloads_refused += 1
        if metrics is not None:
            metrics.policy_reloads.labels(result="refused").inc()
            metrics.policy_reload_ok.set(0)
        log.error("%s: the policy was not reloaded, the current one stays in force: %s", why, exc)
        _audit(
            server,
            "policy_reload_refused",
            {"trigger": why, "source": state.source, "error": str(exc),
             "generation": svc.generation, "result": "refused"},
        )  # fmt: skip
        return False
    finally:
        notify.ready()
    old = server.policy
    diff: dict[str, Any] | None = None
    if isinstance(old, Policy) and isinstance(policy, Policy):
        diff = policy_diff(old, policy)
    outcome = svc.swap_policy(policy)
    state.source = policy.source
    state.loaded_at = state.last_reload_at = time.time()
    state.last_reload_ok = True
    state.last_error = None
    state.reloads_ok += 1
    if metrics is not None:
        metrics.policy_reloads.labels(result="ok").inc()
        metrics.policy_reload_ok.set(1)
        metrics.policy_generation.set(svc.generation)
    changes = format_diff(diff) if diff is not None else []
    log.info(
        "%s: policy reloaded (generation %d)%s",
        why,
        svc.generation,
        (": " + "; ".join(changes)) if changes else ": no change",
    )
    _audit(
        server,
        "policy_reload",
        {"trigger": why, "source": state.source, "generation": svc.generation,
         "diff": diff, "result": "ok"},
    )  # fmt: skip
    if outcome["revoked"] or outcome["restored"] or outcome["connections"]:
        _audit(server, "revoke", {"trigger": why, **outcome, "result": "ok"})
    publish_status(server)
    return True


class PolicyWatcher:
    """Notices a change of the policy file: its (inode, mtime, size), then its content.

    An editor's rename (new inode), an in-place write (mtime, size) and a
    ``touch`` all change the stat; the content hash then tells a real change
    from a touch. A file that cannot be read counts as a change (the reload
    refuses it and says why), once per stat change.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._stat = self._sig()
        self._digest = self._hash()

    def _sig(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _hash(self) -> bytes | None:
        try:
            with open(self.path, "rb") as f:
                return hashlib.sha256(f.read()).digest()
        except OSError:
            return None

    def changed(self) -> bool:
        sig = self._sig()
        if sig == self._stat:
            return False
        self._stat = sig
        digest = self._hash()
        if digest is not None and digest == self._digest:
            return False
        self._digest = digest
        return True

    def reloaded(self) -> None:
        """A reload (SIGHUP) read the file: what it read is the new baseline."""
        self._stat = self._sig()
        self._digest = self._hash()


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


class _Daemon:
    """One run of :func:`run`: the state its signal handlers and background tasks share."""

    def __init__(
        self,
        server: Server,
        load_policy: PolicyLoader | None,
        policy_path: str | os.PathLike[str] | None,
    ) -> None:
        self.server = server
        self.load_policy = load_policy
        self.policy_path = policy_path
        self.stop = asyncio.Event()
        #: A second SIGINT: stop without draining.
        self.forced = False
        self.watcher: PolicyWatcher | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    async def main(self, on_listening: Callable[[], None] | None) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.start()
        if on_listening is not None:
            on_listening()
        if self.policy_path and self.load_policy:
            self.watcher = PolicyWatcher(self.policy_path)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self.on_signal, sig)
        for sig in RELOAD_SIGNALS:
            self.loop.add_signal_handler(sig, self.on_reload)
        notify.ready()
        interval = notify.watchdog_interval_s()
        dog = asyncio.create_task(self.watchdog(interval)) if interval else None
        reporter = asyncio.create_task(self.status())
        watch = asyncio.create_task(self.watch_policy()) if self.watcher is not None else None
        await self.stop.wait()
        if watch is not None:
            watch.cancel()
        if self.server.metrics is not None:
            self.server.metrics.ready = False  # /readyz: take this node out of rotation
        notify.stopping()
        notify.status("stopping: draining connections")
        reporter.cancel()
        if dog is not None:
            dog.cancel()
        if not self.forced:
            await self.server.shutdown()

    def on_signal(self, signum: int) -> None:
        if self.stop.is_set() and signum == signal.SIGINT:
            self.forced = True
            log.warning("second interrupt: stopping without draining")
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            return
        self.stop.set()

    def on_reload(self) -> None:
        # The file is small; a pool thread would gain nothing but a race.
        if self.watcher is not None:
            self.watcher.reloaded()
        reload_policy(self.server, self.load_policy)

    async def watch_policy(self) -> None:
        assert self.watcher is not None
        while True:
            await asyncio.sleep(POLICY_POLL_S)
            try:
                if self.watcher.changed():
                    reload_policy(self.server, self.load_policy, why="policy file changed")
            except Exception:  # the watcher must never stop the daemon
                log.exception("watching the policy file failed")

    @staticmethod
    async def watchdog(interval: float) -> None:
        while True:
            notify.watchdog()
            await asyncio.sleep(interval / 2)

    async def status(self) -> None:
        while True:
            publish_status(self.server)
            await asyncio.sleep(STATUS_INTERVAL_S)


def run(
    server: Server,
    *,
    on_listening: Callable[[], None] | None = None,
    load_policy: PolicyLoader | None = None,
    policy_path: str | os.PathLike[str] | None = None,
) -> None:
    """Run until SIGTERM or SIGINT (a second SIGINT stops without draining).

    ``on_listening`` runs once the socket is bound and listening (before
    ``READY=1``); ``load_policy`` is what SIGHUP reloads (see :func:`reload_policy`).
    Errors of ``server.start()`` (the socket cannot be bound) propagate.
    """
    daemon = _Daemon(server, load_policy, policy_path)
    with contextlib.suppress(asyncio.CancelledError):
        asyncio.run(daemon.main(on_listening))


__all__ = [
    "POLICY_POLL_S",
    "RELOAD_SIGNALS",
    "STATUS_INTERVAL_S",
    "PolicyWatcher",
    "publish_status",
    "reload_policy",
    "run",
    "status_line",
]
