"""The sidecar's one ``Config``: a TOML file, then ``KVOFFLOAD_*`` variables on top.

Precedence (last wins): built-in defaults < config file < environment <
command-line flags. ``Config.dev()`` is the embedded default the README's
first command runs: everything under ``./.kvoffload`` of the working
directory, with a development KEK generated there (outside the store root)
and a loud warning.

File format (every key optional; unknown keys are errors)::

    [store]
    root = "/var/lib/kvoffload/store"      # may be a shared parallel filesystem
    index_dir = "/var/lib/kvoffload/index" # node-local disk, never a network FS
    capacity = "500GiB"                    # or "none"
    high_watermark = 0.95
    low_watermark = 0.85
    durability = "batch"                   # object | batch | none
    key_cache_ttl = "30s"                  # bound on how long a purge takes to reach other nodes
    io = "auto"                            # auto | posix | posix-direct | posix-buffered
                                           #   | kvikio | cufile  (env KVOFFLOAD_IO)
    shared = false                         # the root is shared by several nodes
    journal_poll = "0.5s"                  # how often other nodes' journals are read
    evictor_lease = "15s"                  # the shared root's evictor lease
    io_streams = 0                         # chunks of a batch read/written at once; 0 = auto
    direct_read_min = "16MiB"              # O_DIRECT reads of objects this big not in the
                                           #   page cache (posix); "0" = page cache only
    ram_cache = "auto"                     # RAM tier of those large objects' sealed images:
                                           #   a size, "0" = none; auto = 1/16 of memory, <= 8GiB
    object_keys = true                     # seal each object under its own key (sealed
                                           #   direct reads); false while older nodes share the root

    [server]
    socket = "/run/kvoffload/kvoffload.sock"
    socket_group = "kvoffload-clients"     # group that may connect (mode 0660)
    workers = 0                            # I/O + sealing threads; 0 = one per core
    max_inflight = "1GiB"                  # bytes in flight across all requests
    idle_reservation_timeout = "60s"       # prepare_store without complete_store expires

    [metrics]
    port = 0                               # 0 = off
    host = "127.0.0.1"

    [security]
    kek_file = "/run/credentials/kvoffload.service/kek"
    policy = "/etc/kvoffload/policy.toml"

    [events]                               # KV events, docs/spec/events-v1.md
    enabled = false
    endpoint = "ipc:///run/kvoffload/kvevents.pub"       # default: beside [server] socket
    replay_endpoint = "ipc:///run/kvoffload/kvevents.replay"  # also answers snapshots
    snapshot_endpoint = ""                 # a separate ROUTER for snapshots (optional)
    topic = "kv@<host>@kvoffload"
    buffer = 100000                        # batches kept for replay (in the index)
    locality = "LOCAL"                     # default: REMOTE when [store] shared, else LOCAL
    curve_key_file = ""                    # TCP only: Z85 public + secret key, one a line
    readers = []                           # who reads the full feed besides root and the
                                           # sidecar's uid: "user:router", "group:kv", "uid:N"
    tenant_buffer = 1000                   # batches kept per tenant channel (in memory)
    expiry_interval = "1s"                 # expired chunks leave the store (and the feed)
                                           # within it; "0s": the maintenance sweep only

    [audit]                                # the audit log beside the index, audit-v1.md
    max_bytes = "16MiB"                    # rotate the active file past this size
    keep = 8                               # rotated files kept (older ones are deleted)

Environment: ``KVOFFLOAD_CONFIG`` (file path) and one variable per key,
``KVOFFLOAD_<SECTION>_<KEY>`` upper-cased, e.g. ``KVOFFLOAD_STORE_ROOT``,
``KVOFFLOAD_SERVER_SOCKET``, ``KVOFFLOAD_METRICS_PORT``; plus the short forms
``KVOFFLOAD_KEK_FILE`` and ``KVOFFLOAD_POLICY`` that systemd units use, and
``KVOFFLOAD_IO`` for ``[store] io`` (the I/O backend, see ``store/iobackend.py``).
Every variable is in :mod:`kvoffload.envvars` (``kvoffload serve`` refuses an
unknown one); sizes and durations are parsed by :mod:`kvoffload.units`.

The configuration is one tree: :class:`Config` holds every setting, and its
:attr:`~Config.store`, :attr:`~Config.server`, :attr:`~Config.metrics` and
:attr:`~Config.security` are the typed sections of the file (frozen views of
the same values).
"""

