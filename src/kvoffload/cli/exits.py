"""The CLI's exit codes and the one table that maps exceptions to them.

Commands never pick an exit code for a failure themselves: they raise (a
:mod:`kvoffload.errors` class, or one of the CLI outcomes below) and
:func:`kvoffload.cli.main` turns the exception into one line on stderr,
``<label>: <message>``, and the exit code :data:`EXIT_TABLE` gives its class.
No traceback: an exception no row matches is a bug and keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntEnum
from types import MappingProxyType
from typing import Final

from ..errors import (
    ConfigError,
    IndexFailure,
    KeyringError,
    KVOffloadError,
    LayoutError,
    ListenError,
    PolicyError,
    ProtocolError,
    SidecarStartError,
    StoreError,
    StoreLocked,
    TransportError,
)

__all__ = [
    "EXIT_ABORTED",
    "EXIT_AUDIT_BROKEN",
    "EXIT_ERROR",
    "EXIT_FSCK_PROBLEMS",
    "EXIT_INTERRUPTED",
    "EXIT_LOCKED",
    "EXIT_MEANINGS",
    "EXIT_NOTHING",
    "EXIT_NO_STORE",
    "EXIT_OK",
    "EXIT_TABLE",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "ExitCode",
    "exit_code_help",
    "exit_code_markdown",
    "exit_for",
]


class ExitCode(IntEnum):
    """The documented exit codes (``kvoffload --help``); these numbers never change."""

    OK = 0
    ERROR = 1  # I/O, invalid store, invalid config
    USAGE = 2  # usage error
    NO_STORE = 3  # no store at that location (run `kvoffload init`)
    LOCKED = 4  # the store's index is held by another process (a running sidecar)
    FSCK_PROBLEMS = 5  # fsck found problems (without --repair)
    ABORTED = 6  # aborted at a confirmation prompt
    UNREACHABLE = 7  # the sidecar is not reachable (stats, demo)
    NOTHING = 8  # nothing to do: a purge or invalidate that matches nothing (a typo?)
    AUDIT_BROKEN = 9  # the audit log's hash chain is broken, or absent (audit --verify)
    INTERRUPTED = 130  # stopped by Ctrl-C (SIGINT), as shells report it (128 + 2)


#: What each exit code means: the one table that ``kvoffload --help``
#: (:func:`exit_code_help`) and the README's rows (:func:`exit_code_markdown`,
#: checked by tests/cli/test_cli_exits.py) are made from.
EXIT_MEANINGS: Final[Mapping[ExitCode, str]] = MappingProxyType(
    {
        ExitCode.OK: "success",
        ExitCode.ERROR: "error (I/O, invalid store, invalid config)",
        ExitCode.USAGE: "usage error",
        ExitCode.NO_STORE: "no store at that location (run `kvoffload init`)",
        ExitCode.LOCKED: "the store's index is held by another process "
        "(a sidecar on another socket)",
        ExitCode.FSCK_PROBLEMS: "fsck found problems (without --repair)",
        ExitCode.ABORTED: "aborted at a confirmation prompt",
        ExitCode.UNREACHABLE: "the sidecar is not reachable (stats, demo)",
        ExitCode.NOTHING: "nothing to do: a purge or invalidate that matches nothing (a typo?)",
        ExitCode.AUDIT_BROKEN: "audit --verify: the audit log's hash chain is broken, "
        "or there is no log",
        ExitCode.INTERRUPTED: "stopped by Ctrl-C (one line says what stopped)",
    }
)


def exit_code_help() -> str:
    """The exit-code table of ``kvoffload --help``."""
    return "Exit codes:\n" + "".join(f"  {int(c)}  {m}\n" for c, m in EXIT_MEANINGS.items())


def exit_code_markdown() -> str:
    """The README's exit-code rows (tests/cli/test_cli_exits.py holds the README to them)."""
    rows = "".join(f"| {int(c)} | {m} |\n" for c, m in EXIT_MEANINGS.items())
    return "| code | meaning |\n|---|---|\n" + rows


