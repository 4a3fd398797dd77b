"""A newcomer's first commands (issue 29, items 13-16): the demo in an install without
torch, what `events tail` says when nothing shows, and the small things a careful
operator trips on. Everything runs the real CLI as a subprocess, on real stores and
real sidecar processes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvoffload.cli.exits import ExitCode
from kvoffload.testing import cli_argv
from tests.helpers.cli import one_line
from tests.helpers.cli import run_cli as run
from tests.helpers.paths import REPO
from tests.sidecar_proc import Procs, Sidecar, clean_env

# -- item 13: the demo without torch, and its options checked first ----------------------------

#: An environment without the demo's packages, as the README's operator install is: the
#: modules are hidden from this one process (a stand-in for a venv built without them).
HIDE_DEMO_DEPS = "import sys; sys.modules.update(torch=None, transformers=None)"
#: Says, as the process ends, whether anything imported torch.
TORCH_MARKER = (
    "import atexit, sys\n"
    "atexit.register(lambda: print('marker: torch imported', 'torch' in sys.modules, "
    "file=sys.stderr))"
)


def test_demo_without_torch_says_what_to_install_in_one_line(tmp_path: Path) -> None:
    r = run(tmp_path, "demo", prelude=HIDE_DEMO_DEPS)
    line = one_line(r, ExitCode.ERROR, "demo failed")
    assert "torch and transformers" in line
    assert f"{sys.executable} -m pip install 'kvoffload[demo]'" in line
    assert "make demo" in line
    assert not (tmp_path / ".kvoffload").exists()  # no sidecar was started for nothing


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--chunk-tokens", "0"), "--chunk-tokens must be at least 1, got 0"),
        (("--chunk-tokens", "24"), "--chunk-tokens must be a positive multiple of 16"),
        (("--layers", "-1"), "--layers must be at least 1, got -1"),
        (("--prompt-tokens", "100"), "--prompt-tokens 100 is shorter than one chunk"),
        (("--hidden", "100", "--heads", "3"), "not a multiple of 3 heads"),
    ],
)
def test_demo_options_are_checked_before_torch_is_imported(
    tmp_path: Path, args: tuple[str, ...], says: str
) -> None:
    r = run(tmp_path, "demo", *args, prelude=TORCH_MARKER)
    assert says in one_line(r, ExitCode.USAGE, "usage")
    assert "marker: torch imported False" in r.stderr
    # ... and without torch at all, the same usage error, not the missing-package line.
    hidden = run(tmp_path, "demo", *args, prelude=HIDE_DEMO_DEPS)
    assert says in one_line(hidden, ExitCode.USAGE, "usage")


def test_the_demo_settings_need_no_torch() -> None:
    code = (
        f"{HIDE_DEMO_DEPS}\n"
        "from kvoffload.integrations.demo_config import DemoConfig, ModelShape\n"
        "s = ModelShape(num_layers=2, hidden_size=128)\n"
        "print(DemoConfig(shape=s, prompt_tokens=512).shape.kv_bytes_per_token())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) == 2 * 2 * 2 * 32 * 4  # K and V, 2 layers, 2 KV heads x 32, fp32


# -- item 16: every option says what it is ------------------------------------------------------


def _params() -> list[tuple[str, Any]]:
    """(command path, parameter) for every command of the CLI, groups included."""
    import typer.main

    from kvoffload.cli import app

    found: list[tuple[str, Any]] = []

    def walk(cmd: Any, path: str) -> None:
        for p in cmd.params:
            if p.name != "help":
                found.append((path, p))
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}")

    walk(typer.main.get_command(app), "kvoffload")
    return found


def test_every_option_has_help_and_a_plain_metavar() -> None:
    metavar = re.compile(r"^([A-Z][A-Z0-9_]*|[a-z]+(\|[a-z]+)+)$")
    missing, odd = [], []
    params = _params()
    for path, p in params:
        where = f"{path} {'/'.join(p.opts)}"
        if p.param_type_name == "option":
            if not p.help:
                missing.append(where)
            if not p.is_flag and not (p.metavar and metavar.match(p.metavar)):
                odd.append((where, p.metavar))
        elif not (p.metavar and metavar.match(p.metavar)):
            odd.append((where, p.metavar))
    assert missing == [], missing
    assert odd == [], odd
    assert len(params) > 50  # the walk saw the whole CLI


def test_help_shows_no_typer_type_names(tmp_path: Path) -> None:
    for args in (("purge",), ("ls",), ("audit",), ("invalidate",), ("tokenizer-hash",)):
        r = run(tmp_path, *args, "--help")
        assert r.returncode == 0, r.stderr
        for bad in ("<str>", "<list[str]>", "{path}", "<int range>", "<int>"):
            assert bad not in r.stdout, (args, bad, r.stdout)


def _commands() -> list[str]:
    """Every command a user can run, with its group: ``inspect``, ``events tail``, ..."""
    import typer.main

    from kvoffload.cli import app

    found: list[str] = []

    def walk(cmd: Any, path: list[str]) -> None:
        subs = getattr(cmd, "commands", None)
        if not subs:
            found.append(" ".join(path))
        for name, sub in (subs or {}).items():
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return found


def test_the_readme_synopsis_lists_every_command() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    synopsis = readme.split("## CLI\n\n```\n", 1)[1].split("```", 1)[0]
    commands = _commands()
    assert {"serve", "events tail", "systemd where", "drop-cache", "audit"} <= set(commands)
    missing = [c for c in commands if not re.search(rf"^  {re.escape(c)}( |$)", synopsis, re.M)]
    assert missing == []
    # What the synopsis says of the demo is what it runs: three workers (A, B, C).
    assert "three worker processes" in synopsis and "two worker" not in readme
    # Paths the README names exist.
    root = REPO
    assert (root / "tests/e2e/standin").is_dir() and "standin.py" not in readme
    # inspect counts a tenant's namespaces; `ls --namespaces` lists them.
    vllm = (root / "src/kvoffload/integrations/vllm/README.md").read_text(encoding="utf-8")
    assert "`kvoffload inspect` lists" not in vllm and "ls --namespaces --tenant" in vllm


# -- item 15: events tail says why nothing shows -------------------------------------------------


def _serve(procs: Procs, workdir: Path, *args: str) -> Sidecar:
    sidecar = procs.sidecar(
        workdir, workdir / ".kvoffload/kvoffload.sock", cli_argv("--dev", "serve", *args)
    )
    sidecar.start().wait_ready()
    return sidecar


def _save_without_hashes(sock: Path, n: int) -> None:
    """What the demo and the README's client do: a save that carries no engine block hashes."""
    from kvoffload.client import SidecarClient

    keys = [bytes([i]) * 32 for i in range(n)]
    with SidecarClient(sock, "demo", staging_bytes=1 << 20) as c:
        assert c.save(bytes(32), [(k, [b"x" * 4096]) for k in keys]) == [True] * n


