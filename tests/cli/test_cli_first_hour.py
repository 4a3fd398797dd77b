"""A new user's and an operator's first hour (issue 10): every bad input is one
clear line with its documented exit code, and the CLI's output is for people.

Everything runs the real CLI as a subprocess on a real store.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.cli.exits import ExitCode
from kvoffload.layouts import v1
from kvoffload.store import Store, StoreConfig
from kvoffload.store.keys.keyring import Kek
from tests.helpers.cli import one_line
from tests.helpers.cli import run_cli as run
from tests.helpers.paths import REPO

NS = bytes(range(32))


@pytest.fixture
def dev_store(tmp_path: Path) -> Path:
    r = run(tmp_path, "--dev", "init", "--json")
    assert r.returncode == 0, r.stderr
    cfg = StoreConfig(root=tmp_path / ".kvoffload/store", index_dir=tmp_path / ".kvoffload/index")
    s = Store(cfg, Kek.from_file(tmp_path / ".kvoffload/dev-kek"))
    for i in range(3):
        s.put("acme", NS, bytes([i]) * 32, [os.urandom(5000)])
    s.put("beta", NS, bytes([9]) * 32, [os.urandom(5000)], encrypt=False)
    s.close()
    return tmp_path


# -- item 2: brackets are printed, never eaten as markup ---------------------------------


def test_square_brackets_survive_in_output(tmp_path: Path, kek_file: Path) -> None:
    root = tmp_path / "x[demo]" / "store"
    r = run(tmp_path, "--root", str(root), "--kek-file", str(kek_file), "init")
    assert r.returncode == 0, r.stderr
    assert f"store_root: {root}" in r.stdout


def test_config_errors_keep_their_brackets(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[metrics]\nport = 99999\n")
    line = one_line(run(tmp_path, "--config", str(cfg), "--dev", "inspect"), 1, "config error")
    assert "[metrics] port" in line and "99999" in line


def test_the_demo_install_hint_names_this_interpreter() -> None:
    from kvoffload.integrations import demo_model

    assert "'kvoffload[demo]'" in demo_model.TRANSFORMERS_MISSING
    assert ".venv/bin/pip" not in demo_model.TRANSFORMERS_MISSING
    assert sys.executable in demo_model.TRANSFORMERS_MISSING


# -- item 3: no tracebacks, usage errors are exit 2 ------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ("ls", "--older-than", "7x"),
        ("purge", "--older-than", "7x", "--yes"),
        ("purge", "--older-than", "7x"),  # refused before any prompt
        ("purge", "--tenant", "../etc", "--yes"),
        ("purge", "--tenant", "a b"),
        ("ls", "--tenant", "a/b"),
        ("ls", "--limit", "-1"),
        ("serve", "--metrics-port", "99999"),
        ("serve", "--metrics-port", "-1"),
    ],
)
def test_bad_values_are_usage_errors(dev_store: Path, args: tuple[str, ...]) -> None:
    r = run(dev_store, "--dev", *args)
    assert r.returncode == ExitCode.USAGE, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert "Purge" not in r.stderr  # no confirmation prompt was shown
    assert "serving" not in r.stderr


def test_metrics_port_in_use_is_one_line(dev_store: Path) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        port = busy.getsockname()[1]
        r = run(dev_store, "--dev", "serve", "--metrics-port", str(port))
    finally:
        busy.close()
    line = one_line(_without_dev_banner(r), 1, "cannot serve")
    assert f"127.0.0.1:{port}" in line
    assert not (dev_store / ".kvoffload/kvoffload.sock").exists()


def _without_dev_banner(r: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    """serve's start-up lines (dev mode, KEK banner, I/O backend) set aside."""
    keep = [
        ln
        for ln in r.stderr.splitlines()
        if ln.strip()
        and not set(ln.strip()) <= {"!"}
        and not ln.startswith(("DEVELOPMENT", "DEVELOPMENT KEK"))
        and " INFO " not in ln
        and "WARNING kvoffload.store.keys.keyring" not in ln
    ]
    return subprocess.CompletedProcess(r.args, r.returncode, r.stdout, "\n".join(keep) + "\n")


def _serve_on(cwd: Path, sock: Path) -> subprocess.CompletedProcess[str]:
    cfg = cwd / "sock.toml"
    cfg.write_text(f"[server]\nsocket = {json.dumps(str(sock))}\n")
    return run(cwd, "--dev", "--config", str(cfg), "serve")


