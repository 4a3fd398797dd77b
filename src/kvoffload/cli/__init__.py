"""The ``kvoffload`` command line (typer + rich).

The store commands (inspect, ls, purge, fsck) go through the running
sidecar's admin verbs when one serves the configured socket, and open the
store in-process only when none does (:mod:`.admin`).

The exit codes, with what each means, are the table of :mod:`.exits`
(``kvoffload --help`` prints it).

One module per command group: :mod:`.app` (the typer app, global options,
config and store helpers), :mod:`.store_cmds` (init, inspect, ls, purge, fsck,
keys), :mod:`.serve` (serve, stats), :mod:`.doctor`, :mod:`.demo`; the exit
codes and the one exception → exit-code table are :mod:`.exits`.
"""

from __future__ import annotations

import logging
import signal
import sys
from types import FrameType

from . import (
    audit_cmd,
    config_cmds,
    contract_cmds,
    demo,
    doctor,
    events_cmds,
    router,
    serve,
    store_cmds,
    systemd_cmd,
)
from .app import GLOBAL_VALUED, app, err, fail_line, hoist_global_options, state
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
    _Interrupted,
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
    "router",
    "serve",
    "state",
    "store_cmds",
    "systemd_cmd",
]


class _Sigint:
    """Notes a Ctrl-C before Python's own handler raises KeyboardInterrupt (which typer
    turns into a silent exit 130), so that :func:`main` can say what stopped."""

    def __init__(self) -> None:
        self.seen = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.seen = state.interrupted = True
        signal.default_int_handler(signum, frame)

    def install(self) -> None:
        # Only over Python's default: an ignored SIGINT (a job started with `&` by a
        # shell without job control) stays ignored.
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, self)


def _fail(exc: BaseException) -> None:
    """One line and the exit code for a known exception; re-raise an unknown one."""
    mapped = exit_for(exc)
    if mapped is None:
        raise exc
    code, label = mapped
    if state.log_json:  # serve --log-format json: the last line is JSON too
        log = logging.getLogger("kvoffload.cli")
        log.error("%s: %s", label, exc, extra={"exit_code": int(code)})
    else:
        err.print(fail_line(label, str(exc)))
    sys.exit(code)


def _command(args: list[str]) -> str:
    """``kvoffload <command>`` as typed, for messages (global options skipped)."""
    words, skip = [], False
    for tok in args:
        if skip:
            skip = False
        elif tok in GLOBAL_VALUED:
            skip = True
        elif not tok.startswith("-"):
            words.append(tok)
            if len(words) == 2 or tok not in app_groups():
                break
    return " ".join(["kvoffload", *words])


def app_groups() -> set[str]:
    """The commands that have subcommands (``events tail``, ``config show``, ...)."""
    return {g.name for g in app.registered_groups if g.name}


def main(argv: list[str] | None = None) -> None:
    """The entry point: run the app, and turn a known exception into one line + its code."""
    sigint = _Sigint()
    sigint.install()
    args: list[str] = []
    try:
        args = hoist_global_options(sys.argv[1:] if argv is None else argv)
        app(args=args, prog_name="kvoffload")
    except SystemExit as exc:
        if sigint.seen and exc.code == ExitCode.INTERRUPTED:
            _fail(_Interrupted(f"{_command(args)} stopped at Ctrl-C"))
        raise
    except Exception as exc:
        _fail(exc)
