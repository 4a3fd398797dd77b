"""The direct path (protocol-v1.md 5.14, 5.15; docs/spec/layout-v1.md §4.1) with a real daemon.

The sidecar runs as ``kvoffload serve``; workers are other processes
(``tests/sidecar_proc.py``) that write and read the leased files themselves.
What is checked: round trips across processes and with the staging path,
that the sidecar names nothing it has not verified, that leases leave
nothing behind however they end, that loads pin, that a reported corruption
is re-checked, and that a worker of another uid reaches its own tenant's
files through ``direct_group`` and nothing else. No assertion is about time.
"""

from __future__ import annotations

import grp
import signal
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvoffload.layouts import v1
from kvoffload.protocol import ErrorCode
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
from tests.sidecar_proc import NS, Procs, chunk_key, chunk_layers, object_relpath, wait_until

pytestmark = pytest.mark.skipif(not hasattr(__import__("os"), "O_NOFOLLOW"), reason="Linux only")

POLICY = """\
    version = 1

    [tenants.plain]
    encryption = "none"
    direct = true

    [tenants.stage]
    encryption = "none"

    [[grants]]
    uid = 0
    tenants = ["alpha", "plain", "stage"]
    admin = true
    """


def configure(workdir: Path, policy: str = POLICY, store_extra: str = "", **kw: Any) -> Path:
    cfg = write_config(workdir, policy, **kw)
    text = cfg.read_text()
    cfg.write_text(text.replace('durability = "batch"\n', f'durability = "batch"\n{store_extra}'))
    return cfg


def direct(step: dict[str, Any]) -> dict[str, Any]:
    return {**step, "direct": True}


def uses_direct(tenant: str) -> dict[str, Any]:
    return {"op": "uses_direct", "tenant": tenant, "direct": True}


def final_path(workdir: Path, tenant: str, seed: str, i: int) -> Path:
    return workdir / "store" / object_relpath(tenant, chunk_key(seed, i))


def lease(procs: Procs, sock: Path, **args: Any) -> Any:
    return procs.child(
        "lease",
        {"socket": str(sock), "tenant": "plain", "seed": "x", "indices": [0], **args},
        stdin=True,
    )


# ---------------------------------------------------------------------------


def test_direct_saves_and_loads_across_processes_and_paths(procs: Procs, workdir: Path) -> None:
    sidecar = start_configured(procs, workdir, configure(workdir))
    sock = sidecar.socket_path
    idx = list(range(6))
    out = procs.steps(
        sock,
        [
            uses_direct("plain"),
            uses_direct("alpha"),  # sealed: never offered
            uses_direct("stage"),  # plaintext without direct = true
            direct(save("d", idx, "plain")),
            direct(save("d", idx, "plain")),  # all present now
            direct(save("d", idx, "alpha")),  # falls back to staging
        ],
    )
    assert values(out) == [True, False, False, [True] * 6, [True] * 6, [True] * 6]
    assert all(not r["warnings"] for r in out)

    # Other processes: direct loads, staging loads of the same objects, lookups.
    out = procs.steps(
        sock,
        [
            direct(load("d", idx, "plain")),
            load("d", idx, "plain"),
            direct(load("d", idx, "alpha")),
            lookup("d", idx, "plain"),
            direct(load("d", [*idx, 99], "plain")),  # a miss at the end
        ],
    )
    assert values(out) == [["ok"] * 6, ["ok"] * 6, ["ok"] * 6, 6, ["ok"] * 6 + ["miss"]]

    stats = sidecar.wait_idle()
    assert stats["chunks"] == 12 and stats["reserved_bytes"] == 0
    assert tmp_files(workdir / "store") == []
    for i in idx:
        path = final_path(workdir, "plain", "d", i)
        assert stat.S_IMODE(path.stat().st_mode) == 0o440  # published read-only
        data = path.read_bytes()
        h = v1.decode_header(data)
        assert not h.sealed and h.chunk_key == chunk_key("d", i) and h.namespace == NS
        assert all(layer in data for layer in chunk_layers("plain", "d", i))
    no_tracebacks(sidecar)