def test_socket_path_whose_parent_is_a_file(dev_store: Path) -> None:
    (dev_store / "afile").write_text("x")
    r = _without_dev_banner(_serve_on(dev_store, dev_store / "afile" / "s.sock"))
    line = one_line(r, 1, "cannot serve")
    assert "not a directory" in line
    assert "serving" not in r.stderr


def test_socket_path_that_is_a_regular_file(dev_store: Path) -> None:
    (dev_store / "plain").write_text("keep me")
    r = _without_dev_banner(_serve_on(dev_store, dev_store / "plain"))
    line = one_line(r, 1, "cannot serve")
    assert "not a socket" in line
    assert (dev_store / "plain").read_text() == "keep me"


def test_socket_path_too_long(dev_store: Path) -> None:
    long = dev_store / ("d" * 120) / "s.sock"
    r = _without_dev_banner(_serve_on(dev_store, long))
    line = one_line(r, 1, "cannot serve")
    assert "108" in line


def test_socket_served_by_another_sidecar(dev_store: Path) -> None:
    sock_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    sock = sock_dir / f"kvo-t{os.getpid()}.sock"
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(sock))
    live.listen(1)
    try:
        r = _without_dev_banner(_serve_on(dev_store, sock))
        line = one_line(r, 1, "cannot serve")
        assert "another sidecar is already serving" in line
        assert sock.exists()  # never stolen
    finally:
        live.close()
        sock.unlink(missing_ok=True)


# -- item 4: a prompt without an answer is exit 6 -------------------------------------------


def test_purge_prompt_without_stdin_is_exit_6(dev_store: Path) -> None:
    r = run(dev_store, "--dev", "purge", "--tenant", "acme")  # stdin: /dev/null
    line = one_line(r, ExitCode.ABORTED, "aborted")
    assert "--yes" in line
    info = json.loads(run(dev_store, "--dev", "inspect", "--json").stdout)
    assert info["tenants"]["acme"]["chunks"] == 3  # nothing purged


# -- item 6: --limit ----------------------------------------------------------------------


def test_ls_limit(dev_store: Path) -> None:
    def rows(*extra: str) -> list[dict[str, object]]:
        r = run(dev_store, "--dev", "ls", "--json", *extra)
        assert r.returncode == 0, r.stderr
        out: list[dict[str, object]] = json.loads(r.stdout)
        return out

    assert len(rows("--limit", "0")) == 4  # 0 = all
    assert len(rows("--limit", "2")) == 2
    assert len(rows("--limit", "1")) == 1
    assert len(rows()) == 4


# -- friction ------------------------------------------------------------------------------


def test_purge_of_an_unknown_tenant_is_exit_8(dev_store: Path) -> None:
    line = one_line(
        run(dev_store, "--dev", "purge", "--tenant", "acmee", "--yes"),
        ExitCode.NOTHING,
        "nothing to do",
    )
    assert "tenant acmee has no keys or data" in line


def test_fsck_repair_says_what_it_did(dev_store: Path) -> None:
    obj = dev_store / ".kvoffload/store" / v1.object_relpath("acme", bytes([1]) * 32)
    obj.unlink()
    r = run(dev_store, "--dev", "fsck", "--repair")
    assert r.returncode == 0, r.stderr
    assert "index records without a file: 1 (dropped from the index)" in r.stdout
    assert "dropped 1 index records" in r.stdout
    assert "repaired: True" not in r.stdout
    r = run(dev_store, "--dev", "fsck", "--repair", "--json")
    assert json.loads(r.stdout)["summary"].startswith("removed 0 files, dropped 0 index records")


def test_unknown_environment_variable_is_refused_by_every_command(dev_store: Path) -> None:
    r = run(dev_store, "--dev", "inspect", env={"KVOFFLOAD_STORE_ROOOT": "/x"})
    line = one_line(r, 1, "config error")
    assert "KVOFFLOAD_STORE_ROOOT" in line and "KVOFFLOAD_STORE_ROOT" in line


def test_init_on_a_file(tmp_path: Path, kek_file: Path) -> None:
    (tmp_path / "f").write_text("x")
    r = run(tmp_path, "--root", str(tmp_path / "f"), "--kek-file", str(kek_file), "init")
    line = one_line(r, 1, "store")
    assert "is a file, not a directory" in line


