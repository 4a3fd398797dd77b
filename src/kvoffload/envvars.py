"""Every ``KVOFFLOAD_*`` environment variable kvoffload reads, in one registry.

Each entry has its name, type, default and one line of documentation; the
README's table of variables is generated from (and checked against)
:data:`REGISTRY` (``tests/sidecar/test_config_envvars.py``). The daemon's config
variables are ``KVOFFLOAD_<SECTION>_<KEY>`` for each key of the config file
(``sidecar/config.py``); a few have short forms that systemd units use.

``kvoffload serve`` refuses an unknown ``KVOFFLOAD_*`` variable
(:func:`check_environment`), as the config file refuses unknown keys: a typo
must not silently leave a default in force. Standard library only (a worker
reads ``KVOFFLOAD_DIRECT_IO`` through here).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .errors import ConfigError

__all__ = [
    "PREFIX",
    "REGISTRY",
    "EnvVar",
    "by_name",
    "check_environment",
    "config_var",
    "markdown_table",
    "unknown_variables",
]

PREFIX = "KVOFFLOAD_"


@dataclass(frozen=True)
class EnvVar:
    name: str
    type: str
    default: str
    doc: str
    #: Who reads it: "sidecar" (the daemon and the store commands), "worker", "both",
    #: "router" (``kvoffload router``).
    scope: str = "sidecar"
    #: The config file key it overrides, ``(section, key)``, if any.
    config_key: tuple[str, str] | None = None


def config_var(section: str, key: str) -> str:
    """``KVOFFLOAD_<SECTION>_<KEY>`` of a config file key."""
    return f"{PREFIX}{section.upper()}_{key.upper()}"


def _cfg(section: str, key: str, type_: str, default: str, doc: str) -> EnvVar:
    return EnvVar(config_var(section, key), type_, default, doc, "sidecar", (section, key))


REGISTRY: tuple[EnvVar, ...] = (
    EnvVar("KVOFFLOAD_CONFIG", "path", "(none)", "The config file (TOML) to read."),
    EnvVar("KVOFFLOAD_DEV", "bool (1)", "0", "1: the embedded development store, as --dev."),
    EnvVar(
        "KVOFFLOAD_KEK_FILE",
        "path",
        "(none)",
        "The KEK credential file; short form of KVOFFLOAD_SECURITY_KEK_FILE.",
        config_key=("security", "kek_file"),
    ),
    EnvVar(
        "KVOFFLOAD_POLICY",
        "path",
        "(none)",
        "The policy file; short form of KVOFFLOAD_SECURITY_POLICY.",
        config_key=("security", "policy"),
    ),
    EnvVar(
        "KVOFFLOAD_IO",
        "io mode",
        "auto",
        "The sidecar's I/O backend (auto, posix, posix-direct, posix-buffered, kvikio, "
        "cufile); short form of KVOFFLOAD_STORE_IO.",
        config_key=("store", "io"),
    ),
    EnvVar(
        "KVOFFLOAD_DIRECT_IO",
        "auto|posix|kvikio",
        "auto",
        "The worker's direct-path backend.",
        scope="worker",
    ),
    EnvVar(
        "KVOFFLOAD_VLLM_UNTESTED",
        "bool (1)",
        "0",
        "1: let the vLLM connector start under a vLLM outside the tested range.",
        scope="worker",
    ),
    EnvVar(
        "KVOFFLOAD_GPU_PROBE_TIMEOUT",
        "seconds",
        "20",
        "How long a GPU/GDS probe subprocess may take before it is killed.",
        scope="both",
    ),
    _cfg("store", "root", "path", "/var/lib/kvoffload/store", "[store] root: the store root."),
    _cfg(
        "store",
        "index_dir",
        "path",
        "<root>.index",
        "[store] index_dir: the node-local index directory.",
    ),
    _cfg("store", "capacity", "size", "none", "[store] capacity: the byte limit."),
    _cfg("store", "high_watermark", "float", "0.95", "[store] high_watermark: evict above."),
    _cfg("store", "low_watermark", "float", "0.85", "[store] low_watermark: evict down to."),
    _cfg("store", "durability", "object|batch|none", "batch", "[store] durability."),
    _cfg(
        "store",
        "key_cache_ttl",
        "duration",
        "30s",
        "[store] key_cache_ttl: how long a purge takes to reach other nodes.",
    ),
    _cfg("store", "io", "io mode", "auto", "[store] io (also KVOFFLOAD_IO)."),
    _cfg(
        "store",
        "shared",
        "bool",
        "false",
        "[store] shared: several nodes share the root (journals, one evictor).",
    ),
    _cfg(
        "store",
        "journal_poll",
        "duration",
        "0.5s",
        "[store] journal_poll: how often a shared root's journals are followed.",
    ),
    _cfg(
        "store",
        "evictor_lease",
        "duration",
        "15s",
        "[store] evictor_lease: the shared root's evictor lease duration.",
    ),
    _cfg(
        "store",
        "io_streams",
        "int",
        "0",
        "[store] io_streams: chunks of a batch read/written at once; 0 = one per core, >= 4.",
    ),
    _cfg(
        "store",
        "direct_read_min",
        "size",
        "16MiB",
        "[store] direct_read_min: objects at least this big and mostly not in the page cache "
        "are read with O_DIRECT (posix backend); 0 = always through the page cache.",
    ),
    _cfg(
        "store",
        "ram_cache",
        "size",
        "auto",
        "[store] ram_cache: the RAM tier for the sealed images of objects read or written "
        "around the page cache; auto = 1/16 of memory, at most 8GiB; 0 = none.",
    ),
    _cfg(
        "store",
        "object_keys",
        "bool",
        "true",
        "[store] object_keys: seal each new object under its own key derived from the "
        "tenant's (sealed direct reads); false while nodes of older builds share the root.",
    ),
    _cfg(
        "server",
        "socket",
        "path",
        "/run/kvoffload/kvoffload.sock",
        "[server] socket: the Unix socket.",
    ),
    _cfg(
        "server",
        "socket_group",
        "group",
        "(none)",
        "[server] socket_group: the group that may connect.",
    ),
    _cfg("server", "workers", "int", "0", "[server] workers: I/O threads (0: one per core)."),
    _cfg(
        "server",
        "max_inflight",
        "size",
        "1GiB",
        "[server] max_inflight: bytes in flight across all requests.",
    ),
    _cfg(
        "server",
        "idle_reservation_timeout",
        "duration",
        "60s",
        "[server] idle_reservation_timeout: an unfinished store expires after.",
    ),
    _cfg("metrics", "port", "int", "0", "[metrics] port: Prometheus /metrics (0: off)."),
    _cfg("metrics", "host", "host", "127.0.0.1", "[metrics] host."),
    _cfg("security", "kek_file", "path", "(none)", "[security] kek_file (or KVOFFLOAD_KEK_FILE)."),
    _cfg("security", "policy", "path", "(none)", "[security] policy (also KVOFFLOAD_POLICY)."),
    _cfg("events", "enabled", "bool", "false", "[events] enabled: publish KV events."),
    _cfg("events", "endpoint", "endpoint", "(ipc beside socket)", "[events] endpoint (PUB)."),
    _cfg(
        "events",
        "replay_endpoint",
        "endpoint",
        "(ipc beside socket)",
        "[events] replay_endpoint (ROUTER: replay and snapshots).",
    ),
    _cfg("events", "snapshot_endpoint", "endpoint", "(none)", "[events] snapshot_endpoint."),
    _cfg("events", "topic", "str", "kv@<host>@kvoffload", "[events] topic."),
    _cfg("events", "buffer", "int", "100000", "[events] buffer: batches kept for replay."),
    _cfg(
        "events",
        "locality",
        "LOCAL|REMOTE",
        "(REMOTE if shared)",
        "[events] locality of the store; REMOTE when [store] shared, else LOCAL.",
    ),
    _cfg("events", "curve_key_file", "path", "(none)", "[events] curve_key_file (TCP)."),
    _cfg(
        "events",
        "readers",
        "list",
        "(none)",
        "[events] readers of the full feed: user:NAME, group:NAME, uid:N, gid:N (comma-separated).",
    ),
    _cfg("events", "tenant_buffer", "int", "1000", "[events] tenant_buffer: per tenant channel."),
    _cfg(
        "events",
        "expiry_interval",
        "duration",
        "1s",
        "[events] expiry_interval: expired chunks are dropped (and unannounced) this often.",
    ),
    _cfg("audit", "max_bytes", "size", "16MiB", "[audit] max_bytes: rotate the audit log past it."),
    _cfg("audit", "keep", "int", "8", "[audit] keep: rotated audit files kept."),
    # `kvoffload router` (kvoffload.router.config): its own file, its own [router] keys.
    EnvVar("KVOFFLOAD_ROUTER_CONFIG", "path", "(none)", "The router's config file.", "router"),
    EnvVar("KVOFFLOAD_ROUTER_HOST", "host", "127.0.0.1", "[router] host.", "router"),
    EnvVar("KVOFFLOAD_ROUTER_PORT", "int", "8100", "[router] port.", "router"),
    EnvVar(
        "KVOFFLOAD_ROUTER_ON_DEADLINE_MISS",
        "shed|fastest",
        "shed",
        "[router] on_deadline_miss: 429 or route to the fastest.",
        "router",
    ),
    EnvVar(
        "KVOFFLOAD_ROUTER_DEFAULT_DEADLINE",
        "duration",
        "none",
        "[router] default_deadline: TTFT deadline of tenants without one.",
        "router",
    ),
    EnvVar(
        "KVOFFLOAD_ROUTER_LOG_DECISIONS",
        "bool",
        "false",
        "[router] log_decisions: every decision and its terms.",
        "router",
    ),
)

_BY_NAME = {v.name: v for v in REGISTRY}


def by_name(name: str) -> EnvVar | None:
    return _BY_NAME.get(name)


def unknown_variables(env: Mapping[str, str] | None = None) -> list[str]:
    """The ``KVOFFLOAD_*`` names in ``env`` (default: this process's) that nothing reads."""
    env = os.environ if env is None else env
    return sorted(k for k in env if k.startswith(PREFIX) and k not in _BY_NAME)


def check_environment(env: Mapping[str, str] | None = None) -> None:
    """:class:`ConfigError` naming the first unknown ``KVOFFLOAD_*`` variable and the
    closest known one."""
    unknown = unknown_variables(env)
    if not unknown:
        return
    name = unknown[0]
    close = difflib.get_close_matches(name, list(_BY_NAME), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else "; see the README's table of variables"
    more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
    raise ConfigError(f"unknown environment variable ${name}{more}{hint}")


def markdown_table(variables: Iterable[EnvVar] = REGISTRY) -> str:
    """The README's table of variables."""
    rows = ["| Variable | Type | Default | Read by | Meaning |", "|---|---|---|---|---|"]
    for v in variables:
        cells = (f"`{v.name}`", v.type, f"`{v.default}`", v.scope, v.doc)
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"
