"""The CLI's one exception → exit-code table, and the one line a failure prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from kvoffload import errors
from kvoffload.cli.app import hoist_global_options
from kvoffload.cli.exits import (
    EXIT_MEANINGS,
    EXIT_TABLE,
    ExitCode,
    exit_code_help,
    exit_code_markdown,
    exit_for,
)
from tests.helpers.cli import run_cli as run
from tests.helpers.paths import REPO


def test_the_table_covers_every_documented_code() -> None:
    documented = {int(m) for m in re.findall(r"^  (\d+)  ", exit_code_help(), re.M)}
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


def test_global_options_work_after_the_command_too(tmp_path: Path) -> None:
    """`kvoffload serve --config FILE` is what an operator (and a systemd unit) writes."""
    cfg = tmp_path / "c.toml"
    cfg.write_text("[store]\ncapacity = '1GiB'\n")
    before = run(tmp_path, "--dev", "--config", str(cfg), "config", "show", "--json")
    after = run(tmp_path, "config", "show", "--json", "--config", str(cfg), "--dev")
    assert before.returncode == after.returncode == 0, after.stderr
    assert after.stdout == before.stdout
    assert '"dev default"' in after.stdout and str(cfg) in after.stdout
    r = run(tmp_path, "serve", "--config")
    assert r.returncode == ExitCode.USAGE
    assert r.stderr.strip().splitlines() == ["usage: --config needs a value"]


def test_hoisting_reads_the_commands_own_options() -> None:
    assert hoist_global_options(["serve", "--config", "/c"]) == ["--config", "/c", "serve"]
    # Given before and after: the later one wins, as click has it for a repeated option.
    assert hoist_global_options(["--root", "/x", "ls", "--root", "/y", "--json"]) == [
        "--root", "/x", "--root", "/y", "ls", "--json",
    ]  # fmt: skip
    # A command option's value is never taken for a global option; nothing after --.
    assert hoist_global_options(["ls", "--tenant", "--dev"]) == ["ls", "--tenant", "--dev"]
    assert hoist_global_options(["ls", "--", "--dev"]) == ["ls", "--", "--dev"]
    assert hoist_global_options(["systemd", "print", "service", "-v", "--config=c"]) == [
        "-v", "--config=c", "systemd", "print", "service",
    ]  # fmt: skip
    assert hoist_global_options(["no-such", "--dev"]) == ["no-such", "--dev"]


def test_make_serve_puts_dev_before_the_command() -> None:
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile.split("\nserve:", 1)[1].split("\n\n", 1)[0]
    assert "kvoffload --dev serve" in recipe


def test_the_exit_code_table_is_written_once_and_help_and_readme_come_from_it() -> None:
    """Every code has its meaning in EXIT_MEANINGS; ``--help`` prints that table
    and the README's rows are exactly the ones made from it."""
    assert set(EXIT_MEANINGS) == set(ExitCode)
    readme = (REPO / "README.md").read_text()
    start = "<!-- exit-codes: made from kvoffload.cli.exits.EXIT_MEANINGS -->\n"
    block = readme.split(start, 1)[1].split("<!-- /exit-codes -->", 1)[0]
    assert block == exit_code_markdown(), "README's exit codes: paste\n" + exit_code_markdown()
    help_text = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "200"},
    ).stdout
    for code, meaning in EXIT_MEANINGS.items():
        assert f"{int(code)}  {meaning}" in " ".join(help_text.split("\n")), meaning
    assert exit_code_help().splitlines()[0] == "Exit codes:"
