"""What ``serve`` refuses to start on, found before it binds or opens anything.

``serve`` runs these checks and stops at the first refusal (one line, its
exit code); ``config check`` runs every one and reports each, and exits
non-zero when any refuses, so that it can gate a deployment. Each check
calls the code ``serve`` itself runs (the policy loader,
:func:`~kvoffload.sidecar.server.check_socket_path` and
:func:`~kvoffload.sidecar.server.socket_gid`, :func:`.app.load_kek`,
:meth:`~kvoffload.store.keys.keyring.Keyring.check_store_kek`, the I/O plan),
so the two cannot disagree.

What a running sidecar holds (its socket, its index, its metrics port) is
no refusal of the configuration: checking a new one before ``systemctl
restart kvoffload`` is what ``config check`` is for, so that is a note.
"""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .app import human_bytes, load_kek

if TYPE_CHECKING:
    from ..sidecar.access.policy import Policy
    from ..sidecar.config import Config

__all__ = [
    "capacity_line",
    "index_in_use",
    "io_plan",
    "kek",
    "metrics_port",
    "policy",
    "sock",
    "store",
]


def policy(cfg: Config) -> tuple[Policy, Callable[[], Policy] | None]:
    """The policy serve starts with, and how SIGHUP reloads it (None: it cannot)."""
    from ..errors import ConfigError
    from ..sidecar.access.policy import Policy
    from ..sidecar.access.policy_file import load_policy

    if cfg.policy_file is not None:
        path = cfg.policy_file

        def reload() -> Policy:
            return load_policy(path)

        return load_policy(path), reload
    if cfg.dev:
        return Policy.default_dev(), None
    raise ConfigError("no policy: set [security] policy or KVOFFLOAD_POLICY (or use --dev)")


def sock(cfg: Config, *, inherited: bool) -> str:
    """The client socket: its group exists; unless it is inherited (socket
    activation), a socket can be bound at its path."""
    from ..sidecar.server import check_socket_path, socket_gid

    gid = socket_gid(cfg.socket_group)
    if not inherited:
        check_socket_path(cfg.socket_path)
    return "ok" + (f" (group {cfg.socket_group}, gid {gid})" if gid is not None else "")


def kek(cfg: Config) -> tuple[Any, str]:
    """The KEK (None: the development KEK, created at the first start) and a line."""
    loaded = load_kek(cfg, create=False)
    if loaded is None:
        return None, "the development KEK, created at the first start"
    return loaded, f"ok (id {loaded.key_id})"


def store(cfg: Config, kek: Any) -> str:
    """The store root: none yet (serve creates it), or one this KEK opens."""
    from ..errors import LayoutError
    from ..layouts.store_root import read_layout
    from ..store.keys.keyring import Keyring

    root = cfg.store_root
    if root.exists() and not root.is_dir():
        raise LayoutError(f"store root {root} is a file, not a directory")
    if not (root / "layout.json").exists():
        return "none yet: serve creates it"
    try:
        layout = read_layout(root)
    except LayoutError:
        copy = cfg.resolved_index_dir / "layout.json"
        if not copy.exists():
            raise
        read_layout(cfg.resolved_index_dir)  # the copy serve restores from
        return "layout.json is damaged: serve restores it from this node's copy"
    if kek is not None:
        Keyring(root / "keys", kek).check_store_kek(layout, root)
    return f"ok (store {layout.store_id}, layout v{layout.version})"


def io_plan(cfg: Config) -> str:
    """The configured I/O backend can be opened here (``auto`` always can)."""
    from ..errors import IOBackendUnavailable
    from ..store.iobackend import IOMode, plan

    if cfg.io is IOMode.AUTO:
        return "auto"
    p = plan(cfg.io, cfg.store_root / "objects", direct_read_min=cfg.direct_read_min)
    if p.error is not None:
        raise IOBackendUnavailable(p.requested, p.error)
    return f"{cfg.io}: {p.describe()}"


def metrics_port(cfg: Config, port: int) -> str:
    """The metrics address can be bound (probed: bound and closed at once)."""
    from ..errors import ListenError

    if not port:
        return "off"
    try:
        socket.create_server((cfg.metrics_host, port)).close()
    except OSError as exc:
        raise ListenError(
            f"metrics: cannot listen on {cfg.metrics_host}:{port}: {exc.strerror or exc}"
        ) from exc
    return f"ok (http://{cfg.metrics_host}:{port}/metrics)"


def index_in_use(cfg: Config) -> bool:
    """Whether a process (a running sidecar) holds the store's index lock."""
    path = cfg.resolved_index_dir / "kvoffload.lock"
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def capacity_line(cfg: Config) -> str:
    return (
        f"ok (store {cfg.store_root}, socket {cfg.socket_path}, "
        f"capacity {human_bytes(cfg.capacity_bytes)})"
    )
