"""Where ``inspect``, ``ls``, ``purge`` and ``fsck`` act: the running sidecar, or the store.

While a sidecar serves the configured socket, the commands go through its
admin verbs (protocol-v1.md §5.11, §5.12, §5.16-§5.18; the policy's admin
right), because the sidecar holds the store's index. Only when nothing
listens there do they open the store in-process. Both targets compute the
same views (:mod:`kvoffload.sidecar.admin`), so the output and ``--json``
are the same either way.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from .app import open_store, unreachable_line
from .exits import _SidecarUnreachable

if TYPE_CHECKING:
    from ..protocol import Reply, Request
    from ..sidecar.config import Config
    from ..store import PurgeReport, Store

_T = TypeVar("_T")

#: The connect and the ``hello``, whatever the verb: a sidecar that accepts
#: connections but serves none (wedged) is given up on after this.
HELLO_TIMEOUT_S = 5.0
#: A request that may walk the whole store (fsck, a purge) may take this long
#: once the sidecar has answered the hello (``--timeout``).
ADMIN_TIMEOUT_S = 3600.0
#: Anything else (inspect, one page of ls, stats) is an index read.
QUERY_TIMEOUT_S = 60.0


class Target(Protocol):
    #: Where the command acts, for messages: "the sidecar on PATH" or "the store at ROOT".
    where: str

    def inspect(self) -> dict[str, Any]: ...

    def ls(
        self,
        tenant: str | None,
        namespace: bytes | None,
        older_than_s: float | None,
        newer_than_s: float | None,
        limit: int,
    ) -> list[dict[str, Any]]: ...

    def purge_tenant(self, tenant: str) -> int: ...

    def purge_namespace(self, tenant: str, namespace: bytes) -> int: ...

    def purge_older(self, age_s: float, tenant: str | None) -> int: ...

    def fsck(
        self, repair: bool, verify_data: bool, progress: Callable[[int], None] | None
    ) -> dict[str, Any]: ...

    def namespaces(self, tenant: str | None) -> list[dict[str, Any]]: ...

    def invalidate(
        self, selector: dict[str, str], tenant: str | None, dry_run: bool
    ) -> dict[str, Any]: ...


def offline_audit(store: Store, verb: str, result: str, **details: Any) -> None:
    """The audit record of an offline admin command (docs/spec/audit-v1.md §3):
    the same log, and the same fields, as the sidecar's admin verbs."""
    gid = os.getgid()
    store.record_audit(
        "admin",
        {
            "uid": os.getuid(),
            "gid": gid,
            "pid": os.getpid(),
            "verb": verb,
            "via": "offline",
            "result": result,
            **{k: v for k, v in details.items() if v is not None},
        },
    )


class LocalTarget:
    """The store opened in-process (no sidecar runs); every command leaves an
    ``admin`` audit record, as the sidecar's admin verbs do."""

    def __init__(self, store: Store, cfg: Config) -> None:
        self.store, self.cfg = store, cfg
        self.where = f"the store at {cfg.store_root}"
        #: The last purge's tiers (``reached``/``outside``), for its report.
        self.tiers: dict[str, list[str]] | None = None

    def _audited(self, verb: str, run: Callable[[], _T], **details: Any) -> _T:
        try:
            result = run()
        except Exception as exc:
            offline_audit(self.store, verb, f"error {type(exc).__name__}", **details)
            raise
        if isinstance(result, int) and not isinstance(result, bool):
            details["chunks"] = result
        offline_audit(self.store, verb, "ok", **details)
        return result

    def inspect(self) -> dict[str, Any]:
        from ..sidecar.admin import inspect_report

        return self._audited("inspect", lambda: inspect_report(self.store, self.cfg.store_root))

    def ls(
        self,
        tenant: str | None,
        namespace: bytes | None,
        older_than_s: float | None,
        newer_than_s: float | None,
        limit: int,
    ) -> list[dict[str, Any]]:
        from ..sidecar.admin import ls_rows

        def run() -> list[dict[str, Any]]:
            rows, _ = ls_rows(
                self.store,
                tenant=tenant,
                namespace=namespace,
                older_than_s=older_than_s,
                newer_than_s=newer_than_s,
                limit=limit,
            )
            return rows

        return self._audited(
            "ls", run, tenant=tenant, namespace=namespace.hex() if namespace else None
        )

    def purge_tenant(self, tenant: str) -> int:
        return self._purge(tenant, None)

    def purge_namespace(self, tenant: str, namespace: bytes) -> int:
        return self._purge(tenant, namespace)

    def _purge(self, tenant: str, namespace: bytes | None) -> int:
        """A purge, with its report's tiers: the store's (no sidecar runs here, so
        no load, lease or event feed of this node exists to reach)."""
        from ..sidecar.admin import purge_tiers

        reports: list[PurgeReport] = []

        def run() -> int:
            reports.append(self.store.purge(tenant, namespace))
            return reports[0].removed

        n = self._audited(
            "purge", run, tenant=tenant, namespace=namespace.hex() if namespace else None
        )
        tiers = purge_tiers(reports[0].tiers, events=False, daemon=False)
        self.tiers = {k: list(v) for k, v in tiers.items()}
        return n

    def purge_older(self, age_s: float, tenant: str | None) -> int:
        return self._audited(
            "purge_older",
            lambda: self.store.purge_older_than(age_s, tenant),
            tenant=tenant,
            older_than_s=age_s,
        )

    def fsck(
        self, repair: bool, verify_data: bool, progress: Callable[[int], None] | None
    ) -> dict[str, Any]:
        def run() -> dict[str, Any]:
            report = self.store.fsck(repair, verify_data=verify_data, progress=progress)
            return report.to_dict()

        return self._audited("fsck", run, repair=repair, verify_data=verify_data)

    def namespaces(self, tenant: str | None) -> list[dict[str, Any]]:
        return self.store.namespaces_report(tenant)

    def invalidate(
        self, selector: dict[str, str], tenant: str | None, dry_run: bool
    ) -> dict[str, Any]:
        actor: dict[str, Any] = {"uid": os.getuid(), "gid": os.getgid(), "pid": os.getpid()}
        actor["verb"] = "invalidate (offline)"
        return self.store.invalidate(selector, tenant=tenant, dry_run=dry_run, actor=actor)


