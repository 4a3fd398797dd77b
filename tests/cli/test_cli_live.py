"""The CLI and a running sidecar (issue 10): admin commands over the socket, SIGHUP,
systemd's STATUS=, the connection counter, and the README's client pattern.

Real sidecar processes (``python -m kvoffload.cli --dev serve``), real sockets.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvoffload.cli.exits import ExitCode
from kvoffload.client import SidecarClient
from kvoffload.contract import CompatContract, LayerLayout
from kvoffload.store import Store, StoreConfig
from kvoffload.store.keys.keyring import Kek
from kvoffload.testing import SidecarProcess, cli_argv
from tests.helpers.cli import cli, sidecar
from tests.helpers.paths import REPO

NS = bytes(range(32))
KEYS = [bytes([i]) * 32 for i in range(3)]
DEADLINE_S = 60.0


def seed(directory: Path) -> None:
    """A dev store with 3 sealed chunks of acme and one plaintext chunk of beta."""
    assert cli(directory, directory / "none.sock", "--dev", "init").returncode == 0
    cfg = StoreConfig(root=directory / ".kvoffload/store", index_dir=directory / ".kvoffload/index")
    s = Store(cfg, Kek.from_file(directory / ".kvoffload/dev-kek"))
    for k in KEYS:
        s.put("acme", NS, k, [os.urandom(5000)])
    s.put("beta", NS, bytes([9]) * 32, [os.urandom(5000)], encrypt=False)
    s.close()


def wait_for_log(proc: SidecarProcess, text: str, count: int = 1) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while proc.log_text().count(text) < count:
        assert proc.alive(), proc.log_text()
        assert time.monotonic() < deadline, f"no {text!r} in:\n{proc.log_text()}"
        time.sleep(0.05)


def without_age(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "age_s"} for r in rows]


def test_admin_commands_go_through_the_running_sidecar(tmp_path: Path, short_dir: Path) -> None:
    seed(tmp_path)
    sock = short_dir / "kvo.sock"
    offline = {
        cmd: cli(tmp_path, sock, "--dev", cmd, "--json") for cmd in ("inspect", "ls", "fsck")
    }
    assert all(r.returncode == 0 for r in offline.values()), offline
    with sidecar(tmp_path, sock) as proc:
        # Same output and --json as offline (ls: but for the ages, which move).
        r = cli(tmp_path, sock, "--dev", "inspect", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout) == json.loads(offline["inspect"].stdout)
        r = cli(tmp_path, sock, "--dev", "ls", "--json")
        assert r.returncode == 0, r.stderr
        assert without_age(json.loads(r.stdout)) == without_age(json.loads(offline["ls"].stdout))
        r = cli(tmp_path, sock, "--dev", "ls", "--json", "--tenant", "acme", "--limit", "2")
        assert len(json.loads(r.stdout)) == 2
        r = cli(tmp_path, sock, "--dev", "fsck", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout) == json.loads(offline["fsck"].stdout)
        assert cli(tmp_path, sock, "--dev", "fsck", "--verify-data").returncode == 0

        with SidecarClient(sock, "acme", staging_bytes=1 << 20) as client:
            assert client.lookup(KEYS) == 3
            r = cli(tmp_path, sock, "--dev", "purge", "--tenant", "acme", "--yes", "--json")
            assert r.returncode == 0, r.stderr
            assert json.loads(r.stdout)["chunks"] == 3
            # Gone from the running sidecar's answers, at once.
            assert client.lookup(KEYS) == 0
        info = json.loads(cli(tmp_path, sock, "--dev", "inspect", "--json").stdout)
        assert "acme" not in info["tenants"] and "acme" not in info["tenants_with_keys"]
        assert info["chunks"] == 1
        r = cli(tmp_path, sock, "--dev", "purge", "--tenant", "acme", "--yes")
        assert r.returncode == ExitCode.NOTHING, r.stderr
        r = cli(tmp_path, sock, "--dev", "purge", "--older-than", "0s", "--yes", "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["chunks"] == 1, r.stderr
        assert proc.alive()
        assert proc.stop() == 0
    # No sidecar: the offline path again, on what the sidecar left.
    info = json.loads(cli(tmp_path, sock, "--dev", "inspect", "--json").stdout)
    assert info["chunks"] == 0


def _policy(path: Path, *, admin: bool) -> None:
    path.write_text(
        "version = 1\n[[grants]]\n"
        f"uid = {os.getuid()}\ntenants = ['*']\nadmin = {'true' if admin else 'false'}\n"
    )
    path.chmod(0o644)


def test_sighup_reloads_the_policy_and_keeps_it_when_the_file_is_bad(
    tmp_path: Path, short_dir: Path
) -> None:
    seed(tmp_path)
    sock = short_dir / "kvo.sock"
    policy = tmp_path / "policy.toml"
    _policy(policy, admin=True)
    cfg = tmp_path / "kvo.toml"
    cfg.write_text(f"[security]\npolicy = {json.dumps(str(policy))}\n")
    with sidecar(tmp_path, sock, "--config", str(cfg)) as proc:
        assert cli(tmp_path, sock, "--dev", "inspect").returncode == 0
        _policy(policy, admin=False)
        proc.signal(signal.SIGHUP)
        wait_for_log(proc, "SIGHUP: policy reloaded")
        r = cli(tmp_path, sock, "--dev", "inspect")
        assert r.returncode == 1 and "forbidden: " in r.stderr and "admin" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
        policy.write_text("version = 1\n[[grants]]\nuid = 'not a number'\n")
        proc.signal(signal.SIGHUP)
        wait_for_log(proc, "the current one stays in force")
        assert proc.alive()
        assert cli(tmp_path, sock, "--dev", "inspect").returncode == 1  # still the second
        assert cli(tmp_path, sock, "--dev", "stats").returncode == 0
        assert proc.stop() == 0
    assert not sock.exists()


def test_sighup_without_a_policy_file_is_logged_and_ignored(
    tmp_path: Path, short_dir: Path
) -> None:
    sock = short_dir / "kvo.sock"
    with sidecar(tmp_path, sock) as proc:
        proc.signal(signal.SIGHUP)
        wait_for_log(proc, "no policy file to reload")
        assert proc.alive() and proc.stats()["chunks"] == 0
        assert proc.stop() == 0
    assert not sock.exists()


def test_systemd_gets_ready_status_and_stopping(tmp_path: Path, short_dir: Path) -> None:
    notify_path = short_dir / "notify"
    ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ns.bind(str(notify_path))
    ns.settimeout(DEADLINE_S)
    sock = short_dir / "kvo.sock"
    seen: list[str] = []

    def until(prefix: str) -> str:
        while True:
            for msg in seen:
                for line in msg.splitlines():
                    if line.startswith(prefix):
                        return line
            seen.append(ns.recv(4096).decode())

    try:
        with sidecar(tmp_path, sock, env={"NOTIFY_SOCKET": str(notify_path)}) as proc:
            assert until("READY=1") == "READY=1"
            status = until("STATUS=")
            assert status.startswith("STATUS=serving ")
            assert " chunks, " in status and " connections" in status
            assert proc.stop() == 0
            assert until("STOPPING=1") == "STOPPING=1"
    finally:
        ns.close()


def test_connections_are_counted(tmp_path: Path, short_dir: Path) -> None:
    sock = short_dir / "kvo.sock"
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    with sidecar(tmp_path, sock, env={"KVOFFLOAD_METRICS_PORT": str(port)}) as proc:
        for _ in range(3):
            proc.stats()
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        lines = [ln for ln in body.decode().splitlines() if ln.startswith("kvoffload_conn")]
        total = [
            float(ln.split()[1]) for ln in lines if ln.startswith("kvoffload_connections_total ")
        ]
        assert total and total[0] >= 4, lines  # wait_ready's stats call and ours
        r = cli(tmp_path, sock, "--dev", "stats", "--json")
        data = json.loads(r.stdout)
        assert data["connections_total"] >= 5
        assert all(isinstance(v["count"], int) for v in data["requests"].values())


def test_the_readme_client_pattern_is_a_miss_without_a_sidecar(short_dir: Path) -> None:
    contract = CompatContract(
        model_revision="m@1",
        tokenizer_hash="t",
        chat_template_version="1",
        attention_backend="FLASH_ATTN",
        kv_dtype="bfloat16",
        block_size=16,
        layer_layout=LayerLayout(num_layers=2, num_kv_heads=1, head_dim=64),
        rope_config={},
        tenant_namespace="acme",
    )
    tokens = list(range(1024))
    with SidecarClient(short_dir / "absent.sock", "acme", staging_bytes=1 << 20) as client:
        assert client.salt is None
        keys = client.chunk_keys(contract, tokens)
        assert keys == []
        assert client.lookup(keys) == 0
        assert (
            client.save(contract.fingerprint(), list(zip(keys, [[b"x"]] * 4, strict=False))) == []
        )
        assert client.load(keys) == []
    readme = (REPO / "README.md").read_text()
    assert "keys = client.chunk_keys(contract, token_ids)" in readme


def test_the_client_pattern_gives_real_keys_with_a_sidecar(tmp_path: Path, short_dir: Path) -> None:
    from kvoffload.keys import chunk_keys

    contract = CompatContract(
        model_revision="m@1",
        tokenizer_hash="t",
        chat_template_version="1",
        attention_backend="FLASH_ATTN",
        kv_dtype="bfloat16",
        block_size=16,
        layer_layout=LayerLayout(num_layers=2, num_kv_heads=1, head_dim=64),
        rope_config={},
        tenant_namespace="acme",
    )
    sock = short_dir / "kvo.sock"
    with (
        sidecar(tmp_path, sock),
        SidecarClient(sock, "acme", staging_bytes=1 << 20) as client,
    ):
        keys = client.chunk_keys(contract, list(range(600)))
        assert client.salt is not None
        assert keys == chunk_keys(contract, client.salt, list(range(600)))
        assert len(keys) == 2
        assert sys.executable  # the sidecar ran under this interpreter


def test_an_ungranted_tenant_is_said_once_on_the_worker(
    tmp_path: Path, short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    sock = short_dir / "kvo.sock"
    policy = tmp_path / "policy.toml"
    policy.write_text(f"version = 1\n[[grants]]\nuid = {os.getuid()}\ntenants = ['granted']\n")
    cfg = tmp_path / "kvo.toml"
    cfg.write_text(f"[security]\npolicy = {json.dumps(str(policy))}\n")
    with (
        sidecar(tmp_path, sock, "--config", str(cfg)),
        SidecarClient(sock, "ungranted-x", staging_bytes=1 << 20) as client,
        caplog.at_level(logging.WARNING, logger="kvoffload.client"),
    ):
        for i in range(3):
            assert client.save(NS, [(KEYS[i], [b"z" * 100])]) == [False]
            assert client.lookup(KEYS) == 0
    said = [r for r in caplog.records if "does not grant tenant 'ungranted-x'" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert "always miss" in said[0].getMessage()


@pytest.mark.parametrize("fmt", ["json", "journald"])
def test_log_formats(tmp_path: Path, short_dir: Path, fmt: str) -> None:
    sock = short_dir / "kvo.sock"
    args = ("--dev", "serve", "--log-format", "json") if fmt == "json" else ("--dev", "serve")
    env = {"KVOFFLOAD_SERVER_SOCKET": str(sock)}
    if fmt == "journald":
        env["JOURNAL_STREAM"] = "8:12345"  # what systemd sets for a unit logging to the journal
    proc = SidecarProcess(
        tmp_path, sock, cli_argv(*args), env=env, tie_to_parent=True, log_path=tmp_path / "log"
    )
    proc.start()
    try:
        proc.wait_ready()
        assert proc.stop() == 0
    finally:
        proc.stop()
    logged = [ln for ln in proc.log_text().splitlines() if "kvoffload.server" in ln]
    assert logged, proc.log_text()
    if fmt == "json":
        records = [json.loads(ln) for ln in logged]
        assert {"ts", "level", "logger", "msg"} <= set(records[0])
        assert any(r["msg"].startswith("serving on ") for r in records)
    else:
        # journald stamps each line itself: no second timestamp in ours.
        assert all(ln.startswith(("INFO ", "WARNING ", "ERROR ")) for ln in logged), logged
    io = [ln for ln in proc.log_text().splitlines() if "I/O backend" in ln]
    assert io and all(len(ln) < 250 for ln in io)  # one short reason; the detail is doctor's


def test_stats_shows_a_non_admin_its_own_tenants_usage(tmp_path: Path, short_dir: Path) -> None:
    seed(tmp_path)
    sock = short_dir / "kvo.sock"
    policy = tmp_path / "policy.toml"
    policy.write_text(f"version = 1\n[[grants]]\nuid = {os.getuid()}\ntenants = ['acme']\n")
    cfg = tmp_path / "kvo.toml"
    cfg.write_text(f"[security]\npolicy = {json.dumps(str(policy))}\n")
    with sidecar(tmp_path, sock, "--config", str(cfg)):
        r = cli(tmp_path, sock, "--dev", "stats", "--json")
        assert r.returncode == 0, r.stderr
        data = json.loads(r.stdout)
        assert list(data["tenant_usage"]) == ["acme"]  # not beta's: not granted
        assert data["tenant_usage"]["acme"]["chunks"] == 3
        assert "tenants" not in data  # how many tenants exist is for admins
        human = cli(tmp_path, sock, "--dev", "stats").stdout
        assert "tenant usage: acme 3 chunks" in human and "tenants: " not in human
        assert "chunks: 4" in human and "{" not in human  # store-wide count; no dict reprs
