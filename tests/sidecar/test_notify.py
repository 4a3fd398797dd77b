"""sd_notify and sd_listen_fds, spoken over real sockets."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.sidecar import notify
from tests.helpers.paths import REPO

REPO = REPO


@pytest.fixture
def receiver(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    path = short_dir / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        yield sock


def test_ready_reaches_a_path_socket(receiver: socket.socket) -> None:
    assert notify.ready()
    assert receiver.recv(4096) == b"READY=1"


def test_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"kvoffload-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify.notify("READY=1\nSTATUS=serving")
        assert sock.recv(4096) == b"READY=1\nSTATUS=serving"


def test_each_helper_sends_one_datagram(receiver: socket.socket) -> None:
    assert notify.stopping()
    assert receiver.recv(4096) == b"STOPPING=1"
    assert notify.watchdog()
    assert receiver.recv(4096) == b"WATCHDOG=1"
    assert notify.status("serving 3 tenants\nsecond line")
    assert receiver.recv(4096) == b"STATUS=serving 3 tenants second line"
    assert notify.reloading()
    lines = receiver.recv(4096).decode().split("\n")
    assert lines[0] == "RELOADING=1"
    assert lines[1].startswith("MONOTONIC_USEC=")
    assert abs(int(lines[1].split("=")[1]) - time.monotonic_ns() // 1000) < 60_000_000


@pytest.mark.parametrize(
    "value", [None, "", "vsock:2:1234", "relative.sock", "/nonexistent/x.sock"]
)
def test_no_usable_socket_is_false_not_an_error(
    monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    else:
        monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert notify.ready() is False
    assert notify.watchdog() is False


def test_closed_receiver_is_false(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = short_dir / "gone.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))  # the file is left, nobody listens
    assert notify.ready() is False


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        ("30000000", None, 30.0),
        ("30000000", "self", 30.0),
        ("500000", "self", 0.5),
        ("30000000", "other", None),
        ("30000000", "junk", None),
        ("0", None, None),
        ("-5", None, None),
        ("soon", None, None),
        (None, "self", None),
    ],
)
def test_watchdog_interval(
    monkeypatch: pytest.MonkeyPatch, usec: str | None, pid: str | None, expected: float | None
) -> None:
    for name, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", pid)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            value = {"self": str(os.getpid()), "other": str(os.getpid() + 1)}.get(value, value)
            monkeypatch.setenv(name, value)
    assert notify.watchdog_interval_s() == expected


# -- socket activation -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("pid", "fds"),
    [("other", "1"), (None, "1"), ("self", "x"), ("self", "0"), ("self", None), ("junk", "1")],
)
def test_listen_fds_refuses_and_clears_env(
    monkeypatch: pytest.MonkeyPatch, pid: str | None, fds: str | None
) -> None:
    values = {"LISTEN_PID": pid, "LISTEN_FDS": fds, "LISTEN_FDNAMES": "control"}
    for name, value in values.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            value = {"self": str(os.getpid()), "other": str(os.getpid() + 1)}.get(value, value)
            monkeypatch.setenv(name, value)
    assert notify.listen_fds() == []
    for name in values:
        assert name not in os.environ


# The child sets LISTEN_PID itself: only its own pid is known inside it, and
# systemd, too, sets it in the forked child just before exec.
CHILD = textwrap.dedent(
    """
    import json, os, socket, sys
    inherited = int(sys.argv[1])
    if inherited != 3:
        os.dup2(inherited, 3)  # systemd's fds start at 3
        os.close(inherited)
    os.environ["LISTEN_FDS"] = "1"
    os.environ["LISTEN_PID"] = str(os.getpid())
    os.environ["LISTEN_FDNAMES"] = "control"
    from kvoffload.sidecar.notify import listen_fds, listen_fds_with_names
    got = listen_fds_with_names()
    left = [k for k in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES") if k in os.environ]
    again = listen_fds()
    sock = socket.socket(fileno=got[0][0])
    conn, _ = sock.accept()
    conn.sendall(b"hello from fd 3")
    conn.close()
    print(json.dumps({
        "got": got, "left": left, "again": again,
        "name": sock.getsockname(), "cloexec": not os.get_inheritable(3),
    }))
    """
)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_listen_fds_with_an_inherited_socket(short_dir: Path) -> None:
    path = str(short_dir / "kvoffload.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(4)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(30)
            # Queued in the backlog until the child accepts on its fd 3.
            client.connect(path)
            proc = subprocess.run(
                [sys.executable, "-c", CHILD, str(listener.fileno())],
                pass_fds=(listener.fileno(),),
                env=child_env(),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert proc.returncode == 0, proc.stderr
            assert client.recv(100) == b"hello from fd 3"
    out = json.loads(proc.stdout)
    assert out["got"] == [[3, "control"]]
    assert out["left"] == []
    assert out["again"] == []  # the variables were consumed by the first call
    assert out["name"] == path
    assert out["cloexec"] is True


def test_listen_fds_when_fds_are_not_open() -> None:
    script = (
        "import os\n"
        "os.environ.update(LISTEN_FDS='4', LISTEN_PID=str(os.getpid()))\n"
        "from kvoffload.sidecar.notify import listen_fds\n"
        "print(listen_fds(), 'LISTEN_FDS' in os.environ)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=child_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[] False"


ACTIVATED = textwrap.dedent(
    """
    import json, os, socket
    from kvoffload.sidecar.notify import listen_fds_with_names
    got = listen_fds_with_names()
    sock = socket.socket(fileno=got[0][0])
    conn, _ = sock.accept()
    conn.sendall(json.dumps({"got": got, "pid": os.getpid()}).encode())
    conn.close()
    """
)


@pytest.mark.skipif(
    shutil.which("systemd-socket-activate") is None, reason="systemd-socket-activate not installed"
)
def test_listen_fds_under_systemd_socket_activate(short_dir: Path) -> None:
    """The real protocol, set up by systemd's own tool rather than by hand."""
    path = short_dir / "kvoffload.sock"
    proc = subprocess.Popen(
        [
            "systemd-socket-activate",
            "--listen",
            str(path),
            "--fdname=control",
            f"--setenv=PYTHONPATH={REPO / 'src'}",
            sys.executable,
            "-c",
            ACTIVATED,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while not path.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "socket never appeared"
            time.sleep(0.02)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(30)
            client.connect(str(path))
            data = b""
            while chunk := client.recv(4096):
                data += chunk
        out = json.loads(data)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        proc.stderr.close()
    assert out["got"] == [[3, "control"]]
    assert out["pid"] == proc.pid  # it execs in place, as systemd's LISTEN_PID promises
