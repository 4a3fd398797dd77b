"""The router's one ``RouterConfig``: a TOML file, then the environment on top.

Precedence (last wins): defaults < file < environment < command-line flags.
Every key is optional except the workers; unknown keys and sections are
errors that name the file and the key, like the sidecar's config::

    [router]
    host = "127.0.0.1"
    port = 8100
    on_deadline_miss = "shed"        # shed (429 + Retry-After) | fastest
    default_deadline = "none"        # a TTFT deadline for tenants without one
    health_interval = "2s"           # GET <worker>/health
    metrics_interval = "1s"          # GET <worker>/metrics (queue, running, KV usage)
    request_timeout = "600s"
    connect_timeout = "5s"
    max_body = "64MiB"               # a larger request body is a 413
    log_decisions = false            # every decision, with each candidate's terms, at INFO
    work_weight = 1.0                # the weight of added work under load (core.Router)
    risk = 2.0                       # the weight of an estimate's spread (std. dev.) in the choice
    salt_secret_file = "/etc/kvoffload/router-salt"  # derives each tenant's cache_salt
    trust_tenant_header = false      # take X-KVOffload-Tenant from a trusted gateway

    [model]
    name = "llama-3-8b"              # the served model name
    tokenizer = "/models/llama-3-8b" # a local directory (tokenizer + chat template)
    tokenizer_processes = 0          # 0: tokenize in a thread; N: N processes tokenize and hash
    block_size = 16                  # the engine's block size
    hash_algorithm = "sha256"        # the engine's --prefix-caching-hash-algo
    hash_seed = "vllm-none-hash"     # the engine's PYTHONHASHSEED, if it sets one

    [priors]                         # the TTFT model's starting point (model.Priors)
    prefill_overhead = "15ms"        # per engine step
    prefill_tokens_per_s = 12000
    prefill_quadratic = 0.0          # seconds per token² (attention)
    decode_slowdown = 0.0005         # a full step's share per decoding request
    prefill_budget_tokens = 8192     # the workers' max_num_batched_tokens
    kv_capacity_tokens = 0           # the workers' KV cache in tokens (0: unknown)
    bytes_per_token = "128KiB"
    cpu_bandwidth = "20GB"           # per second
    storage_local_bandwidth = "5GB"
    storage_remote_bandwidth = "2GB"

    [[workers]]
    name = "w0"
    url = "http://10.0.0.1:8000"
    node = "node0"
    events = "tcp://10.0.0.1:5557"   # the engine's KV-event publisher (optional)
    events_replay = "tcp://10.0.0.1:5558"   # its replay socket (gaps are refilled)
    metrics_url = "http://10.0.0.1:8000/metrics"   # default: <url>/metrics

    [[stores]]                       # the sidecar stores workers read
    name = "node0"                   # the store root's id
    nodes = ["node0"]                # the nodes whose workers read it
    shared = false                   # true: a root shared by several nodes (STORAGE REMOTE)
    events = "ipc:///run/kvoffload/events.sock"
    events_replay = "ipc:///run/kvoffload/events-replay.sock"

    [[lora]]                         # adapters: a request's "model" naming one hashes with it
    name = "sql"
    path = "/adapters/sql"

    [tenants.acme]
    api_keys = ["sk-acme-1"]         # Authorization: Bearer <key> → this tenant
    cache_salt = "…"                 # default: HMAC-SHA256(salt secret, tenant name)
    deadline = "2s"

Environment: ``KVOFFLOAD_ROUTER_CONFIG`` (the file), ``KVOFFLOAD_ROUTER_HOST``,
``KVOFFLOAD_ROUTER_PORT``, ``KVOFFLOAD_ROUTER_ON_DEADLINE_MISS``,
``KVOFFLOAD_ROUTER_DEFAULT_DEADLINE``, ``KVOFFLOAD_ROUTER_LOG_DECISIONS``
(all in :mod:`kvoffload.envvars`; the router refuses an unknown
``KVOFFLOAD_*`` variable as ``serve`` does).

Tenants: with no ``[tenants]`` table the router serves one anonymous tenant
and sets no salt (a single-tenant deployment). With tenants, every request
must name one (its API key, or the trusted header) or it is refused with 401;
the router sets the tenant's ``cache_salt`` on the request it forwards (a
client's own salt is appended to it, never replaces it), so a tenant's prompt
can only match KV its own salt produced.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kvoffload import envvars
from kvoffload.errors import ConfigError
from kvoffload.units import parse_duration, parse_size

from .core import Topology, WorkerInfo
from .hashing import ALGORITHMS, BlockHasher
from .model import Priors

__all__ = [
    "ENV_KEYS",
    "LoraSpec",
    "RouterConfig",
    "StoreSpec",
    "TenantSpec",
    "WorkerSpec",
    "load_router_config",
]


@dataclass(frozen=True)
class WorkerSpec:
    name: str
    url: str
    node: str
    events: str | None = None
    metrics_url: str | None = None
    events_replay: str | None = None

    @property
    def metrics(self) -> str:
        return self.metrics_url or self.url.rstrip("/") + "/metrics"


@dataclass(frozen=True)
class StoreSpec:
    name: str
    nodes: tuple[str, ...]
    shared: bool = False
    events: str | None = None
    events_replay: str | None = None


@dataclass(frozen=True)
class LoraSpec:
    name: str
    path: str


@dataclass(frozen=True)
class TenantSpec:
    name: str
    api_keys: tuple[str, ...] = ()
    cache_salt: str | None = None
    deadline_s: float | None = None


@dataclass
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8100
    on_deadline_miss: str = "shed"
    default_deadline_s: float | None = None
    health_interval_s: float = 2.0
    metrics_interval_s: float = 1.0
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    max_body_bytes: int = 64 << 20
    log_decisions: bool = False
    work_weight: float = 1.0
    risk: float = 2.0
    salt_secret_file: Path | None = None
    trust_tenant_header: bool = False
    model_name: str | None = None
    tokenizer: Path | None = None
    tokenizer_processes: int = 0
    block_size: int = 16
    hash_algorithm: str = "sha256"
    hash_seed: str | None = None
    priors: Priors = field(default_factory=Priors)
    workers: tuple[WorkerSpec, ...] = ()
    stores: tuple[StoreSpec, ...] = ()
    loras: tuple[LoraSpec, ...] = ()
    tenants: tuple[TenantSpec, ...] = ()

    def topology(self) -> Topology:
        roots = {s.name: (s.shared, s.nodes) for s in self.stores}
        return Topology(tuple(WorkerInfo(w.name, w.node) for w in self.workers), roots)

    def hasher(self) -> BlockHasher:
        return BlockHasher(self.block_size, self.hash_algorithm, self.hash_seed)

    def lora(self, model: object) -> tuple[str, str] | None:
        for spec in self.loras:
            if spec.name == model:
                return (spec.name, spec.path)
        return None

    def tenant_salts(self) -> dict[str, str]:
        """Each tenant's ``cache_salt``: configured, or derived from the salt secret."""
        secret: bytes | None = None
        out: dict[str, str] = {}
        for t in self.tenants:
            if t.cache_salt:
                out[t.name] = t.cache_salt
                continue
            if secret is None:
                if self.salt_secret_file is None:
                    raise ConfigError(
                        f"tenant {t.name!r} has no cache_salt and [router] salt_secret_file "
                        "is not set: one of them must give each tenant its salt"
                    )
                try:
                    secret = self.salt_secret_file.read_bytes().strip()
                except OSError as exc:
                    raise ConfigError(
                        f"cannot read salt_secret_file {self.salt_secret_file}: {exc}"
                    ) from exc
                if len(secret) < 16:
                    raise ConfigError(f"{self.salt_secret_file}: the salt secret is too short")
            out[t.name] = hmac.new(secret, t.name.encode(), hashlib.sha256).hexdigest()
        return out


