"""The typer application, its global options and what every command shares."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..router.cli import register as register_router
from .exits import _CliUsageError, _NoStore

if TYPE_CHECKING:
    from ..sidecar.config import Config
    from ..sidecar.store import Store

EPILOG = """Exit codes:
  0  success
  1  error (I/O, invalid store, invalid config)
  2  usage error
  3  no store at that location (run `kvoffload init`)
  4  the store's index is held by another process (a sidecar on another socket)
  5  fsck found problems (without --repair)
  6  aborted at a confirmation prompt
  7  the sidecar is not reachable (stats, demo)
  8  nothing to do: purge of a tenant with no keys or data (a typo?)
  9  audit --verify: the audit log's hash chain is broken, or there is no log
"""

HELP = """KV-cache offload sidecar and its store.

Global options (--dev, --config, --root, --index-dir, --kek-file, -v) go
before the command: `kvoffload --dev serve`, `kvoffload --dev inspect`.
"""

app = typer.Typer(
    name="kvoffload",
    help=HELP,
    # "\b" keeps click from re-wrapping the table into one paragraph.
    epilog=EPILOG.replace("Exit codes:\n", "Exit codes:\n\n\b\n", 1),
    no_args_is_help=True,
    add_completion=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)
keys_app = typer.Typer(help="Key management.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
register_router(app)  # `kvoffload router` lives with the router (kvoffload.router.cli)

# Markup off: messages and user-supplied strings (tenants, paths, "[store] foo",
# "kvoffload[demo]") are printed as they are; styling goes through rich.text.Text.
out = Console(soft_wrap=True, markup=False, highlight=False)
err = Console(stderr=True, soft_wrap=True, markup=False, highlight=False)


def fail_line(label: str, message: str) -> Text:
    """``<label>: <message>`` with the label in red; nothing in either is markup."""
    return Text.assemble((f"{label}:", "red"), " ", message)


class _State:
    config_path: Path | None = None
    dev: bool = False
    root: Path | None = None
    index_dir: Path | None = None
    kek_file: Path | None = None
    verbose: bool = False


state = _State()

#: The global options (before the command); none of them is a command's option.
GLOBAL_FLAGS = ("--dev", "--verbose", "-v")
GLOBAL_VALUED = ("--config", "-c", "--root", "--index-dir", "--kek-file")


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        sys.stdout.write(f"kvoffload {__version__}\n")
        raise typer.Exit(0)


@app.callback()
def _main(
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="Config file (TOML).")
    ] = None,
    dev: Annotated[
        bool,
        typer.Option(
            "--dev",
            help="Use the embedded default store under ./.kvoffload with a development KEK.",
        ),
    ] = False,
    root: Annotated[Path | None, typer.Option("--root", help="Store root.")] = None,
    index_dir: Annotated[
        Path | None, typer.Option("--index-dir", help="Node-local index directory.")
    ] = None,
    kek_file: Annotated[
        Path | None, typer.Option("--kek-file", help="KEK credential file.")
    ] = None,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Log at INFO level (serve always does).")
    ] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version", help="Print the version and exit.", callback=_version, is_eager=True
        ),
    ] = False,
) -> None:
    state.config_path, state.dev, state.root = config, dev, root
    state.index_dir, state.kek_file, state.verbose = index_dir, kek_file, verbose
    setup_logging(logging.INFO if verbose else logging.WARNING)


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg (and exc when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return json.dumps(data, ensure_ascii=False, default=str)


def setup_logging(level: int, fmt: str = "plain", *, daemon: bool = False) -> None:
    """The CLI's one log handler on stderr.

    ``plain``: ``LEVEL logger: message``; the daemon (``serve``) puts a
    timestamp in front unless journald already stamps every line
    (``$JOURNAL_STREAM`` is set under systemd). ``json``: :class:`JsonLogFormatter`.
    """
    import os

    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonLogFormatter())
    else:
        stamped = daemon and not os.environ.get("JOURNAL_STREAM")
        stamp = "%(asctime)s " if stamped else ""
        handler.setFormatter(logging.Formatter(stamp + "%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


def misplaced_global_option(argv: list[str]) -> str | None:
    """The one-line complaint when a global option follows the command, else None."""
    command: str | None = None
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            return None
        name = tok.split("=", 1)[0]
        if command is None:
            if name in GLOBAL_VALUED and "=" not in tok:
                i += 2
                continue
            if not tok.startswith("-"):
                command = tok
        elif name in GLOBAL_FLAGS or name in GLOBAL_VALUED:
            return (
                f"{name} is a global option: put {name} before the command, "
                f"e.g. `kvoffload {name}{' …' if name in GLOBAL_VALUED else ''} {command}`"
            )
        i += 1
    return None


def config() -> Config:
    """The configuration: file/environment/defaults, then the global options."""
    from .. import envvars
    from ..sidecar.config import load_config

    envvars.check_environment()
    cfg = load_config(state.config_path, dev=state.dev)
    if state.root is not None:
        cfg.store_root = state.root
    if state.index_dir is not None:
        cfg.index_dir = state.index_dir
    if state.kek_file is not None:
        cfg.kek_file = state.kek_file
    return cfg


def load_kek(cfg: Config, *, banner: bool = False) -> Any:
    """The KEK; in dev mode the development KEK (created on first use).

    ``banner``: the loud development-KEK warning (``serve``); other commands
    log a one-line reminder.
    """
    from ..errors import KeyringError
    from ..sidecar.keyring import Kek

    if cfg.kek_file is None:
        raise KeyringError(
            "no KEK: pass --kek-file, set KVOFFLOAD_KEK_FILE or [security] "
            "kek_file, or use --dev for the embedded development store"
        )
    if cfg.dev:
        keys = cfg.store_root / "keys"
        if not cfg.kek_file.exists() and keys.is_dir() and any(keys.iterdir()):
            # A new KEK cannot open the keys the lost one wrapped.
            raise KeyringError(
                f"the development KEK {cfg.kek_file} is gone, so the tenants' keys in "
                f"{keys} cannot be opened; the development store is only a cache: "
                f"delete {cfg.store_root.parent} and start again"
            )
        cfg.kek_file.parent.mkdir(parents=True, exist_ok=True)
        return Kek.generate_dev(cfg.kek_file, banner=banner)
    return Kek.from_file(cfg.kek_file)


@contextmanager
def open_store(cfg: Config, *, create: bool = False, banner: bool = False) -> Iterator[Store]:
    from ..errors import LayoutError
    from ..sidecar.store import Store

    if create and cfg.store_root.exists() and not cfg.store_root.is_dir():
        raise LayoutError(f"store root {cfg.store_root} is a file, not a directory")
    kek = load_kek(cfg, banner=banner)
    try:
        store = Store(cfg.store_config(), kek, create=create)
    except LayoutError as exc:
        if not (cfg.store_root / "layout.json").exists():
            raise _NoStore(f"{exc} (run `kvoffload init`)") from exc
        raise
    try:
        yield store
    finally:
        store.close()


def emit(as_json: bool, data: Any, table: Table | None = None) -> None:
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    elif table is not None:
        out.print(table)
    else:
        for k, v in data.items():
            out.print(f"{k}: {v}")


JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


def human_bytes(n: int | None) -> str:
    from ..units import format_size

    return format_size(n)


def check_tenant(tenant: str | None) -> str | None:
    """A usage error (exit 2) for a malformed tenant id, before anything is opened."""
    from ..contract import validate_tenant
    from ..errors import ContractError

    if tenant is None:
        return None
    try:
        return validate_tenant(tenant)
    except ContractError as exc:
        raise _CliUsageError(f"--tenant: {exc}") from exc


def parse_ns(namespace: str | None) -> bytes | None:
    if namespace is None:
        return None
    try:
        ns = bytes.fromhex(namespace)
    except ValueError:
        ns = b""
    if len(ns) != 32:
        raise _CliUsageError("--namespace must be a 64-hex-digit fingerprint")
    return ns
