"""``kvoffload config show|check`` and ``kvoffload policy check FILE``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from ..errors import KVOffloadError
from .app import JsonOpt, app, emit, err, fail_line, human_bytes, out, state
from .exits import ExitCode, _CliUsageError, exit_for

config_app = typer.Typer(help="The effective configuration.", no_args_is_help=True)
policy_app = typer.Typer(help="Policy files.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(policy_app, name="policy")


def _effective() -> tuple[Any, dict[str, str]]:
    """The configuration as every command sees it, and each setting's source."""
    from .. import envvars
    from ..sidecar.config import load_config_sources

    envvars.check_environment()
    cfg, sources = load_config_sources(state.config_path, dev=state.dev)
    for flag, name in (("--root", "store_root"), ("--index-dir", "index_dir")):
        value = state.root if name == "store_root" else state.index_dir
        if value is not None:
            setattr(cfg, name, value)
            sources[name] = flag
    if state.kek_file is not None:
        cfg.kek_file = state.kek_file
        sources["kek_file"] = "--kek-file"
    return cfg, sources


#: Config fields that are sizes (bytes) and durations (seconds): shown as a file writes them.
_SIZES = ("capacity_bytes", "max_inflight_bytes", "direct_read_min", "ram_cache", "audit_max_bytes")
_DURATIONS = ("key_cache_ttl_s", "journal_poll_s", "evictor_lease_s", "idle_reservation_timeout_s")


def _unset(cfg: Any, name: str) -> tuple[Any, str]:
    """What a setting left unset means: (its JSON value, how it is shown)."""
    import socket

    from ..sidecar.events import default_endpoints
    from ..store.iobackend import DIRECT_READ_MIN
    from ..store.ramtier import auto_capacity
    from ..units import format_size, size_setting

    pub, replay = default_endpoints(cfg.socket_path)
    meaning: dict[str, tuple[Any, str]] = {
        "capacity_bytes": (None, "none (no limit)"),
        "direct_read_min": (DIRECT_READ_MIN, size_setting(DIRECT_READ_MIN)),
        "ram_cache": ("auto", f"auto ({format_size(auto_capacity())} here)"),
        "socket_group": (None, "none (the sidecar's own group)"),
        "events_endpoint": (pub, pub),
        "events_replay_endpoint": (replay, replay),
        "events_snapshot_endpoint": (None, "none (the replay endpoint answers snapshots)"),
        "events_topic": (f"kv@{socket.gethostname()}@kvoffload",) * 2,
    }
    return meaning.get(name, (None, "none"))


def setting_value(cfg: Any, name: str) -> tuple[Any, str]:
    """A config field's effective value: (for --json: bytes, seconds, booleans, null;
    for people: as the file would write it, defaults that are set spelled out)."""
    from enum import Enum

    from ..units import duration_setting, size_setting

    value = getattr(cfg, name)
    if name == "index_dir" and value is None:
        value = cfg.resolved_index_dir
    if name == "events_locality" and not value:
        value = cfg.events.locality
    if value is None:
        return _unset(cfg, name)
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, Path):
        return str(value), str(value)
    if isinstance(value, bool):
        return value, "true" if value else "false"
    if name in _SIZES:
        return value, size_setting(value)
    if name in _DURATIONS:
        return value, duration_setting(value)
    return value, str(value)


@config_app.command("show")
def show(as_json: JsonOpt = False) -> None:
    """Every setting's effective value and where it came from (default, file, env, flag).

    Defaults are shown as what they mean (16MiB, auto, the event endpoints
    beside the socket); with --json sizes are bytes, durations seconds and
    booleans true/false.
    """
    from ..sidecar.config import _KEYS

    cfg, sources = _effective()
    rows: list[dict[str, Any]] = []
    for (section, key), (name, _) in _KEYS.items():
        src = sources[name]
        if name == "index_dir" and cfg.index_dir is None:
            src += " (next to the store root)"
        value, shown = setting_value(cfg, name)
        row = {"setting": f"[{section}] {key}", "value": value, "shown": shown, "source": src}
        rows.append(row)
    if cfg.policy_file is not None:
        rows += _policy_rows(cfg.policy_file)
    if as_json:
        emit(True, [{k: v for k, v in r.items() if k != "shown"} for r in rows])
        return
    table = Table(title="kvoffload configuration" + (" (--dev)" if cfg.dev else ""))
    for col in ("setting", "value", "source"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["setting"], r["shown"], r["source"])
    out.print(table)


