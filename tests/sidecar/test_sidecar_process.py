"""The sidecar as a real daemon process (``kvoffload serve``), with real client processes.

``tests/sidecar/test_server.py`` drives the server in-process; these tests start
``python -m kvoffload.cli serve`` and talk to it only over its socket, from
other processes (``tests/sidecar_proc.py``), and kill processes where a test
is about crashes. No assertion is about elapsed time: every wait is a bounded
wait for a condition.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import stat
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvoffload import protocol as p
from kvoffload.client import SidecarClient
from kvoffload.layouts import v1
from kvoffload.protocol import CLIENT_MAGIC, MAX_FRAME, SERVER_MAGIC, ErrorCode
from kvoffload.transport import TransportClosed, UnixTransport
from tests.helpers.process import (
    NO_GRANT_UID,
    SOCKET_GROUP,
    UNUSED_UID,
    load,
    lookup,
    no_tracebacks,
    save,
    start_configured,
    tmp_files,
    values,
    write_config,
)
from tests.sidecar_proc import (
    NS,
    PAGE,
    Procs,
    Sidecar,
    chunk_key,
    chunk_layers,
    clean_env,
    object_relpath,
    wait_until,
)

# ---------------------------------------------------------------------------
# Helpers


def dev_socket(workdir: Path) -> Path:
    return workdir / ".kvoffload" / "kvoffload.sock"


def start_dev(procs: Procs, workdir: Path, env: dict[str, str] | None = None) -> Sidecar:
    s = procs.sidecar(workdir, dev_socket(workdir), Sidecar.serve_argv("--dev", "serve"), env=env)
    s.start().wait_ready()
    return s


def salt(tenant: str) -> dict[str, Any]:
    return {"op": "salt", "tenant": tenant}


def exact_reservation(tenant: str, seed: str, indices: list[int]) -> int:
    return sum(
        v1.object_size([len(x) for x in chunk_layers(tenant, seed, i)], True) for i in indices
    )


# ---------------------------------------------------------------------------
# 1. save in one process, load in another


def test_saved_chunks_load_in_another_process_encrypted_and_plaintext(
    procs: Procs, workdir: Path
) -> None:
    cfg = write_config(
        workdir,
        """\
        version = 1

        [tenants.plain]
        encryption = "none"

        [[grants]]
        uid = 0
        tenants = ["alpha", "plain"]
        """,
    )
    sidecar = start_configured(procs, workdir, cfg)
    idx = list(range(7))
    for t in ("alpha", "plain"):
        shapes = [[len(x) for x in chunk_layers(t, "one", i)] for i in idx]
        assert all(len(s) >= 2 for s in shapes)  # several layers
        assert all(n % PAGE for s in shapes for n in s)  # sizes off the page grid

    saved = procs.steps(sidecar.socket_path, [save("one", idx, "alpha"), save("one", idx, "plain")])
    assert values(saved) == [[True] * 7, [True] * 7]

    # Another process, other connections: same bytes, per tenant (same keys, other data).
    loaded = procs.steps(
        sidecar.socket_path,
        [
            load("one", idx, "alpha"),
            load("one", idx, "plain"),
            lookup("one", idx, "alpha"),
            lookup("one", idx, "plain"),
        ],
    )
    assert values(loaded) == [["ok"] * 7, ["ok"] * 7, 7, 7]
    assert all(not r["warnings"] for r in saved + loaded)
    assert sidecar.stats()["chunks"] == 14

    # The policy's encryption setting reached the disk.
    for i in idx:
        k = chunk_key("one", i)
        plain = (workdir / "store" / object_relpath("plain", k)).read_bytes()
        sealed = (workdir / "store" / object_relpath("alpha", k)).read_bytes()
        assert all(layer in plain for layer in chunk_layers("plain", "one", i))
        assert not any(layer[:64] in sealed for layer in chunk_layers("alpha", "one", i))
    no_tracebacks(sidecar)


# ---------------------------------------------------------------------------
# 2. many concurrent client processes


@pytest.mark.slow
def test_sixteen_concurrent_client_processes(procs: Procs, workdir: Path) -> None:
    sidecar = start_dev(procs, workdir)
    n_workers, shared = 16, 24
    tenants = {w: ("acme", "beta")[w % 2] for w in range(n_workers)}
    workers = [
        procs.child(
            "mixed",
            {
                "socket": str(sidecar.socket_path),
                "tenant": tenants[w],
                "worker": w,
                "shared": shared,
                "rounds": 24,
            },
        )
        for w in range(n_workers)
    ]
    reports = [w.finish(timeout_s=120)[-1] for w in workers]

    total: dict[str, int] = {}
    for r in reports:
        for name, n in r["counts"].items():
            total[name] = total.get(name, 0) + n
        assert r["warnings"] == [], r["warnings"]
    for problem in ("save_failed", "bad", "not_prefix", "lost", "lookup_short"):
        assert total.get(problem, 0) == 0, (problem, total)
    assert total["hit"] > 0 and total["save_shared"] > 0 and total["load_shared"] > 0

    shared_saved = {
        t: sorted({i for w, r in enumerate(reports) if tenants[w] == t for i in r["shared"]})
        for t in ("acme", "beta")
    }
    steps: list[dict[str, Any]] = []
    for t, idx in shared_saved.items():
        steps += [lookup("shared", idx, t), load("shared", idx, t)]
    for w, r in enumerate(reports):
        own = list(range(r["own"]))
        steps += [lookup(f"own-{w}", own, tenants[w]), load(f"own-{w}", own, tenants[w])]
    final = values(procs.steps(sidecar.socket_path, steps))
    for n, verdicts in zip(final[0::2], final[1::2], strict=True):
        assert verdicts == ["ok"] * len(verdicts)
        assert n == len(verdicts)

    stats = sidecar.wait_idle()
    expected = sum(len(v) for v in shared_saved.values()) + sum(r["own"] for r in reports)
    assert stats["chunks"] == expected
    no_tracebacks(sidecar)


# ---------------------------------------------------------------------------
# 3. a client that dies mid-store leaves nothing behind


def test_client_killed_between_prepare_and_complete_leaves_nothing(
    procs: Procs, workdir: Path
) -> None:
    # The default 60 s handle TTL: only the disconnect can release it in time.
    sidecar = start_dev(procs, workdir)
    idx = [0, 1, 2, 3]
    raw = procs.child(
        "raw",
        {"socket": str(sidecar.socket_path), "tenant": "acme", "seed": "mid", "indices": idx},
        stdin=True,
    )
    prepared = raw.wait_for(lambda m: "handle" in m)
    assert prepared["handle"] != 0 and prepared["statuses"] == ["write"] * 4
    held = sidecar.stats()
    assert held["reserved_bytes"] == exact_reservation("acme", "mid", idx)
    assert held["server"]["connections"] == 2

    raw.kill(signal.SIGKILL)
    stats = sidecar.wait_idle()
    assert stats["chunks"] == 0
    assert tmp_files(workdir / ".kvoffload" / "store") == []

    # Nothing is held: the same keys store and load again.
    out = procs.steps(sidecar.socket_path, [save("mid", idx), load("mid", idx), lookup("mid", idx)])
    assert values(out) == [[True] * 4, ["ok"] * 4, 4]
    assert sidecar.wait_idle()["chunks"] == 4
    no_tracebacks(sidecar)


def test_client_killed_during_a_big_save_leaves_nothing(procs: Procs, workdir: Path) -> None:
    sidecar = start_dev(procs, workdir)
    stream = procs.child(
        "stream",
        {
            "socket": str(sidecar.socket_path),
            "tenant": "acme",
            "seed": "big",
            "size": "big",
            "batch": 6,
            "staging": 1 << 20,  # smaller than a batch: each save is several rounds
        },
    )
    stream.wait_for(lambda m: "ok" in m)
    stream.wait_for(lambda m: "start" in m)
    stream.kill(signal.SIGKILL)
    # Every batch it began, including any begun before the kill landed.
    started = max(i for m in stream.seen if "start" in m for i in m["start"])

    sidecar.wait_idle()
    store_root = workdir / ".kvoffload" / "store"
    wait_until(lambda: not tmp_files(store_root), "no temp files left")
    assert sidecar.stats()["reserved_bytes"] == 0

    idx = list(range(started + 1))
    out = procs.steps(
        sidecar.socket_path,
        [save("big", idx, size="big"), load("big", idx, size="big"), lookup("big", idx)],
    )
    assert values(out) == [[True] * len(idx), ["ok"] * len(idx), len(idx)]
    assert sidecar.wait_idle()["chunks"] == len(idx)
    no_tracebacks(sidecar)


def test_abandoned_store_handle_expires_after_the_reservation_timeout(
    procs: Procs, workdir: Path
) -> None:
    sidecar = start_dev(procs, workdir, env={"KVOFFLOAD_SERVER_IDLE_RESERVATION_TIMEOUT": "1s"})
    idx = [0, 1, 2]
    raw = procs.child(
        "raw",
        {"socket": str(sidecar.socket_path), "tenant": "acme", "seed": "ttl", "indices": idx},
        stdin=True,
    )
    prepared = raw.wait_for(lambda m: "handle" in m)
    assert prepared["statuses"] == ["write"] * 3
    # The client stays connected and idle: only the expiry can free its space.
    wait_until(lambda: sidecar.stats()["reserved_bytes"] == 0, "the handle expired")
    assert sidecar.stats()["server"]["connections"] == 2

    raw.send("complete")
    assert raw.wait_for(lambda m: "code" in m) == {"code": int(ErrorCode.BAD_HANDLE)}
    raw.send("exit")
    raw.finish()

    out = procs.steps(sidecar.socket_path, [save("ttl", idx), load("ttl", idx)])
    assert values(out) == [[True] * 3, ["ok"] * 3]
    stats = sidecar.wait_idle()
    assert stats["chunks"] == 3
    assert tmp_files(workdir / ".kvoffload" / "store") == []


# ---------------------------------------------------------------------------
# 4. the daemon killed with SIGKILL keeps what it acknowledged


@pytest.mark.slow
def test_sidecar_sigkill_and_restart_keeps_acknowledged_chunks(procs: Procs, workdir: Path) -> None:
    sidecar = start_dev(procs, workdir)
    idx = list(range(12))
    assert values(procs.steps(sidecar.socket_path, [save("keep", idx)])) == [[True] * 12]
    before = sidecar.wait_idle()
    assert before["chunks"] == 12

    sidecar.kill()
    assert sidecar.socket_path.exists()  # stale: the restart must cope with it
    after = sidecar.start().wait_ready()
    assert after["chunks"] == 12
    assert after["store_id"] == before["store_id"]
    assert after["server"]["server_id"] != before["server"]["server_id"]
    assert values(procs.steps(sidecar.socket_path, [load("keep", idx), lookup("keep", idx)])) == [
        ["ok"] * 12,
        12,
    ]

    # Killed in the middle of a stream of saves.
    stream = procs.child(
        "stream",
        {"socket": str(sidecar.socket_path), "tenant": "acme", "seed": "s9", "batch": 3},
    )
    for _ in range(4):
        stream.wait_for(lambda m: "ok" in m)
    sidecar.kill()
    acked = sorted(i for m in stream.finish() if "ok" in m for i in m["ok"])
    assert len(acked) >= 12

    sidecar.start().wait_ready()
    out = values(procs.steps(sidecar.socket_path, [load("s9", acked), load("keep", idx)]))
    assert out == [["ok"] * len(acked), ["ok"] * 12]
    assert sidecar.stats()["chunks"] >= 12 + len(acked)
    no_tracebacks(sidecar)


# ---------------------------------------------------------------------------
# 5. uid isolation


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run children as other uids")
@pytest.mark.skipif(SOCKET_GROUP is None, reason="no nogroup/nobody group for the socket")
def test_other_uids_learn_nothing_about_a_tenant(procs: Procs, workdir: Path) -> None:
    import grp

    assert SOCKET_GROUP is not None
    gid = grp.getgrnam(SOCKET_GROUP).gr_gid
    workdir.chmod(0o755)
    cfg = write_config(
        workdir,
        f"""\
        version = 1

        [[grants]]
        uid = 0
        tenants = ["alpha"]
        admin = true

        [[grants]]
        uid = {UNUSED_UID}
        tenants = ["beta"]
        """,
        socket_group=SOCKET_GROUP,
    )
    sidecar = start_configured(procs, workdir, cfg)
    st = sidecar.socket_path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == gid
    secret = (workdir / "index" / "server-secret").read_bytes()

    def fake(tenant: str) -> str:
        return p.fake_salt(secret, tenant).hex()

    idx = [0, 1, 2, 3]
    root = procs.steps(sidecar.socket_path, [save("a", idx, "alpha"), salt("alpha")])
    assert root[0]["value"] == [True] * 4
    alpha_salt = root[1]["value"]
    assert alpha_salt != fake("alpha")

    other = procs.steps(
        sidecar.socket_path,
        [
            salt("alpha"),
            salt("alpha"),
            lookup("a", idx, "alpha"),
            load("a", idx, "alpha"),
            save("a", idx, "alpha"),
            salt("gamma"),
            salt("beta"),
            save("b", [0, 1, 2], "beta"),
            load("b", [0, 1, 2], "beta"),
            lookup("b", [0, 1, 2], "beta"),
        ],
        user=UNUSED_UID,
        group=gid,
    )
    v = values(other)
    # alpha: the stable fake salt, not alpha's (the same on a second connection)...
    assert v[0] == v[1] == fake("alpha") != alpha_salt
    assert len(bytes.fromhex(v[0])) == 32
    # ...and the answers for an empty tenant; the write is refused as FORBIDDEN.
    assert v[2] == 0
    assert v[3] == ["miss"] * 4
    assert v[4] == [False] * 4
    assert any("FORBIDDEN" in w for w in other[4]["warnings"]), other[4]
    # An unknown tenant gets a salt of the same kind.
    assert v[5] == fake("gamma")
    # Its own tenant works.
    assert v[6] != fake("beta")
    assert v[7:] == [[True] * 3, ["ok"] * 3, 3]
    assert not other[7]["warnings"] and not other[8]["warnings"]

    nobody = procs.steps(
        sidecar.socket_path,
        [
            salt("alpha"),
            salt("beta"),
            lookup("a", idx, "alpha"),
            lookup("b", [0, 1, 2], "beta"),
            load("a", idx, "alpha"),
            load("b", [0, 1, 2], "beta"),
            save("x", [0], "alpha"),
            {"op": "stats"},
        ],
        user=NO_GRANT_UID,
        group=gid,
    )
    w = values(nobody)
    assert w[:6] == [fake("alpha"), fake("beta"), 0, 0, ["miss"] * 4, ["miss"] * 3]
    assert w[6] == [False]
    assert "tenants" not in w[7]  # how many tenants exist is not its business

    # Root has no grant for beta either; alpha is intact; refused writes wrote nothing.
    back = values(
        procs.steps(
            sidecar.socket_path,
            [salt("beta"), lookup("b", [0, 1, 2], "beta"), load("a", idx, "alpha")],
        )
    )
    assert back == [fake("beta"), 0, ["ok"] * 4]
    assert sidecar.stats()["chunks"] == 7

    # Outside the socket's group a process cannot even connect.
    outsider = procs.steps(
        sidecar.socket_path, [salt("alpha")], user=NO_GRANT_UID, group=NO_GRANT_UID
    )
    assert outsider[0]["value"] is None
    assert any("Permission denied" in m for m in outsider[0]["warnings"]), outsider
    no_tracebacks(sidecar)


# ---------------------------------------------------------------------------
# 6. malformed input


def raw_exchange(path: Path, payload: bytes, *, read: bool = True) -> list[Any] | None:
    """Send bytes, half-close, and read until the server closes; None when not read.

    Returns the server's frames after its magic as (id, reply) pairs, or the
    string "no-magic" if the server did not even send its magic.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        s.connect(str(path))
        s.sendall(payload)
        if not read:
            return None
        s.shutdown(socket.SHUT_WR)
        data = bytearray()
        while chunk := s.recv(1 << 16):  # a timeout here fails the test: no close
            data += chunk
    assert data.startswith(SERVER_MAGIC), bytes(data[:64])
    frames = p.FrameDecoder(expect_magic=SERVER_MAGIC).feed(bytes(data), [])
    return [p.parse_reply(f.msg) for f in frames]


