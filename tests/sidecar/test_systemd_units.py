"""The systemd units and example files in systemd/: present, consistent, and valid.

The directive checks run everywhere. The checks that need systemd's own tools
(systemd-analyze, systemd-sysusers, systemd-tmpfiles; Debian package
``systemd``) skip with a reason where they are not installed. None of them
needs systemd running as PID 1, so they work in containers.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

from kvoffload.sidecar.access.policy import ALL_TENANTS
from kvoffload.sidecar.access.policy_file import load_policy
from tests.helpers.paths import REPO

SYSTEMD = REPO / "systemd"
SERVICE = SYSTEMD / "kvoffload.service"
SOCKET = SYSTEMD / "kvoffload.socket"
SYSUSERS = SYSTEMD / "kvoffload.sysusers.conf"
TMPFILES = SYSTEMD / "kvoffload.tmpfiles.conf"
EXEC = "/usr/bin/kvoffload"

Unit = dict[str, dict[str, list[str]]]


def parse_unit(path: Path) -> Unit:
    """Sections → key → every value assigned, in order (systemd's own reading, simplified)."""
    unit: Unit = defaultdict(lambda: defaultdict(list))
    section = ""
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not a key=value line: {line!r}"
        unit[section][key.strip()].append(value.strip())
    return unit


def single(unit: Unit, section: str, key: str) -> str:
    values = unit[section].get(key)
    assert values, f"[{section}] {key}= is missing"
    return values[-1]  # the last assignment wins, as in systemd


@pytest.fixture(scope="module")
def service() -> Unit:
    return parse_unit(SERVICE)


@pytest.fixture(scope="module")
def sock() -> Unit:
    return parse_unit(SOCKET)


# -- directives that must stay --------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("Type", "notify"),
        ("NotifyAccess", "main"),
        ("WatchdogSec", "30"),
        ("Restart", "on-failure"),
        ("User", "kvoffload"),
        ("Group", "kvoffload"),
        ("LoadCredential", "kek:/etc/kvoffload/kek"),
        ("ProtectSystem", "strict"),
        ("NoNewPrivileges", "yes"),
        ("PrivateTmp", "yes"),
        ("ProtectHome", "yes"),
        ("ProtectKernelTunables", "yes"),
        ("ProtectKernelModules", "yes"),
        ("ProtectControlGroups", "yes"),
        ("LockPersonality", "yes"),
        ("SystemCallFilter", "@system-service"),
        ("CapabilityBoundingSet", ""),
        ("UMask", "0007"),
        ("KillSignal", "SIGTERM"),
        ("StateDirectory", "kvoffload"),
    ],
)
def test_service_directive(service: Unit, key: str, value: str) -> None:
    assert single(service, "Service", key) == value


def test_service_runs_the_daemon(service: Unit) -> None:
    assert single(service, "Service", "ExecStart").split() == [
        EXEC,
        "--config",
        "/etc/kvoffload/config.toml",
        "serve",
    ]
    assert "TimeoutStopSec" in service["Service"]
    assert "KVOFFLOAD_KEK_FILE=%d/kek" in " ".join(service["Service"]["Environment"])


def test_service_network_and_paths(service: Unit) -> None:
    families = set(single(service, "Service", "RestrictAddressFamilies").split())
    assert families == {"AF_UNIX", "AF_INET", "AF_INET6"}
    writable = single(service, "Service", "ReadWritePaths").split()
    assert "/var/lib/kvoffload" in writable


def test_service_deliberate_omissions(service: Unit) -> None:
    # CUDA (the GDS path) needs writable+executable memory: see the unit's comment.
    assert service["Service"].get("MemoryDenyWriteExecute", ["no"])[-1] == "no"
    # RuntimeDirectory= would re-own /run/kvoffload to the service's group and
    # remove it on stop, locking clients out and deleting the socket unit's socket.
    assert "RuntimeDirectory" not in service["Service"]
    assert "DynamicUser" not in service["Service"]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("ListenStream", "/run/kvoffload/kvoffload.sock"),
        ("SocketMode", "0660"),
        ("SocketUser", "kvoffload"),
        ("SocketGroup", "kvoffload-clients"),
        ("Service", "kvoffload.service"),
    ],
)
def test_socket_directive(sock: Unit, key: str, value: str) -> None:
    assert single(sock, "Socket", key) == value