from __future__ import annotations

import os
import socket
import tomllib
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from kvoffload import envvars
from kvoffload.errors import ConfigError
from kvoffload.protocol import ALIGNMENT, MAX_BATCH
from kvoffload.units import parse_duration, parse_size

from ..store import Durability, IOMode, StoreConfig, parse_mode
from .access.revocation import revoked_path
from .secret import SECRET_SIZE

DEV_DIR_NAME = ".kvoffload"


@dataclass(frozen=True)
class StoreSection:
    """``[store]``."""

    root: Path
    index_dir: Path
    capacity_bytes: int | None
    high_watermark: float
    low_watermark: float
    durability: Durability
    key_cache_ttl_s: float
    io: IOMode
    io_streams: int = 0
    direct_read_min: int | None = None
    ram_cache: int | None = None


@dataclass(frozen=True)
class ServerSection:
    """``[server]``."""

    socket_path: Path
    socket_group: str | None
    socket_fd: int | None
    workers: int
    max_inflight_bytes: int
    idle_reservation_timeout_s: float


@dataclass(frozen=True)
class MetricsSection:
    """``[metrics]``."""

    port: int
    host: str


@dataclass(frozen=True)
class SecuritySection:
    """``[security]``."""

    kek_file: Path | None
    policy_file: Path | None


DEFAULT_EVENTS_BUFFER = 100_000
DEFAULT_TENANT_BUFFER = 1000
DEFAULT_EXPIRY_INTERVAL_S = 1.0


@dataclass(frozen=True)
class EventsSettings:
    """``[events]`` (docs/spec/events-v1.md §7); an empty endpoint means the default."""

    enabled: bool = False
    endpoint: str | None = None
    replay_endpoint: str | None = None
    snapshot_endpoint: str | None = None
    topic: str | None = None
    buffer: int = DEFAULT_EVENTS_BUFFER
    locality: str = "LOCAL"
    curve_secret_key_file: Path | None = None
    #: Who reads the full feed besides root and the sidecar's uid (§7.1):
    #: ``"uid:N"`` / ``"gid:N"``, names resolved when the config is read.
    readers: tuple[str, ...] = ()
    #: Batches each tenant channel keeps for replay (in memory).
    tenant_buffer: int = DEFAULT_TENANT_BUFFER
    #: How often chunks past their stamped expiry are dropped (0: only by the
    #: maintenance sweep), so that they leave the feed within it.
    expiry_interval_s: float = DEFAULT_EXPIRY_INTERVAL_S


def _bool(raw: object) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(raw, str) and raw.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, not {raw!r}")


def _endpoint(raw: object) -> str | None:
    value = str(raw).strip()
    if not value:
        return None
    if not value.startswith(("ipc://", "tcp://")):
        raise ValueError(f"expected an ipc:// or tcp:// endpoint, not {value!r}")
    return value


def _buffer(raw: object) -> int:
    n = int(str(raw))
    if not 1 <= n <= 10_000_000:
        raise ValueError(f"expected 1..10000000 batches, not {n}")
    return n


def _locality(raw: object) -> str:
    value = str(raw).strip().upper()
    if value not in ("LOCAL", "REMOTE"):
        raise ValueError(f"expected LOCAL or REMOTE, not {raw!r}")
    return value


@dataclass
class ServerConfig:
    """What the server (server.py) runs with, built from a :class:`Config` (cli/serve.py)."""

    socket_path: Path | None = None
    #: An inherited listening socket (systemd socket activation) instead of socket_path.
    socket_fd: int | None = None
    socket_mode: int = 0o660
    socket_group: str | None = None
    #: Key of the fake salts; use load_or_create_secret() in production.
    secret: bytes = field(default_factory=lambda: os.urandom(SECRET_SIZE))
    server_id: str = field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    )
    store_id: str | None = None
    workers: int = 0
    alignment: int = ALIGNMENT
    max_staging: int = 64 << 30
    max_batch: int = MAX_BATCH
    max_inflight: int = 64
    max_handles: int = 256
    handle_ttl_s: float = 60.0
    drain_timeout_s: float = 10.0
    maintenance_interval_s: float = 30.0
    max_inflight_bytes: int = 1 << 30
    #: Where the revoked tenants are kept (revocation.py); None: in memory only.
    revoked_file: Path | None = None

    @property
    def worker_threads(self) -> int:
        return self.workers or max(2, os.cpu_count() or 2)


