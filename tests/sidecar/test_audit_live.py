"""Every governance action leaves its audit line (docs/spec/audit-v1.md §3):
driven through a real sidecar process (admin verbs over the socket, a hello
naming a tenant the peer may not use, an admin verb of a non-admin after a
SIGHUP reload) and the real offline CLI (init, ls, fsck, purge, rotate-kek),
then read back with ``kvoffload audit --verify --json``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from kvoffload.client import SidecarClient
from kvoffload.store import Store, StoreConfig
from kvoffload.store.keys.keyring import Kek
from kvoffload.testing import SidecarProcess
from tests.helpers.cli import cli, sidecar

NS = bytes(range(32))
KEYS = [bytes([i]) * 32 for i in range(3)]
DEADLINE_S = 60.0


def wait_for_log(proc: SidecarProcess, text: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while text not in proc.log_text():
        assert proc.alive(), proc.log_text()
        assert time.monotonic() < deadline, f"no {text!r} in:\n{proc.log_text()}"
        time.sleep(0.05)


def policy(path: Path, *, admin: bool) -> None:
    path.write_text(
        "version = 1\n[[grants]]\n"
        f"uid = {os.getuid()}\ntenants = ['acme']\nadmin = {'true' if admin else 'false'}\n"
    )
    path.chmod(0o644)


def audit(cwd: Path, sock: Path) -> list[dict[str, Any]]:
    r = cli(cwd, sock, "--dev", "audit", "--verify", "--json")
    assert r.returncode == 0, (r.stdout, r.stderr)
    data = json.loads(r.stdout)
    assert data["intact"], data["problems"]
    return list(data["records"])


def find(records: list[dict[str, Any]], **want: Any) -> list[dict[str, Any]]:
    return [r for r in records if all(r.get(k) == v for k, v in want.items())]


def test_every_action_leaves_its_line(tmp_path: Path, short_dir: Path) -> None:
    sock = short_dir / "kvo.sock"
    me = os.getuid()
    # Offline: init, then chunks of two tenants (creates their keys).
    assert cli(tmp_path, sock, "--dev", "init").returncode == 0
    cfg = StoreConfig(root=tmp_path / ".kvoffload/store", index_dir=tmp_path / ".kvoffload/index")
    s = Store(cfg, Kek.from_file(tmp_path / ".kvoffload/dev-kek"))
    for k in KEYS:
        s.put("acme", NS, k, [os.urandom(5000)])
    s.put("beta", NS, bytes([9]) * 32, [os.urandom(5000)])
    s.put("gamma", NS, bytes([8]) * 32, [os.urandom(5000)])
    salts = {t: s.tenant_salt(t).hex() for t in ("acme", "beta")}
    s.close()
    for args in (("ls",), ("fsck",), ("purge", "--tenant", "gamma", "--yes")):
        r = cli(tmp_path, sock, "--dev", *args)
        assert r.returncode == 0, r.stderr

    pol = tmp_path / "policy.toml"
    policy(pol, admin=True)
    conf = tmp_path / "kvo.toml"
    conf.write_text(f"[security]\npolicy = {json.dumps(str(pol))}\n")
    with sidecar(tmp_path, sock, "--config", str(conf)) as proc:
        for args in (("inspect",), ("ls",), ("fsck",)):
            r = cli(tmp_path, sock, "--dev", *args)
            assert r.returncode == 0, r.stderr
        r = cli(tmp_path, sock, "--dev", "purge", "--tenant", "acme", "--namespace", NS.hex(), "-y")
        assert r.returncode == 0, r.stderr
        # A hello naming a tenant this peer may not use.
        with SidecarClient(sock, "beta", staging_bytes=1 << 20) as client:
            assert client.lookup(KEYS) == 0
        # An admin verb of a peer without the admin right.
        policy(pol, admin=False)
        proc.signal(signal.SIGHUP)
        wait_for_log(proc, "SIGHUP: policy reloaded")
        r = cli(tmp_path, sock, "--dev", "inspect")
        assert r.returncode == 1 and "forbidden" in r.stderr
        sidecar_pid = proc.pid
        assert proc.stop() == 0
    # Offline again: a KEK rotation.
    new = tmp_path / "new-kek"
    new.write_bytes(os.urandom(32))
    new.chmod(0o600)
    r = cli(tmp_path, sock, "--dev", "keys", "rotate-kek", "--new-kek-file", str(new))
    assert r.returncode == 0, r.stderr

    recs = audit(tmp_path, sock)
    offline = {"via": "offline", "uid": me, "result": "ok"}
    for verb in ("init", "ls", "fsck", "purge", "rotate-kek"):
        assert find(recs, event="admin", verb=verb, **offline), verb
    assert find(recs, event="admin", verb="purge", tenant="gamma", via="offline")
    assert find(recs, event="purge_tenant", tenant="gamma")
    assert find(recs, event="destroy", tenant="gamma")
    assert find(recs, event="create_tenant", tenant="acme")
    assert find(recs, event="rotate_kek", kek_id=Kek.from_file(new).key_id)
    # Through the socket: each admin verb, with the peer's credentials.
    for verb in ("inspect", "ls", "fsck", "purge"):
        mine = find(recs, event="admin", verb=verb, result="ok", uid=me, via=None)
        assert mine, verb  # (purge asks inspect first: two inspects)
        for rec in mine:
            assert rec["gid"] is not None and rec["pid"] not in (None, sidecar_pid)
    (purge,) = find(recs, event="admin", verb="purge", via=None)
    assert purge["tenant"] == "acme" and purge["namespace"] == NS.hex() and purge["chunks"] == 3
    assert find(recs, event="purge_namespace", tenant="acme", chunks=3)
    (hello,) = find(recs, event="refused_access", verb="hello")
    assert hello["tenant"] == "beta" and hello["uid"] == me and hello["result"] == "refused"
    (denied,) = find(recs, event="refused_access", verb="inspect")
    assert denied["uid"] == me and denied["result"] == "refused"
    # Never keys, salts or data.
    text = "".join(p.read_text() for p in (tmp_path / ".kvoffload/index").glob("audit*.jsonl"))
    for salt in salts.values():
        assert salt not in text
    assert [r["seq"] for r in recs] == list(range(1, len(recs) + 1))


def test_tenant_and_since_filters_over_a_live_log(tmp_path: Path, short_dir: Path) -> None:
    sock = short_dir / "kvo.sock"
    assert cli(tmp_path, sock, "--dev", "init").returncode == 0
    assert cli(tmp_path, sock, "--dev", "ls", "--tenant", "acme").returncode == 0
    r = cli(tmp_path, sock, "--dev", "audit", "--tenant", "acme", "--json")
    recs = json.loads(r.stdout)["records"]
    assert recs and all(rec["tenant"] == "acme" for rec in recs)
    r = cli(tmp_path, sock, "--dev", "audit", "--since", "1h")
    assert r.returncode == 0 and "chain intact" in r.stdout