EXIT_OK = ExitCode.OK
EXIT_ERROR = ExitCode.ERROR
EXIT_USAGE = ExitCode.USAGE
EXIT_NO_STORE = ExitCode.NO_STORE
EXIT_LOCKED = ExitCode.LOCKED
EXIT_FSCK_PROBLEMS = ExitCode.FSCK_PROBLEMS
EXIT_ABORTED = ExitCode.ABORTED
EXIT_UNREACHABLE = ExitCode.UNREACHABLE
EXIT_NOTHING = ExitCode.NOTHING
EXIT_AUDIT_BROKEN = ExitCode.AUDIT_BROKEN
EXIT_INTERRUPTED = ExitCode.INTERRUPTED


# -- outcomes only the CLI has (not library errors) ----------------------------
#
# Private on purpose: they are the commands' way of telling main() which exit
# code applies, raised and caught inside the CLI, never seen by a caller; the
# package's public exceptions all live in kvoffload.errors (tests/test_errors.py).


class _CliOutcome(KVOffloadError):
    """Base of the command-line outcomes that are not library errors."""


class _CliUsageError(_CliOutcome):
    """Options that do not make sense together, or a malformed value."""


class _NoStore(LayoutError):
    """No store at the configured root (no layout.json): run ``kvoffload init``."""


class _FsckProblems(_CliOutcome):
    """fsck found problems and was not asked to repair them (the report is printed)."""


class _Aborted(_CliOutcome):
    """The user said no at a confirmation prompt."""


class _NothingToDo(_CliOutcome):
    """What the command would act on does not exist: a purge of a tenant with no
    keys or data or of a namespace with no chunks, an invalidate that matches no
    namespace."""


class _AuditBroken(_CliOutcome):
    """``audit --verify`` found the hash chain broken (the first break is named)."""


class _SidecarUnreachable(_CliOutcome):
    """No sidecar answered on the socket."""


class _Forbidden(_CliOutcome):
    """The sidecar refused an admin verb: this user lacks the policy's admin right."""


class _EngineResetFailed(_CliOutcome):
    """``purge --engine``: an engine's prefix cache was not reset (the store purge was done)."""


class _Interrupted(_CliOutcome):
    """Ctrl-C (SIGINT) stopped the command; :func:`kvoffload.cli.main` says so."""


class _DemoFailed(_CliOutcome):
    """A demo worker failed, or the demo cannot run here (the message says why)."""


#: exception class → (exit code, label of the one stderr line). The first row
#: whose class the exception is an instance of wins, so subclasses come first.
EXIT_TABLE: tuple[tuple[type[BaseException], ExitCode, str], ...] = (
    (_CliUsageError, ExitCode.USAGE, "usage"),
    (_Aborted, ExitCode.ABORTED, "aborted"),
    (_FsckProblems, ExitCode.FSCK_PROBLEMS, "fsck"),
    (_NothingToDo, ExitCode.NOTHING, "nothing to do"),
    (_AuditBroken, ExitCode.AUDIT_BROKEN, "audit"),
    (_Interrupted, ExitCode.INTERRUPTED, "interrupted"),
    (_NoStore, ExitCode.NO_STORE, "no store"),
    (StoreLocked, ExitCode.LOCKED, "locked"),
    (_SidecarUnreachable, ExitCode.UNREACHABLE, "unreachable"),
    (SidecarStartError, ExitCode.UNREACHABLE, "sidecar"),
    (TransportError, ExitCode.UNREACHABLE, "unreachable"),
    (ProtocolError, ExitCode.UNREACHABLE, "unreachable"),
    (_DemoFailed, ExitCode.ERROR, "demo failed"),
    (_EngineResetFailed, ExitCode.ERROR, "engine"),
    (_Forbidden, ExitCode.ERROR, "forbidden"),
    (ListenError, ExitCode.ERROR, "cannot serve"),
    (ConfigError, ExitCode.ERROR, "config error"),
    (PolicyError, ExitCode.ERROR, "policy"),
    (KeyringError, ExitCode.ERROR, "KEK"),
    (LayoutError, ExitCode.ERROR, "store"),
    (StoreError, ExitCode.ERROR, "store"),
    (IndexFailure, ExitCode.ERROR, "store"),
    (KVOffloadError, ExitCode.ERROR, "error"),
    (OSError, ExitCode.ERROR, "error"),
)


def exit_for(exc: BaseException) -> tuple[ExitCode, str] | None:
    """The exit code and label for ``exc``, or None when no row matches (a bug)."""
    for cls, code, label in EXIT_TABLE:
        if isinstance(exc, cls):
            return code, label
    return None