def frame(msg: dict[str, Any]) -> bytes:
    return p.encode_frame(msg)


HELLO = {"op": "hello", "id": 1, "min_version": 1, "max_version": 1, "client": "x", "tenants": []}


def test_malformed_input_never_hurts_the_daemon(procs: Procs, workdir: Path) -> None:
    sidecar = start_dev(procs, workdir)
    path = sidecar.socket_path
    rng = random.Random(7)

    def fds() -> int:
        return len(os.listdir(f"/proc/{sidecar.pid}/fd"))

    def client_works(i: int) -> None:
        with SidecarClient(path, "acme", staging_bytes=1 << 20, timeout_s=30) as c:
            layers = chunk_layers("acme", "mal", i)
            assert c.save(NS, [(chunk_key("mal", i), layers)]) == [True]
            got = c.load([chunk_key("mal", j) for j in range(i + 1)])
            assert all(g.ok for g in got)
            assert [bytes(x) for x in got[-1].layers] == layers
        assert sidecar.alive()

    client_works(0)
    sidecar.wait_idle()
    # The fewest it holds while idle (a stats connection may still be closing).
    baseline = min(fds() for _ in range(5) if sidecar.wait_idle())

    def codes(frames: list[Any] | None) -> list[tuple[int, int]]:
        assert frames is not None
        return [(rid, int(r.code)) for rid, r in frames]

    cases: list[tuple[str, bytes, Any]] = [
        # Not our magic: the server closes and says nothing more, not even to a hello.
        ("random bytes", rng.randbytes(4096), []),
        ("wrong magic", SERVER_MAGIC + frame(HELLO), []),
        ("random after magic", CLIENT_MAGIC + rng.randbytes(65536), None),
        ("oversized length", CLIENT_MAGIC + struct.pack("<I", MAX_FRAME + 1), [(0, 3)]),
        ("huge length", CLIENT_MAGIC + struct.pack("<I", 0xFFFFFFFF) + b"x" * 100, [(0, 3)]),
        ("zero length", CLIENT_MAGIC + struct.pack("<I", 0), [(0, 1)]),
        (
            "unsupported versions",
            CLIENT_MAGIC + frame({**HELLO, "min_version": 2, "max_version": 9}) + frame(HELLO),
            [(1, int(ErrorCode.UNSUPPORTED_VERSION))],
        ),
        ("request before hello", CLIENT_MAGIC + frame({"op": "stats", "id": 5}), [(5, 1)]),
    ]
    for n, (name, payload, expected) in enumerate(cases, start=1):
        frames = raw_exchange(path, payload)
        if expected is None:
            # Whatever it made of the garbage, it answered only with errors and closed.
            assert frames is not None and all(r.code != 0 for _, r in frames), name
        else:
            assert codes(frames) == expected, name
        if name == "unsupported versions":
            assert frames is not None
            assert frames[0][1].server_versions == (1, 1)
        client_works(n)

    # A well-formed hello, then a body that is not MessagePack: a fatal error frame, closed.
    t = UnixTransport.connect(path, timeout_s=20)
    t.send(p.request_message(1, p.Hello(1, 1, "then-garbage", ("acme",))))
    assert isinstance(p.parse_reply(t.recv().msg)[1], p.HelloReply)
    t.socket.sendall(struct.pack("<I", 5) + b"\xc1" * 5)
    rid, reply = p.parse_reply(t.recv().msg)
    assert isinstance(reply, p.ErrorReply)
    assert (rid, reply.code) == (0, ErrorCode.BAD_REQUEST)
    with pytest.raises(TransportClosed):
        t.recv()
    client_works(len(cases) + 1)

    # A frame cut short, then the client goes away.
    header = struct.pack("<I", 500)
    raw_exchange(path, CLIENT_MAGIC + header + frame(HELLO)[4:20], read=False)
    raw_exchange(path, CLIENT_MAGIC + frame(HELLO)[:7], read=False)
    client_works(len(cases) + 2)

    stats = sidecar.wait_idle()
    assert stats["chunks"] == len(cases) + 3
    # Every connection's socket and staging mapping was released.
    wait_until(lambda: fds() <= baseline, f"fds back to {baseline} (now {fds()})")
    assert sidecar.alive()
    no_tracebacks(sidecar)