@dataclass
class Config:
    # [store]
    store_root: Path = Path("/var/lib/kvoffload/store")
    index_dir: Path | None = None
    capacity_bytes: int | None = None
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    durability: Durability = Durability.BATCH
    key_cache_ttl_s: float = 30.0
    io: IOMode = IOMode.AUTO
    shared: bool = False
    journal_poll_s: float = 0.5
    evictor_lease_s: float = 15.0
    io_streams: int = 0
    #: None: the I/O backend's default (iobackend.DIRECT_READ_MIN); 0: never
    direct_read_min: int | None = None
    #: None: "auto" (store.ramtier.auto_capacity); 0: no RAM tier
    ram_cache: int | None = None
    #: Seal under per-object keys (layout-v1.md §3.3); False: under the DEK, as before.
    object_keys: bool = True
    # [server]
    socket_path: Path = Path("/run/kvoffload/kvoffload.sock")
    socket_group: str | None = None
    socket_fd: int | None = None  # inherited listening socket (systemd socket activation)
    workers: int = 0
    max_inflight_bytes: int = 1 << 30
    idle_reservation_timeout_s: float = 60.0
    # [metrics]
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    # [security]
    kek_file: Path | None = None
    policy_file: Path | None = None
    # [events]
    events_enabled: bool = False
    events_endpoint: str | None = None
    events_replay_endpoint: str | None = None
    events_snapshot_endpoint: str | None = None
    events_topic: str | None = None
    events_buffer: int = DEFAULT_EVENTS_BUFFER
    events_locality: str = ""  # "": REMOTE when [store] shared, else LOCAL
    events_curve_key_file: Path | None = None
    events_readers: tuple[str, ...] = ()
    events_tenant_buffer: int = DEFAULT_TENANT_BUFFER
    events_expiry_interval_s: float = DEFAULT_EXPIRY_INTERVAL_S
    # [audit]
    audit_max_bytes: int = 16 << 20
    audit_keep: int = 8
    dev: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def dev_default(cls, base: Path | None = None) -> Config:
        d = (base or Path.cwd()) / DEV_DIR_NAME
        return cls(
            store_root=d / "store",
            index_dir=d / "index",
            socket_path=d / "kvoffload.sock",
            kek_file=d / "dev-kek",
            durability=Durability.BATCH,
            dev=True,
        )

    @property
    def resolved_index_dir(self) -> Path:
        if self.index_dir is not None:
            return self.index_dir
        return self.store_root.parent / f"{self.store_root.name}.index"

    @property
    def store(self) -> StoreSection:
        return StoreSection(
            self.store_root,
            self.resolved_index_dir,
            self.capacity_bytes,
            self.high_watermark,
            self.low_watermark,
            self.durability,
            self.key_cache_ttl_s,
            self.io,
            self.io_streams,
            self.direct_read_min,
            self.ram_cache,
        )

    @property
    def server(self) -> ServerSection:
        return ServerSection(
            self.socket_path,
            self.socket_group,
            self.socket_fd,
            self.workers,
            self.max_inflight_bytes,
            self.idle_reservation_timeout_s,
        )

    @property
    def metrics(self) -> MetricsSection:
        return MetricsSection(self.metrics_port, self.metrics_host)

    @property
    def security(self) -> SecuritySection:
        return SecuritySection(self.kek_file, self.policy_file)

    @property
    def events(self) -> EventsSettings:
        return EventsSettings(
            self.events_enabled,
            self.events_endpoint,
            self.events_replay_endpoint,
            self.events_snapshot_endpoint,
            self.events_topic,
            self.events_buffer,
            self.events_locality or ("REMOTE" if self.shared else "LOCAL"),
            self.events_curve_key_file,
            self.events_readers,
            self.events_tenant_buffer,
            self.events_expiry_interval_s,
        )

    @property
    def worker_threads(self) -> int:
        return self.workers or max(2, os.cpu_count() or 2)

    def store_config(self) -> StoreConfig:
        """The engine's settings from this tree (the store's sections)."""
        return StoreConfig(
            root=self.store_root,
            index_dir=self.resolved_index_dir,
            capacity_bytes=self.capacity_bytes,
            high_watermark=self.high_watermark,
            low_watermark=self.low_watermark,
            durability=self.durability,
            key_cache_ttl_s=self.key_cache_ttl_s,
            io=self.io,
            shared=self.shared,
            journal_poll_s=self.journal_poll_s,
            evictor_lease_s=self.evictor_lease_s,
            io_streams=self.io_streams,
            direct_read_min=self.direct_read_min,
            ram_cache=self.ram_cache,
            object_keys=self.object_keys,
            audit_max_bytes=self.audit_max_bytes,
            audit_keep=self.audit_keep,
        )

    def server_config(self, *, fd: int | None, secret: bytes, store_id: str) -> ServerConfig:
        """The server's settings from this tree: the socket (or the inherited
        ``fd``), its group, the pool and the limits, and where revocations are kept."""
        return ServerConfig(
            socket_path=None if fd is not None else self.socket_path,
            socket_fd=fd,
            socket_group=self.socket_group,
            secret=secret,
            store_id=store_id,
            workers=self.workers,
            handle_ttl_s=self.idle_reservation_timeout_s,
            max_inflight_bytes=self.max_inflight_bytes,
            revoked_file=revoked_path(self.resolved_index_dir),
        )


