"""Sealed direct reads (protocol-v1.md §5.33) with a real ``kvoffload serve``.

The sidecar runs as its own process on real files; the worker is this test's
:class:`~kvoffload.client.SidecarClient` (``sealed_direct=True``), which gets
each object's descriptor over the Unix socket (SCM_RIGHTS) and the key of
that object alone, and verifies and decrypts it itself. What is checked: the
bytes round-trip, the descriptors are read-only and the keys open their own
object only (not another of the tenant, not another tenant's); after a
revocation or a purge nothing more is handed out (what a worker already
holds reads that object only); a torn or flipped object is a miss, never
wrong data, and the client goes on; objects sealed before per-object keys
load through staging. No assertion is about time.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import random
import subprocess
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvoffload.client import SidecarClient
from kvoffload.client.sealed import SealedPath, open_handed
from kvoffload.client.session import Session
from kvoffload.errors import CorruptObject
from kvoffload.layouts import v1
from kvoffload.protocol import ErrorCode, SealedLoad, SealedLoadReply, close_fds
from kvoffload.store import Store, StoreConfig
from kvoffload.store.keys.keyring import Kek
from kvoffload.testing import cli_argv

from ..sidecar_proc import Procs, Sidecar, clean_env, wait_until

NS = bytes(range(32))

POLICY = """\
    version = 1

    [[grants]]
    uid = 0
    tenants = [{tenants}]
    admin = true
    """


def key(tag: str, i: int) -> bytes:
    return hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=32).digest()


def layers(tenant: str, tag: str, i: int) -> list[bytes]:
    r = random.Random(f"{tenant}/{tag}/{i}")
    return [r.randbytes(5000 + 301 * j + i) for j in range(3)]


def chunks(tenant: str, tag: str, n: int) -> list[tuple[bytes, list[bytes]]]:
    return [(key(tag, i), layers(tenant, tag, i)) for i in range(n)]


def write_policy(workdir: Path, tenants: list[str]) -> None:
    pol = workdir / "policy.toml"
    tmp = workdir / "policy.toml.tmp"
    tmp.write_text(textwrap.dedent(POLICY.format(tenants=", ".join(f'"{t}"' for t in tenants))))
    tmp.chmod(0o644)
    tmp.replace(pol)


def configure(workdir: Path, store_extra: str = "") -> Path:
    kek = workdir / "kek"
    kek.write_bytes(os.urandom(32))
    kek.chmod(0o600)
    write_policy(workdir, ["acme", "beta"])
    cfg = workdir / "kvoffload.toml"
    cfg.write_text(
        textwrap.dedent(
            f"""\
            [store]
            root = "{workdir}/store"
            index_dir = "{workdir}/index"
            durability = "batch"
            {store_extra}
            [server]
            socket = "{workdir}/run/kvo.sock"

            [security]
            kek_file = "{kek}"
            policy = "{workdir}/policy.toml"
            """
        )
    )
    return cfg


class Node:
    def __init__(self, procs: Procs, workdir: Path, store_extra: str = "") -> None:
        self.workdir = workdir
        self.cfg = configure(workdir, store_extra)
        self.sock = workdir / "run" / "kvo.sock"
        self.procs = procs
        self.proc: Sidecar | None = None

    def start(self) -> Node:
        argv = Sidecar.serve_argv("--config", str(self.cfg), "serve")
        self.proc = self.procs.sidecar(self.workdir, self.sock, argv)
        self.proc.start().wait_ready()
        return self

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.stop()

    def client(self, tenant: str, **kw: object) -> SidecarClient:
        return SidecarClient(self.sock, tenant, sealed_direct=True, **kw)  # type: ignore[arg-type]

    def object_path(self, tenant: str, k: bytes) -> Path:
        return self.workdir / "store" / v1.object_relpath(tenant, k)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            cli_argv("--config", str(self.cfg), *args),
            capture_output=True,
            text=True,
            env=clean_env(),
            timeout=120,
            check=False,
        )


@pytest.fixture
def node(procs: Procs, workdir: Path) -> Iterator[Node]:
    n = Node(procs, workdir).start()
    yield n


def session_of(c: SidecarClient) -> Session:
    s, path = c._ensure_path()
    assert s is not None and isinstance(path, SealedPath), path
    return s


def sealed_call(s: Session, keys: list[bytes]) -> tuple[SealedLoadReply, list[int]]:
    reply, fds = s.call_fds(SealedLoad(s.tenant, tuple(keys)))
    assert isinstance(reply, SealedLoadReply), reply
    return reply, fds


def packed(sizes: list[int]) -> list[memoryview]:
    return [memoryview(bytearray(n)) for n in sizes]


def test_loads_round_trip_through_handed_descriptors(node: Node) -> None:
    data = chunks("acme", "rt", 40)  # more than one reply's descriptors
    with node.client("acme") as c:
        assert c.save(NS, data) == [True] * 40
        got = c.load([k for k, _ in data] + [key("rt", 999)])
        assert [r.ok for r in got] == [True] * 40 + [False]
        assert [[bytes(x) for x in r.layers] for r in got[:40]] == [ls for _, ls in data]
        # Straight into the caller's destinations too.
        dests: dict[int, list[bytearray]] = {}

        def dest_for(i: int, _k: bytes, sizes: Sequence[int]) -> list[bytearray]:
            dests[i] = [bytearray(n) for n in sizes]
            return dests[i]

        assert c.load_to([k for k, _ in data[:3]], dest_for) == [True] * 3
        assert [[bytes(x) for x in dests[i]] for i in range(3)] == [ls for _, ls in data[:3]]
    assert node.proc is not None
    assert "Traceback" not in node.proc.log_text()


def test_a_handed_descriptor_is_read_only_and_its_key_opens_that_object_only(node: Node) -> None:
    acme, beta = chunks("acme", "k", 2), chunks("beta", "k", 1)
    with node.client("acme") as ca, node.client("beta") as cb:
        assert ca.save(NS, acme) == [True, True] and cb.save(NS, beta) == [True]
        sa, sb = session_of(ca), session_of(cb)
        ra, fa = sealed_call(sa, [k for k, _ in acme])
        rb, fb = sealed_call(sb, [beta[0][0]])
        try:
            assert ra.found == 2 and len(fa) == 2 and rb.found == 1 and len(fb) == 1
            for fd in fa + fb:
                assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
                with pytest.raises(OSError):
                    os.pwrite(fd, b"x", 0)
            a0, a1 = ra.chunks[0], ra.chunks[1]
            assert len({a0.key, a1.key, rb.chunks[0].key}) == 3

            def dests(sizes: list[int]) -> list[memoryview]:
                return packed(sizes)

            got = open_handed(fa[0], a0, "acme", acme[0][0], dests)
            assert [bytes(x) for x in got] == acme[0][1]
            # Chunk 0's key on chunk 1's object, and on another tenant's
            # object of the same chunk key: neither opens.
            wrong1 = type(a1)(True, a1.size, a0.key, a1.namespace)
            with pytest.raises(CorruptObject):
                open_handed(fa[1], wrong1, "acme", acme[1][0], dests)
            b0 = rb.chunks[0]
            wrongb = type(b0)(True, b0.size, a0.key, b0.namespace)
            with pytest.raises(CorruptObject):
                open_handed(fb[0], wrongb, "beta", beta[0][0], dests)
        finally:
            close_fds(fa + fb)
    # A tenant the peer is not granted gets an empty tenant's answer: no descriptor.
    with node.client("gamma") as cg:
        reply, fds = sealed_call(session_of(cg), [beta[0][0], acme[0][0]])
        assert reply.found == 0 and fds == []
        assert reply.stop is ErrorCode.NOT_FOUND and reply.handle == 0


def test_nothing_is_handed_out_after_a_purge(node: Node) -> None:
    data = chunks("acme", "p", 3)
    with node.client("acme") as c:
        assert c.save(NS, data) == [True] * 3
        s = session_of(c)
        held, held_fds = sealed_call(s, [data[0][0]])
        try:
            assert held.found == 1
            out = node.cli("purge", "--tenant", "acme", "--yes", "--json")
            assert out.returncode == 0, out.stderr
            reply, fds = sealed_call(s, [k for k, _ in data])
            assert reply.found == 0 and fds == [] and reply.stop is ErrorCode.NOT_FOUND
            assert [r.ok for r in c.load([k for k, _ in data])] == [False] * 3
            # What the worker already holds: that one object, until it closes it.
            got = open_handed(held_fds[0], held.chunks[0], "acme", data[0][0], packed)
            assert [bytes(x) for x in got] == data[0][1]
        finally:
            close_fds(held_fds)


def test_nothing_is_handed_out_after_a_revocation(node: Node) -> None:
    data = chunks("acme", "r", 2)
    assert node.proc is not None
    with node.client("acme") as c:
        assert c.save(NS, data) == [True, True]
        s = session_of(c)
        reply, fds = sealed_call(s, [k for k, _ in data])
        close_fds(fds)
        assert reply.found == 2
        gen = node.proc.stats()["policy"]["generation"]
        write_policy(node.workdir, ["beta"])  # acme named nowhere: revoked
        wait_until(lambda: node.proc.stats()["policy"]["generation"] > gen, "policy reload")  # type: ignore[union-attr]
        reply, fds = sealed_call(s, [k for k, _ in data])
        assert reply.found == 0 and fds == [] and reply.handle == 0
        assert [r.ok for r in c.load([k for k, _ in data])] == [False, False]
    write_policy(node.workdir, ["acme", "beta"])  # named again: served again
    wait_until(lambda: node.proc.stats()["policy"]["generation"] > gen + 1, "policy reload")  # type: ignore[union-attr]
    with node.client("acme") as c:
        assert [r.ok for r in c.load([k for k, _ in data])] == [True, True]


def test_a_torn_or_flipped_object_is_a_miss_and_the_client_goes_on(node: Node) -> None:
    data = chunks("acme", "t", 6)
    with node.client("acme") as c:
        assert c.save(NS, data) == [True] * 6
        keys = [k for k, _ in data]
        # A torn object (cut short): chunk 1 and after miss; chunk 0 loads.
        torn = node.object_path("acme", keys[1])
        with open(torn, "r+b") as f:
            f.truncate(torn.stat().st_size // 2)
        got = c.load(keys[:3])
        assert [r.ok for r in got] == [True, False, False]
        assert [bytes(x) for x in got[0].layers] == data[0][1]
        # A flipped byte in a layer: only the worker sees it (the sidecar hands
        # out after the header check); it is a miss, never wrong data.
        flip = node.object_path("acme", keys[4])
        h = v1.decode_header(flip.read_bytes())
        raw = bytearray(flip.read_bytes())
        raw[h.layers[2].offset + 7] ^= 0x01
        flip.write_bytes(bytes(raw))
        got = c.load(keys[3:6])
        assert [r.ok for r in got] == [True, False, False]
        assert [bytes(x) for x in got[0].layers] == data[3][1]
        # Reported, re-checked by the sidecar, dropped: a miss from the index now.
        assert c.lookup(keys[3:6]) == 1
        # The client is unharmed: the other chunks still load.
        assert [r.ok for r in c.load(keys[2:4])] == [True, True]
    assert node.proc is not None and node.proc.alive()
    assert "Traceback" not in node.proc.log_text()


def test_objects_sealed_before_per_object_keys_load_through_staging(node: Node) -> None:
    new = chunks("acme", "n", 3)
    with node.client("acme") as c:
        assert c.save(NS, new) == [True] * 3
    node.stop()
    # An earlier build's objects: sealed under the tenant's DEK itself.
    old = chunks("acme", "o", 3)
    store = Store(
        StoreConfig(
            root=node.workdir / "store", index_dir=node.workdir / "index", object_keys=False
        ),
        Kek.from_file(node.workdir / "kek"),
    )
    try:
        assert store.put_many("acme", NS, old) == [True] * 3
    finally:
        store.close()
    h = v1.decode_header(node.object_path("acme", old[0][0]).read_bytes())
    assert not h.flags & v1.FLAG_OBJECT_KEY
    node.start()
    mixed = new[:2] + old + new[2:]
    with node.client("acme") as c:
        s = session_of(c)
        reply, fds = sealed_call(s, [k for k, _ in mixed])
        close_fds(fds)
        from kvoffload.protocol import CompleteLoad

        s.call(CompleteLoad(reply.handle))
        assert reply.found == 2 and reply.stop is ErrorCode.UNSUPPORTED  # stops at the old one
        got = c.load([k for k, _ in mixed])
        assert [r.ok for r in got] == [True] * 6
        assert [[bytes(x) for x in r.layers] for r in got] == [ls for _, ls in mixed]


def test_a_sidecar_told_object_keys_false_seals_under_the_dek_and_still_serves(
    procs: Procs, workdir: Path
) -> None:
    node = Node(procs, workdir, "object_keys = false\n").start()
    data = chunks("acme", "cfg", 3)
    with node.client("acme") as c:
        assert c.save(NS, data) == [True] * 3
        h = v1.decode_header(node.object_path("acme", data[0][0]).read_bytes())
        assert h.sealed and not h.flags & v1.FLAG_OBJECT_KEY
        reply, fds = sealed_call(session_of(c), [k for k, _ in data])
        assert reply.found == 0 and fds == [] and reply.stop is ErrorCode.UNSUPPORTED
        got = c.load([k for k, _ in data])
        assert [[bytes(x) for x in r.layers] for r in got] == [ls for _, ls in data]