def test_units_reference_each_other(service: Unit, sock: Unit) -> None:
    assert "kvoffload.socket" in single(service, "Unit", "Requires").split()
    assert "kvoffload.socket" in single(service, "Unit", "After").split()
    assert single(service, "Install", "WantedBy") == "multi-user.target"
    assert single(sock, "Install", "WantedBy") == "sockets.target"


def test_sysusers_and_tmpfiles_lines() -> None:
    sysusers = [line.split() for line in SYSUSERS.read_text().splitlines() if line[:1].isalpha()]
    assert ["u", "kvoffload"] in [fields[:2] for fields in sysusers]
    assert ["g", "kvoffload-clients"] in [fields[:2] for fields in sysusers]
    tmpfiles = {
        fields[1]: fields
        for fields in (line.split() for line in TMPFILES.read_text().splitlines())
        if fields and fields[0] == "d"
    }
    assert tmpfiles["/run/kvoffload"][2:5] == ["0750", "kvoffload", "kvoffload-clients"]
    assert tmpfiles["/var/lib/kvoffload"][2:5] == ["0750", "kvoffload", "kvoffload"]


# -- example files ---------------------------------------------------------------------


def test_policy_example_loads() -> None:
    policy = load_policy(SYSTEMD / "policy.example.toml")
    assert policy.tenants_for(0, [0]) is ALL_TENANTS
    assert policy.is_admin(0, [0])
    assert policy.tenants_for(1001, [1001]) == frozenset({"acme", "public-demo"})
    assert not policy.tenant("public-demo").encryption
    assert policy.tenant("acme").encryption
    assert policy.tenant("research").ttl_s is None
    # An auditor: admin verbs, no tenant data.
    assert policy.is_admin(5000, [2001])
    assert policy.tenants_for(5000, [2001]) == frozenset()


def test_config_example_matches_the_units(sock: Unit) -> None:
    config = tomllib.loads((SYSTEMD / "config.example.toml").read_text(encoding="utf-8"))
    assert config["server"]["socket"] == single(sock, "Socket", "ListenStream")
    assert config["server"]["socket_group"] == single(sock, "Socket", "SocketGroup")
    assert config["security"]["policy"] == "/etc/kvoffload/policy.toml"
    assert config["metrics"]["host"] == "127.0.0.1"


def test_config_example_loads_as_under_the_unit(service: Unit, sock: Unit) -> None:
    config = pytest.importorskip("kvoffload.sidecar.config")
    # The unit's Environment= line, with %d expanded as systemd would.
    env = dict(
        item.replace("%d", "/run/credentials/kvoffload.service").split("=", 1)
        for item in " ".join(service["Service"]["Environment"]).split()
    )
    cfg = config.load_config(SYSTEMD / "config.example.toml", env=env)
    assert cfg.socket_path == Path(single(sock, "Socket", "ListenStream"))
    assert cfg.socket_group == single(sock, "Socket", "SocketGroup")
    assert cfg.policy_file == Path("/etc/kvoffload/policy.toml")
    assert cfg.kek_file == Path("/run/credentials/kvoffload.service/kek")


# -- systemd's own tools ----------------------------------------------------------------

needs_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze not installed (Debian: apt-get install systemd)",
)


def stand_in_binary() -> str:
    venv_cli = Path(sys.executable).parent / "kvoffload"
    if venv_cli.exists():
        return str(venv_cli)
    true = shutil.which("true")
    assert true is not None
    return true


@pytest.fixture
def unit_copies(tmp_path: Path) -> Path:
    """The units, with ExecStart pointing at a binary that exists here.

    `systemd-analyze verify` fails a unit whose ExecStart binary is missing,
    and /usr/bin/kvoffload exists only where the package is installed. Only
    the program path changes; every other line is verified as shipped.
    """
    for unit in (SERVICE, SOCKET):
        text = unit.read_text(encoding="utf-8")
        text = re.sub(
            rf"^ExecStart={re.escape(EXEC)}\b",
            f"ExecStart={stand_in_binary()}",
            text,
            flags=re.M,
        )
        (tmp_path / unit.name).write_text(text, encoding="utf-8")
    return tmp_path


