"""Revocation at once and deletion across tiers (issue 16, items 1 and 7), with a real
daemon (``kvoffload serve``) and real client processes under another uid.

Every wait is a bounded poll for a condition, never an assertion about time.
Mid-load tests use the store's test hook ``KVO_TEST_HOOK_LOAD_GATE``
(``kvoffload/store/cancel.py``): set only in these tests' daemon, it
pauses a load before a layer is copied into staging, so that the test can
change the policy or purge while the load is in flight.
"""

from __future__ import annotations

import grp
import json
import os
import signal
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.process import SOCKET_GROUP, UNUSED_UID, lookup, save, write_config
from tests.revoke_proc import HERE as REVOKE_PROC
from tests.sidecar_proc import (
    Child,
    Procs,
    Sidecar,
    chunk_key,
    chunk_layers,
    clean_env,
    object_relpath,
    wait_until,
)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or SOCKET_GROUP is None, reason="needs root to run peers under another uid"
)

PEER = UNUSED_UID


def _gid() -> int:
    assert SOCKET_GROUP is not None
    return grp.getgrnam(SOCKET_GROUP).gr_gid


def policy(peer_tenants: list[str], *, beta_table: bool = True, root_all: bool = True) -> str:
    """Root: every tenant (admin). PEER: ``peer_tenants``. beta: plaintext, direct path."""
    text = "version = 1\n\n"
    if beta_table:
        text += f'[tenants.beta]\nencryption = "none"\ndirect = true\ndirect_group = {_gid()}\n\n'
    text += "[[grants]]\nuid = 0\n"
    text += 'tenants = ["*"]\n' if root_all else 'tenants = ["alpha"]\n'
    text += "admin = true\n\n"
    text += f"[[grants]]\nuid = {PEER}\ntenants = {json.dumps(peer_tenants)}\n"
    return text


def replace_policy(path: Path, text: str) -> None:
    """As an editor saves: a new file renamed over the old one."""
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    tmp.chmod(0o644)
    os.replace(tmp, path)


def start(
    procs: Procs, workdir: Path, text: str, *, gate: Path | None = None
) -> tuple[Sidecar, Path]:
    workdir.chmod(0o755)
    cfg = write_config(workdir, text, socket_group=SOCKET_GROUP)
    env = {"KVO_TEST_HOOK_LOAD_GATE": str(gate)} if gate is not None else None
    s = procs.sidecar(
        workdir,
        workdir / "run" / "kvo.sock",
        Sidecar.serve_argv("--config", str(cfg), "serve"),
        env=env,
    )
    s.start().wait_ready()
    return s, cfg


def session(procs: Procs, sidecar: Sidecar, tenant: str, *, as_peer: bool = True) -> Child:
    args: dict[str, Any] = {"socket": str(sidecar.socket_path), "tenant": tenant}
    kw: dict[str, Any] = {"user": PEER, "group": _gid()} if as_peer else {}
    c = Child("session", args, stdin=True, script=REVOKE_PROC, **kw)
    procs.children.append(c)
    c.wait_for(lambda m: "ready" in m)
    return c


def ask(c: Child, **order: Any) -> dict[str, Any]:
    c.send(json.dumps(order))
    msg = c.next()
    assert msg is not None, c.stderr
    return msg


def audit(workdir: Path) -> list[dict[str, Any]]:
    path = workdir / "index" / "audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def generation(sidecar: Sidecar) -> int:
    return int(sidecar.stats()["policy"]["generation"])


# ---------------------------------------------------------------------------
# Revocation of a grant: by editing the file, by SIGHUP


