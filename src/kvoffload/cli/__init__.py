"""The ``kvoffload`` command line (typer + rich).

The store commands (inspect, ls, purge, fsck) go through the running
sidecar's admin verbs when one serves the configured socket, and open the
store in-process only when none does (:mod:`.admin`).

Exit codes:
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

One module per command group: :mod:`.app` (the typer app, global options,
config and store helpers), :mod:`.store_cmds` (init, inspect, ls, purge, fsck,
keys), :mod:`.serve` (serve, stats), :mod:`.doctor`, :mod:`.demo`; the exit
codes and the one exception → exit-code table are :mod:`.exits`.
"""

from __future__ import annotations

import sys

from . import (
    audit_cmd,
    config_cmds,
    contract_cmds,
    demo,
    doctor,
    events_cmds,
    serve,
    store_cmds,
    systemd_cmd,
)
from .app import app, err, fail_line, misplaced_global_option, state
from .exits import (
    EXIT_ABORTED,
    EXIT_ERROR,
    EXIT_FSCK_PROBLEMS,
    EXIT_LOCKED,
    EXIT_NO_STORE,
    EXIT_NOTHING,
    EXIT_OK,
    EXIT_TABLE,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    ExitCode,
    exit_for,
)

__all__ = [
    "EXIT_ABORTED",
    "EXIT_ERROR",
    "EXIT_FSCK_PROBLEMS",
    "EXIT_LOCKED",
    "EXIT_NOTHING",
    "EXIT_NO_STORE",
    "EXIT_OK",
    "EXIT_TABLE",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "ExitCode",
    "app",
    "audit_cmd",
    "config_cmds",
    "contract_cmds",
    "demo",
    "doctor",
    "events_cmds",
    "exit_for",
    "main",
    "serve",
    "state",
    "store_cmds",
    "systemd_cmd",
]


def main(argv: list[str] | None = None) -> None:
    """The entry point: run the app, and turn a known exception into one line + its code."""
    args = sys.argv[1:] if argv is None else argv
    misplaced = misplaced_global_option(args)
    if misplaced is not None:
        err.print(fail_line("usage", misplaced))
        sys.exit(ExitCode.USAGE)
    try:
        app(args=args, prog_name="kvoffload")
    except Exception as exc:
        mapped = exit_for(exc)
        if mapped is None:
            raise
        code, label = mapped
        err.print(fail_line(label, str(exc)))
        sys.exit(code)
