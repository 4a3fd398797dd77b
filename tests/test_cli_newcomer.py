"""A newcomer's first commands (issue 29, items 13-16): the demo in an install without
torch, what `events tail` says when nothing shows, and the small things a careful
operator trips on. Everything runs the real CLI as a subprocess, on real stores and
real sidecar processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.cli.exits import ExitCode
from kvoffload.testing import cli_argv

from .sidecar_proc import clean_env


def run(
    cwd: Path, *args: str, env: dict[str, str] | None = None, prelude: str = ""
) -> subprocess.CompletedProcess[str]:
    """``kvoffload ARGS`` in ``cwd``; ``prelude``: Python run before the CLI is imported."""
    code = f"{prelude}\nfrom kvoffload.cli import main\nmain()\n"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env=clean_env(env),
        timeout=120,
    )


def one_line(r: subprocess.CompletedProcess[str], code: int, label: str) -> str:
    """The failure's one stderr line (the dev-KEK reminder and test markers left out)."""
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [
        ln
        for ln in r.stderr.splitlines()
        if not ln.startswith(("WARNING kvoffload.sidecar.keyring: development KEK", "marker:"))
    ]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"{label}: "), lines[0]
    return lines[0]


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


def test_ctrl_c_says_what_stopped_and_exits_130(workdir: Path) -> None:
    """Ctrl-C in a command that waits (here ``stats`` on a wedged sidecar: a test double,
    a socket that accepts and never answers) is one line and exit 130, not silence."""
    import socket as socketlib

    sock_path = workdir / "wedged.sock"
    listener = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    listener.bind(os.fspath(sock_path))
    listener.listen(4)
    listener.settimeout(60)
    cmd = subprocess.Popen(
        cli_argv("stats"),
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
