"""An operator's first day (issue 29): `config check` gates a deployment, the
admin commands give up on a wedged sidecar and say where, the messages name
what the policy really has, namespaces are taken by a unique prefix, and
nothing is cut when piped.

Everything runs the real CLI as a subprocess, on real stores and sockets.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.cli.exits import ExitCode
from kvoffload.testing import SidecarProcess, cli_argv
from tests.helpers.cli import one_line
from tests.helpers.cli import run_cli as run
from tests.helpers.paths import REPO


@contextlib.contextmanager
def served(
    workdir: Path, sock: Path, *args: str, env: dict[str, str] | None = None
) -> Iterator[SidecarProcess]:
    """A real `kvoffload ARGS serve` on ``sock``, stopped at the end."""
    argv = cli_argv(*args, "serve")
    proc = SidecarProcess(workdir, sock, argv, env=env, tie_to_parent=True)
    proc.start()
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def no_traceback(r: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in r.stderr, r.stderr


# -- item 2: config check exits non-zero whenever serve would refuse ------------------------


def write_setup(tmp_path: Path, short_dir: Path, **over: str | None) -> Path:
    """A complete production-style config (policy, KEK, socket group); ``over``
    replaces or (None) removes one of its lines."""
    import grp

    policy = tmp_path / "policy.toml"
    policy.write_text("version = 1\n[[grants]]\nuid = 0\ntenants = ['*']\nadmin = true\n")
    kek = tmp_path / "kek"
    if not kek.exists():
        kek.write_bytes(os.urandom(32))
        kek.chmod(0o600)
    lines = {
        "root": f"[store]\nroot = {json.dumps(str(tmp_path / 'store'))}",
        "index": f"index_dir = {json.dumps(str(tmp_path / 'index'))}",
        "socket": f"[server]\nsocket = {json.dumps(str(short_dir / 'kvo.sock'))}",
        "group": f"socket_group = {json.dumps(grp.getgrgid(os.getgid()).gr_name)}",
        "security": "[security]",
        "policy": f"policy = {json.dumps(str(policy))}",
        "kek": f"kek_file = {json.dumps(str(kek))}",
    }
    for key, value in over.items():
        if value is None:
            lines[key] = "[security]" if key == "security" else ""
        else:
            lines[key] = value
    cfg = tmp_path / "config.toml"
    cfg.write_text("\n".join(lines.values()) + "\n")
    return cfg


def test_config_check_passes_a_config_serve_accepts(tmp_path: Path, short_dir: Path) -> None:
    cfg = write_setup(tmp_path, short_dir)
    r = run(tmp_path, "--config", str(cfg), "config", "check")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    out = r.stdout
    assert "policy " in out and ": ok (1 grants" in out
    assert "KEK " in out and ": ok (id " in out
    assert f"socket {short_dir / 'kvo.sock'}: ok (group " in out
    assert "none yet: serve creates it" in out


def refusals(tmp_path: Path, short_dir: Path, case: str) -> Path:
    if case == "unknown socket group":
        return write_setup(tmp_path, short_dir, group='socket_group = "no-such-group-kvo"')
    if case == "no policy":
        return write_setup(tmp_path, short_dir, policy=None)
    if case == "no KEK":
        return write_setup(tmp_path, short_dir, kek=None)
    if case == "socket path is a file":
        (short_dir / "kvo.sock").write_text("not a socket")
        return write_setup(tmp_path, short_dir)
    if case == "another store's KEK":
        cfg = write_setup(tmp_path, short_dir)
        assert run(tmp_path, "--config", str(cfg), "init").returncode == 0
        (tmp_path / "kek").write_bytes(os.urandom(32))
        return cfg
    raise AssertionError(case)


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("unknown socket group", "no-such-group-kvo"),
        ("no policy", "no policy"),
        ("no KEK", "no KEK"),
        ("socket path is a file", "is not a socket"),
        ("another store's KEK", "is not this store's KEK"),
    ],
)
def test_config_check_refuses_what_serve_refuses(
    tmp_path: Path, short_dir: Path, case: str, says: str
) -> None:
    cfg = refusals(tmp_path, short_dir, case)
    check = run(tmp_path, "--config", str(cfg), "config", "check")
    serve = run(tmp_path, "--config", str(cfg), "serve")
    no_traceback(check)
    no_traceback(serve)
    assert serve.returncode != 0 and says in serve.stderr, serve.stderr
    assert check.returncode == serve.returncode, (check.stdout, check.stderr)
    refused = [ln for ln in check.stderr.splitlines() if says in ln]
    assert len(refused) == 1, check.stderr


def test_config_check_reports_every_refusal(tmp_path: Path, short_dir: Path) -> None:
    cfg = write_setup(
        tmp_path, short_dir, group='socket_group = "no-such-group-kvo"', policy=None, kek=None
    )
    r = run(tmp_path, "--config", str(cfg), "config", "check")
    assert r.returncode == ExitCode.ERROR
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 3, r.stderr
    assert lines[0].startswith("config error: no policy")
    assert lines[1].startswith("KEK: no KEK")
    assert lines[2].startswith("config error: [server] socket_group 'no-such-group-kvo'")


def test_config_check_with_the_sidecar_running_is_a_note(tmp_path: Path, short_dir: Path) -> None:
    """Checking a new config before a restart: the running sidecar holds the
    socket and the index, which is no fault of the config."""
    cfg = write_setup(tmp_path, short_dir)
    with served(tmp_path, short_dir / "kvo.sock", "--config", str(cfg)):
        r = run(tmp_path, "--config", str(cfg), "config", "check")
    assert r.returncode == 0, r.stderr
    assert f"note: a sidecar serves {short_dir / 'kvo.sock'} now" in r.stdout


# -- item 3: a wedged sidecar is given up on at once, naming its socket ----------------------


def test_a_wedged_sidecar_is_one_line_naming_its_socket(tmp_path: Path, short_dir: Path) -> None:
    """A stopped (SIGSTOP) sidecar still accepts connections (the kernel queues
    them) but answers nothing: every verb gives up after the hello's timeout,
    not the job's, and says which socket. The verbs run at once (each its own
    CLI process and connection): five 5 s waits side by side, not one after another."""
    import signal
    from concurrent.futures import ThreadPoolExecutor

    sock = short_dir / "kvo.sock"
    env = {"KVOFFLOAD_SERVER_SOCKET": str(sock)}
    verbs = [["inspect"], ["ls"], ["fsck"], ["purge", "--tenant", "acme", "--yes"], ["stats"]]
    with served(tmp_path, sock, "--dev", env=env) as proc:
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(len(verbs)) as pool:
                results = list(pool.map(lambda args: run(tmp_path, "--dev", *args, env=env), verbs))
        finally:
            os.kill(proc.pid, signal.SIGCONT)
    for args, r in zip(verbs, results, strict=True):
        line = one_line(r, ExitCode.UNREACHABLE, "unreachable")
        assert str(sock) in line, (args, line)
        assert "no answer to hello within 5 s" in line, (args, line)


class StandInSidecar:
    """A test double of a sidecar busy with a long job: it answers ``hello`` (the
    real protocol, over a real socket) and never the request after it."""

    def __init__(self, path: Path) -> None:
        import threading

        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(8)
        self.stop = threading.Event()
        self.requests: list[str] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        from kvoffload.errors import ProtocolError, TransportError
        from kvoffload.protocol import HelloReply, parse_request, reply_message
        from kvoffload.transport import UnixTransport

        try:
            transport = UnixTransport.accept(conn, timeout_s=60)
        except TransportError:
            conn.close()  # the CLI's probe connection, gone already
            return
        try:
            rid, _ = parse_request(transport.recv().msg)
            hello = HelloReply(version=1, server_id="stand-in", store_id="stand-in", salts={})
            transport.send(reply_message(rid, hello))
            _, req = parse_request(transport.recv().msg)
            self.requests.append(req.OP.value)
            self.stop.wait()  # the job "runs" until the test ends
        except (TransportError, ProtocolError):
            pass  # the CLI's probe connection, or its give-up
        finally:
            transport.close()

    def close(self) -> None:
        self.stop.set()
        self.listener.close()


@pytest.mark.parametrize("verb", ["fsck", "purge"])
def test_a_long_job_past_its_timeout_says_so_and_how_to_wait_longer(
    tmp_path: Path, short_dir: Path, verb: str
) -> None:
    sock = short_dir / "busy.sock"
    stand_in = StandInSidecar(sock)
    args = ["--older-than", "1d", "--yes"] if verb == "purge" else []
    try:
        r = run(
            tmp_path,
            "--root", str(tmp_path / "no-store"),
            verb, *args, "--timeout", "1s",
            env={"KVOFFLOAD_SERVER_SOCKET": str(sock)},
        )  # fmt: skip
    finally:
        stand_in.close()
    line = one_line(r, ExitCode.UNREACHABLE, "unreachable")
    op = "purge_older" if verb == "purge" else "fsck"
    assert stand_in.requests == [op]
    assert f"the sidecar on {sock} took {op} but did not finish it within 1 s" in line, line
    assert "--timeout waits longer" in line
    bad = run(tmp_path, verb, *args, "--timeout", "0s")
    assert one_line(bad, ExitCode.USAGE, "usage") == "usage: --timeout must be more than 0"


# -- item 4: serve --log-format json writes JSON objects only ---------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def json_lines(text: str) -> list[dict[str, object]]:
    records = []
    for line in text.splitlines():
        assert line.startswith("{"), f"not a JSON object: {line!r}"
        records.append(json.loads(line))
    return records


def test_json_logs_are_json_objects_only(tmp_path: Path, short_dir: Path) -> None:
    sock = short_dir / "kvo.sock"
    env = {
        "KVOFFLOAD_SERVER_SOCKET": str(sock),
        "KVOFFLOAD_METRICS_PORT": str(free_port()),
        "KVOFFLOAD_EVENTS_ENABLED": "true",
        "KVOFFLOAD_EVENTS_ENDPOINT": f"ipc://{short_dir}/ev.pub",
        "KVOFFLOAD_EVENTS_REPLAY_ENDPOINT": f"ipc://{short_dir}/ev.replay",
    }
    log = tmp_path / "serve.log"
    argv = cli_argv("--dev", "serve", "--log-format", "json")
    proc = SidecarProcess(tmp_path, sock, argv, env=env, tie_to_parent=True, log_path=log)
    proc.start()
    try:
        proc.wait_ready()
        assert run(tmp_path, "--dev", "inspect", env=env).returncode == 0
        assert proc.stop() == 0
    finally:
        proc.stop()
    records = json_lines(log.read_text())
    said = [str(r["msg"]) for r in records]
    for own in ("DEVELOPMENT MODE", "metrics on http://", "KV events on ", "sidecar serving"):
        assert any(own in m for m in said), (own, said)
    audits = [r for r in records if "audit" in r]
    assert audits, said
    admin = [r["audit"] for r in audits if isinstance(r["audit"], dict)]
    assert {"event": "admin", "verb": "inspect"}.items() <= admin[-1].items()
    # The record is the field, not an escaped string in msg.
    assert all(r["msg"] == f"audit: {r['audit']['event']}" for r in audits)  # type: ignore[index]


def test_a_json_start_up_failure_is_a_json_object(tmp_path: Path, short_dir: Path) -> None:
    policy = tmp_path / "bad.toml"
    policy.write_text("version = 1\n[[grants]]\nuid = 'x'\n")
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[security]\npolicy = {json.dumps(str(policy))}\n")
    env = {"KVOFFLOAD_SERVER_SOCKET": str(short_dir / "kvo.sock")}
    r = run(tmp_path, "--dev", "--config", str(cfg), "serve", "--log-format", "json", env=env)
    assert r.returncode == ExitCode.ERROR
    last = json_lines(r.stderr)[-1]
    assert last["level"] == "ERROR" and last["exit_code"] == 1
    assert str(last["msg"]).startswith("policy: ") and f"{policy}:3:" in str(last["msg"])


# -- item 5: a refusal names what the policy really has, and the command run ---------------------


def test_a_non_admin_is_told_the_policy_key_and_the_command(
    tmp_path: Path, short_dir: Path
) -> None:
    sock = short_dir / "kvo.sock"
    policy = tmp_path / "policy.toml"
    policy.write_text(f"version = 1\n[[grants]]\nuid = {os.getuid()}\ntenants = ['acme']\n")
    cfg = tmp_path / "kvo.toml"
    cfg.write_text(f"[security]\npolicy = {json.dumps(str(policy))}\n")
    env = {"KVOFFLOAD_SERVER_SOCKET": str(sock)}
    with served(tmp_path, sock, "--dev", "--config", str(cfg), env=env):
        purge = run(tmp_path, "--dev", "purge", "--tenant", "acme", "--yes", env=env)
        fsck = run(tmp_path, "--dev", "fsck", env=env)
    for verb, r in (("purge", purge), ("fsck", fsck)):
        line = one_line(r, ExitCode.ERROR, "forbidden")
        assert f"the sidecar on {sock} refused {verb}: it needs the admin right" in line, line
        assert "`admin = true` in a [[grants]] entry" in line and f"uid {os.getuid()}" in line
        assert "admin_uids" not in line


# -- item 7: a namespace filter takes a unique prefix, as git does ------------------------------

NS_A = bytes.fromhex("abcd01" + "11" * 29)
NS_B = bytes.fromhex("abcd02" + "22" * 29)
NS_C = bytes.fromhex("5e5e" + "33" * 30)


@pytest.fixture
def three_namespaces(tmp_path: Path) -> Path:
    from kvoffload.store import Store, StoreConfig
    from kvoffload.store.keys.keyring import Kek

    assert run(tmp_path, "--dev", "init").returncode == 0
    cfg = StoreConfig(root=tmp_path / ".kvoffload/store", index_dir=tmp_path / ".kvoffload/index")
    s = Store(cfg, Kek.from_file(tmp_path / ".kvoffload/dev-kek"))
    for i, ns in enumerate((NS_A, NS_A, NS_B, NS_C)):
        s.put("acme", ns, bytes([i]) * 32, [os.urandom(3000)])
    s.put("beta", NS_C, bytes([9]) * 32, [os.urandom(3000)], encrypt=False)
    s.close()
    return tmp_path


def test_ls_takes_a_unique_namespace_prefix(three_namespaces: Path) -> None:
    d = three_namespaces
    for given in ("abcd01", "ABCD01", NS_A.hex()[:12], NS_A.hex()):
        r = run(d, "--dev", "ls", "--namespace", given, "--json")
        assert r.returncode == 0, r.stderr
        assert [row["namespace"] for row in json.loads(r.stdout)] == [NS_A.hex()] * 2
    # Of every tenant: 5e5e is acme's and beta's (the same fingerprint).
    r = run(d, "--dev", "ls", "-n", "5e5e", "--json")
    assert sorted(row["tenant"] for row in json.loads(r.stdout)) == ["acme", "beta"]


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("abcd", "--namespace abcd is ambiguous: 2 namespaces start with it (acme/abcd01"),
        ("ffff", "--namespace ffff: no namespace of tenant acme in the store at "),
        ("abc", "at least 4"),
        ("xyz1", "64 hex digits"),
    ],
)
def test_a_namespace_prefix_that_names_no_one_is_one_line_exit_2(
    three_namespaces: Path, given: str, says: str
) -> None:
    r = run(three_namespaces, "--dev", "ls", "-t", "acme", "-n", given)
    line = one_line(r, ExitCode.USAGE, "usage")
    assert says in line, line
    if given == "abcd":
        assert f"acme/{NS_A.hex()[:16]}" in line and f"acme/{NS_B.hex()[:16]}" in line


def test_purge_takes_a_unique_namespace_prefix(three_namespaces: Path) -> None:
    d = three_namespaces
    r = run(d, "--dev", "purge", "-t", "acme", "-n", "abcd01", "--yes", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert (report["namespace"], report["chunks"]) == (NS_A.hex(), 2)
    left = json.loads(run(d, "--dev", "ls", "--json").stdout)
    assert sorted(row["namespace"][:6] for row in left) == ["5e5e33", "5e5e33", "abcd02"]
    scoped = run(d, "--dev", "purge", "-t", "acme", "-n", "5e5e3", "--yes")
    assert scoped.returncode == 0, scoped.stderr  # acme's only: beta's namespace is not a candidate
    for gone in ("abcd01", NS_A.hex(), "ffff"):
        r = run(d, "--dev", "purge", "-t", "acme", "-n", gone, "--yes")
        line = one_line(r, ExitCode.NOTHING, "nothing to do")
        assert "no namespace of tenant acme in the store at " in line, line


# -- item 8: a table written to a pipe is never cut to 80 columns --------------------------------


def piped(cwd: Path, *args: str) -> str:
    """stdout of the CLI through a pipe, without $COLUMNS (which would set a width)."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS" and not k.startswith("KVOFFLOAD")}
    # capture_output: both are pipes, as in `kvoffload ... | less`, ssh or a script.
    r = subprocess.run(
        cli_argv(*args), cwd=cwd, capture_output=True, stdin=subprocess.DEVNULL, text=True,
        env=env, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "…" not in r.stdout, r.stdout  # nothing elided
    return r.stdout


def test_piped_tables_keep_every_cell_whole(tmp_path: Path) -> None:
    deep = tmp_path / ("a-rather-long-directory-name-" * 5) / "store"
    shown = piped(tmp_path, "--dev", "--root", str(deep), "config", "show")
    assert any(str(deep) in line and "--root" in line for line in shown.splitlines()), shown

    example = REPO / "systemd/policy.example.toml"
    policy = piped(tmp_path, "policy", "check", str(example)).splitlines()
    header = [ln for ln in policy if "encryption" in ln]
    assert len(header) == 1, policy  # one line, not wrapped into four
    for col in ("tenant", "max_age", "idle_ttl", "sensitivity", "lookup floor + jitter"):
        assert col in header[0]
    assert any("public-demo" in ln and "50.0 GiB" in ln for ln in policy)

    assert run(tmp_path, "--dev", "init").returncode == 0
    audit = piped(tmp_path, "--dev", "audit").splitlines()
    header = [ln for ln in audit if "event" in ln and "result" in ln]
    assert len(header) == 1 and "time (UTC)" in header[0], audit


# -- item 10: rotate-kek and doctor say what is true -------------------------------------------


def test_rotate_kek_with_a_sidecar_running_says_to_stop_it(tmp_path: Path, short_dir: Path) -> None:
    sock = short_dir / "kvo.sock"
    new = tmp_path / "new-kek"
    new.write_bytes(os.urandom(32))
    new.chmod(0o600)
    env = {"KVOFFLOAD_SERVER_SOCKET": str(sock)}
    elsewhere = {"KVOFFLOAD_SERVER_SOCKET": str(short_dir / "other.sock")}
    rotate = ("--dev", "keys", "rotate-kek", "--new-kek-file", str(new))
    with served(tmp_path, sock, "--dev", env=env):
        here = run(tmp_path, *rotate, env=env)
        other = run(tmp_path, *rotate, env=elsewhere)
    for r, holder in ((here, f"the sidecar on {sock} holds the store"), (other, "another process")):
        line = one_line(r, ExitCode.LOCKED, "locked")
        assert holder in line, line
        assert "stop it first (systemctl stop kvoffload), run keys rotate-kek" in line, line
        assert "admin verbs" not in line
    # Stopped, the same command does it.
    done = run(tmp_path, *rotate, "--json", env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["new_kek_id"]


def test_doctor_help_says_when_it_exits_non_zero(tmp_path: Path) -> None:
    text = " ".join(run(tmp_path, "doctor", "--help").stdout.split())
    assert "Always exits 0" not in text
    assert "a configuration that does not load is one line, exit 1" in text
    r = run(tmp_path, "--config", str(tmp_path / "missing.toml"), "doctor")
    assert "cannot read config" in one_line(r, ExitCode.ERROR, "config error")
