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

from .exits import _CliUsageError, _NoStore, exit_code_help

if TYPE_CHECKING:
    from ..sidecar.config import Config
    from ..store import Store

EPILOG = exit_code_help()

HELP = """KV-cache offload sidecar and its store.

Global options (--dev, --config, --root, --index-dir, --kek-file, -v) go
before or after the command: `kvoffload --dev serve`, `kvoffload inspect --dev`.
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

# Markup off: messages and user-supplied strings (tenants, paths, "[store] foo",
# "kvoffload[demo]") are printed as they are; styling goes through rich.text.Text.
#: The width of a table written to a pipe or a file: nothing is cut or wrapped to
#: fit a screen there is none of (`| less -S`, a script, ssh without a tty).
PIPE_WIDTH = 10_000


def _width(stream: Any) -> int | None:
    """None (rich measures the terminal, or honours $COLUMNS) on a terminal or
    where COLUMNS is set; :data:`PIPE_WIDTH` elsewhere, where rich would say 80."""
    import os

    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    return None if tty or os.environ.get("COLUMNS") else PIPE_WIDTH


out = Console(soft_wrap=True, markup=False, highlight=False, width=_width(sys.stdout))
err = Console(stderr=True, soft_wrap=True, markup=False, highlight=False, width=_width(sys.stderr))


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
    #: ``serve --log-format json``: every line on stderr is a JSON object, the
    #: failure that ends the command too (:func:`kvoffload.cli.main`).
    log_json: bool = False
    #: A Ctrl-C was seen (:func:`kvoffload.cli.main`'s handler). Python drops a
    #: KeyboardInterrupt raised inside a finalizer ("Exception ignored in"), so a
    #: command that loops until interrupted checks this too.
    interrupted: bool = False


state = _State()

#: The global options (before or after the command: :func:`hoist_global_options`).
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
        Path | None,
        typer.Option("--config", "-c", metavar="FILE", readable=False, help="Config file (TOML)."),
    ] = None,
    dev: Annotated[
        bool,
        typer.Option(
            "--dev",
            help="Use the embedded default store under ./.kvoffload with a development KEK.",
        ),
    ] = False,
    root: Annotated[
        Path | None, typer.Option("--root", metavar="DIR", readable=False, help="Store root.")
    ] = None,
    index_dir: Annotated[
        Path | None,
        typer.Option(
            "--index-dir", metavar="DIR", readable=False, help="Node-local index directory."
        ),
    ] = None,
    kek_file: Annotated[
        Path | None,
        typer.Option("--kek-file", metavar="FILE", readable=False, help="KEK credential file."),
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


#: ``extra=`` keys a log record may carry that :class:`JsonLogFormatter` writes as
#: fields of their own: ``audit`` (the audit record, audit-v1.md §3, as an
#: object), ``exit_code`` (the failure that ends the command).
JSON_FIELDS = ("audit", "exit_code")


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, the :data:`JSON_FIELDS`
    the record carries (an audit record as an object, not a string in msg), and
    exc when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in JSON_FIELDS:
            if hasattr(record, key):
                data[key] = getattr(record, key)
        if isinstance(data.get("audit"), dict):
            data["msg"] = f"audit: {data['audit'].get('event')}"  # the record is the field
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
    state.log_json = fmt == "json"
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


def hoist_global_options(argv: list[str]) -> list[str]:
    """``argv`` with the global options given after the command moved in front of it.

    ``kvoffload serve --config FILE`` then means ``kvoffload --config FILE
    serve``, as an operator (and the systemd unit) would expect; given twice,
    the later one wins, as click has it. The command's own options are read
    from click's tree, so an option's value is never taken for a global
    option, and a command's own option of the same name (none today) would
    win. Nothing after ``--`` moves.
    """
    start, names = 0, GLOBAL_FLAGS + GLOBAL_VALUED
    while start < len(argv) and argv[start].startswith("-") and argv[start] != "--":
        start += 2 if argv[start] in GLOBAL_VALUED else 1
    if not any(tok.split("=", 1)[0] in names for tok in argv[start:]):
        return argv  # the common case: nothing to move, click's tree not built
    found = _command_at(argv, start)
    if found is None:
        return argv  # an unknown command: click says so
    command, path_end = found
    own = {name: p for p in command.params for name in (*p.opts, *p.secondary_opts)}
    moved: list[str] = []
    rest: list[str] = []
    i = path_end
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            rest += argv[i:]
            break
        name, inline = tok.split("=", 1)[0], "=" in tok
        param = own.get(name)
        if param is None:
            takes_value = name in GLOBAL_VALUED
        else:
            takes_value = param.param_type_name == "option" and not (param.is_flag or param.count)
        span = [tok] if inline or not takes_value else argv[i : i + 2]
        if param is None and name in names:
            if takes_value and len(span) == 1 and not inline:
                raise _CliUsageError(f"{name} needs a value")
            moved += span
        else:
            rest += span
        i += len(span)
    return argv[:start] + moved + argv[start:path_end] + rest


def _command_at(argv: list[str], i: int) -> tuple[Any, int] | None:
    """The (sub)command named from ``argv[i]`` on, and where its arguments start."""
    # Typer carries its own copy of click: its classes are reached through the tree.
    command: Any = typer.main.get_command(app)
    while i < len(argv) and isinstance(getattr(command, "commands", None), dict):
        sub = command.commands.get(argv[i])
        if sub is None:
            return None
        command, i = sub, i + 1
    return command, i


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


def load_kek(cfg: Config, *, banner: bool = False, create: bool = True) -> Any:
    """The KEK; in dev mode the development KEK (created on first use).

    ``banner``: the loud development-KEK warning (``serve``); other commands
    log a one-line reminder. ``create=False`` (``config check``): None where
    the development KEK does not exist yet, rather than creating it.
    """
    from ..errors import KeyringError
    from ..store.keys.keyring import Kek

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
        if not create:
            return Kek.from_file(cfg.kek_file) if cfg.kek_file.exists() else None
        cfg.kek_file.parent.mkdir(parents=True, exist_ok=True)
        return Kek.generate_dev(cfg.kek_file, banner=banner)
    return Kek.from_file(cfg.kek_file)


@contextmanager
def open_store(cfg: Config, *, create: bool = False, banner: bool = False) -> Iterator[Store]:
    from ..errors import LayoutError
    from ..store import Store

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


def socket_group_hint(path: Path) -> str:
    """What to do about a sidecar socket (or event socket) this user may not open."""
    import grp
    import os

    try:
        group: str | None = grp.getgrgid(os.stat(path).st_gid).gr_name
    except (OSError, KeyError):
        group = None
    if group is None or group == "root":
        return (
            "join the sidecar's socket group ([server] socket_group) and log in again, "
            "or run as the sidecar's user"
        )
    return (
        f"join its group {group} (`sudo usermod -aG {group} $USER`, then log in again), "
        "or run as the sidecar's user"
    )


def unreachable_line(socket_path: Path, exc: BaseException) -> str:
    """Why no sidecar answered on ``socket_path``; a permission error says what to do."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, PermissionError):
        cause = cause.__cause__
    if cause is not None:
        return f"permission denied on {socket_path}: {socket_group_hint(socket_path)}"
    return f"no sidecar answered on {socket_path}: {exc}"


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