def _policy_rows(policy_file: Path) -> list[dict[str, Any]]:
    """The retention and feed settings of each tenant table of the policy in force."""
    from ..sidecar.access.policy_file import load_policy
    from ..sidecar.access.revocation import setting_as_written

    policy = load_policy(policy_file)
    rows = []
    for name, t in [("(defaults)", policy.defaults), *sorted(policy.tenants.items())]:
        for field in ("ttl_s", "max_age_s", "idle_ttl_s", "sensitivity", "events", "encryption"):
            value = getattr(t, field)
            key, shown = setting_as_written(field, value)
            if field == "encryption":
                value = "aes-256-gcm" if value else "none"
            rows.append(
                {
                    "setting": f"policy {name} {key}",
                    "value": value,
                    "shown": shown.strip('"'),
                    "source": str(policy_file),
                }
            )
    return rows


@config_app.command("check")
def check() -> None:
    """Check everything `serve` would refuse to start on, so that it can gate a deployment.

    The configuration, the policy, the KEK (and that it opens the store), the
    socket path and group, the store root, the I/O backend and the metrics
    port, with the checks serve itself runs: one line each, a refusal on
    stderr, exit non-zero when serve would refuse. A sidecar running now is
    a note, not a refusal: check a new configuration before a restart.
    """
    from . import preflight
    from .admin import sidecar_listening

    cfg, _ = _effective()
    out.print(f"config: {preflight.capacity_line(cfg)}")
    running = sidecar_listening(cfg.socket_path)
    codes: list[int] = []
    kek: list[Any] = [None]

    def step(run: Callable[[], str], *, busy: str | None = None) -> None:
        """One check: its line on stdout, or its refusal on stderr (a note where
        what refuses is only held by the running sidecar, ``busy``)."""
        try:
            out.print(run())
        except (KVOffloadError, OSError) as exc:
            if busy is not None and running:
                out.print(f"{busy}: {exc}: the running sidecar holds it")
                return
            code, name = exit_for(exc) or (ExitCode.ERROR, "error")
            codes.append(code)
            err.print(fail_line(name, str(exc)))

    def the_policy() -> str:
        policy, _ = preflight.policy(cfg)
        if cfg.policy_file is None:
            return "policy: the development policy (root and you: every tenant, admin)"
        return (
            f"policy {cfg.policy_file}: ok ({len(policy.grants)} grants, "
            f"{len(policy.tenants)} tenant tables)"
        )

    def the_kek() -> str:
        kek[0], line = preflight.kek(cfg)
        return f"KEK {cfg.kek_file}: {line}"

    step(the_policy)
    step(the_kek)
    step(lambda: f"socket {cfg.socket_path}: {preflight.sock(cfg, inherited=False)}")
    step(lambda: f"store {cfg.store_root}: {preflight.store(cfg, kek[0])}")
    step(lambda: f"I/O: {preflight.io_plan(cfg)}")
    step(lambda: f"metrics: {preflight.metrics_port(cfg, cfg.metrics_port)}", busy="metrics")
    if running:
        out.print(
            f"note: a sidecar serves {cfg.socket_path} now: a new one starts once it stops "
            "(systemctl restart kvoffload)"
        )
    elif preflight.index_in_use(cfg):
        codes.append(ExitCode.LOCKED)
        err.print(
            fail_line(
                "locked",
                f"the index at {cfg.resolved_index_dir} is held by another process, not by a "
                f"sidecar on {cfg.socket_path}: serve would be refused until it stops",
            )
        )
    if codes:
        raise typer.Exit(codes[0])


