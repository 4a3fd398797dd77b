"""``kvoffload systemd``: the shipped units and examples, from wherever kvoffload is installed.

A wheel installs ``systemd/`` under ``<prefix>/share/doc/kvoffload/systemd``
(pyproject's data-files); a source checkout has it at the top of the repo.
``print service`` fills in what depends on the install: the path of this
``kvoffload`` executable (``ExecStart=``) and of the README next to the units
(``Documentation=``), so that ``kvoffload systemd print service >
/etc/systemd/system/kvoffload.service`` is a working unit.
"""

from __future__ import annotations

import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Annotated

import typer

from .app import app, out
from .exits import _CliUsageError

systemd_app = typer.Typer(help="The shipped systemd units and examples.", no_args_is_help=True)
app.add_typer(systemd_app, name="systemd")

#: name on the command line → file in systemd/
FILES = {
    "service": "kvoffload.service",
    "socket": "kvoffload.socket",
    "sysusers": "kvoffload.sysusers.conf",
    "tmpfiles": "kvoffload.tmpfiles.conf",
    "config": "config.example.toml",
    "policy": "policy.example.toml",
    "readme": "README.md",
}
_SHIPPED_EXE = "/usr/bin/kvoffload"
_SHIPPED_DOC = "file:///usr/share/doc/kvoffload/systemd/README.md"


def candidates() -> list[Path]:
    """Where the units may be, most specific first."""
    here = Path(__file__).resolve()
    dirs = [
        Path(sysconfig.get_path("data")),
        Path(sys.prefix),
        here.parents[2],  # pip install --target DIR: DIR/share/doc/… beside DIR/kvoffload
        Path("/usr"),
        Path("/usr/local"),
    ]
    found = list(dict.fromkeys(d / "share/doc/kvoffload/systemd" for d in dirs))
    # A source checkout (editable install): src/kvoffload/cli/ → the repo's systemd/.
    found.append(here.parents[3] / "systemd")
    return found


def units_dir() -> Path:
    for d in candidates():
        if (d / FILES["service"]).is_file():
            return d
    raise FileNotFoundError(
        "the systemd units are not installed here; looked in "
        + ", ".join(str(d) for d in candidates())
    )


def executable() -> str:
    """This installation's ``kvoffload`` script (the units' ExecStart)."""
    beside = Path(sys.executable).parent / "kvoffload"
    if beside.is_file():
        return str(beside)
    return shutil.which("kvoffload") or _SHIPPED_EXE


def render(name: str) -> str:
    if name not in FILES:
        raise _CliUsageError(f"unknown file {name!r}: one of {', '.join(FILES)}")
    d = units_dir()
    text = (d / FILES[name]).read_text(encoding="utf-8")
    if name in ("service", "socket"):
        text = text.replace(_SHIPPED_DOC, (d / FILES["readme"]).as_uri())
    if name == "service":
        text = text.replace(_SHIPPED_EXE + " ", executable() + " ")
    return text


@systemd_app.command("print")
def print_(
    name: Annotated[str, typer.Argument(metavar="NAME", help=" | ".join(FILES))],
) -> None:
    """Print a unit or example, e.g. `kvoffload systemd print service > kvoffload.service`."""
    sys.stdout.write(render(name))


@systemd_app.command("where")
def where() -> None:
    """The directory the units and examples are read from."""
    out.print(str(units_dir()))