def test_removing_a_grant_in_the_file_empties_the_tenant_for_open_connections(
    procs: Procs, workdir: Path
) -> None:
    sidecar, _ = start(procs, workdir, policy(["beta"]))
    peer = session(procs, sidecar, "beta")
    assert ask(peer, op="save", seed="e", indices=[0, 1, 2])["stored"] == [True] * 3
    assert ask(peer, op="lookup", seed="e", indices=[0, 1, 2])["found"] == 3
    gen0 = generation(sidecar)

    replace_policy(workdir / "policy.toml", policy(["gamma"]))
    # The same open connection: its next lookups answer like an empty tenant.
    wait_until(
        lambda: ask(peer, op="lookup", seed="e", indices=[0, 1, 2])["found"] == 0,
        "the peer's open connection lost tenant beta",
    )
    state = sidecar.stats()["policy"]
    assert state["generation"] > gen0 and state["last_reload_ok"] is True
    assert state["revoked_tenants"] == []  # beta is still named: a lost grant, not a revocation
    # Saving is refused as for any forbidden tenant; the chunks are still there for root.
    assert ask(peer, op="save", seed="e2", indices=[0]) == {"code": "FORBIDDEN"}
    assert procs.steps(sidecar.socket_path, [lookup("e", [0, 1, 2], "beta")])[0]["value"] == 3

    events = audit(workdir)
    reloads = [e for e in events if e["event"] == "policy_reload"]
    assert reloads and reloads[-1]["trigger"] == "policy file changed"
    assert reloads[-1]["diff"]["grants"][f"uid {PEER}"] == {"added": ["gamma"], "removed": ["beta"]}
    revokes = [e for e in events if e["event"] == "revoke"]
    assert any(
        c["uid"] == PEER and c["tenants"] == ["beta"] for r in revokes for c in r["connections"]
    ), revokes
    assert "Traceback" not in sidecar.log_text()


