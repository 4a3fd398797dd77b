"""The sidecar itself (serve) and what reads it over its socket (stats)."""

from __future__ import annotations

import logging
from typing import Annotated, Any

import typer

from .app import JsonOpt, app, config, emit, err, open_store
from .exits import _CliUsageError, _SidecarUnreachable


@app.command()
def serve(
    fd: Annotated[
        int | None,
        typer.Option("--fd", help="Serve an inherited listening socket (socket activation)."),
    ] = None,
    metrics_port: Annotated[
        int | None, typer.Option("--metrics-port", help="Prometheus /metrics port (0 = off).")
    ] = None,
) -> None:
    """Run the sidecar: serve the store on its Unix socket until SIGTERM.

    An unknown KVOFFLOAD_* variable in the environment is an error (as an
    unknown key in the config file is): one line naming it and the closest known one.
    """
    from .. import envvars
    from ..errors import ConfigError
    from ..sidecar import notify
    from ..sidecar.metrics import Metrics
    from ..sidecar.policy import Policy, load_policy
    from ..sidecar.server import Server, ServerConfig, load_or_create_secret, run

    envvars.check_environment()
    cfg = config()
    logging.getLogger().setLevel(logging.INFO)
    if cfg.policy_file is not None:
        policy = load_policy(cfg.policy_file)
    elif cfg.dev:
        policy = Policy.default_dev()
    else:
        raise ConfigError("no policy: set [security] policy or KVOFFLOAD_POLICY (or use --dev)")
    if fd is None:
        inherited = notify.listen_fds()
        if len(inherited) > 1:
            raise _CliUsageError(f"socket activation: expected one socket, got {len(inherited)}")
        fd = inherited[0] if inherited else None
    if cfg.dev:
        err.print(
            "[bold yellow]DEVELOPMENT MODE[/bold yellow]: embedded store under "
            f"{cfg.store_root.parent}, a development KEK in a plain file, a policy that lets "
            "root and you use every tenant. Not for production."
        )
    with open_store(cfg, create=True) as store:
        index_dir = cfg.resolved_index_dir
        metrics = Metrics(store.stats)
        port = cfg.metrics_port if metrics_port is None else metrics_port
        if port:
            bound = metrics.start_http(cfg.metrics_host, port)
            err.print(f"metrics on http://{cfg.metrics_host}:{bound}/metrics")
        server = Server(
            store,
            policy,
            ServerConfig(
                socket_path=None if fd is not None else cfg.socket_path,
                socket_fd=fd,
                socket_group=cfg.socket_group,
                secret=load_or_create_secret(index_dir / "server-secret"),
                store_id=store.layout.store_id,
                workers=cfg.workers,
                handle_ttl_s=cfg.idle_reservation_timeout_s,
                max_inflight_bytes=cfg.max_inflight_bytes,
            ),
            metrics=metrics,
        )
        events = _start_events(cfg, store, server) if cfg.events_enabled else None
        where = f"fd {fd}" if fd is not None else str(cfg.socket_path)
        err.print(f"kvoffload sidecar serving store {store.layout.store_id} on {where}")
        try:
            run(server)
        finally:
            metrics.stop_http()
            if events is not None:
                store.events_hook = None
                events.close()


def _start_events(cfg: Any, store: Any, server: Any) -> Any:
    """The KV-event feed (docs/spec/events-v1.md), wired to the store and the verbs."""
    import grp

    from ..errors import ConfigError
    from ..sidecar.events import start_events

    gid = None
    if cfg.socket_group is not None:
        try:
            gid = grp.getgrnam(cfg.socket_group).gr_gid
        except KeyError as exc:
            raise ConfigError(f"[server] socket_group: unknown group {cfg.socket_group!r}") from exc
    events = start_events(
        cfg.events, store.index, lambda: server.service.policy, cfg.socket_path, gid
    )
    store.events_hook = events
    server.service.events = events
    err.print(
        f"KV events on {events.publisher.endpoint} (replay {events.publisher.replay_endpoint})"
    )
    return events


@app.command()
def stats(as_json: JsonOpt = False) -> None:
    """Counters of the running sidecar, read over its socket (no side effects)."""
    from ..client import fetch_stats
    from ..errors import ProtocolError, TransportError

    cfg = config()
    try:
        data = fetch_stats(cfg.socket_path)
    except (TransportError, ProtocolError, OSError) as exc:
        raise _SidecarUnreachable(f"no sidecar answered on {cfg.socket_path}: {exc}") from exc
    emit(as_json, data)
