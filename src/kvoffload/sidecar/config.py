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

Environment: ``KVOFFLOAD_CONFIG`` (file path) and one variable per key,
``KVOFFLOAD_<SECTION>_<KEY>`` upper-cased, e.g. ``KVOFFLOAD_STORE_ROOT``,
``KVOFFLOAD_SERVER_SOCKET``, ``KVOFFLOAD_METRICS_PORT``; plus the short forms
``KVOFFLOAD_KEK_FILE`` and ``KVOFFLOAD_POLICY`` that systemd units use, and
``KVOFFLOAD_IO`` for ``[store] io`` (the I/O backend, see ``sidecar/iobackend.py``).
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

from kvoffload.errors import ConfigError

from .fileio import Durability
from .iobackend import IOMode, parse_mode

DEV_DIR_NAME = ".kvoffload"


_SIZE_RE = re.compile(r"^\s*(?P<num>\d+(?:\.\d+)?)\s*(?P<unit>[KMGTP]i?B|B)?\s*$")
_SIZE_UNITS: dict[str | None, int] = {
    None: 1,
    "B": 1,
    **{f"{p}iB": 1024 ** (i + 1) for i, p in enumerate("KMGTP")},
    **{f"{p}B": 1000 ** (i + 1) for i, p in enumerate("KMGTP")},
}
_DURATION_RE = re.compile(r"^\s*(?P<num>\d+(?:\.\d+)?)\s*(?P<unit>ms|s|m|h|d)?\s*$")
_DURATION_UNITS: dict[str | None, float] = {
    None: 1.0,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
    "d": 86400.0,
}


def parse_size(value: object) -> int | None:
    """``"200GiB"`` → bytes; an int is bytes; ``"none"`` → None."""
    if value is None or value == "none":
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = _SIZE_RE.match(value) if isinstance(value, str) else None
    if m is None:
        raise ConfigError(f'bad size {value!r}: e.g. 4096, "512MiB", "2TB" or "none"')
    size = Fraction(m["num"]) * _SIZE_UNITS[m["unit"]]
    return int(size)


def parse_duration(value: object) -> float | None:
    """``"30s"``, ``"15m"``, ``"7d"`` → seconds; a number is seconds; ``"none"`` → None."""
    if value is None or value == "none":
        return None
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        return float(value)
    m = _DURATION_RE.match(value) if isinstance(value, str) else None
    if m is None:
        raise ConfigError(f'bad duration {value!r}: e.g. 30, "500ms", "15m", "7d"')
    return float(m["num"]) * _DURATION_UNITS[m["unit"]]


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
    def worker_threads(self) -> int:
        return self.workers or max(2, os.cpu_count() or 2)

    def store_config(self) -> Any:
        from .store import StoreConfig

        return StoreConfig(
            root=self.store_root,
            index_dir=self.resolved_index_dir,
            capacity_bytes=self.capacity_bytes,
            high_watermark=self.high_watermark,
            low_watermark=self.low_watermark,
            durability=self.durability,
            key_cache_ttl_s=self.key_cache_ttl_s,
            io=self.io,
        )


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
    ("server", "socket"): ("socket_path", Path),
    ("server", "socket_group"): ("socket_group", str),
    ("server", "workers"): ("workers", int),
    ("server", "max_inflight"): ("max_inflight_bytes", parse_size),
    ("server", "idle_reservation_timeout"): ("idle_reservation_timeout_s", parse_duration),
    ("metrics", "port"): ("metrics_port", int),
    ("metrics", "host"): ("metrics_host", str),
    ("security", "kek_file"): ("kek_file", Path),
    ("security", "policy"): ("policy_file", Path),
}
_SHORT_ENV = {
    "KVOFFLOAD_KEK_FILE": ("security", "kek_file"),
    "KVOFFLOAD_POLICY": ("security", "policy"),
    "KVOFFLOAD_IO": ("store", "io"),
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
    env = os.environ if env is None else env
    cfg = Config.dev_default() if dev or env.get("KVOFFLOAD_DEV") == "1" else Config()
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
    for var, value in env.items():
        if var in _SHORT_ENV:
            cfg = _apply(cfg, *_SHORT_ENV[var], value, f"${var}")
        elif var.startswith("KVOFFLOAD_") and var not in ("KVOFFLOAD_CONFIG", "KVOFFLOAD_DEV"):
            rest = var[len("KVOFFLOAD_") :].lower()
            section, _, key = rest.partition("_")
            if (section, key) in _KEYS:
                cfg = _apply(cfg, section, key, value, f"${var}")
    if not 0 < cfg.low_watermark <= cfg.high_watermark <= 1:
        raise ConfigError("watermarks must satisfy 0 < low_watermark <= high_watermark <= 1")
    return cfg


def config_fields() -> list[str]:
    return [f.name for f in fields(Config)]