# ---------------------------------------------------------------------------
# 7. socket activation


def test_socket_activation(procs: Procs, workdir: Path) -> None:
    path = workdir / "activated.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)
    fd = listener.fileno()
    wrapper = (
        "import os, sys\n"
        "os.environ['LISTEN_PID'] = str(os.getpid())\n"
        "os.environ['LISTEN_FDS'] = '1'\n"
        f"os.dup2({fd}, 3)\n"
        "os.execv(sys.executable, [sys.executable, '-m', 'kvoffload.cli', '--dev', 'serve'])\n"
    )
    try:
        first = procs.sidecar(
            workdir, path, [sys.executable, "-c", wrapper], pass_fds=[fd], log_name="activated"
        )
        first.start().wait_ready()
        out = procs.steps(path, [save("act", [0, 1, 2]), load("act", [0, 1, 2])])
        assert values(out) == [[True] * 3, ["ok"] * 3]
        assert not dev_socket(workdir).exists()  # it served the fd, bound nothing
        first.signal(signal.SIGTERM)
        assert first.wait() == 0
        assert path.exists()  # the socket belongs to whoever passed it: not unlinked

        # The listening socket outlives the daemon: a client that connects
        # meanwhile is served by the next one, here started with --fd N.
        waiting = UnixTransport.connect(path, timeout_s=60)
        waiting.send(p.request_message(1, p.Hello(1, 1, "early", ("acme",))))
        second = procs.sidecar(
            workdir,
            path,
            Sidecar.serve_argv("--dev", "serve", "--fd", str(fd)),
            pass_fds=[fd],
            log_name="fd",
        )
        second.start()
        rid, reply = p.parse_reply(waiting.recv().msg)
        waiting.close()
        assert rid == 1 and isinstance(reply, p.HelloReply), reply
        second.wait_ready()
        out = procs.steps(path, [load("act", [0, 1, 2]), save("act", [3]), load("act", [3])])
        assert values(out) == [["ok"] * 3, [True], ["ok"]]
        assert not dev_socket(workdir).exists()
        second.signal(signal.SIGTERM)
        assert second.wait() == 0
        assert path.exists()
        no_tracebacks(first)
        no_tracebacks(second)
    finally:
        listener.close()


