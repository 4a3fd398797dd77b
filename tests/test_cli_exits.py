"""The CLI's one exception → exit-code table, and the one line a failure prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import kvoffload.cli as cli
from kvoffload import errors
from kvoffload.cli.app import misplaced_global_option
from kvoffload.cli.exits import EXIT_TABLE, ExitCode, exit_for


def run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")},
        timeout=120,
    )


def test_the_table_covers_every_documented_code() -> None:
    assert cli.__doc__ is not None
    documented = {int(m) for m in re.findall(r"^  (\d+)  ", cli.__doc__, re.M)}
    assert documented == {int(c) for c in ExitCode}
    # USAGE also comes from click's own option parsing; every other failure code
    # is reached through the table.
    assert {code for _, code, _ in EXIT_TABLE} == set(ExitCode) - {ExitCode.OK}


def test_rows_are_ordered_subclasses_first() -> None:
    for i, (cls, _, _) in enumerate(EXIT_TABLE):
        for earlier, _, _ in EXIT_TABLE[:i]:
            assert not issubclass(cls, earlier), f"{cls.__name__} is shadowed by {earlier}"


def test_library_errors_map_to_their_codes() -> None:
    assert exit_for(errors.ConfigError("x")) == (ExitCode.ERROR, "config error")
    assert exit_for(errors.StoreLocked("x")) == (ExitCode.LOCKED, "locked")
    assert exit_for(errors.SidecarStartError("x")) == (ExitCode.UNREACHABLE, "sidecar")
    assert exit_for(errors.TransportClosed("x")) == (ExitCode.UNREACHABLE, "unreachable")
    assert exit_for(errors.StoreFull(1, 2, 3)) == (ExitCode.ERROR, "store")
    assert exit_for(ValueError("a bug")) is None  # not ours: keeps its traceback


def test_config_error_is_one_line_exit_1_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[store]\nroot = '/x'\nbogus = 1\n")
    r = run(tmp_path, "--config", str(bad), "inspect")
    assert r.returncode == ExitCode.ERROR
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("config error: ") and "[store] bogus" in lines[0]


def test_global_option_after_the_command_is_one_line_exit_2(tmp_path: Path) -> None:
    r = run(tmp_path, "serve", "--dev")
    assert r.returncode == ExitCode.USAGE
    assert r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "usage: --dev is a global option: put --dev before the command, "
        "e.g. `kvoffload --dev serve`"
    ]
    assert misplaced_global_option(["--root", "/x", "ls", "--root", "/y"]) is not None
    assert misplaced_global_option(["--root", "/x", "ls", "--json"]) is None


def test_make_serve_puts_dev_before_the_command() -> None:
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    recipe = makefile.split("\nserve:", 1)[1].split("\n\n", 1)[0]
    assert "kvoffload --dev serve" in recipe