def test_lost_dev_kek_says_how_to_recover(dev_store: Path) -> None:
    (dev_store / ".kvoffload/dev-kek").unlink()
    r = run(dev_store, "--dev", "inspect")
    line = one_line(r, 1, "KEK")
    assert "is gone" in line and "delete" in line and ".kvoffload" in line
    assert not (dev_store / ".kvoffload/dev-kek").exists()  # no new KEK to confuse things


def test_help_has_an_exit_code_table_and_says_where_global_options_go(tmp_path: Path) -> None:
    r = run(tmp_path, "--help")
    assert r.returncode == 0
    text = r.stdout
    assert "Exit codes:" in text
    table = text.split("Exit codes:", 1)[1].strip().splitlines()
    assert [ln.split()[0] for ln in table[:9]] == [str(i) for i in range(9)]  # single-spaced
    assert "before or after the command" in " ".join(text.split())
    assert "-v, --verbose" in text and "Log at INFO" in text


def test_version(tmp_path: Path) -> None:
    from kvoffload import __version__

    r = run(tmp_path, "--version")
    assert r.returncode == 0 and r.stdout.strip() == f"kvoffload {__version__}"


def test_dev_kek_reminder_is_one_line_outside_serve(dev_store: Path) -> None:
    r = run(dev_store, "--dev", "inspect")
    assert r.returncode == 0
    assert r.stderr.count("development KEK") == 1
    assert "!!!!" not in r.stderr


def test_audit_record_is_one_json_line_at_info(dev_store: Path) -> None:
    r = run(dev_store, "--dev", "-v", "purge", "--tenant", "beta", "--yes")
    assert r.returncode == 0, r.stderr
    audit = [ln for ln in r.stderr.splitlines() if "audit: " in ln]
    assert audit and all(ln.startswith("INFO kvoffload.store: audit: {") for ln in audit)
    for ln in audit:
        json.loads(ln.split("audit: ", 1)[1])
    quiet = run(dev_store, "--dev", "purge", "--tenant", "acme", "--yes")
    assert "audit: " not in quiet.stderr  # INFO, not WARNING


# -- config show / check, policy check ---------------------------------------------------------


def test_config_show_names_each_source(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[store]\ncapacity = '1GiB'\n")
    r = run(
        tmp_path,
        "--dev", "--config", str(cfg), "--root", str(tmp_path / "r"),
        "config", "show", "--json",
        env={"KVOFFLOAD_METRICS_PORT": "9400"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = {row["setting"]: row for row in json.loads(r.stdout)}
    assert rows["[store] capacity"] == {
        "setting": "[store] capacity",
        "value": 1 << 30,
        "source": str(cfg),
    }
    assert rows["[metrics] port"]["source"] == "$KVOFFLOAD_METRICS_PORT"
    assert rows["[metrics] port"]["value"] == 9400
    assert rows["[store] root"]["source"] == "--root"
    assert rows["[server] workers"]["source"] == "dev default"


def test_config_check(tmp_path: Path) -> None:
    policy = tmp_path / "p.toml"
    policy.write_text("version = 1\n[[grants]]\nuid = 0\ntenants = ['*']\nadmin = true\n")
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[security]\npolicy = {json.dumps(str(policy))}\n")
    r = run(tmp_path, "--dev", "--config", str(cfg), "config", "check")
    assert r.returncode == 0, r.stderr
    assert f"policy {policy}: ok (1 grants" in r.stdout
    policy.write_text("version = 1\n[[grants]]\nuid = 'x'\n")
    line = one_line(run(tmp_path, "--dev", "--config", str(cfg), "config", "check"), 1, "policy")
    assert f"{policy}:3:" in line


def test_policy_check_prints_who_may_do_what(tmp_path: Path) -> None:
    example = REPO / "systemd/policy.example.toml"
    r = run(tmp_path, "policy", "check", str(example), "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    by = {g["principal"]: g for g in data["grants"]}
    assert by["uid 1001"]["tenants"] == ["acme", "public-demo"] and not by["uid 1001"]["admin"]
    assert by["uid 0"]["tenants"] == "*" and by["uid 0"]["admin"]
    assert data["tenants"]["public-demo"]["encryption"] == "none"
    human = run(tmp_path, "policy", "check", str(example))
    assert "every tenant" in human.stdout and "acme, public-demo" in human.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text("version = 1\n[[grants]]\nuid = 1\ntenants = ['ok', '../x']\n")
    line = one_line(run(tmp_path, "policy", "check", str(bad)), 1, "policy")
    assert str(bad) in line and "Traceback" not in line
