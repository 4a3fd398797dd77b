"""What every benchmark prints the same way: its consoles, the machine table, a cell
that may be empty, and the warning for cold rows that were not cold."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from benchlib.results import Result


def begin(d: Path | None, width: int) -> tuple[Console, Console, Path | None]:
    """A benchmark's start: kvoffload's log quiet (a store logs each tenant creation as
    an audit warning; the progress lines stay readable), the console of the tables
    (``width`` columns where it is not a terminal, so that piped tables keep theirs),
    the console of the progress lines (stderr), and ``--dir`` (default: the working
    directory) resolved, or None after one line saying it is not a directory."""
    logging.getLogger("kvoffload").setLevel(logging.ERROR)
    console = Console()
    if not console.is_terminal:
        console = Console(width=width)
    err = Console(stderr=True)
    parent = (d or Path.cwd()).resolve()
    if not parent.is_dir():
        err.print(f"--dir {parent}: not a directory")
        return console, err, None
    return console, err, parent


def cell(x: float | None, fmt: str = "{:.3f}") -> str:
    """``x`` in ``fmt``, or "-" where there is none."""
    return "-" if x is None else fmt.format(x)


def machine_table(
    facts: Mapping[str, str], more: Iterable[tuple[str, str]] = (), title: str = "machine"
) -> Table:
    """The facts of the run, one row each, then ``more`` rows (the shapes, say)."""
    t = Table(title=title, show_header=False)
    t.add_column("fact", style="bold")
    t.add_column("value")
    for k, v in (*facts.items(), *more):
        t.add_row(escape(k), escape(v))
    return t


def warn_not_cold(console: Console, results: Iterable[Result]) -> None:
    """One line where cold rows found their files still cached after DONTNEED."""
    bad = [r for r in results if "cold" in r.name and r.cached is not None and r.cached > 0.05]
    if bad:
        console.print(
            f"[bold red]warning[/bold red]: {len(bad)} cold rows had >5% of their pages cached "
            "after DONTNEED (tmpfs or a file system that ignores fadvise?): they are not cold."
        )