@pytest.mark.parametrize(
    "fill", ["zeros", "flip", "wrongkey", "truncate", "extend"], ids=lambda f: f"worker-{f}"
)
def test_the_sidecar_names_nothing_it_has_not_verified(
    procs: Procs, workdir: Path, fill: str
) -> None:
    sidecar = start_configured(procs, workdir, configure(workdir))
    w = lease(procs, sidecar.socket_path, seed=fill, indices=[0, 1], fill=fill)
    leased = w.wait_for(lambda m: "handle" in m)
    assert leased["statuses"] == ["write", "write"]
    assert all(Path(x).exists() for x in leased["paths"])  # the sidecar made them
    assert sidecar.stats()["reserved_bytes"] > 0
    w.send("complete")
    assert w.wait_for(lambda m: "stored" in m) == {"code": 0, "stored": [False, False]}
    w.send("exit")
    w.finish()

    assert not any(Path(x).exists() for x in leased["paths"])
    assert not final_path(workdir, "plain", fill, 0).exists()
    stats = sidecar.wait_idle()
    assert stats["chunks"] == 0 and stats["reserved_bytes"] == 0
    assert "direct-path object refused" in sidecar.log_text()

    # Nothing was held back: the same keys store properly afterwards.
    out = procs.steps(
        sidecar.socket_path, [direct(save(fill, [0, 1], "plain")), load(fill, [0, 1], "plain")]
    )
    assert values(out) == [[True, True], ["ok", "ok"]]
    no_tracebacks(sidecar)


def test_a_good_raw_lease_is_stored_and_aborted_or_abandoned_leases_leave_nothing(
    procs: Procs, workdir: Path
) -> None:
    sidecar = start_configured(procs, workdir, configure(workdir))
    sock = sidecar.socket_path

    good = lease(procs, sock, seed="good", indices=[0, 1, 2])
    assert good.wait_for(lambda m: "handle" in m)["statuses"] == ["write"] * 3
    good.send("complete")
    assert good.wait_for(lambda m: "stored" in m)["stored"] == [True] * 3
    good.send("exit")
    good.finish()

    aborted = lease(procs, sock, seed="abort", indices=[0, 1])
    paths = aborted.wait_for(lambda m: "handle" in m)["paths"]
    aborted.send("abort")
    assert aborted.wait_for(lambda m: "code" in m) == {"code": 0}
    aborted.send("exit")
    aborted.finish()
    assert not any(Path(x).exists() for x in paths)

    killed = lease(procs, sock, seed="kill", indices=[0, 1])
    paths = killed.wait_for(lambda m: "handle" in m)["paths"]
    killed.kill(signal.SIGKILL)
    wait_until(lambda: not any(Path(x).exists() for x in paths), "the disconnect removed them")

    stats = sidecar.wait_idle()
    assert stats["chunks"] == 3 and stats["reserved_bytes"] == 0
    assert tmp_files(workdir / "store") == []
    out = procs.steps(sock, [load("good", [0, 1, 2], "plain"), lookup("kill", [0, 1], "plain")])
    assert values(out) == [["ok"] * 3, 0]
    no_tracebacks(sidecar)


def test_an_expired_lease_is_removed(procs: Procs, workdir: Path) -> None:
    sidecar = start_configured(procs, workdir, configure(workdir, reservation_timeout="1s"))
    w = lease(procs, sidecar.socket_path, seed="ttl", indices=[0])
    paths = w.wait_for(lambda m: "handle" in m)["paths"]
    # Connected and idle: only the expiry can remove the file.
    wait_until(lambda: not Path(paths[0]).exists(), "the lease expired")
    assert sidecar.stats()["reserved_bytes"] == 0
    w.send("complete")
    assert w.wait_for(lambda m: "code" in m) == {"code": int(ErrorCode.BAD_HANDLE)}
    w.send("exit")
    w.finish()


def test_sealed_and_forbidden_tenants_get_no_direct_path(procs: Procs, workdir: Path) -> None:
    sidecar = start_configured(procs, workdir, configure(workdir))
    sock = sidecar.socket_path
    w = lease(procs, sock, tenant="alpha")
    assert w.wait_for(lambda m: "code" in m)["code"] == int(ErrorCode.FORBIDDEN)
    w.finish()
    w = lease(procs, sock, tenant="stage")
    assert w.wait_for(lambda m: "code" in m)["code"] == int(ErrorCode.FORBIDDEN)
    w.finish()
    # A tenant this peer has no grant for: exactly an empty tenant's load answer.
    w = lease(procs, sock, tenant="nobody", mode="load")
    assert w.wait_for(lambda m: "found" in m) == {"handle": 0, "found": 0, "stop": "NOT_FOUND"}
    w.send("exit")
    w.finish()
    assert tmp_files(workdir / "store") == []