def _tenant_settings(t: Any) -> dict[str, Any]:
    return {
        "encryption": "aes-256-gcm" if t.encryption else "none",
        "ttl_s": t.ttl_s,
        "quota_bytes": t.quota_bytes,
        "direct": t.direct,
        "direct_gid": t.direct_gid,
        "trust_group": t.trust_group,
        "max_age_s": t.max_age_s,
        "idle_ttl_s": t.idle_ttl_s,
        "sensitivity": t.sensitivity,
        "events": t.events,
        "lookup_floor_s": t.lookup_floor_s,
        "lookup_jitter_s": t.lookup_jitter_s,
        "share_prefixes": t.share_prefixes,
    }


def _dur(seconds: float | None) -> str:
    return "none" if seconds is None else f"{seconds:g} s"


@policy_app.command("check")
def policy_check(
    file: Annotated[
        Path, typer.Argument(metavar="FILE", readable=False, help="The policy file (TOML).")
    ],
    as_json: JsonOpt = False,
) -> None:
    """Validate a policy file and print what each uid and gid may do.

    Check an edited file before `systemctl reload kvoffload` (SIGHUP): an
    invalid file is one line naming the file and line, exit 1.
    """
    from ..sidecar.access.policy import AllTenants
    from ..sidecar.access.policy_file import load_policy

    policy = load_policy(file)
    grants: list[dict[str, Any]] = [
        {
            "principal": f"{g.principal} {g.id}",
            "named": g.label,
            "tenants": "*" if isinstance(g.tenants, AllTenants) else sorted(g.tenants),
            "admin": g.admin,
        }
        for g in policy.grants
    ]
    tenants = {n: _tenant_settings(t) for n, t in sorted(policy.tenants.items())}
    defaults = _tenant_settings(policy.defaults)
    data: dict[str, Any] = {
        "file": str(file),
        "grants": grants,
        "defaults": defaults,
        "tenants": tenants,
    }
    if as_json:
        emit(True, data)
        return
    out.print(f"{file}: ok")
    table = Table(title="who may do what")
    for col in ("principal", "as written", "tenants", "admin verbs"):
        table.add_column(col)
    for g in grants:
        who = "every tenant" if g["tenants"] == "*" else ", ".join(g["tenants"]) or "none"
        table.add_row(g["principal"], g["named"], who, "yes" if g["admin"] else "no")
    out.print(table)
    settings = Table(title="tenant settings")
    cols = ("tenant", "encryption", "ttl", "max_age", "idle_ttl", "sensitivity", "events")
    for col in (*cols, "quota", "direct", "lookup floor + jitter", "trust group"):
        settings.add_column(col)
    for name, s in [("(defaults)", defaults), *tenants.items()]:
        settings.add_row(
            name,
            s["encryption"],
            _dur(s["ttl_s"]),
            _dur(s["max_age_s"]),
            _dur(s["idle_ttl_s"]),
            s["sensitivity"],
            "on" if s["events"] else "off",
            human_bytes(s["quota_bytes"]),
            "yes" if s["direct"] else "no",
            f"{s['lookup_floor_s'] * 1e3:g} + {s['lookup_jitter_s'] * 1e3:g} ms"
            if s["lookup_floor_s"] or s["lookup_jitter_s"]
            else "-",
            (s["trust_group"] or "-") + (" (shared prefixes)" if s["share_prefixes"] else ""),
        )
    out.print(settings)


@app.command("tokenizer-hash")
def tokenizer_hash_cmd(
    path: Annotated[
        Path,
        typer.Argument(
            metavar="PATH",
            readable=False,
            help="A tokenizer directory (or its tokenizer.json / tokenizer.model).",
        ),
    ],
) -> None:
    """The canonical hash of a tokenizer's files and special tokens (the contract's
    tokenizer_hash; the vLLM connector's default for a local tokenizer directory)."""
    from ..tokenizer_hash import tokenizer_hash

    try:
        digest = tokenizer_hash(path)
    except FileNotFoundError as exc:
        raise _CliUsageError(f"no tokenizer to hash: {exc}") from exc
    out.print(digest)