def _bool(v: object) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return v.lower() in ("1", "true", "yes", "on")
    raise ValueError(f"not a boolean: {v!r}")


def _int(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int | str):
        raise ValueError(f"not an integer: {v!r}")
    return int(v)


def _float(v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        raise ValueError(f"not a number: {v!r}")
    try:
        return float(v)
    except ValueError:
        raise ValueError(f"not a number: {v!r}") from None


def _str(v: object) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError(f"not a non-empty string: {v!r}")
    return v


def _deadline(v: object) -> float | None:
    if isinstance(v, str) and v.lower() == "none":
        return None
    s = parse_duration(v)
    if s is None or s <= 0:
        raise ValueError("a deadline must be positive (or none)")
    return s


def _positive_duration(v: object) -> float:
    s = parse_duration(v)
    if s is None or s <= 0:
        raise ValueError("must be a positive duration")
    return s


def _positive_size(v: object) -> int:
    n = parse_size(v)
    if not n or n <= 0:
        raise ValueError("must be a positive size")
    return int(n)


def _processes(v: object) -> int:
    n = _int(v)
    if not 0 <= n <= 64:
        raise ValueError("must be 0 (a thread) to 64")
    return n


def _miss(v: object) -> str:
    if v not in ("shed", "fastest"):
        raise ValueError(f"must be shed or fastest, not {v!r}")
    return str(v)


def _port(v: object) -> int:
    p = _int(v)
    if not 0 <= p < 65536:
        raise ValueError(f"not a port: {p}")
    return p


def _algo(v: object) -> str:
    if v not in ALGORITHMS:
        raise ValueError(f"must be one of {', '.join(ALGORITHMS)}")
    return str(v)


def _block_size(v: object) -> int:
    n = _int(v)
    if n <= 0:
        raise ValueError("must be positive")
    return n


_ROUTER_KEYS: dict[str, tuple[str, Any]] = {
    "host": ("host", _str),
    "port": ("port", _port),
    "on_deadline_miss": ("on_deadline_miss", _miss),
    "default_deadline": ("default_deadline_s", _deadline),
    "health_interval": ("health_interval_s", _positive_duration),
    "metrics_interval": ("metrics_interval_s", _positive_duration),
    "request_timeout": ("request_timeout_s", _positive_duration),
    "connect_timeout": ("connect_timeout_s", _positive_duration),
    "max_body": ("max_body_bytes", _positive_size),
    "log_decisions": ("log_decisions", _bool),
    "work_weight": ("work_weight", _float),
    "risk": ("risk", lambda v: _nonneg(_float(v))),
    "salt_secret_file": ("salt_secret_file", Path),
    "trust_tenant_header": ("trust_tenant_header", _bool),
}
_MODEL_KEYS: dict[str, tuple[str, Any]] = {
    "name": ("model_name", _str),
    "tokenizer": ("tokenizer", Path),
    "tokenizer_processes": ("tokenizer_processes", _processes),
    "block_size": ("block_size", _block_size),
    "hash_algorithm": ("hash_algorithm", _algo),
    "hash_seed": ("hash_seed", _str),
}


def _bandwidth(v: object) -> float:
    n = parse_size(v)
    if not n:
        raise ValueError("a bandwidth must be a positive size per second")
    return float(n)


_PRIOR_KEYS: dict[str, tuple[str, Any]] = {
    "prefill_overhead": ("prefill_a_s", lambda v: parse_duration(v) or 0.0),
    "prefill_tokens_per_s": ("prefill_b_s", lambda v: 1.0 / _positive(_float(v))),
    "prefill_quadratic": ("prefill_c_s", lambda v: _nonneg(_float(v))),
    "decode_slowdown": ("decode_slowdown", lambda v: _nonneg(_float(v))),
    "bytes_per_token": ("bytes_per_token", lambda v: int(_bandwidth(v))),
    "cpu_bandwidth": ("cpu_bandwidth", _bandwidth),
    "storage_local_bandwidth": ("storage_local_bandwidth", _bandwidth),
    "storage_remote_bandwidth": ("storage_remote_bandwidth", _bandwidth),
    # The workers' vLLM settings (not coefficients: the model learns those).
    "prefill_budget_tokens": ("prefill_budget_tokens", lambda v: _count(v, 16)),
    "kv_capacity_tokens": ("kv_capacity_tokens", lambda v: _count(v, 0)),
}


def _count(v: object, low: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"must be an integer >= {low}")
    return v


def _positive(x: float) -> float:
    if x <= 0:
        raise ValueError("must be positive")
    return x


def _nonneg(x: float) -> float:
    if x < 0:
        raise ValueError("must not be negative")
    return x


#: ``KVOFFLOAD_<ROUTER>_<KEY>`` → ``[router]`` key (``KVOFFLOAD_ROUTER_CONFIG`` is the file).
ENV_KEYS: dict[str, str] = {
    envvars.config_var("router", k): k
    for k in ("host", "port", "on_deadline_miss", "default_deadline", "log_decisions")
}
CONFIG_VAR = envvars.config_var("router", "config")


def _table(source: str, where: str, raw: object) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {where} must be a table")
    return raw


def _apply(
    cfg: RouterConfig,
    keys: dict[str, tuple[str, Any]],
    section: str,
    key: str,
    raw: object,
    source: str,
) -> RouterConfig:
    spec = keys.get(key)
    if spec is None:
        raise ConfigError(f"{source}: unknown setting [{section}] {key}")
    name, conv = spec
    try:
        value = conv(raw)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{source}: [{section}] {key}: {exc}") from exc
    return replace(cfg, **{name: value})


def _fields(
    source: str, where: str, raw: object, required: tuple[str, ...], optional: tuple[str, ...]
) -> dict[str, Any]:
    t = _table(source, where, raw)
    for k in t:
        if k not in required and k not in optional:
            raise ConfigError(f"{source}: unknown setting {where} {k}")
    for k in required:
        if k not in t:
            raise ConfigError(f"{source}: {where} needs {k}")
    return t


def _worker(source: str, i: int, raw: object) -> WorkerSpec:
    where = f"[[workers]] #{i + 1}"
    t = _fields(
        source, where, raw, ("name", "url"), ("node", "events", "events_replay", "metrics_url")
    )
    try:
        name, url = _str(t["name"]), _str(t["url"])
        u = urlparse(url)
        if u.scheme not in ("http", "https") or not u.netloc:
            raise ValueError(f"url must be http(s)://host:port, not {url!r}")
        node = _str(t.get("node", name))
        events = _str(t["events"]) if "events" in t else None
        metrics = _str(t["metrics_url"]) if "metrics_url" in t else None
        replay = _str(t["events_replay"]) if "events_replay" in t else None
    except ValueError as exc:
        raise ConfigError(f"{source}: {where}: {exc}") from exc
    return WorkerSpec(name, url.rstrip("/"), node, events, metrics, replay)


def _store(source: str, i: int, raw: object) -> StoreSpec:
    where = f"[[stores]] #{i + 1}"
    t = _fields(source, where, raw, ("name", "nodes"), ("shared", "events", "events_replay"))
    try:
        nodes = t["nodes"]
        if not isinstance(nodes, list) or not nodes:
            raise ValueError("nodes must be a non-empty list of node names")
        return StoreSpec(
            _str(t["name"]),
            tuple(_str(n) for n in nodes),
            _bool(t.get("shared", False)),
            _str(t["events"]) if "events" in t else None,
            _str(t["events_replay"]) if "events_replay" in t else None,
        )
    except ValueError as exc:
        raise ConfigError(f"{source}: {where}: {exc}") from exc


def _tenant(source: str, name: str, raw: object) -> TenantSpec:
    where = f"[tenants.{name}]"
    t = _fields(source, where, raw, (), ("api_keys", "cache_salt", "deadline"))
    try:
        keys = t.get("api_keys", [])
        if not isinstance(keys, list):
            raise ValueError("api_keys must be a list")
        return TenantSpec(
            name,
            tuple(_str(k) for k in keys),
            _str(t["cache_salt"]) if "cache_salt" in t else None,
            _deadline(t["deadline"]) if "deadline" in t else None,
        )
    except ValueError as exc:
        raise ConfigError(f"{source}: {where}: {exc}") from exc


def _check(cfg: RouterConfig, source: str) -> RouterConfig:
    if not cfg.workers:
        raise ConfigError(f"{source}: no [[workers]]: the router needs at least one")
    seen: set[str] = set()
    for w in cfg.workers:
        if w.name in seen:
            raise ConfigError(f"{source}: two workers are named {w.name!r}")
        seen.add(w.name)
    nodes = {w.node for w in cfg.workers}
    for s in cfg.stores:
        unknown = [n for n in s.nodes if n not in nodes]
        if unknown:
            raise ConfigError(f"{source}: store {s.name!r} names unknown node {unknown[0]!r}")
    keys: dict[str, str] = {}
    for t in cfg.tenants:
        for k in t.api_keys:
            if k in keys:
                raise ConfigError(f"{source}: tenants {keys[k]!r} and {t.name!r} share an API key")
            keys[k] = t.name
    cfg.tenant_salts()
    try:
        cfg.hasher()
    except ValueError as exc:
        raise ConfigError(f"{source}: [model] {exc}") from exc
    return cfg


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def _array(source: str, section: str, raw: object) -> list[Any]:
    if not isinstance(raw, list):
        raise ConfigError(f"{source}: {section} must be an array of tables ([[{section}]])")
    return raw


def _router_section(cfg: RouterConfig, source: str, raw: object) -> RouterConfig:
    for key, value in _table(source, "[router]", raw).items():
        cfg = _apply(cfg, _ROUTER_KEYS, "router", key, value, source)
    return cfg


def _model_section(cfg: RouterConfig, source: str, raw: object) -> RouterConfig:
    for key, value in _table(source, "[model]", raw).items():
        cfg = _apply(cfg, _MODEL_KEYS, "model", key, value, source)
    return cfg


def _priors_section(cfg: RouterConfig, source: str, raw: object) -> RouterConfig:
    pri = cfg.priors
    for key, value in _table(source, "[priors]", raw).items():
        spec = _PRIOR_KEYS.get(key)
        if spec is None:
            raise ConfigError(f"{source}: unknown setting [priors] {key}")
        try:
            pri = replace(pri, **{spec[0]: spec[1](value)})
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{source}: [priors] {key}: {exc}") from exc
    return replace(cfg, priors=pri)


def _workers_section(cfg: RouterConfig, source: str, raw: object) -> RouterConfig:
    raw = _array(source, "workers", raw)
    return replace(cfg, workers=tuple(_worker(source, i, t) for i, t in enumerate(raw)))


def _stores_section(cfg: RouterConfig, source: str, raw: object) -> RouterConfig:
    raw = _array(source, "stores", raw)
    return replace(cfg, stores=tuple(_store(source, i, t) for i, t in enumerate(raw)))


def _lora_section(cfg: RouterConfig, source: str, raw: object) -> RouterConfig:
    loras = []
    for i, t in enumerate(_array(source, "lora", raw)):
        f = _fields(source, f"[[lora]] #{i + 1}", t, ("name", "path"), ())
        loras.append(LoraSpec(str(f["name"]), str(f["path"])))
    return replace(cfg, loras=tuple(loras))


def _tenants_section(cfg: RouterConfig, source: str, raw: object) -> RouterConfig:
    table = _table(source, "[tenants]", raw)
    return replace(cfg, tenants=tuple(_tenant(source, n, t) for n, t in table.items()))


#: What each section of the file sets, in the config read so far.
_SECTIONS: dict[str, Callable[[RouterConfig, str, object], RouterConfig]] = {
    "router": _router_section,
    "model": _model_section,
    "priors": _priors_section,
    "workers": _workers_section,
    "stores": _stores_section,
    "lora": _lora_section,
    "tenants": _tenants_section,
}


def load_router_config(
    path: Path | None = None, *, env: Mapping[str, str] | None = None
) -> RouterConfig:
    """The router's config: file, then environment. :class:`ConfigError` names what is wrong."""
    env = os.environ if env is None else env
    envvars.check_environment(env)
    cfg = RouterConfig()
    path = path or (Path(env[CONFIG_VAR]) if env.get(CONFIG_VAR) else None)
    source = str(path) if path else "(no config file)"
    if path is not None:
        for section, raw in _read_toml(path).items():
            apply = _SECTIONS.get(section)
            if apply is None:
                raise ConfigError(f"{source}: unknown section [{section}]")
            cfg = apply(cfg, source, raw)
    for var, key in ENV_KEYS.items():
        if var in env:
            cfg = _apply(cfg, _ROUTER_KEYS, "router", key, env[var], f"${var}")
    return _check(cfg, source)
