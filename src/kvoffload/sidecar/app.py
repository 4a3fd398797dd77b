"""The daemon's composition root: what ``kvoffload serve`` runs, built in one place.

:func:`build` takes an open store, the policy and the one :class:`~.config.Config`
tree, and wires the parts by their constructors, in this order::

    Metrics(store counters, tenant usage)        the Prometheus collector, /metrics
    SidecarEvents(store's event log, policy)     the KV-event feed ([events] enabled)
    Server(store, policy, ServerConfig, metrics, events)
      └─ Service(store, policy, config, metrics, events)

The store is opened before (the CLI does, with its KEK banner) and told of the
feed here, the one part that must exist after it: the feed keeps its durable
replay buffer in the store's index. :meth:`Daemon.run` serves until SIGTERM
(daemon.py: signals, sd_notify, policy reloads) and takes everything down in
reverse. The CLI (cli/serve.py) only parses options, checks what ``config
check`` checks, and prints.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvoffload.errors import ListenError

from ..store import Store
from .access.policy import Policy
from .access.revocation import RevokedSet
from .config import Config
from .daemon import run
from .events import SidecarEvents, start_events
from .metrics import Metrics
from .ports import PolicyAPI
from .secret import load_or_create_secret
from .server import Server, socket_gid

#: Writes one of serve's own lines (cli/serve.py: plain, or a JSON log record).
SayFn = Callable[[str, int], None]


@dataclass
class Daemon:
    """The built daemon: its parts, and where it listens."""

    store: Store
    metrics: Metrics
    events: SidecarEvents | None
    server: Server
    where: str

    def run(
        self,
        say: SayFn,
        reload: Callable[[], Policy] | None = None,
        policy_path: Path | None = None,
    ) -> None:
        """Serve until SIGTERM; then stop the metrics and the feed."""

        def listening() -> None:
            self.metrics.ready = True
            store_id = self.store.layout.store_id
            say(f"kvoffload sidecar serving store {store_id} on {self.where}", logging.INFO)

        try:
            run(self.server, on_listening=listening, load_policy=reload, policy_path=policy_path)
        finally:
            self.metrics.stop_http()
            if self.events is not None:
                self.store.events_hook = None
                self.events.close()


def build(
    cfg: Config,
    store: Store,
    policy: PolicyAPI,
    *,
    fd: int | None,
    metrics_port: int | None,
    say: SayFn,
) -> Daemon:
    """The daemon of ``cfg`` over the open ``store``: see the module docstring."""
    server: Server | None = None

    def current_policy() -> PolicyAPI:
        # The reloaded one after a SIGHUP: the service holds the policy in force.
        return policy if server is None else server.service.policy

    secret = load_or_create_secret(cfg.resolved_index_dir / "server-secret")
    server_cfg = cfg.server_config(fd=fd, secret=secret, store_id=store.layout.store_id)
    # The tenants a reload revoked: the service applies them, the feed hides them.
    revoked = RevokedSet(server_cfg.revoked_file)
    metrics = _metrics(cfg, store, current_policy, metrics_port, say)
    events = _events(cfg, store, current_policy, revoked, say) if cfg.events_enabled else None
    server = Server(store, policy, server_cfg, metrics=metrics, events=events, revoked=revoked)
    where = f"fd {fd}" if fd is not None else str(cfg.socket_path)
    return Daemon(store, metrics, events, server, where)


def _metrics(
    cfg: Config,
    store: Store,
    policy: Callable[[], PolicyAPI],
    port: int | None,
    say: SayFn,
) -> Metrics:
    def tenant_usage() -> dict[str, tuple[int, int, int | None]]:
        current = policy()
        return {
            t: (u.count, u.bytes, current.tenant(t).quota_bytes)
            for t, u in store.tenant_usage().items()
        }

    metrics = Metrics(store.stats, tenant_usage)
    metrics.key_cache_ttl.set(cfg.key_cache_ttl_s)
    metrics.high_watermark.set(cfg.high_watermark)
    port = cfg.metrics_port if port is None else port
    if port:
        try:
            bound = metrics.start_http(cfg.metrics_host, port)
        except OSError as exc:
            raise ListenError(
                f"metrics: cannot listen on {cfg.metrics_host}:{port}: {exc.strerror or exc}"
            ) from exc
        say(f"metrics on http://{cfg.metrics_host}:{bound}/metrics", logging.INFO)
    return metrics


def _events(
    cfg: Config,
    store: Store,
    policy: Callable[[], PolicyAPI],
    revoked: RevokedSet,
    say: SayFn,
) -> SidecarEvents:
    """The KV-event feed (docs/spec/events-v1.md), told of every chunk that leaves the store."""
    gid = socket_gid(cfg.socket_group)
    settings = cfg.events
    events = start_events(settings, store.index, policy, cfg.socket_path, gid, revoked)
    store.events_hook = events
    # An expired chunk nobody reads leaves the feed within this, not at the sweep.
    events.watch_expiry(store.expire_due, settings.expiry_interval_s)
    pub = events.publisher
    say(f"KV events on {pub.endpoint} (replay {pub.replay_endpoint})", logging.INFO)
    return events


__all__ = ["Daemon", "build"]