def test_a_direct_load_pins_its_chunks_against_eviction(procs: Procs, workdir: Path) -> None:
    one = v1.object_size([len(x) for x in chunk_layers("plain", "pin", 0)], False)
    cfg = configure(workdir, store_extra='capacity = "1MiB"\n')
    sidecar = start_configured(procs, workdir, cfg)
    sock = sidecar.socket_path
    assert values(procs.steps(sock, [direct(save("pin", [0, 1], "plain"))])) == [[True, True]]
    assert one < (1 << 20) // 4

    reader = lease(procs, sock, seed="pin", indices=[0, 1], mode="load")
    assert reader.wait_for(lambda m: "found" in m)["found"] == 2
    # Fill the store several times over: everything unpinned is evicted.
    out = procs.steps(sock, [direct(save("fill", list(range(40)), "plain"))])
    assert sum(out[0]["value"]) > 0
    assert values(procs.steps(sock, [lookup("pin", [0, 1], "plain")])) == [2]
    reader.send("complete")
    assert reader.wait_for(lambda m: "code" in m) == {"code": 0}
    reader.send("exit")
    reader.finish()
    # Unpinned: the next round of writes may evict them.
    procs.steps(sock, [direct(save("fill2", list(range(40)), "plain"))])
    assert values(procs.steps(sock, [lookup("pin", [0, 1], "plain")])) == [0]
    assert sidecar.stats()["capacity_bytes"] == 1 << 20
    no_tracebacks(sidecar)


def test_a_reader_reported_corruption_is_rechecked_and_dropped(procs: Procs, workdir: Path) -> None:
    sidecar = start_configured(procs, workdir, configure(workdir))
    sock = sidecar.socket_path
    idx = [0, 1, 2, 3]
    assert values(procs.steps(sock, [direct(save("rot", idx, "plain"))])) == [[True] * 4]
    # Bit rot in a layer of chunk 2 (the header stays valid, so the sidecar's
    # header check passes and only the reader's checksum can catch it).
    path = final_path(workdir, "plain", "rot", 2)
    h = v1.decode_header(path.read_bytes())
    path.chmod(0o640)
    with open(path, "r+b") as f:
        f.seek(h.layers[1].offset + 7)
        b = f.read(1)
        f.seek(h.layers[1].offset + 7)
        f.write(bytes([b[0] ^ 0x40]))

    out = procs.steps(sock, [direct(load("rot", idx, "plain"))])
    assert values(out) == [["ok", "ok", "miss", "miss"]]
    wait_until(lambda: not path.exists(), "the sidecar re-checked and dropped it")
    assert values(procs.steps(sock, [lookup("rot", idx, "plain")])) == [2]
    assert final_path(workdir, "plain", "rot", 3).exists()  # the good ones stay
    assert sidecar.stats()["corrupt"] >= 1
    no_tracebacks(sidecar)


