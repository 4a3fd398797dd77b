"""A whole-tenant purge racing saves of the same tenant (issue 28 item 7).

A save either lands wholly after the purge (a new key, its file, its record:
readable) or reports not stored; never an index record without its file, a
record whose object the destroyed key sealed, or an acknowledgement of a
chunk the purge then removes. Real files, real LMDB, real AES-GCM; the race
is made deterministic by running the racing save from inside the purge's own
steps (its key destruction, its file removal), and shown with real
concurrent threads and a real sidecar process.
"""

from __future__ import annotations

import hashlib
import random
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload.errors import TransferCancelled
from kvoffload.layouts import v1
from kvoffload.store import Store, StoreConfig
from kvoffload.store.keys.keyring import Kek
from tests.helpers.stores import make_store

NS = bytes(range(32))


def key(tag: str, i: int) -> bytes:
    return hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=32).digest()


def layers(tag: str, i: int, n: int = 3) -> list[bytes]:
    rng = random.Random(f"{tag}/{i}")
    return [rng.randbytes(2000 + 37 * j) for j in range(n)]


@pytest.fixture
def s(tmp_path: Path, kek_file: Path) -> Iterator[Store]:
    store = make_store(tmp_path / "store", kek_file, durability="none", io_streams=4, ram_cache=0)
    yield store
    store.close()


def save(store: Store, tag: str, n: int) -> list[bool] | None:
    """put_many of ``n`` chunks; None when the store refused the batch (cancelled)."""
    chunks = [(key(tag, i), layers(tag, i)) for i in range(n)]
    try:
        return store.put_many("acme", NS, chunks)
    except TransferCancelled:
        return None


def assert_whole(store: Store) -> None:
    """Every record of acme has its file and loads its own bytes; fsck is clean."""
    for rec in store.index.records(tenant="acme"):
        assert (store.root / v1.object_relpath("acme", rec.chunk_key)).exists(), rec
    rep = store.fsck()
    assert rep.missing_files == [] and rep.corrupt_files == [], rep.to_dict()


def during(monkeypatch: pytest.MonkeyPatch, target: Any, name: str, fn: Callable[[], None]) -> None:
    """Run ``fn`` (once) at the start of ``target.name``, then the real call."""
    real = getattr(target, name)
    done = threading.Event()

    def hooked(*a: Any, **kw: Any) -> Any:
        if not done.is_set():
            done.set()
            fn()
        return real(*a, **kw)

    monkeypatch.setattr(target, name, hooked)