def parse_bool(raw: object) -> bool:
    """A TOML boolean, or true/false/1/0/yes/no/on/off from the environment."""
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {raw!r} (true or false)")


def _parse_streams(raw: object) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int | str):
        raise ValueError(f"an integer, not {raw!r}")
    n = int(raw)
    if n < 0:
        raise ValueError("must be >= 0 (0: one per core, at least 4)")
    return n


def _direct_read_min(raw: object) -> int:
    n = parse_size(raw, allow_none=False, whole=True)  # refuses a negative size
    assert n is not None
    return n


def _ram_cache(raw: object) -> int | None:
    if raw == "auto":
        return None
    n = parse_size(raw, allow_none=False, whole=True, what='size (or "auto")')
    assert n is not None
    return n


def _audit_max_bytes(raw: object) -> int:
    n = parse_size(raw)
    if n is None or n < 4096:
        raise ValueError("the audit log rotates past max_bytes: at least 4KiB")
    return n


def _audit_keep(raw: object) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int | str):
        raise ValueError(f"an integer, not {raw!r}")
    n = int(raw)
    if not 1 <= n <= 100_000:
        raise ValueError("rotated audit files kept: 1..100000")
    return n


def _readers(raw: object) -> tuple[str, ...]:
    """``[events] readers``: a list (or a comma-separated string) of ``user:NAME``,
    ``group:NAME``, ``uid:N``, ``gid:N``; names are resolved now."""
    import grp
    import pwd

    items = raw.split(",") if isinstance(raw, str) else raw
    if not isinstance(items, list | tuple):
        raise ValueError(f"a list of user:, group:, uid:, gid: entries, not {raw!r}")
    out: list[str] = []
    for item in items:
        kind, sep, name = str(item).strip().partition(":")
        if not str(item).strip():
            continue
        try:
            if kind in ("uid", "gid") and sep and name.isdigit():
                out.append(f"{kind}:{int(name)}")
            elif kind == "user" and name:
                out.append(f"uid:{pwd.getpwnam(name).pw_uid}")
            elif kind == "group" and name:
                out.append(f"gid:{grp.getgrnam(name).gr_gid}")
            else:
                raise ValueError(f"{item!r}: expected user:NAME, group:NAME, uid:N or gid:N")
        except KeyError as exc:
            raise ValueError(f"{item!r}: no such {kind}") from exc
    return tuple(dict.fromkeys(out))


def _expiry_interval(raw: object) -> float:
    s = parse_duration(raw, allow_none=False)
    if s is None or s < 0:
        raise ValueError("a duration >= 0 (0: expiry by the maintenance sweep only)")
    return s


def parse_port(raw: object) -> int:
    """A TCP port: 1-65535, or 0 for off."""
    if isinstance(raw, bool):
        raise ValueError(f"{raw!r} is not a port number")
    port: int = int(raw)  # type: ignore[call-overload]
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is out of range: 1-65535, or 0 for off")
    return port


