"""The JuiceFS tier of issue 28 (items 1 and 2): real ``kvoffload serve``
processes, one per JuiceFS client, killed with SIGKILL and restarted inside an
evictor epoch, and a node started without ``shared`` on the live root.

What is on the volume is read from its own metadata through a client that
caches nothing (tests/sharedfs.py ``bytes_under``). Skipped, with the reason,
where FUSE or juicefs is absent.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload.store.shared.lease import EvictorLease, LeaseState
from kvoffload.testing import cli_argv, sidecar_env
from tests.helpers.paths import REPO
from tests.sharedfs import bytes_under, juice_volume, juicefs_unavailable
from tests.sidecar_proc import Sidecar, wait_until

pytestmark = pytest.mark.skipif(
    juicefs_unavailable() is not None, reason=str(juicefs_unavailable())
)

CAP = 8 << 20
#: The evictor lease of these nodes (their config below).
LEASE_S = 4.0
NS = hashlib.sha256(b"issue 28: a shared root across restarts").digest()
LAYERS, LAYER_BYTES = 3, 30_000  # ~94 KB objects: ~89 fill the capacity


@pytest.fixture(scope="module")
def volume(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Path], Path]]:
    """Two node clients and an observer that caches nothing; the volume's metadata."""
    base = tmp_path_factory.mktemp("juicefs")
    with juice_volume(base, nodes=2, observer=True) as mounts:
        yield mounts, base / "meta.db"


@pytest.fixture
def policy_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvo28-", dir="/tmp"))  # socket paths stay short
    kek = d / "kek"
    kek.write_bytes(os.urandom(32))
    kek.chmod(0o600)
    (d / "policy.toml").write_text(
        f'version = 1\n\n[[grants]]\nuid = {os.getuid()}\ntenants = ["acme"]\nadmin = true\n'
    )
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Node:
    """One node: its config (root on its own JuiceFS client, index and socket on
    local disk) and its sidecar process, started as often as the test says."""

    def __init__(self, base: Path, name: str, root: Path, *, shared: bool = True) -> None:
        self.name = name
        self.dir = base / name
        self.dir.mkdir()
        self.config = self.dir / "kvoffload.toml"
        self.config.write_text(
            f'[store]\nroot = "{root}"\nindex_dir = "{self.dir}/index"\n'
            f'durability = "batch"\nshared = {"true" if shared else "false"}\n'
            f'journal_poll = "100ms"\nevictor_lease = "{LEASE_S:g}s"\ncapacity = "{CAP}"\n\n'
            f'[server]\nsocket = "{self.dir}/kvo.sock"\n\n'
            f'[security]\nkek_file = "{base}/kek"\npolicy = "{base}/policy.toml"\n'
        )
        self.proc: Sidecar | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        self.proc = Sidecar(
            self.dir,
            self.dir / "kvo.sock",
            Sidecar.serve_argv("--config", str(self.config), "serve"),
            log_name=f"sidecar-{self.starts}",
        )
        self.proc.start().wait_ready()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()

    def shared(self) -> dict[str, Any]:
        assert self.proc is not None
        info: dict[str, Any] = self.proc.stats()["shared"]
        return info

    def client(self) -> Any:
        from kvoffload.client import SidecarClient

        return SidecarClient(self.dir / "kvo.sock", "acme", staging_bytes=4 << 20)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def _chunk(seed: str, i: int) -> tuple[bytes, list[bytes]]:
    rng = random.Random(f"{seed}/{i}")
    key = hashlib.sha256(f"{seed}/{i}".encode()).digest()
    return key, [rng.randbytes(LAYER_BYTES) for _ in range(LAYERS)]


class Saver:
    """Saves batches of 4 chunks through one client; counts what was acknowledged."""

    def __init__(self, client: Any, seed: str) -> None:
        self.client, self.seed = client, seed
        self.i = 0
        self.acked = 0

    def batch(self) -> int:
        chunks = [_chunk(self.seed, self.i + j) for j in range(4)]
        self.i += 4
        ok = sum(self.client.save(NS, chunks))
        self.acked += ok
        if ok < 4:
            time.sleep(0.1)  # refused (the root is full until the evictor makes room)
        return ok


def _lease(root: Path) -> LeaseState | None:
    return EvictorLease(root, "0" * 32, "observer").current()