class SidecarTarget:
    """The running sidecar, through its admin verbs."""

    def __init__(
        self, socket_path: Path, job_timeout_s: float = ADMIN_TIMEOUT_S, command: str | None = None
    ) -> None:
        self.socket_path = socket_path
        self.job_timeout_s = job_timeout_s
        #: The command for messages, when it is not the verb (purge asks inspect first).
        self.command = command
        self.where = f"the sidecar on {socket_path}"
        self.store_id: str | None = None
        #: The last purge's tiers as the sidecar reported them (None: an older one).
        self.tiers: dict[str, list[str]] | None = None

    def call(self, req: Request, timeout_s: float = QUERY_TIMEOUT_S) -> Reply:
        from ..client import call_tenantless
        from ..errors import ErrorCode, ProtocolError, TransportError
        from .exits import _Forbidden, _SidecarUnreachable

        try:
            hello, (reply,) = call_tenantless(
                self.socket_path,
                [req],
                client=f"kvoffload {req.OP.value}",
                timeout_s=timeout_s,
                hello_timeout_s=min(HELLO_TIMEOUT_S, timeout_s),
            )
        except TransportError as exc:
            raise _SidecarUnreachable(self._no_answer(req, exc, timeout_s)) from exc
        except ProtocolError as exc:
            if exc.code is ErrorCode.FORBIDDEN:
                raise _Forbidden(
                    f"{self.where} refused {self.command or req.OP.value}: it needs the "
                    "admin right, `admin = true` in a [[grants]] entry of the policy for "
                    f"this user or one of its groups; uid {os.getuid()} has none"
                ) from exc
            if exc.code is ErrorCode.UNSUPPORTED:
                raise ProtocolError(
                    exc.code,
                    f"{self.where} does not serve {req.OP.value} (an older sidecar?): "
                    "stop it to run the command offline",
                ) from exc
            raise
        self.store_id = hello.store_id
        return reply

    def _no_answer(self, req: Request, exc: Exception, timeout_s: float) -> str:
        """The one line for a sidecar that did not answer ``req``: wedged (no
        hello), a job past its time, or a connection that broke."""
        from ..client.session import NO_HELLO
        from ..errors import TransportTimeout

        verb = req.OP.value
        if not isinstance(exc, TransportTimeout):
            return f"{self.where} did not answer {verb}: {exc}"
        if str(exc).startswith(NO_HELLO):
            return (
                f"{self.where} accepts connections but serves none ({exc}): wedged or "
                "overloaded, see its log (journalctl -u kvoffload); nothing was done"
            )
        long_job = verb in ("fsck", "purge", "purge_older")
        hint = " (--timeout waits longer for a long job)" if long_job else ""
        return (
            f"{self.where} took {verb} but did not finish it within {timeout_s:g} s; it may "
            f"still be running there{hint}"
        )

    def check_store(self, cfg: Config) -> None:
        """Refuse when the sidecar serves another store than the one configured."""
        from ..errors import ConfigError
        from ..layouts.store_root import read_layout
        from ..protocol import Stats, StatsReply

        try:
            local = read_layout(cfg.store_root).store_id
        except Exception:  # no readable layout here: the sidecar's store is the one
            return
        reply = self.call(Stats())
        served = self.store_id if isinstance(reply, StatsReply) else None
        if served is not None and served != local:
            raise ConfigError(
                f"{self.where} serves store {served}, not the store at {cfg.store_root} "
                f"({local}): point --config/--root at the sidecar's store, or stop it"
            )

    def inspect(self) -> dict[str, Any]:
        from ..client.session import expect
        from ..protocol import Inspect, InspectReply

        return dict(expect(self.call(Inspect()), InspectReply).report)

    def ls(
        self,
        tenant: str | None,
        namespace: bytes | None,
        older_than_s: float | None,
        newer_than_s: float | None,
        limit: int,
    ) -> list[dict[str, Any]]:
        from ..client.session import expect
        from ..protocol import Ls, LsReply

        rows: list[dict[str, Any]] = []
        while True:
            want = 0 if limit == 0 else limit - len(rows)
            req = Ls(tenant, namespace, older_than_s, newer_than_s, want, len(rows))
            page = expect(self.call(req), LsReply).report
            rows.extend(page.get("chunks", []))
            if not page.get("more") or (limit and len(rows) >= limit):
                return rows[:limit] if limit else rows

    def purge_tenant(self, tenant: str) -> int:
        from ..client.session import expect
        from ..protocol import Purge, PurgeReply

        reply = expect(self.call(Purge(tenant, tiers=True), self.job_timeout_s), PurgeReply)
        self.tiers = {k: list(v) for k, v in reply.tiers.items()} or None  # None: older server
        return reply.removed

    def purge_namespace(self, tenant: str, namespace: bytes) -> int:
        from ..client.session import expect
        from ..protocol import Purge, PurgeReply

        req = Purge(tenant, namespace, tiers=True)
        reply = expect(self.call(req, self.job_timeout_s), PurgeReply)
        self.tiers = {k: list(v) for k, v in reply.tiers.items()} or None
        return reply.removed

    def drop_cache(self) -> tuple[int, int]:
        """§5.31: (images dropped, bytes the tier still maps)."""
        from ..client.session import expect
        from ..protocol import DropCache, DropCacheReply

        reply = expect(self.call(DropCache()), DropCacheReply)
        return reply.dropped, reply.held_bytes

    def purge_older(self, age_s: float, tenant: str | None) -> int:
        from ..client.session import expect
        from ..protocol import PurgeOlder, PurgeOlderReply

        return expect(
            self.call(PurgeOlder(age_s, tenant), self.job_timeout_s), PurgeOlderReply
        ).removed

    def fsck(
        self, repair: bool, verify_data: bool, progress: Callable[[int], None] | None
    ) -> dict[str, Any]:
        from ..client.session import expect
        from ..protocol import Fsck, FsckReply

        reply = self.call(Fsck(repair, verify_data), self.job_timeout_s)
        report = dict(expect(reply, FsckReply).report)
        report.pop("verified_data", None)
        return report

    def namespaces(self, tenant: str | None) -> list[dict[str, Any]]:
        from ..client.session import expect
        from ..protocol import Namespaces, NamespacesReply

        rows: list[dict[str, Any]] = []
        while True:
            req = Namespaces(tenant, len(rows))
            page = expect(self.call(req, self.job_timeout_s), NamespacesReply).report
            got = list(page.get("namespaces", []))
            rows.extend(got)
            if not page.get("more") or not got:
                return rows

    def invalidate(
        self, selector: dict[str, str], tenant: str | None, dry_run: bool
    ) -> dict[str, Any]:
        from ..client.session import expect
        from ..protocol import Invalidate, InvalidateReply

        req = Invalidate(**selector, tenant=tenant, dry_run=dry_run)
        return dict(expect(self.call(req, self.job_timeout_s), InvalidateReply).report)


