"""The sidecar itself (serve) and what reads it over its socket (stats)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated, Any

import typer
from rich.text import Text

from .admin import sidecar_listening
from .app import (
    JsonOpt,
    app,
    config,
    emit,
    err,
    human_bytes,
    open_store,
    out,
    setup_logging,
    state,
)
from .exits import _CliUsageError, _SidecarUnreachable


@app.command()
def serve(
    fd: Annotated[
        int | None,
        typer.Option("--fd", help="Serve an inherited listening socket (socket activation)."),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            "--metrics-port",
            min=0,
            max=65535,
            help="Prometheus /metrics port (0 = off; default: [metrics] port).",
        ),
    ] = None,
    log_format: Annotated[
        str,
        typer.Option(
            "--log-format",
            help="plain (no timestamp under journald, which stamps lines) or json (one "
            "object per line).",
        ),
    ] = "plain",
) -> None:
    """Run the sidecar: serve the store on its Unix socket until SIGTERM.

    SIGHUP reloads the policy file. An unknown KVOFFLOAD_* variable in the
    environment is an error (as an unknown key in the config file is): one
    line naming it and the closest known one.
    """
    from ..errors import ConfigError, ListenError
    from ..sidecar import notify
    from ..sidecar.metrics import Metrics
    from ..sidecar.policy import Policy, load_policy
    from ..sidecar.revocation import revoked_path
    from ..sidecar.server import Server, ServerConfig, load_or_create_secret, run

    if log_format not in ("plain", "json"):
        raise _CliUsageError(f"--log-format: {log_format!r} is not plain or json")
    setup_logging(logging.DEBUG if state.verbose else logging.INFO, log_format, daemon=True)
    cfg = config()
    if cfg.policy_file is not None:
        policy_file = cfg.policy_file
        policy = load_policy(policy_file)

        def reload() -> Policy:
            return load_policy(policy_file)

        reloader: Callable[[], Policy] | None = reload
    elif cfg.dev:
        policy = Policy.default_dev()
        reloader = None
    else:
        raise ConfigError("no policy: set [security] policy or KVOFFLOAD_POLICY (or use --dev)")
    if fd is None:
        inherited = notify.listen_fds()
        if len(inherited) > 1:
            raise _CliUsageError(f"socket activation: expected one socket, got {len(inherited)}")
        fd = inherited[0] if inherited else None
    if fd is None and sidecar_listening(cfg.socket_path):
        # Said before the store is opened: its lock would only say "in use".
        raise ListenError(
            f"cannot listen on {cfg.socket_path}: another sidecar is already serving it "
            "(stop that one, or give this one another [server] socket)"
        )
    if cfg.dev:
        err.print(
            Text.assemble(
                ("DEVELOPMENT MODE", "bold yellow"),
                f": embedded store under {cfg.store_root.parent}, a development KEK in a "
                "plain file, a policy that lets root and you use every tenant. Not for "
                "production.",
            )
        )
    with open_store(cfg, create=True, banner=True) as store:
        index_dir = cfg.resolved_index_dir

        def tenant_usage() -> dict[str, tuple[int, int, int | None]]:
            current = server.policy  # the reloaded one after a SIGHUP
            return {
                t: (u.count, u.bytes, current.tenant(t).quota_bytes)
                for t, u in store.tenant_usage().items()
            }

        metrics = Metrics(store.stats, tenant_usage)
        metrics.key_cache_ttl.set(cfg.key_cache_ttl_s)
        port = cfg.metrics_port if metrics_port is None else metrics_port
        if port:
            try:
                bound = metrics.start_http(cfg.metrics_host, port)
            except OSError as exc:
                raise ListenError(
                    f"metrics: cannot listen on {cfg.metrics_host}:{port}: {exc.strerror or exc}"
                ) from exc
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
                revoked_file=revoked_path(index_dir),
            ),
            metrics=metrics,
        )
        events = _start_events(cfg, store, server) if cfg.events_enabled else None
        where = f"fd {fd}" if fd is not None else str(cfg.socket_path)

        def listening() -> None:
            metrics.ready = True
            err.print(f"kvoffload sidecar serving store {store.layout.store_id} on {where}")

        try:
            run(
                server,
                on_listening=listening,
                load_policy=reloader,
                policy_path=cfg.policy_file if reloader is not None else None,
            )
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
    svc = server.service
    settings = cfg.events
    events = start_events(
        settings, store.index, lambda: svc.policy, cfg.socket_path, gid, svc.revoked
    )
    store.events_hook = events
    svc.events = events
    # An expired chunk nobody reads leaves the feed within this, not at the sweep.
    events.watch_expiry(store.expire_due, settings.expiry_interval_s)
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
    if as_json:
        emit(True, data)
    else:
        for line in stats_lines(data):
            out.print(line)


def stats_lines(s: dict[str, Any]) -> list[str]:
    """``stats`` for people: sizes in units, counts as integers, one topic per line."""

    def n(key: str) -> int:
        v = s.get(key, 0)
        return int(v) if isinstance(v, int | float) else 0

    io: dict[str, Any] = s["io"] if isinstance(s.get("io"), dict) else {}
    server: dict[str, Any] = s["server"] if isinstance(s.get("server"), dict) else {}
    lines = [
        f"store: {s.get('store_id', '?')} (layout v{s.get('layout_version', '?')})",
        f"chunks: {n('chunks')}",
        f"used: {human_bytes(n('used_bytes'))} of {human_bytes(s.get('capacity_bytes'))}"
        + (f" ({human_bytes(n('reserved_bytes'))} reserved)" if n("reserved_bytes") else ""),
    ]
    if "tenants" in s:
        lines.append(f"tenants: {n('tenants')}")
    lines += [
        f"reads: {n('hits')} hits, {n('misses')} misses; writes: {n('puts')} stored, "
        f"{n('put_exists')} already present; {n('evictions')} evicted, {n('corrupt')} corrupt",
        f"bytes: {human_bytes(n('bytes_in'))} in, {human_bytes(n('bytes_out'))} out",
        f"durability: {s.get('durability', '?')}; I/O: {io.get('backend', '?')} "
        "(`kvoffload doctor` says why)",
        f"server: {server.get('server_id', '?')}, protocol v{server.get('protocol_version', '?')}, "
        f"{server.get('connections', 0)} open connections, "
        f"{n('connections_total')} since start",
    ]
    usage = s.get("tenant_usage")
    if isinstance(usage, dict) and usage:
        lines.append(
            "tenant usage: "
            + ", ".join(
                f"{t} {u.get('chunks', 0)} chunks / {human_bytes(u.get('bytes', 0))}"
                for t, u in usage.items()
            )
        )
    requests = s.get("requests")
    if isinstance(requests, dict) and requests:
        parts = []
        for verb, r in sorted(requests.items()):
            count = int(r.get("count", 0))
            mean = r.get("seconds", 0.0) / count * 1e3 if count else 0.0
            parts.append(f"{verb} {count} ({mean:.2f} ms mean)")
        lines.append("requests: " + ", ".join(parts))
    errors = s.get("errors")
    if isinstance(errors, dict) and errors:
        lines.append("errors: " + ", ".join(f"{c} {int(v)}" for c, v in sorted(errors.items())))
    policy = s.get("policy")
    if isinstance(policy, dict):
        line = f"policy: {policy.get('source', '?')}, generation {policy.get('generation', 0)}"
        if policy.get("last_reload_ok") is False:
            line += "; LAST RELOAD REFUSED, the previous policy is in force: "
            line += str(policy.get("last_error"))
        revoked = policy.get("revoked_tenants")
        if isinstance(revoked, list) and revoked:
            line += f"; revoked tenants: {', '.join(map(str, revoked))}"
        lines.append(line)
    return lines