def verify(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            "systemd-analyze",
            "verify",
            str(directory / "kvoffload.service"),
            str(directory / "kvoffload.socket"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SYSTEMD_LOG_COLOR": "0"},
    )


def own_complaints(proc: subprocess.CompletedProcess[str]) -> list[str]:
    # verify only warns (exit 0) about unknown keys or unparsable values, so
    # any line about our units counts; unrelated noise from the host's own
    # unit files is not ours to fail on.
    return [line for line in (proc.stdout + proc.stderr).splitlines() if "kvoffload" in line]


@needs_analyze
def test_systemd_analyze_verify(unit_copies: Path) -> None:
    proc = verify(unit_copies)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert own_complaints(proc) == []


@needs_analyze
def test_systemd_analyze_verify_catches_mistakes(unit_copies: Path) -> None:
    """The check above is live: a typo'd directive does get reported."""
    service = unit_copies / "kvoffload.service"
    text = service.read_text(encoding="utf-8")
    service.write_text(
        text.replace("NoNewPrivileges=yes", "NoNewPrivilege=yes\nProtectHome=perhaps"),
        encoding="utf-8",
    )
    complaints = "\n".join(own_complaints(verify(unit_copies)))
    assert "NoNewPrivilege" in complaints
    assert "perhaps" in complaints


@needs_analyze
def test_systemd_analyze_security_exposure(unit_copies: Path) -> None:
    # --threshold is in tenths of the 0-10 exposure scale: 30 is the top of "OK".
    proc = subprocess.run(
        [
            "systemd-analyze",
            "security",
            "--offline=yes",
            "--threshold=30",
            "--no-pager",
            str(unit_copies / "kvoffload.service"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    overall = [line for line in proc.stdout.splitlines() if "Overall exposure" in line]
    assert proc.returncode == 0, "\n".join(overall) or proc.stderr


@pytest.mark.skipif(
    shutil.which("systemd-sysusers") is None or shutil.which("systemd-tmpfiles") is None,
    reason="systemd-sysusers/systemd-tmpfiles not installed (Debian: apt-get install systemd)",
)
@pytest.mark.skipif(os.geteuid() != 0, reason="systemd-tmpfiles must be root to chown")
def test_sysusers_and_tmpfiles_apply(tmp_path: Path) -> None:
    """Apply both files to an empty root directory and look at the result."""
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    # Configuration paths are given absolute: with --root, the tools would
    # otherwise look for them inside the root.
    for cmd in (
        ["systemd-sysusers", f"--root={root}", str(SYSUSERS)],
        ["systemd-tmpfiles", f"--root={root}", "--create", str(TMPFILES)],
    ):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr

    users = {
        f[0]: f for f in (ln.split(":") for ln in (root / "etc/passwd").read_text().splitlines())
    }
    groups = {
        f[0]: f for f in (ln.split(":") for ln in (root / "etc/group").read_text().splitlines())
    }
    assert "kvoffload" in users
    assert users["kvoffload"][5] == "/var/lib/kvoffload"
    uid, gid = int(users["kvoffload"][2]), int(users["kvoffload"][3])
    assert int(groups["kvoffload"][2]) == gid
    clients_gid = int(groups["kvoffload-clients"][2])

    run = (root / "run/kvoffload").stat()
    assert (run.st_mode & 0o7777, run.st_uid, run.st_gid) == (0o750, uid, clients_gid)
    state = (root / "var/lib/kvoffload").stat()
    assert (state.st_mode & 0o7777, state.st_uid, state.st_gid) == (0o750, uid, gid)


# -- the unit's own ExecStart, run for real ------------------------------------------------

CONFIG_IN_UNIT = "/etc/kvoffload/config.toml"


def printed_service(tmp_path: Path) -> Path:
    """`kvoffload systemd print service`, as an operator installs it."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "systemd", "print", "service"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    path = tmp_path / "printed.service"
    path.write_text(proc.stdout, encoding="utf-8")
    return path


def exec_start(unit: Unit) -> list[str]:
    argv = single(unit, "Service", "ExecStart").split()
    assert CONFIG_IN_UNIT in argv, argv
    if argv[0] == EXEC:  # the shipped unit names the packaged path
        argv[0] = stand_in_binary()
    if not os.access(argv[0], os.X_OK) or Path(argv[0]).name != "kvoffload":
        pytest.skip(f"no kvoffload executable to run the unit's ExecStart ({argv[0]})")
    return argv


def unit_config(tmp_path: Path, short: Path) -> Path:
    """config.example.toml with its paths moved here; every other line as shipped."""
    import grp

    text = (SYSTEMD / "config.example.toml").read_text(encoding="utf-8")
    for old, new in (
        ('"/var/lib/kvoffload/store"', json_str(tmp_path / "store")),
        ('"/var/lib/kvoffload/index"', json_str(tmp_path / "index")),
        ('"/run/kvoffload/kvoffload.sock"', json_str(short / "kvoffload.sock")),
        ('"kvoffload-clients"', json_str(grp.getgrgid(os.getgid()).gr_name)),
        ('"/etc/kvoffload/policy.toml"', json_str(SYSTEMD / "policy.example.toml")),
        ("port = 9464", "port = 0"),
    ):
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "config.toml"
    path.write_text(text, encoding="utf-8")
    return path


def json_str(path: Path | str) -> str:
    import json

    return json.dumps(str(path))


@pytest.mark.skipif(
    shutil.which("systemd-socket-activate") is None,
    reason="systemd-socket-activate not installed (Debian: apt-get install systemd)",
)
@pytest.mark.parametrize("source", ["shipped", "printed"])
def test_the_units_exec_start_serves_and_reports_ready(tmp_path: Path, source: str) -> None:
    """The ExecStart line, run as systemd would: the socket unit's socket on fd 3,
    the unit's Environment= (%d: the credentials directory with the KEK), a clean
    environment otherwise, and Type=notify: READY=1 from the main process."""
    import socket
    import struct
    import tempfile

    unit = parse_unit(SERVICE if source == "shipped" else printed_service(tmp_path))
    sock_unit = parse_unit(SOCKET)
    short = Path(tempfile.mkdtemp(prefix="kvo-", dir="/tmp"))  # AF_UNIX paths are short
    creds = tmp_path / "credentials"
    creds.mkdir()
    (creds / "kek").write_bytes(os.urandom(32))
    (creds / "kek").chmod(0o600)
    config = unit_config(tmp_path, short)
    argv = [config.as_posix() if a == CONFIG_IN_UNIT else a for a in exec_start(unit)]
    env = [
        item.replace("%d", str(creds)) for item in " ".join(unit["Service"]["Environment"]).split()
    ]
    notify_path = short / "notify.sock"
    listen = short / "kvoffload.sock"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(notify_path))
    receiver.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    receiver.settimeout(0.5)
    proc = subprocess.Popen(
        [
            "systemd-socket-activate",
            "--listen",
            str(listen),
            f"--fdname={Path(single(sock_unit, 'Socket', 'ListenStream')).name}",
            *(f"--setenv={item}" for item in env),
            f"--setenv=NOTIFY_SOCKET={notify_path}",
            f"--setenv=PYTHONPATH={REPO / 'src'}",
            *argv,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        while not listen.exists():
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.02)
        client.connect(str(listen))  # systemd-socket-activate starts the service now
        states: list[tuple[str, int]] = []
        deadline = time.monotonic() + 300  # a bound on a hang, not a speed check
        while not any(s == "READY=1" for s, _ in states):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"no READY=1 from {argv}: {proc.communicate(timeout=60)}")
            try:
                data, anc, _, _ = receiver.recvmsg(4096, socket.CMSG_SPACE(12))
            except TimeoutError:
                continue
            pid = next(
                struct.unpack("3i", d)[0]
                for level, kind, d in anc
                if (level, kind) == (socket.SOL_SOCKET, socket.SCM_CREDENTIALS)
            )
            states += [(line, pid) for line in data.decode().split("\n")]
        # NotifyAccess=main: the daemon itself says READY (systemd-socket-activate
        # execs it in place, as systemd does).
        assert ("READY=1", proc.pid) in states
        from kvoffload.client import fetch_stats

        stats = fetch_stats(listen)
        assert stats["chunks"] == 0
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    finally:
        client.close()
        receiver.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        shutil.rmtree(short, ignore_errors=True)
    assert proc.returncode == 0, err
    assert "serving store" in err and "on fd 3" in err, err
