"""The sidecar's RAM tier (store/ramtier.py): sealed images of large objects.

Real stores on a real file system (O_DIRECT where it takes it), real files
removed and replaced behind the store's back, real AES-GCM, a real sidecar
process for ``drop_cache`` and ``stats``.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload.client import SidecarClient
from kvoffload.layouts import v1
from kvoffload.store import Store
from kvoffload.store.ramtier import RamTier, Slot, _aligned
from tests.helpers.cli import cli, sidecar
from tests.helpers.direct_reads import DirectReads, cached_pages
from tests.helpers.stores import evict, make_store

NS = bytes(range(32))
#: Two 600 KiB layers: a sealed object of about 1.2 MiB, over the tier's
#: 1 MiB floor below (direct_read_min).
LAYER = 600 << 10


def key(i: int) -> bytes:
    return bytes([i]) * 32


def layers(i: int) -> list[bytes]:
    rnd = random.Random(i)
    return [rnd.randbytes(LAYER), rnd.randbytes(LAYER)]


@pytest.fixture
def store(direct_dir: Path, kek_file: Path) -> Iterator[Store]:
    s = make_store(
        direct_dir / "store",
        kek_file,
        durability="none",
        io="posix",
        direct_read_min=1 << 20,
        ram_cache=16 << 20,
        io_streams=2,
    )
    try:
        yield s
    finally:
        s.close()


def tier(s: Store) -> RamTier:
    ram = s._state.ram
    assert ram is not None
    return ram


def spares_ready(s: Store, n: int = 2) -> None:
    """Wait until the filler has ``n`` buffers ready for objects of :func:`layers`' size."""
    ram = tier(s)
    size = v1.object_size([LAYER, LAYER], True)
    want = _aligned(size)
    slot = ram.lend(size)  # None the first time: the filler is asked for spares
    if slot is not None:
        ram.give_back(slot)
    deadline = time.monotonic() + 30
    while len(ram._free.get(want, [])) < n:
        assert time.monotonic() < deadline, ram.stats()
        time.sleep(0.01)


def saved(s: Store, tenant: str, i: int) -> Path:
    """Save chunk ``i`` with a tier buffer ready, so its image is kept."""
    spares_ready(s)
    assert s.put(tenant, NS, key(i), layers(i))
    assert tier(s).holds(tenant, key(i))
    return s._path(tenant, key(i))


def test_a_saved_chunk_is_served_from_ram_only_while_its_file_is_there(store: Store) -> None:
    s = store
    path = saved(s, "acme", 1)
    evict([path])
    assert s.get("acme", key(1)) == layers(1)
    assert tier(s).stats()["hits"] == 1
    # The file goes behind the store's back (an operator, another node's
    # evictor): the image is never served again, and the chunk is a miss.
    path.unlink()
    assert s.get("acme", key(1)) is None
    st = tier(s).stats()
    assert (st["hits"], st["stale"]) == (1, 1)
    assert not tier(s).holds("acme", key(1))
    # Replaced by another file under the same name: the image is stale, the
    # file is read (and verified) instead.
    path2 = saved(s, "acme", 2)
    copy = path2.with_name(path2.name + ".copy")
    copy.write_bytes(path2.read_bytes())
    os.chmod(copy, 0o200)
    copy.replace(path2)
    assert s.get("acme", key(2)) == layers(2)
    assert tier(s).stats()["stale"] == 2