# (section, key) → (Config field, converter)
_KEYS: dict[tuple[str, str], tuple[str, Any]] = {
    ("store", "root"): ("store_root", Path),
    ("store", "index_dir"): ("index_dir", Path),
    ("store", "capacity"): ("capacity_bytes", parse_size),
    ("store", "high_watermark"): ("high_watermark", float),
    ("store", "low_watermark"): ("low_watermark", float),
    ("store", "durability"): ("durability", Durability),
    ("store", "key_cache_ttl"): ("key_cache_ttl_s", parse_duration),
    ("store", "io"): ("io", parse_mode),
    ("store", "shared"): ("shared", parse_bool),
    ("store", "journal_poll"): ("journal_poll_s", parse_duration),
    ("store", "evictor_lease"): ("evictor_lease_s", parse_duration),
    ("store", "io_streams"): ("io_streams", _parse_streams),
    ("store", "direct_read_min"): ("direct_read_min", _direct_read_min),
    ("store", "ram_cache"): ("ram_cache", _ram_cache),
    ("store", "object_keys"): ("object_keys", parse_bool),
    ("server", "socket"): ("socket_path", Path),
    ("server", "socket_group"): ("socket_group", str),
    ("server", "workers"): ("workers", int),
    ("server", "max_inflight"): ("max_inflight_bytes", parse_size),
    ("server", "idle_reservation_timeout"): ("idle_reservation_timeout_s", parse_duration),
    ("metrics", "port"): ("metrics_port", parse_port),
    ("metrics", "host"): ("metrics_host", str),
    ("security", "kek_file"): ("kek_file", Path),
    ("security", "policy"): ("policy_file", Path),
    ("events", "enabled"): ("events_enabled", _bool),
    ("events", "endpoint"): ("events_endpoint", _endpoint),
    ("events", "replay_endpoint"): ("events_replay_endpoint", _endpoint),
    ("events", "snapshot_endpoint"): ("events_snapshot_endpoint", _endpoint),
    ("events", "topic"): ("events_topic", lambda raw: str(raw) or None),
    ("events", "buffer"): ("events_buffer", _buffer),
    ("events", "locality"): ("events_locality", _locality),
    ("events", "curve_key_file"): ("events_curve_key_file", lambda raw: Path(raw) if raw else None),
    ("events", "readers"): ("events_readers", _readers),
    ("events", "tenant_buffer"): ("events_tenant_buffer", _buffer),
    ("events", "expiry_interval"): ("events_expiry_interval_s", _expiry_interval),
    ("audit", "max_bytes"): ("audit_max_bytes", _audit_max_bytes),
    ("audit", "keep"): ("audit_keep", _audit_keep),
}
#: environment variable → (section, key), from the one registry (kvoffload.envvars).
_ENV_KEYS: dict[str, tuple[str, str]] = {
    v.name: v.config_key for v in envvars.REGISTRY if v.config_key is not None
}


def _apply(cfg: Config, section: str, key: str, raw: object, source: str) -> Config:
    spec = _KEYS.get((section, key))
    if spec is None:
        raise ConfigError(f"{source}: unknown setting [{section}] {key}")
    name, conv = spec
    try:
        value = conv(raw)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{source}: [{section}] {key}: {exc}") from exc
    return replace(cfg, **{name: value})


def load_config(
    path: Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    dev: bool = False,
) -> Config:
    return load_config_sources(path, env=env, dev=dev)[0]


def load_config_sources(
    path: Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    dev: bool = False,
) -> tuple[Config, dict[str, str]]:
    """:func:`load_config`, and where each setting came from: ``Config`` field →
    ``"default"``, ``"dev default"``, the file's path or ``$VARIABLE``."""
    env = os.environ if env is None else env
    is_dev = dev or env.get("KVOFFLOAD_DEV") == "1"
    cfg = Config.dev_default() if is_dev else Config()
    base = "dev default" if is_dev else "default"
    sources = {name: base for name in config_fields()}
    path = path or (Path(env["KVOFFLOAD_CONFIG"]) if env.get("KVOFFLOAD_CONFIG") else None)
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: [{section}] must be a table")
            for key, raw in table.items():
                cfg = _apply(cfg, section, key, raw, str(path))
                sources[_KEYS[(section, key)][0]] = str(path)
    for var, value in env.items():
        if var in _ENV_KEYS:
            cfg = _apply(cfg, *_ENV_KEYS[var], value, f"${var}")
            sources[_KEYS[_ENV_KEYS[var]][0]] = f"${var}"
    if not 0 < cfg.low_watermark <= cfg.high_watermark <= 1:
        raise ConfigError("watermarks must satisfy 0 < low_watermark <= high_watermark <= 1")
    return cfg, sources


def config_keys() -> list[tuple[str, str]]:
    """Every ``(section, key)`` of the config file."""
    return list(_KEYS)


def config_fields() -> list[str]:
    return [f.name for f in fields(Config)]