def test_a_full_disk_is_refused_at_lease_time(procs: Procs, workdir: Path) -> None:
    mnt = workdir / "store"
    mnt.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)], check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a small tmpfs here: {exc}")
    try:
        sidecar = start_configured(procs, workdir, configure(workdir))
        big = {"size": "big", "seed": "full"}
        out = procs.steps(
            sidecar.socket_path,
            [direct({**save("full", list(range(8)), "plain"), **big})],
        )
        saved = out[0]["value"]
        assert False in saved  # the tmpfs holds at most a few
        assert any("NO_SPACE" in w for w in out[0]["warnings"])
        stats = sidecar.wait_idle()
        assert stats["reserved_bytes"] == 0
        assert tmp_files(mnt) == []
        # What was stored is intact.
        kept = [i for i, ok in enumerate(saved) if ok]
        out = procs.steps(sidecar.socket_path, [direct({**load("full", kept, "plain"), **big})])
        assert values(out) == [["ok"] * len(kept)]
        no_tracebacks(sidecar)
    finally:
        procs.close()
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.skipif(SOCKET_GROUP is None, reason="needs a nogroup/nobody group")
def test_a_worker_of_another_uid_reaches_its_tenant_through_direct_group(
    procs: Procs, workdir: Path
) -> None:
    assert SOCKET_GROUP is not None
    gid = grp.getgrnam(SOCKET_GROUP).gr_gid
    workdir.chmod(0o755)
    cfg = configure(
        workdir,
        f"""\
        version = 1

        [tenants.plain]
        encryption = "none"
        direct = true
        direct_group = "{SOCKET_GROUP}"

        [tenants.stage]
        encryption = "none"

        [[grants]]
        uid = 0
        tenants = ["*"]

        [[grants]]
        uid = {UNUSED_UID}
        tenants = ["plain", "stage"]
        """,
        socket_group=SOCKET_GROUP,
    )
    sidecar = start_configured(procs, workdir, cfg)
    sock = sidecar.socket_path
    idx = [0, 1, 2]
    worker = {"user": UNUSED_UID, "group": gid}
    out = procs.steps(
        sock,
        [
            uses_direct("plain"),
            direct(save("g", idx, "plain")),
            direct(load("g", idx, "plain")),
            direct(save("g", idx, "stage")),  # staging: the sidecar writes
        ],
        **worker,
    )
    assert values(out) == [True, [True] * 3, ["ok"] * 3, [True] * 3]
    assert all(not r["warnings"] for r in out)

    tenant_dir = workdir / "store" / "objects" / "plain"
    st = tenant_dir.stat()
    assert st.st_gid == gid and stat.S_IMODE(st.st_mode) == 0o3770
    obj = final_path(workdir, "plain", "g", 0)
    ost = obj.stat()
    assert (ost.st_uid, ost.st_gid, stat.S_IMODE(ost.st_mode)) == (0, gid, 0o440)
    # The sealed-path tenant's tree stays the sidecar's alone.
    assert (workdir / "store" / "objects" / "stage").stat().st_gid != gid

    # Another uid outside the group reaches neither file nor directory.
    paths = [str(obj), str(final_path(workdir, "stage", "g", 0))]
    probe = procs.child("try_open", {"paths": paths}, user=NO_GRANT_UID, group=NO_GRANT_UID)
    res = probe.finish()[0]
    assert res[paths[0]] == ["EACCES", "EACCES"]
    assert res[paths[1]] == ["EACCES", "EACCES"]
    # The group's worker may read its objects but not rewrite them.
    probe = procs.child("try_open", {"paths": paths}, **worker)
    res = probe.finish()[0]
    assert res[paths[0]] == ["ok", "EACCES"]
    no_tracebacks(sidecar)


@pytest.mark.gds
def test_direct_path_from_and_to_gpu_memory(procs: Procs, workdir: Path) -> None:
    """GPU tensors saved through the direct path and loaded back into GPU memory."""
    from kvoffload.gpu_probe import probe

    rep = probe()
    if not rep.kvikio_usable:
        pytest.skip(f"kvikio cannot do I/O here: {rep.kvikio_reason}")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    from kvoffload.client import SidecarClient

    sidecar = start_configured(procs, workdir, configure(workdir))
    g = torch.Generator(device="cpu").manual_seed(7)
    chunks = []
    for i in range(4):
        layers = [torch.randn(16 * 1024 + 3 * i, generator=g).cuda() for _ in range(3)]
        chunks.append((chunk_key("gpu", i), layers))
    with SidecarClient(sidecar.socket_path, "plain", direct=True) as c:
        assert c.uses_direct()
        assert c.save(NS, chunks) == [True] * 4
        outs = [[torch.empty_like(x) for x in layers] for _, layers in chunks]
        got = c.load_to([k for k, _ in chunks], lambda i, k, sizes: outs[i])
    assert got == [True] * 4
    for (_, layers), back in zip(chunks, outs, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(layers, back, strict=True))
    # The staging path reads the same objects, verified by the sidecar.
    with SidecarClient(sidecar.socket_path, "plain") as c:
        loaded = c.load([k for k, _ in chunks])
    assert all(x.ok for x in loaded)
    assert bytes(loaded[0].layers[0]) == chunks[0][1][0].cpu().numpy().tobytes()