def test_a_cold_large_read_is_kept_and_the_next_load_comes_from_ram(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = store
    path = saved(s, "acme", 1)
    assert tier(s).clear()[0] == 1  # drop_cache: the buffers stay as spares
    assert not tier(s).holds("acme", key(1))
    assert evict([path])
    if cached_pages(path) is None:
        pytest.skip("cachestat(2) needs Linux 6.5+: cold reads stay in the page cache")
    spares_ready(s)
    spy = DirectReads(monkeypatch)
    outs = [memoryview(bytearray(2 * LAYER))]
    assert s.get_many_into("acme", [key(1)], outs) == [[LAYER, LAYER]]
    assert bytes(outs[0]) == b"".join(layers(1))
    assert spy.count == 1 and tier(s).holds("acme", key(1))
    assert cached_pages(path) == 0  # still not in the page cache: in the tier
    assert s.get("acme", key(1)) == layers(1)
    assert spy.count == 1  # no second read of the file
    assert tier(s).stats()["hits"] == 1


def test_removal_purge_and_revocation_drop_the_images_before_they_return(store: Store) -> None:
    s = store
    for t, i in (("acme", 1), ("acme", 2), ("beta", 3), ("gamma", 4)):
        saved(s, t, i)
    assert s.delete("acme", key(1))
    assert not tier(s).holds("acme", key(1)) and tier(s).holds("acme", key(2))
    s.cancel_loads("gamma")  # a revocation
    assert not tier(s).holds("gamma", key(4)) and tier(s).holds("beta", key(3))
    s.purge_namespace("beta", NS)
    assert not tier(s).holds("beta", key(3))
    s.purge_tenant("acme")  # wait=False: the files go later, the images now
    assert not tier(s).holds("acme", key(2))
    assert tier(s).stats()["images"] == 0
    assert s.has_ram_tier


def test_a_damaged_image_is_dropped_and_the_file_read_its_object_untouched(
    store: Store,
) -> None:
    s = store
    path = saved(s, "acme", 1)
    ram = tier(s)
    img = ram._images[("acme", key(1))]
    img.data[img.size // 2] ^= 1  # memory went bad: the tag check finds it
    assert s.get("acme", key(1)) == layers(1)
    assert ram.stats()["failed"] == 1
    assert s.counters.corrupt == 0 and path.exists() and s.contains("acme", key(1))
    # Layer-wise loads serve the image too, and treat a bad one the same way.
    spares_ready(s)
    s.drop_cache()
    assert evict([path])
    if cached_pages(path) is None:
        pytest.skip("cachestat(2) needs Linux 6.5+: cold reads stay in the page cache")
    assert s.get("acme", key(1)) == layers(1)  # the file, read into a buffer of the tier
    img = ram._images.get(("acme", key(1))) or pytest.fail("the cold read kept no image")
    out = memoryview(bytearray(2 * LAYER))
    got = s.get_layerwise_into(
        "acme", [key(1)], [out], lambda _p: None, lambda _d, _v: None, lambda _i: False
    )
    assert got == [[LAYER, LAYER]] and bytes(out) == b"".join(layers(1))
    assert ram.stats()["hits"] == 1
    img.data[img.size - 100] ^= 1
    got = s.get_layerwise_into(
        "acme", [key(1)], [out], lambda _p: None, lambda _d, _v: None, lambda _i: False
    )
    assert got == [None]  # a miss, never a bad byte handed out
    assert ram.stats()["failed"] == 2 and not ram.holds("acme", key(1))
    assert path.exists() and s.contains("acme", key(1)) and s.counters.corrupt == 0
    assert s.get("acme", key(1)) == layers(1)


def _slot_files(tmp_path: Path, n: int) -> list[str]:
    paths = []
    for i in range(n):
        p = tmp_path / f"obj{i}"
        p.write_bytes(bytes([i]) * 8192)
        paths.append(str(p))
    return paths


def _lend(ram: RamTier, size: int) -> Slot:
    deadline = time.monotonic() + 30
    while (slot := ram.lend(size)) is None:
        assert time.monotonic() < deadline, ram.stats()
        time.sleep(0.01)
    return slot


def test_the_tier_keeps_within_its_capacity_and_never_reuses_a_pinned_buffer(
    tmp_path: Path,
) -> None:
    # A sealed chunk and a plaintext one of the same shape share buffers; the
    # rounding costs at most about 1/16 of the object.
    sealed, plain = (v1.object_size([1 << 20] * 32, enc) for enc in (True, False))
    assert _aligned(sealed) == _aligned(plain) <= sealed * 17 // 16
    ram = RamTier(capacity=3 * 8192, min_size=4096)
    try:
        paths = _slot_files(tmp_path, 6)
        assert not ram.admits(100) and not ram.admits(4 * 8192) and ram.admits(8192)
        for i in range(3):
            slot = _lend(ram, 8192)
            slot.view[:8192] = bytes([i]) * 8192
            assert ram.keep("t", key(i), slot, 8192, paths[i], lambda: True)
            assert ram.stats()["held_bytes"] <= 3 * 8192
        pinned = ram.pinned("t", key(0), paths[0])
        assert pinned is not None and bytes(pinned.data) == bytes([0]) * 8192
        # Full: the next buffer is the least recently used unpinned image's (1).
        slot = _lend(ram, 8192)
        assert not ram.holds("t", key(1)) and ram.holds("t", key(0))
        slot.view[:8192] = bytes([3]) * 8192
        assert ram.keep("t", key(3), slot, 8192, paths[3], lambda: True)
        # Dropped while pinned: gone from the tier, its buffer untouched until unpinned.
        ram.clear()
        assert not ram.holds("t", key(0))
        for i in (4, 5):
            slot = _lend(ram, 8192)
            slot.view[:8192] = bytes([i]) * 8192
            assert ram.keep("t", key(i), slot, 8192, paths[i], lambda: True)
            assert slot.mm is not pinned.slot.mm
        assert bytes(pinned.data) == bytes([0]) * 8192
        ram.unpin(pinned)
        assert ram.stats()["held_bytes"] <= 3 * 8192
        # A purge or revocation since the read began: the image is not taken.
        slot = _lend(ram, 8192)
        assert not ram.keep("u", key(9), slot, 8192, paths[0], lambda: False)
        assert not ram.holds("u", key(9))
        # A file of another size than the image: not taken.
        slot = _lend(ram, 8192)
        assert not ram.keep("u", key(9), slot, 4096, paths[0], lambda: True)
    finally:
        ram.close()
    assert ram.stats()["held_bytes"] == 0


def test_drop_cache_empties_a_running_sidecars_tier(tmp_path: Path, short_dir: Path) -> None:
    sock = short_dir / "kvo.sock"
    r = cli(tmp_path, sock, "--dev", "drop-cache")
    assert (
        r.returncode == 0 and r.stdout.strip() == f"no sidecar serves {sock}: no RAM tier to drop"
    )
    env = {
        "KVOFFLOAD_IO": "posix",
        "KVOFFLOAD_STORE_DURABILITY": "none",
        "KVOFFLOAD_STORE_DIRECT_READ_MIN": "1MiB",
        "KVOFFLOAD_STORE_RAM_CACHE": "16MiB",
    }
    with (
        sidecar(tmp_path, sock, env=env),
        SidecarClient(sock, "acme", staging_bytes=8 << 20) as client,
    ):
        stats: dict[str, Any] = client.stats()
        assert stats["ram_tier"]["capacity_bytes"] == 16 << 20
        deadline = time.monotonic() + 30
        i = 0
        while client.stats()["ram_tier"]["images"] == 0:  # the first saves wait for spares
            assert time.monotonic() < deadline, client.stats()
            assert client.save(NS, [(key(i), layers(i))]) == [True]
            i += 1
        assert [c.ok for c in client.load([key(i - 1)])] == [True]
        assert client.stats()["ram_tier"]["hits"] == 1
        r = cli(tmp_path, sock, "--dev", "drop-cache", "--json")
        assert r.returncode == 0, r.stderr
        rep = json.loads(r.stdout)
        assert rep["dropped"] >= 1 and rep["held_bytes"] > 0
        st = client.stats()["ram_tier"]
        assert st["images"] == 0
        loaded = client.load([key(i - 1)])
        assert [c.ok for c in loaded] == [True]
        assert [bytes(x) for x in loaded[0].layers] == layers(i - 1)
        assert client.stats()["ram_tier"]["hits"] == 1  # read from the file this time


def test_close_after_a_ctrl_c_interrupted_the_fillers_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C can land inside ``Thread.start()`` (it waits for the new thread
    to run): the filler is then never started, or not yet. Closing the tier, as a
    store's clean-up does next, must not fail on it (``join`` refuses a thread
    not started); seen when a benchmark was interrupted while settling its tier."""
    import threading

    from kvoffload.store import ramtier

    class Interrupted(threading.Thread):  # a test double: start() hit by a Ctrl-C
        def start(self) -> None:
            raise KeyboardInterrupt

    ram = RamTier(capacity=3 * 8192, min_size=4096)
    monkeypatch.setattr(ramtier.threading, "Thread", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        ram.lend(8192)
    monkeypatch.undo()
    ram.close()  # before: RuntimeError: cannot join thread before it is started
    assert ram.stats()["held_bytes"] == 0
