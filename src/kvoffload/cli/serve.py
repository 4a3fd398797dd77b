"""The sidecar itself (serve) and what reads it over its socket (stats)."""

from __future__ import annotations

import logging
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
    unreachable_line,
)
from .exits import _CliUsageError, _SidecarUnreachable


@app.command()
def serve(
    fd: Annotated[
        int | None,
        typer.Option(
            "--fd", metavar="FD", help="Serve an inherited listening socket (socket activation)."
        ),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            "--metrics-port",
            metavar="PORT",
            min=0,
            max=65535,
            help="Prometheus /metrics port (0 = off; default: [metrics] port).",
        ),
    ] = None,
    log_format: Annotated[
        str,
        typer.Option(
            "--log-format",
            metavar="plain|json",
            help="plain (no timestamp under journald, which stamps lines) or json (every "
            "line one object: log records, serve's own lines, a start-up failure; audit "
            "records as an `audit` object).",
        ),
    ] = "plain",
    publish_events: Annotated[
        bool,
        typer.Option(
            "--events",
            help="Publish KV events (docs/spec/events-v1.md): as [events] enabled = true "
            "or KVOFFLOAD_EVENTS_ENABLED=1; `kvoffload events tail` shows them.",
        ),
    ] = False,
) -> None:
    """Run the sidecar: serve the store on its Unix socket until SIGTERM.

    SIGHUP reloads the policy file. An unknown KVOFFLOAD_* variable in the
    environment is an error (as an unknown key in the config file is): one
    line naming it and the closest known one.
    """
    from ..errors import ListenError
    from ..sidecar import notify
    from ..sidecar.app import build
    from . import preflight

    if log_format not in ("plain", "json"):
        raise _CliUsageError(f"--log-format: {log_format!r} is not plain or json")
    setup_logging(logging.DEBUG if state.verbose else logging.INFO, log_format, daemon=True)
    cfg = config()
    if publish_events:
        cfg.events_enabled = True
    # `config check` runs these same checks (cli/preflight.py).
    policy, reloader = preflight.policy(cfg)
    if fd is None:
        inherited = notify.listen_fds()
        if len(inherited) > 1:
            raise _CliUsageError(f"socket activation: expected one socket, got {len(inherited)}")
        fd = inherited[0] if inherited else None
    preflight.sock(cfg, inherited=fd is not None)
    _check_index_dir(cfg)
    if fd is None and sidecar_listening(cfg.socket_path):
        # Said before the store is opened: its lock would only say "in use".
        raise ListenError(
            f"cannot listen on {cfg.socket_path}: another sidecar is already serving it "
            "(stop that one, or give this one another [server] socket)"
        )
    if cfg.dev:
        say(
            Text.assemble(
                ("DEVELOPMENT MODE", "bold yellow"),
                f": embedded store under {cfg.store_root.parent}, a development KEK in a "
                "plain file, a policy that lets root and you use every tenant. Not for "
                "production.",
            ),
            level=logging.WARNING,
        )
    with open_store(cfg, create=True, banner=True) as store:
        daemon = build(cfg, store, policy, fd=fd, metrics_port=metrics_port, say=say)
        daemon.run(say, reloader, cfg.policy_file if reloader is not None else None)


def say(text: str | Text, level: int = logging.INFO) -> None:
    """One of serve's own lines on stderr: as it is, or with ``--log-format json``
    a log record (one JSON object, as every other line then is)."""
    if state.log_json:
        plain = text.plain if isinstance(text, Text) else text
        logging.getLogger("kvoffload.serve").log(level, "%s", plain)
    else:
        err.print(text)


def _check_index_dir(cfg: Any) -> None:
    """Refuse an index (LMDB, the server secret) on a network or cluster
    filesystem, as ``doctor`` warns of it: the default ``index_dir`` is beside
    the store root, so a root on a shared filesystem puts it there. On a FUSE
    filesystem of unknown kind: one warning line."""
    from ..errors import ConfigError
    from ..store.fstypes import index_dir_kind

    index_dir = cfg.resolved_index_dir
    kind = index_dir_kind(index_dir)
    where = "[store] index_dir" if cfg.index_dir is not None else "the default index_dir"
    if kind.network:
        raise ConfigError(
            f"the index directory {index_dir} ({where}) is on {kind.family}: LMDB must "
            "live on node-local disk; set [store] index_dir to a local directory"
        )
    if kind.network is None and kind.family == "FUSE":
        say(
            f"warning: the index directory {index_dir} is on a FUSE filesystem "
            f"({kind.fs_type}): if it is shared or remote, LMDB must not live there; "
            "set [store] index_dir to node-local disk",
            logging.WARNING,
        )


@app.command()
def stats(as_json: JsonOpt = False) -> None:
    """Counters of the running sidecar, read over its socket (no side effects)."""
    from ..client import fetch_stats
    from ..errors import ProtocolError, TransportError

    cfg = config()
    try:
        data = fetch_stats(cfg.socket_path)
    except (TransportError, ProtocolError, OSError) as exc:
        raise _SidecarUnreachable(unreachable_line(cfg.socket_path, exc)) from exc
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
        f"{_count(server.get('connections', 0), 'open connection')}, "
        f"{n('connections_total')} since start",
    ]
    lines += _tier_and_events_lines(s)
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


def _count(n: object, noun: str) -> str:
    """``1 open connection``, ``2 open connections``."""
    k = int(n) if isinstance(n, int | float) else 0
    return f"{k} {noun}" + ("" if k == 1 else "s")


def _tier_and_events_lines(s: dict[str, Any]) -> list[str]:
    """The RAM tier (``ram_tier``) and the KV-event feed (``events``) of ``stats``."""
    lines = []
    ram = s.get("ram_tier")
    if isinstance(ram, dict):
        lines.append(
            f"RAM tier: {_count(ram.get('images', 0), 'chunk image')}, "
            f"{human_bytes(ram.get('image_bytes', 0))} of {human_bytes(ram.get('capacity_bytes'))}"
            f"; {ram.get('hits', 0)} hits, {ram.get('evicted', 0)} evicted"
        )
    elif "ram_tier" in s:
        lines.append("RAM tier: off ([store] ram_cache = 0)")
    ev = s.get("events")
    if isinstance(ev, dict):
        if not ev.get("enabled"):
            lines.append("events: off (`kvoffload serve --events`, or [events] enabled = true)")
        elif "endpoint" not in ev:
            lines.append("events: on")
        else:
            lines.append(
                f"events: on {ev['endpoint']}, last seq {ev.get('last_seq', '?')}; stored "
                f"chunks announced {ev.get('stored_announced', 0)}, not announced: "
                f"{ev.get('stored_without_hashes', 0)} without engine block hashes, "
                f"{ev.get('stored_tenant_events_off', 0)} of tenants with events = false"
            )
    return lines