def sidecar_listening(path: Path) -> bool:
    """Whether something accepts connections on the Unix socket ``path``; one this
    user may not connect to is :class:`~.exits._SidecarUnreachable` (exit 7)."""
    if not os.path.exists(path):
        return False
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(2.0)
    try:
        sock.connect(os.fspath(path))
    except PermissionError as exc:
        # A sidecar may well serve it, for its group: not a reason to open the store.
        raise _SidecarUnreachable(unreachable_line(path, exc)) from exc
    except OSError:
        return False
    finally:
        sock.close()
    return True


@contextlib.contextmanager
def admin_target(
    cfg: Config, job_timeout_s: float = ADMIN_TIMEOUT_S, command: str | None = None
) -> Iterator[Target]:
    """The running sidecar if one listens on the configured socket, else the store.

    ``job_timeout_s``: how long the sidecar may take over a long job (fsck, a
    purge) once it has answered; a sidecar that does not answer at all is given
    up on after :data:`HELLO_TIMEOUT_S`, whatever the verb. ``command``: what a
    refusal names, where the command runs other verbs too (purge)."""
    if sidecar_listening(cfg.socket_path):
        target = SidecarTarget(cfg.socket_path, job_timeout_s, command)
        target.check_store(cfg)
        yield target
        return
    with open_store(cfg) as store:
        yield LocalTarget(store, cfg)


__all__ = [
    "LocalTarget",
    "SidecarTarget",
    "Target",
    "admin_target",
    "offline_audit",
    "sidecar_listening",
]