def test_events_tail_says_the_feed_is_off_and_how_to_turn_it_on(
    procs: Procs, workdir: Path
) -> None:
    _serve(procs, workdir)
    line = one_line(run(workdir, "--dev", "events", "tail", "--timeout", "1"), 7, "unreachable")
    assert "publishes no KV events" in line
    assert "`kvoffload --dev serve --events`" in line and "KVOFFLOAD_EVENTS_ENABLED=1" in line
    stats = run(workdir, "--dev", "stats")
    assert "events: off (`kvoffload serve --events`" in stats.stdout


def test_serve_events_and_a_tail_that_explains_saves_without_hashes(
    procs: Procs, workdir: Path
) -> None:
    sidecar = _serve(procs, workdir, "--events")
    tail = subprocess.Popen(
        cli_argv("--dev", "events", "tail", "--timeout", "60"),
        cwd=workdir,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert tail.stderr is not None
        first = tail.stderr.readline()  # it is following: its counters are taken
        assert first.startswith("following the KV events on ipc://"), first
        _save_without_hashes(sidecar.socket_path, 3)
        note = tail.stderr.readline()  # said while the tail waits, not only at its end
        assert note.startswith("note: 3 chunk(s) stored since this tail started"), note
        assert "no engine block hashes" in note and "events-v1 §7" in note
        tail.send_signal(signal.SIGINT)
        out, rest = tail.communicate(timeout=60)
    finally:
        if tail.poll() is None:
            tail.kill()
            tail.communicate()  # closes its pipes: no ResourceWarning in a later test
    # Ctrl-C: one line saying what stopped, exit 130 (item 16).
    assert tail.returncode == ExitCode.INTERRUPTED == 130
    assert rest.strip().splitlines() == ["interrupted: kvoffload events tail stopped at Ctrl-C"]
    assert out == ""  # nothing was announced
    data = json.loads(run(workdir, "--dev", "stats", "--json").stdout)["events"]
    assert data["enabled"] is True and data["endpoint"].startswith("ipc://")
    assert (data["stored_without_hashes"], data["stored_announced"]) == (3, 0)
    human = run(workdir, "--dev", "stats").stdout
    assert "events: on ipc://" in human and "3 without engine block hashes" in human


def test_a_ctrl_c_dropped_in_a_finalizer_still_stops_the_tail(procs: Procs, workdir: Path) -> None:
    """Python runs a signal's handler at the next bytecode, which may be inside a
    ``__del__`` (the tail's once-a-second stats call makes and drops sockets): the
    KeyboardInterrupt raised there is printed as "Exception ignored" and dropped.
    Here the Ctrl-C is sent from inside a finalizer, so it lands there every time;
    the tail must still stop at once with its one line and 130, not follow on to
    its --timeout and exit 0."""
    _serve(procs, workdir, "--events")
    prelude = (
        "import gc, os, signal, kvoffload.cli.events_cmds as ev\n"
        "class _Drop:\n"
        "    def __del__(self):\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "        for _ in range(1000): pass  # the handler runs here, inside __del__\n"
        "_check = ev._SilenceHints.check\n"
        "def check(self, *, now=False):\n"
        "    _check(self, now=now)\n"
        "    if not getattr(ev, '_sent', False):\n"
        "        ev._sent = True\n"
        "        _Drop()\n"
        "ev._SilenceHints.check = check\n"
        "from kvoffload.cli import main\n"
        "main()\n"
    )
    tail = subprocess.run(
        [sys.executable, "-c", prelude, "--dev", "events", "tail", "--timeout", "30"],
        cwd=workdir,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Exception ignored" in tail.stderr  # the KeyboardInterrupt was dropped...
    assert tail.returncode == ExitCode.INTERRUPTED == 130, tail.stderr  # ...and still stopped it
    assert tail.stderr.strip().splitlines()[-1] == (
        "interrupted: kvoffload events tail stopped at Ctrl-C"
    )


# -- item 16: the small things -------------------------------------------------------------------


def _without_dac_override() -> None:
    """preexec_fn: the child runs as root without CAP_DAC_OVERRIDE/READ_SEARCH, so file
    modes bind it as they bind any user (a mode-000 file is unreadable). Root only."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP: gone after exec
            raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP")


def run_bound_by_modes(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``kvoffload ARGS`` as a process that file modes apply to (see above)."""
    return subprocess.run(
        cli_argv(*args),
        cwd=cwd,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env=clean_env(),
        timeout=120,
        preexec_fn=_without_dac_override if os.geteuid() == 0 else None,
    )


def test_an_unreadable_config_is_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text("[store]\ncapacity = '1GiB'\n")
    cfg.chmod(0)
    for args in (("config", "show"), ("inspect",), ("serve",)):
        r = run_bound_by_modes(tmp_path, "--dev", "--config", str(cfg), *args)
        line = one_line(r, ExitCode.ERROR, "config error")
        assert line == (
            f"config error: cannot read config {cfg}: [Errno 13] Permission denied: '{cfg}'"
        )
    policy = tmp_path / "policy.toml"
    policy.write_text("version = 1\n")
    policy.chmod(0)
    r = run_bound_by_modes(tmp_path, "policy", "check", str(policy))
    assert "Permission denied" in one_line(r, ExitCode.ERROR, "policy")


def test_the_socket_permission_error_says_to_join_the_group(procs: Procs, workdir: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the socket is given to another user and group")
    import grp

    sidecar = _serve(procs, workdir)
    os.chown(sidecar.socket_path, 65534, 65534)  # not this user's, nor its group's
    group = grp.getgrgid(65534).gr_name
    for args in (("stats",), ("inspect",), ("ls",)):
        r = run_bound_by_modes(workdir, "--dev", *args)
        line = one_line(r, ExitCode.UNREACHABLE, "unreachable")
        assert line.startswith(f"unreachable: permission denied on {sidecar.socket_path}")
        assert f"join its group {group} (`sudo usermod -aG {group} $USER`" in line, line


def test_a_failed_start_leaves_no_socket_file(tmp_path: Path) -> None:
    r = run(tmp_path, "--dev", "serve", env={"KVOFFLOAD_SERVER_SOCKET_GROUP": "no-such-group-29"})
    assert r.returncode == ExitCode.ERROR and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]  # after the development-mode banners
    assert last.startswith("config error: [server] socket_group 'no-such-group-29': no such group")
    assert not (tmp_path / ".kvoffload/kvoffload.sock").exists()


def test_config_show_spells_out_defaults_and_json_keeps_types(tmp_path: Path) -> None:
    human = run(tmp_path, "--dev", "config", "show")
    assert human.returncode == 0, human.stderr
    rows = {}
    for ln in human.stdout.splitlines():
        cells = [c.strip() for c in ln.strip("│ ").split("│")]
        if len(cells) == 3 and cells[0].startswith("["):
            rows[cells[0]] = cells[1]
    assert rows["[store] direct_read_min"] == "16MiB"
    assert rows["[store] ram_cache"].startswith("auto (")
    assert rows["[store] key_cache_ttl"] == "30s" and rows["[server] max_inflight"] == "1GiB"
    assert rows["[events] locality"] == "LOCAL" and rows["[store] shared"] == "false"
    assert rows["[events] endpoint"].startswith("ipc://")
    assert "-" not in rows.values()
    data = {
        r["setting"]: r["value"]
        for r in json.loads(run(tmp_path, "--dev", "config", "show", "--json").stdout)
    }
    assert data["[store] direct_read_min"] == 16 << 20 and data["[store] ram_cache"] == "auto"
    assert data["[server] max_inflight"] == 1 << 30 and data["[store] key_cache_ttl"] == 30.0
    assert data["[store] shared"] is False and data["[audit] keep"] == 8
    assert data["[store] capacity"] is None and data["[server] socket_group"] is None


@pytest.fixture
def dev_store(tmp_path: Path) -> Path:
    """A dev store with three chunks of tenant acme (offline)."""
    from kvoffload.store import Store, StoreConfig
    from kvoffload.store.keys.keyring import Kek

    assert run(tmp_path, "--dev", "init").returncode == 0
    cfg = StoreConfig(root=tmp_path / ".kvoffload/store", index_dir=tmp_path / ".kvoffload/index")
    s = Store(cfg, Kek.from_file(tmp_path / ".kvoffload/dev-kek"))
    for i in range(3):
        s.put("acme", bytes(range(32)), bytes([i]) * 32, [os.urandom(3 << 20)])
    s.record_audit("admin", {"verb": "probe", "tenant": None, "uid": None, "result": "ok"})
    s.close()
    return tmp_path


def test_a_second_init_says_the_store_already_exists(dev_store: Path) -> None:
    r = run(dev_store, "--dev", "init")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"already exists: the store at {dev_store}/.kvoffload/store")
    assert "nothing changed" in r.stdout
    assert json.loads(run(dev_store, "--dev", "init", "--json").stdout)["created"] is False


def test_ls_prints_sizes_as_inspect_does(dev_store: Path) -> None:
    ls = run(dev_store, "--dev", "ls")
    assert ls.returncode == 0, ls.stderr
    assert "3.0 MiB" in ls.stdout and str(3 << 20) not in ls.stdout  # as inspect prints it
    assert [
        r["bytes"] > 3 << 20 for r in json.loads(run(dev_store, "--dev", "ls", "--json").stdout)
    ] == [True] * 3


def test_purge_prints_no_none(dev_store: Path) -> None:
    purge = run(dev_store, "--dev", "purge", "--older-than", "1d", "--yes")
    assert purge.returncode == 0, purge.stderr
    assert "None" not in purge.stdout and "older than: 1d" in purge.stdout


def test_audit_prints_no_none(dev_store: Path) -> None:
    audit = run(dev_store, "--dev", "audit")
    assert audit.returncode == 0, audit.stderr
    assert "probe" in audit.stdout and "None" not in audit.stdout


def test_ctrl_c_says_what_stopped_and_exits_130(workdir: Path) -> None:
    """Ctrl-C in a command that waits (here ``stats`` on a wedged sidecar: a test double,
    a socket that accepts and never answers) is one line and exit 130, not silence."""
    import socket as socketlib

    sock_path = workdir / "wedged.sock"
    listener = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    listener.bind(os.fspath(sock_path))
    listener.listen(4)
    listener.settimeout(60)
    # The hello's 5 s give-up raised out of reach: on a loaded machine the SIGINT
    # below may come later than 5 s after the connect, and it, not the timeout,
    # must be what stops the command.
    prelude = "import kvoffload.cli.admin as a; a.HELLO_TIMEOUT_S = 600.0"
    argv = [sys.executable, "-c", f"{prelude}\nfrom kvoffload.cli import main\nmain()\n"]
    cmd = subprocess.Popen(
        [*argv, "stats"],
        cwd=workdir,
        env=clean_env({"KVOFFLOAD_SERVER_SOCKET": str(sock_path)}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        conn, _ = listener.accept()  # the command is connected and waits for the handshake
        cmd.send_signal(signal.SIGINT)
        out, err = cmd.communicate(timeout=60)
        conn.close()
    finally:
        listener.close()
        if cmd.poll() is None:
            cmd.kill()
            cmd.wait()
    assert cmd.returncode == ExitCode.INTERRUPTED == 130, err
    assert err.strip().splitlines() == ["interrupted: kvoffload stats stopped at Ctrl-C"]
    assert out == ""


def test_one_open_connection_is_singular() -> None:
    from kvoffload.cli.serve import stats_lines

    lines = stats_lines({"server": {"connections": 1}, "connections_total": 2})
    assert any(", 1 open connection, 2 since start" in ln for ln in lines), lines
    lines = stats_lines({"server": {"connections": 2}})
    assert any(", 2 open connections," in ln for ln in lines), lines


def test_policy_diff_writes_settings_as_the_file_does(tmp_path: Path) -> None:
    base = 'version = 1\n[tenants.acme]\nttl = "{ttl}"\nquota = "{quota}"\nevents = {events}\n'
    base += '[[grants]]\nuid = 0\ntenants = ["acme"]\n'
    old, new = tmp_path / "old.toml", tmp_path / "new.toml"
    old.write_text(base.format(ttl="12h", quota="10GiB", events="true"))
    new.write_text(base.format(ttl="90m", quota="512MiB", events="false"))
    r = run(tmp_path, "policy", "diff", str(old), str(new))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        '~ acme ttl = "12h" -> "1.5h"',
        '~ acme quota = "10GiB" -> "512MiB"',
        "~ acme events = true -> false",
    ]
    js = json.loads(run(tmp_path, "policy", "diff", str(old), str(new), "--json").stdout)
    assert js["settings"]["acme"]["ttl_s"] == [43200.0, 5400.0]  # JSON: seconds


def test_tokenizer_hash_refuses_a_file_that_is_no_tokenizer(tmp_path: Path) -> None:
    r = run(tmp_path, "tokenizer-hash", "/etc/passwd")
    line = one_line(r, ExitCode.USAGE, "usage")
    assert "/etc/passwd is not a tokenizer file" in line and r.stdout == ""
    tok = tmp_path / "tokenizer.json"
    tok.write_text('{"model": {"type": "BPE", "vocab": {"a": 0}}}')
    ok = run(tmp_path, "tokenizer-hash", str(tok))
    assert ok.returncode == 0 and ok.stdout.startswith("tok-b2-")