def test_a_sidecar_killed_and_restarted_inside_an_epoch_keeps_what_it_wrote(
    volume: tuple[list[Path], Path], policy_dir: Path
) -> None:
    """kill -9 of a node's sidecar inside an evictor epoch: its restart knows what
    it wrote under the epoch (before, `.shared.grant.written` fell to 0 and the
    node was granted its whole cumulative grant again: the root outgrew its
    capacity), and the root stays within the capacity, a kill during saves too."""
    mounts, meta = volume
    (mounts[0] / "restart").mkdir()
    objects = mounts[2] / "restart" / "objects"
    b = Node(policy_dir, "b", mounts[1] / "restart")
    a = Node(policy_dir, "a", mounts[0] / "restart")
    b.start()  # first: the holder, for the whole test
    a.start()
    clients = [a.client()]
    try:
        saver = Saver(clients[0], "a")
        peak = 0

        def within_capacity() -> None:
            nonlocal peak
            used = bytes_under(meta, objects)
            peak = max(peak, used)
            assert used <= CAP, f"{used} bytes on the root, capacity {CAP}"

        chunk_bytes = LAYERS * LAYER_BYTES
        while saver.acked * chunk_bytes < 3 * CAP:  # three capacities through a
            saver.batch()
            within_capacity()
            assert saver.i < 4000, "saves through a stopped being acknowledged"
        before = a.shared()["grant"]
        assert before["written"] > 2 * CAP and before["bytes"] >= before["written"]
        epoch = before["epoch"]
        a.kill()
        a.start()
        after = a.shared()["grant"]
        assert (after["epoch"], after["written"]) == (epoch, before["written"])
        clients[0].close()
        clients[0] = a.client()
        saver.client = clients[0]
        target = saver.acked + 2 * CAP // chunk_bytes
        while saver.acked < target:  # two more capacities after the restart
            saver.batch()
            within_capacity()
        # Killed again, this time with saves in flight from another client.
        busy = _saving_process(a, "busy")
        wait_until(lambda: a.shared()["writes_in_flight"] > 0, "a save in flight", 60)
        a.kill()
        busy.kill()
        busy.wait(30)
        a.start()
        assert a.shared()["grant"]["epoch"] == epoch
        clients[0].close()
        clients[0] = a.client()
        saver.client = clients[0]
        target = saver.acked + CAP // chunk_bytes
        while saver.acked < target:
            saver.batch()
            within_capacity()
        cur = _lease(mounts[2] / "restart")
        assert cur is not None and cur.epoch == epoch  # one epoch throughout
        print(f"peak {peak} of {CAP} bytes; {saver.acked} chunks acknowledged through a")
    finally:
        for c in clients:
            c.close()
        a.stop()
        b.stop()


