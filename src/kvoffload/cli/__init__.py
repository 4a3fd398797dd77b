"""The ``kvoffload`` command line (typer + rich).

Store commands open the store in-process and so need the index to be free:
while a sidecar runs, they exit with code 4 and say so.

Exit codes:
  0  success
  1  error (I/O, invalid store, invalid config)
  2  usage error
  3  no store at that location (run `kvoffload init`)
  4  the store's index is held by another process (a running sidecar)
  5  fsck found problems (without --repair)
  6  aborted at a confirmation prompt
  7  the sidecar is not reachable (stats, demo)

One module per command group: :mod:`.app` (the typer app, global options,
config and store helpers), :mod:`.store_cmds` (init, inspect, ls, purge, fsck,
keys), :mod:`.serve` (serve, stats), :mod:`.doctor`, :mod:`.demo`; the exit
codes and the one exception → exit-code table are :mod:`.exits`.
"""

from __future__ import annotations

import sys

from rich.markup import escape

from . import demo, doctor, events_cmds, serve, store_cmds
from .app import app, err, misplaced_global_option, state
from .exits import (
    EXIT_ABORTED,
    EXIT_ERROR,
    EXIT_FSCK_PROBLEMS,
    EXIT_LOCKED,
    EXIT_NO_STORE,
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
    "EXIT_NO_STORE",
    "EXIT_OK",
    "EXIT_TABLE",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "ExitCode",
    "app",
    "demo",
    "doctor",
    "events_cmds",
    "exit_for",
    "main",
    "serve",
    "state",
    "store_cmds",
]


def main(argv: list[str] | None = None) -> None:
    """The entry point: run the app, and turn a known exception into one line + its code."""
    args = sys.argv[1:] if argv is None else argv
    misplaced = misplaced_global_option(args)
    if misplaced is not None:
        err.print(f"[red]usage:[/red] {escape(misplaced)}")
        sys.exit(ExitCode.USAGE)
    try:
        app(args=args, prog_name="kvoffload")
    except Exception as exc:
        mapped = exit_for(exc)
        if mapped is None:
            raise
        code, label = mapped
        err.print(f"[red]{escape(label)}:[/red] {escape(str(exc))}")
        sys.exit(code)