def test_sighup_revokes_a_grant_the_watcher_did_not_see(procs: Procs, workdir: Path) -> None:
    sidecar, _ = start(procs, workdir, policy(["beta"]))
    peer = session(procs, sidecar, "beta")
    assert ask(peer, op="save", seed="h", indices=[0, 1])["stored"] == [True, True]
    pol = workdir / "policy.toml"
    st = pol.stat()
    # Rewritten in place, same size, same mtime: the file watcher sees no change.
    old, new = policy(["beta"]), policy(["btea"])
    assert len(old) == len(new)
    with pol.open("r+") as f:
        f.write(new)
    os.utime(pol, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (pol.stat().st_ino, pol.stat().st_size) == (st.st_ino, st.st_size)

    sidecar.signal(signal.SIGHUP)
    wait_until(
        lambda: ask(peer, op="lookup", seed="h", indices=[0, 1])["found"] == 0,
        "SIGHUP took tenant beta from the open connection",
    )
    reloads = [e for e in audit(workdir) if e["event"] == "policy_reload"]
    assert [r["trigger"] for r in reloads] == ["SIGHUP"]


def test_a_malformed_policy_is_refused_and_the_old_one_stays_in_force(
    procs: Procs, workdir: Path
) -> None:
    sidecar, cfg = start(procs, workdir, policy(["beta"]))
    peer = session(procs, sidecar, "beta")
    assert ask(peer, op="save", seed="m", indices=[0, 1])["stored"] == [True, True]
    gen0 = generation(sidecar)
    # Line 9 names a tenant as a string, not a list.
    bad = policy(["beta"]).replace('tenants = ["beta"]', 'tenants = "beta"')
    replace_policy(workdir / "policy.toml", bad)
    wait_until(
        lambda: sidecar.stats()["policy"]["reloads"]["refused"] >= 1, "the bad policy was refused"
    )
    state = sidecar.stats()["policy"]
    line = bad.splitlines().index('tenants = "beta"') + 1
    assert state["last_reload_ok"] is False
    assert f"policy.toml:{line}:" in state["last_error"], state
    assert state["generation"] == gen0
    # The old policy is in force: the peer still has its tenant.
    assert ask(peer, op="lookup", seed="m", indices=[0, 1])["found"] == 2
    refused = [e for e in audit(workdir) if e["event"] == "policy_reload_refused"]
    assert refused and f"policy.toml:{line}:" in refused[-1]["error"]
    human = _cli(cfg, "stats")
    assert human.returncode == 0 and "LAST RELOAD REFUSED" in human.stdout, human
    # Fixing the file applies it.
    replace_policy(workdir / "policy.toml", policy(["gamma"]))
    wait_until(lambda: sidecar.stats()["policy"]["last_reload_ok"] is True, "the fix applied")
    assert ask(peer, op="lookup", seed="m", indices=[0, 1])["found"] == 0
    assert "Traceback" not in sidecar.log_text()


# ---------------------------------------------------------------------------
# In flight: loads, pending stores, direct-path leases


def test_a_revocation_mid_load_copies_no_further_byte_into_staging(
    procs: Procs, workdir: Path
) -> None:
    gate = workdir / "gate"
    gate.mkdir()
    sidecar, _ = start(procs, workdir, policy(["beta"]), gate=gate)
    peer = session(procs, sidecar, "beta")
    idx = [0, 1, 2, 3]
    assert ask(peer, op="save", seed="l", indices=idx)["stored"] == [True] * 4
    # Control: a load writes into staging, and "check" sees it.
    ask(peer, op="fill")
    assert ask(peer, op="load", seed="l", indices=idx)["found"] == [True] * 4
    assert ask(peer, op="check")["dirty"] > 0
    ask(peer, op="fill")

    # Paused before layer 1 of each chunk: layer 0 is in staging already.
    (gate / "hold").write_text("1")
    peer.send(json.dumps({"op": "load", "seed": "l", "indices": idx}))
    wait_until(lambda: (gate / "waiting").exists(), "the load reached the test hook")
    gen0 = generation(sidecar)
    replace_policy(workdir / "policy.toml", policy(["gamma"]))
    wait_until(lambda: generation(sidecar) > gen0, "the policy without the grant is in force")
    (gate / "hold").unlink()
    reply = peer.next()
    assert reply is not None and reply["found"] == [False] * 4, reply
    assert reply["handle"] == 0
    # At most the layers 0 copied before the revocation; no byte of any later layer.
    first_layers = sum(len(chunk_layers("beta", "l", i)[0]) for i in idx)
    everything = sum(len(x) for i in idx for x in chunk_layers("beta", "l", i))
    dirty = ask(peer, op="check")["dirty"]
    assert 0 < dirty <= first_layers < everything, (dirty, first_layers)
    # Cancelled loads are misses, not damage: the chunks are still there.
    assert procs.steps(sidecar.socket_path, [lookup("l", idx, "beta")])[0]["value"] == 4


def test_a_revocation_aborts_pending_stores_and_leases(procs: Procs, workdir: Path) -> None:
    sidecar, _ = start(procs, workdir, policy(["beta"]))
    peer = session(procs, sidecar, "beta")
    prep = ask(peer, op="prepare_store", seed="p", indices=[0, 1])
    assert prep["statuses"] == ["write", "write"] and prep["handle"]
    lease = ask(peer, op="lease_store", seed="q", indices=[0])
    assert lease["statuses"] == ["write"] and lease["handle"]
    leased = Path(lease["paths"][0])
    assert leased.exists()
    assert sidecar.stats()["reserved_bytes"] > 0

    replace_policy(workdir / "policy.toml", policy(["gamma"]))

    def released() -> bool:
        return sidecar.stats()["reserved_bytes"] == 0 and not leased.exists()

    wait_until(released, "reservations and the leased file released")
    # The handles were released: their completion stores and publishes nothing.
    assert ask(peer, op="complete", handle=prep["handle"]) == {"code": "OK", "stored": [False] * 2}
    assert ask(peer, op="complete", handle=lease["handle"]) == {"code": "OK", "stored": [False]}
    # ... once: the handle numbers are gone after that.
    assert ask(peer, op="complete", handle=prep["handle"])["code"] == "BAD_HANDLE"
    root = workdir / "store"
    for seed, i in (("p", 0), ("p", 1), ("q", 0)):
        assert not (root / object_relpath("beta", chunk_key(seed, i))).exists()
    assert procs.steps(sidecar.socket_path, [lookup("p", [0, 1], "beta")])[0]["value"] == 0


# ---------------------------------------------------------------------------
# A tenant removed from the policy: revoked for everyone, across a restart


def test_a_tenant_removed_from_the_policy_is_revoked_even_for_star_grants(
    procs: Procs, workdir: Path
) -> None:
    sidecar, _ = start(procs, workdir, policy(["beta"]))
    assert procs.steps(sidecar.socket_path, [save("r", [0, 1], "beta")])[0]["value"] == [True] * 2

    replace_policy(workdir / "policy.toml", policy(["gamma"], beta_table=False))

    def root_finds() -> int:
        return int(procs.steps(sidecar.socket_path, [lookup("r", [0, 1], "beta")])[0]["value"])

    wait_until(lambda: root_finds() == 0, "root's '*' grant no longer serves revoked beta")
    assert sidecar.stats()["policy"]["revoked_tenants"] == ["beta"]
    assert (workdir / "store" / object_relpath("beta", chunk_key("r", 0))).exists()  # not erased
    revokes = [e for e in audit(workdir) if e["event"] == "revoke"]
    assert any("beta" in r["revoked"] for r in revokes), revokes

    # A restart keeps it revoked (revoked.json beside the index).
    sidecar.stop()
    saved = json.loads((workdir / "index" / "revoked.json").read_text())
    assert saved["tenants"] == ["beta"]
    sidecar.start().wait_ready()
    assert root_finds() == 0
    # Granted again: served again (purge, not revocation, erases).
    replace_policy(workdir / "policy.toml", policy(["beta", "gamma"]))
    wait_until(lambda: root_finds() == 2, "beta granted again is served again")
    assert sidecar.stats()["policy"]["revoked_tenants"] == []


def test_a_tenant_removed_while_the_daemon_was_down_is_revoked_at_start(
    procs: Procs, workdir: Path
) -> None:
    sidecar, _ = start(procs, workdir, policy(["beta"]))
    assert procs.steps(sidecar.socket_path, [save("d", [0], "beta")])[0]["value"] == [True]
    sidecar.stop()
    replace_policy(workdir / "policy.toml", policy(["gamma"], beta_table=False))
    sidecar.start().wait_ready()
    assert procs.steps(sidecar.socket_path, [lookup("d", [0], "beta")])[0]["value"] == 0
    assert sidecar.stats()["policy"]["revoked_tenants"] == ["beta"]


# ---------------------------------------------------------------------------
# Purge: loads in flight, the report's tiers, engines


def _cli(cfg: Path, *args: str) -> subprocess.CompletedProcess[str]:
    from kvoffload.testing import cli_argv

    return subprocess.run(
        cli_argv("--config", str(cfg), *args),
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_purge_cancels_a_load_in_flight_and_reports_its_tiers(
    procs: Procs, workdir: Path
) -> None:
    gate = workdir / "gate"
    gate.mkdir()
    sidecar, cfg = start(procs, workdir, policy(["beta"]), gate=gate)
    owner = session(procs, sidecar, "alpha", as_peer=False)
    idx = [0, 1, 2]
    assert ask(owner, op="save", seed="g", indices=idx)["stored"] == [True] * 3
    ask(owner, op="fill")  # the save's bytes out of staging: only a load may write there now
    (gate / "hold").touch()
    owner.send(json.dumps({"op": "load", "seed": "g", "indices": idx}))
    wait_until(lambda: (gate / "waiting").exists(), "the load reached the test hook")

    done = _cli(cfg, "purge", "--tenant", "alpha", "--yes", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["chunks"] == 3
    reached, outside = report["tiers"]["reached"], report["tiers"]["outside"]
    for tier in ("index", "objects", "keys", "loads_in_flight", "direct_leases"):
        assert tier in reached, report
    assert "engine_gpu_prefix_cache" in outside
    (gate / "hold").unlink()
    reply = owner.next()
    assert reply is not None and reply["found"] == [False] * 3, reply
    assert ask(owner, op="check")["dirty"] == 0
    assert ask(owner, op="lookup", seed="g", indices=idx)["found"] == 0
    assert any(e["event"] == "purge_tenant" for e in audit(workdir))


def test_a_purge_revokes_the_tenants_leases_and_pending_stores(procs: Procs, workdir: Path) -> None:
    sidecar, cfg = start(procs, workdir, policy(["beta"]))
    peer = session(procs, sidecar, "beta")
    prep = ask(peer, op="prepare_store", seed="s", indices=[0])
    lease = ask(peer, op="lease_store", seed="t", indices=[0])
    leased = Path(lease["paths"][0])
    assert leased.exists()
    done = _cli(cfg, "purge", "--tenant", "beta", "--yes")
    assert done.returncode == 0, done.stderr
    assert "tiers reached:" in done.stdout and "tiers outside kvoffload:" in done.stdout
    wait_until(
        lambda: sidecar.stats()["reserved_bytes"] == 0 and not leased.exists(),
        "the purge released the reservation and the leased file",
    )
    assert ask(peer, op="complete", handle=lease["handle"]) == {"code": "OK", "stored": [False]}
    assert ask(peer, op="complete", handle=prep["handle"]) == {"code": "OK", "stored": [False]}
    assert not (workdir / "store" / object_relpath("beta", chunk_key("t", 0))).exists()


def test_purge_engine_resets_a_local_http_stand_in_and_reports_an_unreachable_one(
    procs: Procs, workdir: Path
) -> None:
    """The engine is a local HTTP server standing in for vLLM's /reset_prefix_cache."""
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    calls: list[str] = []

    class VllmStandIn(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            calls.append(self.path)
            body = b'{"success": true}' if self.path.startswith("/reset_prefix_cache") else b""
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), VllmStandIn)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    try:
        sidecar, cfg = start(procs, workdir, policy(["beta"]))
        assert procs.steps(sidecar.socket_path, [save("x", [0], "alpha")])[0]["value"] == [True]
        good = f"http://127.0.0.1:{httpd.server_address[1]}"
        ok = _cli(cfg, "purge", "--tenant", "alpha", "--yes", "--json", "--engine", good)
        assert ok.returncode == 0, ok.stderr
        assert calls == ["/reset_prefix_cache"]
        engines = json.loads(ok.stdout)["engines"]
        assert engines == [{"engine": good, "ok": True, "detail": engines[0]["detail"]}]

        assert procs.steps(sidecar.socket_path, [save("y", [0], "alpha")])[0]["value"] == [True]
        bad = _cli(
            cfg, "purge", "--tenant", "alpha", "--yes", "--engine", good,
            "--engine", f"127.0.0.1:{dead}",
        )  # fmt: skip
        assert bad.returncode == 1
        lines = bad.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("engine:") and "unreachable" in lines[0]
        assert "Traceback" not in bad.stderr
        # The store purge was done all the same.
        assert procs.steps(sidecar.socket_path, [lookup("y", [0], "alpha")])[0]["value"] == 0
        assert len(calls) == 2
    finally:
        httpd.shutdown()
        httpd.server_close()


# ---------------------------------------------------------------------------
# policy diff


def test_policy_diff_cli(workdir: Path) -> None:
    from kvoffload.testing import cli_argv

    old, new, bad = workdir / "old.toml", workdir / "new.toml", workdir / "bad.toml"
    old.write_text(policy(["beta", "delta"]))
    new.write_text(policy(["delta", "gamma"], beta_table=False))
    bad.write_text(textwrap.dedent("version = 1\n[[grants]]\nuid = 'x'\ntenants = []\n"))
    for f in (old, new, bad):
        f.chmod(0o644)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            cli_argv(*args), env=clean_env(), capture_output=True, text=True, check=False
        )

    text = run("policy", "diff", str(old), str(new))
    assert text.returncode == 0, text.stderr
    assert f"- grant uid {PEER}: beta" in text.stdout
    assert f"+ grant uid {PEER}: gamma" in text.stdout
    assert "- tenant beta (revoked" in text.stdout
    js = run("policy", "diff", str(old), str(new), "--json")
    d = json.loads(js.stdout)
    assert d["changed"] is True
    assert d["tenants"]["revoked"] == ["beta"]
    assert d["grants"][f"uid {PEER}"] == {"added": ["gamma"], "removed": ["beta"]}
    same = run("policy", "diff", str(old), str(old), "--json")
    assert json.loads(same.stdout)["changed"] is False
    refused = run("policy", "diff", str(old), str(bad))
    assert refused.returncode == 1
    assert refused.stderr.strip() == f"policy: {bad}:3: uid must be an integer, not 'x'"
    usage = run("policy", "diff", str(old))
    assert usage.returncode == 2