def _saving_process(node: Node, seed: str) -> subprocess.Popen[bytes]:
    """A client process that saves through ``node`` until it is killed."""
    code = (
        "import sys, time\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from tests.store.test_shared_juicefs_restart import NS, _chunk\n"
        "from kvoffload.client import SidecarClient\n"
        "c = SidecarClient(sys.argv[1], 'acme', staging_bytes=4 << 20)\n"
        "i = 0\n"
        "while True:\n"
        "    c.save(NS, [_chunk(sys.argv[3], i + j) for j in range(8)])\n"
        "    i += 8\n"
    )
    repo = str(REPO)
    env = sidecar_env()
    env["PYTHONPATH"] = os.pathsep.join([repo, env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, "-c", code, str(node.dir / "kvo.sock"), repo, seed],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def test_a_restarted_sidecar_that_takes_the_lease_does_not_empty_the_root(
    volume: tuple[list[Path], Path], policy_dir: Path
) -> None:
    """A node killed mid-epoch and restarted that takes the lease counts what it
    saw of the others' grants: before, it counted every byte ever granted in the
    epoch as unused, evicted the whole root and granted nothing for three lease
    times (0 bytes stored for ~10 s)."""
    mounts, meta = volume
    (mounts[0] / "takeover").mkdir()
    root = mounts[2] / "takeover"
    a = Node(policy_dir, "a", mounts[0] / "takeover")
    b = Node(policy_dir, "b", mounts[1] / "takeover")
    a.start()  # first: the holder of epoch 1
    b.start()
    clients = [a.client(), b.client()]
    try:
        savers = [Saver(clients[0], "a"), Saver(clients[1], "b")]
        chunk_bytes = LAYERS * LAYER_BYTES
        while sum(s.acked for s in savers) * chunk_bytes < 4 * CAP:
            for s in savers:
                s.batch()
            assert savers[0].i < 4000
        first = _lease(root)
        assert first is not None and first.holder == a.shared()["node_id"]
        assert sum(first.grants.values()) > 3 * CAP  # cumulative: far above the capacity
        wait_until(lambda: b.shared()["followed"] > 0, "b follows a's journal")
        # b pauses (so that the restarted a, not b, takes the role); a is killed
        # and restarted at once, and takes the next epoch once epoch 1 has looked
        # unchanged for the lease time.
        assert b.proc is not None
        b.proc.signal(signal.SIGSTOP)
        a.kill()
        before = bytes_under(meta, root / "objects")
        a.start()
        clients[0].close()
        clients[0] = a.client()
        savers[0].client = clients[0]

        def taken() -> LeaseState | None:
            cur = _lease(root)
            return cur if cur is not None and cur.epoch > first.epoch and cur.renewal else None

        wait_until(lambda: taken() is not None, "the restarted a takes the next epoch", 60)
        new = taken()
        assert new is not None and new.holder == first.holder
        # Its first grants are on file at once: not after three lease times.
        assert new.grants.get(new.holder, 0) > 0
        # Saves land within one lease time (4 s), where they were refused for three;
        # the first batch may still meet a grant topped up on the holder's next tick.
        refused_until = time.monotonic() + LEASE_S
        while savers[0].batch() < 4:
            assert time.monotonic() < refused_until, "saves refused for a lease time"
        # It evicted at most what the others' unused grants of epoch 1 call for
        # (at most grant_max per node, down to the low watermark), not the root.
        after = bytes_under(meta, root / "objects")
        assert after >= int(CAP * 0.85) - CAP // 4 - 4 * chunk_bytes, (before, after)
        b.proc.signal(signal.SIGCONT)
        for _ in range(10):
            for s in savers:
                s.batch()
            assert bytes_under(meta, root / "objects") <= CAP
        print(f"root before the takeover {before}, after {after} of {CAP} bytes")
    finally:
        if b.proc is not None:
            b.proc.signal(signal.SIGCONT)
        for c in clients:
            c.close()
        a.stop()
        b.stop()


def test_a_sidecar_without_shared_on_a_live_shared_root_refuses_to_start(
    volume: tuple[list[Path], Path], policy_dir: Path
) -> None:
    """With `shared = false` on a root two nodes journal into, `serve` walked the
    tree, journaled nothing and, with a capacity, one save evicted the others'
    objects without a record. It refuses: one line, a non-zero exit, nothing
    touched; the shared nodes go on serving every chunk they acknowledged."""
    mounts, meta = volume
    (mounts[0] / "plain").mkdir()
    a = Node(policy_dir, "a", mounts[0] / "plain")
    b = Node(policy_dir, "b", mounts[1] / "plain")
    a.start()
    b.start()
    clients = [a.client(), b.client()]
    try:
        chunks = [_chunk("plain", i) for i in range(12)]
        assert all(clients[0].save(NS, chunks[:6]))
        assert all(clients[1].save(NS, chunks[6:]))
        keys = [k for k, _ in chunks]
        wait_until(lambda: clients[1].lookup(keys) == 12, "b sees a's chunks")
        objects = mounts[2] / "plain" / "objects"
        on_disk = bytes_under(meta, objects)
        c = Node(policy_dir, "c", mounts[1] / "plain", shared=False)
        try:
            r = subprocess.run(
                cli_argv("--config", str(c.config), "serve"),
                capture_output=True,
                text=True,
                env=sidecar_env(),
                timeout=60,
                check=False,
            )
        except subprocess.TimeoutExpired:
            pytest.fail("serve started on a live shared root without shared = true")
        assert r.returncode == 1, r.stderr
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        assert "is shared: 2 other node(s)" in lines[0] and "shared = true" in lines[0]
        assert not (c.dir / "index" / "lmdb").exists()
        assert bytes_under(meta, objects) == on_disk
        for cl in clients:
            got = cl.load(keys)
            assert [g.ok for g in got] == [True] * 12
            assert all(
                [bytes(x) for x in g.layers] == layers
                for g, (_k, layers) in zip(got, chunks, strict=True)
            )
    finally:
        for cl in clients:
            cl.close()
        a.stop()
        b.stop()