def test_a_save_during_the_file_removal_lands_whole(
    s: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    save(s, "old", 6)
    got: list[list[bool] | None] = []

    # The purge's file removal starts: a save of the tenant runs to its end first
    # (in another thread, as the sidecar's would).
    def racing_save() -> None:
        t = threading.Thread(target=lambda: got.append(save(s, "new", 5)))
        t.start()
        t.join()

    during(monkeypatch, shutil, "rmtree", racing_save)
    s.purge_tenant("acme", wait=True)
    assert got, "the racing save did not run"
    assert_whole(s)
    for i in range(6):
        assert s.get("acme", key("old", i)) is None
    if got[0] is not None:  # stored: then readable, with a key made after the purge
        for i in range(5):
            assert s.get("acme", key("new", i)) == layers("new", i), i
    # A re-save is acknowledged only where the chunk then loads.
    assert save(s, "new", 5) is not None
    for i in range(5):
        assert s.get("acme", key("new", i)) == layers("new", i), i
    assert_whole(s)


def test_a_save_while_the_keys_are_destroyed_is_refused_or_readable(
    s: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    save(s, "old", 4)
    got: list[list[bool] | None] = []

    def racing_save() -> None:
        t = threading.Thread(target=lambda: got.append(save(s, "new", 4)))
        t.start()
        t.join()

    during(monkeypatch, s.keyring, "destroy", racing_save)
    s.purge_tenant("acme", wait=True)
    assert got, "the racing save did not run"
    assert_whole(s)
    present = [s.get("acme", key("new", i)) for i in range(4)]
    if got[0] is None:
        assert present == [None] * 4  # refused: nothing of it stored
    else:
        # Acknowledged: it must load after the purge, not be purged under its feet.
        assert present == [layers("new", i) for i in range(4)]
    assert s.lookup("acme", [key("old", i) for i in range(4)]) == 0


def test_an_old_save_finishing_after_the_purge_is_not_indexed(
    s: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch that began before the purge and commits after it: cancelled, its
    files gone, nothing indexed (its objects were sealed with the destroyed key)."""
    import kvoffload.store.writes as writes_mod

    real = writes_mod.Writes._finish_puts
    purge = threading.Thread(target=lambda: s.purge_tenant("acme", wait=True))

    def finish_after_purge(self: Any, done: Any) -> list[bool]:
        # The purge starts while this batch is written: it either runs to its
        # end (then this batch commits after it) or waits for this batch.
        purge.start()
        writes = getattr(s._state, "tenant_writes", None)
        while purge.is_alive() and not (writes is not None and writes.purging("acme")):
            time.sleep(0.001)
        return real(self, done)

    monkeypatch.setattr(writes_mod.Writes, "_finish_puts", finish_after_purge)
    got = save(s, "mid", 4)
    monkeypatch.setattr(writes_mod.Writes, "_finish_puts", real)
    purge.join()
    assert got is None  # reported not stored
    assert list(s.index.records(tenant="acme")) == []
    assert not list((s.root / "objects").rglob("*.kvo"))
    assert_whole(s)


def test_concurrent_batched_saves_and_purges_leave_no_record_without_its_file(
    s: Store,
) -> None:
    acked: dict[bytes, list[bytes]] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def saver(w: int) -> None:
        try:
            for n in range(BATCHES):
                tag = f"w{w}/{n}"
                if save(s, tag, 3) is not None:
                    with lock:
                        acked.update((key(tag, i), layers(tag, i)) for i in range(3))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=saver, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    purges = 0
    while any(t.is_alive() for t in threads) or purges < 2:
        s.purge_tenant("acme", wait=True)
        purges += 1
    for t in threads:
        t.join()
    assert not errors, errors
    assert_whole(s)
    # Whatever the index still holds loads; a re-save of acknowledged chunks is
    # acknowledged and then loads (no stale record answers "already there").
    for rec in list(s.index.records(tenant="acme")):
        assert s.get("acme", rec.chunk_key) == acked[rec.chunk_key]
    sample = list(acked.items())[:: max(1, len(acked) // 40)]
    assert s.put_many("acme", NS, sample) is not None
    for k, ls in sample:
        assert s.get("acme", k) == ls


def test_a_tree_left_by_an_interrupted_purge_is_never_read_and_goes_at_open(
    tmp_path: Path, kek_file: Path
) -> None:
    """A crash between the purge's rename and the tree's removal leaves
    ``objects/.purged-<tenant>-<hex>``: no walk (fsck, the sweep) reads it as
    objects, and the next open removes it."""
    cfg = StoreConfig(root=tmp_path / "store", durability="none", ram_cache=0)
    kek = Kek.from_file(kek_file)
    store = Store(cfg, kek, create=True)
    save(store, "a", 3)
    left = store.root / "objects" / ".purged-acme-0123456789abcdef"
    shutil.copytree(store.root / "objects" / "acme", left)
    assert store.sweep()["adopted"] == 0
    rep = store.fsck()
    assert rep.objects_on_disk == 3 and rep.corrupt_files == [] and rep.clean, rep.to_dict()
    store.close()
    store = Store(cfg, kek)
    try:
        store.wait_background()
        assert not left.exists()
        assert [store.get("acme", key("a", i)) for i in range(3)] == [
            layers("a", i) for i in range(3)
        ]
    finally:
        store.close()


#: Batches each concurrent saver sends (bounded: the savers stop on their own).
BATCHES = 40
#: At most this many batches per client in the sidecar test (it stops them sooner).
SIDECAR_BATCHES = 3000


def test_a_store_request_during_a_purge_is_not_stored_and_says_busy(
    s: Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Protocol-v1 §5.11/§5.21 through a real server socket: a ``store`` of the
    tenant that arrives while its purge runs gets ``stored`` false with code
    ``BUSY`` (not INTERNAL), even for a chunk that was there before; saved
    again after the purge, it is stored and loads."""
    from kvoffload.client import SidecarClient
    from tests.helpers.server import start

    d = Path(tempfile.mkdtemp(prefix="kvo-pr-", dir="/tmp"))
    st = start(d, s)
    try:
        path = st.server.config.socket_path
        assert path is not None
        with SidecarClient(path, "acme", staging_bytes=1 << 20, timeout_s=30) as c:
            before = [(key("pre", i), layers("pre", i)) for i in range(2)]
            assert c.save(NS, before) == [True, True]
            batch = before + [(key("new", i), layers("new", i)) for i in range(3)]
            got: list[list[bool]] = []

            def racing_save() -> None:
                t = threading.Thread(target=lambda: got.append(c.save(NS, batch)))
                t.start()
                t.join()

            during(monkeypatch, s.keyring, "destroy", racing_save)
            with caplog.at_level("WARNING", logger="kvoffload"):
                s.purge_tenant("acme", wait=True)
            assert got == [[False] * 5]
            assert "BUSY" in caplog.text and "INTERNAL" not in caplog.text
            assert c.lookup([k for k, _ in batch]) == 0
            assert c.save(NS, batch) == [True] * 5
            loaded = c.load([k for k, _ in batch])
            assert [[bytes(x) for x in r.layers or []] for r in loaded] == [ls for _, ls in batch]
    finally:
        st.stop()
        shutil.rmtree(d, ignore_errors=True)


# -- through a real sidecar -----------------------------------------------------------


def test_purge_racing_batched_saves_through_a_sidecar(tmp_path: Path) -> None:
    """8 clients save batches while ``purge --tenant`` runs, several times: every
    chunk the sidecar still counts loads, a re-save is then readable, and after
    a clean stop the offline fsck finds every record's file."""
    from kvoffload.client import SidecarClient
    from kvoffload.testing import cli_argv
    from tests.sidecar_proc import dev_sidecar

    with dev_sidecar() as sc:
        sock = sc.socket_path
        errors: list[BaseException] = []
        saved: list[str] = []  # batch tags; the bytes are a function of the tag
        acked = [0]  # chunks the sidecar said it stored
        stop = threading.Event()
        lock = threading.Lock()

        def saver(w: int) -> None:
            try:
                with SidecarClient(sock, "acme", staging_bytes=4 << 20) as c:
                    for n in range(SIDECAR_BATCHES):
                        if stop.is_set():
                            break
                        tag = f"c{w}/{n}"
                        got = c.save(NS, [(key(tag, i), layers(tag, i, 1)) for i in range(8)])
                        with lock:
                            saved.append(tag)
                            acked[0] += sum(got)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=saver, args=(w,)) for w in range(8)]
        for t in threads:
            t.start()
        try:
            # Each purge finds a tenant of a few thousand objects to remove
            # while the eight clients keep saving into it.
            for round_ in range(1, 3):
                while acked[0] < 800 * round_ and any(t.is_alive() for t in threads):
                    time.sleep(0.01)
                r = subprocess.run(
                    cli_argv("--dev", "purge", "--tenant", "acme", "--yes", "--json"),
                    cwd=sc.workdir,
                    env=_env(sock),
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                assert r.returncode == 0, (r.stderr, errors[:1])
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not errors, errors
        assert saved
        with SidecarClient(sock, "acme", staging_bytes=4 << 20) as c:
            stale = []
            for tag in saved:
                keys = [key(tag, i) for i in range(8)]
                present = c.lookup(keys)
                loaded = c.load(keys[:present]) if present else []
                for i, res in enumerate(loaded):
                    if not res.ok or [bytes(x) for x in res.layers or []] != layers(tag, i, 1):
                        stale.append(f"{tag}/{i}")
            assert stale == [], f"{len(stale)} chunks counted present do not load: {stale[:8]}"
            for tag in saved[:: max(1, len(saved) // 16)]:
                batch = [(key(tag, i), layers(tag, i, 1)) for i in range(8)]
                assert c.save(NS, batch) == [True] * 8
                loaded = c.load([k for k, _ in batch])
                assert all(r.ok for r in loaded), f"{tag}: a re-save was acknowledged but misses"
        assert sc.proc.stop() == 0
        # Offline, after a clean stop: every record has its file (exit 0, not 5).
        fsck = subprocess.run(
            cli_argv("--dev", "fsck", "--json"),
            cwd=sc.workdir,
            env=_env(sock),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert fsck.returncode == 0, fsck.stdout + fsck.stderr


def _env(sock: Path) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    env["KVOFFLOAD_SERVER_SOCKET"] = str(sock)
    return env