# ---------------------------------------------------------------------------
# 8. SIGTERM drains


def test_sigterm_mid_stream_exits_cleanly_and_keeps_acknowledged_saves(
    procs: Procs, workdir: Path
) -> None:
    sidecar = start_dev(procs, workdir)
    stream = procs.child(
        "stream",
        {"socket": str(sidecar.socket_path), "tenant": "acme", "seed": "term", "batch": 4},
    )
    for _ in range(3):
        stream.wait_for(lambda m: "ok" in m)
    sidecar.signal(signal.SIGTERM)
    assert sidecar.wait(30) == 0
    assert not sidecar.socket_path.exists()
    assert "stopped" in sidecar.log_text()
    acked = sorted(i for m in stream.finish() if "ok" in m for i in m["ok"])
    assert len(acked) >= 12

    restarted = sidecar.start().wait_ready()
    assert restarted["chunks"] >= len(acked)
    out = values(procs.steps(sidecar.socket_path, [load("term", acked), lookup("term", acked)]))
    assert out == [["ok"] * len(acked), len(acked)]
    no_tracebacks(sidecar)


# ---------------------------------------------------------------------------
# 9. `kvoffload stats`


def cli(workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        Sidecar.serve_argv("--dev", *args),
        cwd=workdir,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow
def test_stats_cli_against_the_daemon(procs: Procs, workdir: Path) -> None:
    absent = cli(workdir, "stats")
    assert absent.returncode == 7, absent

    sidecar = start_dev(procs, workdir)
    assert values(procs.steps(sidecar.socket_path, [save("cli", [0, 1, 2])])) == [[True] * 3]
    r = cli(workdir, "stats")
    assert r.returncode == 0, r.stderr
    assert "chunks: 3" in r.stdout
    r = cli(workdir, "stats", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["chunks"] == 3 and data["reserved_bytes"] == 0

    sidecar.kill()  # leaves a stale socket file behind: still unreachable
    assert sidecar.socket_path.exists()
    dead = cli(workdir, "stats")
    assert dead.returncode == 7, dead
    assert "unreachable" in dead.stderr