#: The shortest namespace prefix a filter takes (git's minimum for an object name).
MIN_NS_PREFIX = 4


def parse_ns(namespace: str | None) -> str | None:
    """``--namespace`` as given, lower-cased: the fingerprint's 64 hex digits, or a
    prefix of at least :data:`MIN_NS_PREFIX` (ls and inspect show 12 or 16), for
    :func:`resolve_ns`; a usage error (exit 2) otherwise."""
    if namespace is None:
        return None
    text = namespace.strip().lower()
    if not MIN_NS_PREFIX <= len(text) <= 64 or text.strip("0123456789abcdef"):
        raise _CliUsageError(
            f"--namespace {namespace!r}: the namespace's fingerprint, 64 hex digits, or a "
            f"unique prefix of it of at least {MIN_NS_PREFIX} (as ls shows it)"
        )
    return text


def resolve_ns(given: str, info: dict[str, Any], tenant: str | None) -> bytes | None:
    """The namespace ``given`` (:func:`parse_ns`) names among those of the inspect
    report ``info``, of ``tenant`` or of every tenant: 64 digits as they are; a
    prefix when exactly one namespace starts with it, None when none does, and
    a usage error (exit 2) listing the candidates when several do (as git)."""
    if len(given) == 64:
        return bytes.fromhex(given)
    found = sorted(
        (t, ns)
        for t, usage in info["tenants"].items()
        if tenant in (None, t)
        for ns in usage["namespaces"]
        if ns.startswith(given)
    )
    names = sorted({ns for _, ns in found})
    if len(names) > 1:
        shown = ", ".join(f"{t}/{ns[:16]}" for t, ns in found[:8])
        raise _CliUsageError(
            f"--namespace {given} is ambiguous: {len(names)} namespaces start with it "
            f"({shown}{', …' if len(found) > 8 else ''}); give more digits"
        )
    return bytes.fromhex(names[0]) if names else None
