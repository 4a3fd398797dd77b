"""The store's lease lifecycle: lease, worker write, verify, publish or refuse; load leases
and reader-reported corruption. Real LMDB, real files, real AES-GCM."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvoffload.client.direct import Extent, PosixDirectIO
from kvoffload.errors import LeaseInvalid, StoreFull
from kvoffload.layouts import v1
from kvoffload.store import Store, StoreConfig, StoreLease, leasefiles
from kvoffload.store.keys.keyring import Kek
from tests.direct_helpers import NS, OTHER_NS, TENANT, key, rand_layers, sealed_plain, verify

# ------------------------------------------------------------ store lease lifecycle


def open_store(tmp_path: Path, kek_file: Path, name: str = "store", **kw: Any) -> Store:
    kw.setdefault("durability", "none")
    cfg = StoreConfig(root=tmp_path / name, **kw)
    return Store(cfg, Kek.from_file(kek_file), create=True)


@pytest.fixture
def st(tmp_path: Path, kek_file: Path) -> Iterator[Store]:
    s = open_store(tmp_path, kek_file)
    yield s
    s.close()


def temp_files(s: Store) -> list[Path]:
    return sorted(p for p in (s.root / "objects").rglob(f"{v1.TMP_PREFIX}*"))


def objects(s: Store) -> list[Path]:
    return sorted((s.root / "objects").rglob(f"*{v1.OBJECT_SUFFIX}"))


LAYERS = rand_layers(21, [5000, 3000, 4096])
LENGTHS = [len(x) for x in LAYERS]
SIZE = v1.object_size(LENGTHS, False)


def lease(s: Store, k: bytes, lengths: Sequence[int] = LENGTHS, **kw: Any) -> StoreLease:
    got = s.lease_store(TENANT, NS, k, lengths, **kw)
    assert got is not None
    return got


def write_object(
    lz: StoreLease, layers: Sequence[bytes], *, chunk_key: bytes | None = None, **kw: Any
) -> None:
    lengths = [len(x) for x in layers]
    head = v1.plain_header_block(
        tenant=kw.pop("tenant", TENANT),
        namespace=kw.pop("namespace", NS),
        chunk_key=chunk_key or lz.chunk_key,
        lengths=lengths,
        checks=[v1.layer_check(x) for x in layers],
        created_ns=77,
    )
    _, offsets = v1.plan_offsets(len(layers), lengths, False)
    PosixDirectIO(**kw).write_object(str(lz.tmp), head, layers, offsets)


def assert_nothing_left(s: Store, k: bytes) -> None:
    assert temp_files(s) == []
    assert objects(s) == []
    assert not s.contains(TENANT, k)
    assert s.get(TENANT, k) is None
    assert s.reserved_bytes == 0 and s.used_bytes == 0


@pytest.mark.parametrize("o_direct", [True, False], ids=["o_direct", "buffered"])
def test_lease_write_publish_get(st: Store, o_direct: bool) -> None:
    lz = lease(st, key(1), ttl_s=3600.0)
    assert lz.size == SIZE and lz.tmp.parent == lz.final.parent
    assert lz.final == st.root / v1.object_relpath(TENANT, key(1))
    assert lz.offsets == v1.plan_offsets(3, LENGTHS, False)
    assert temp_files(st) == [lz.tmp]
    assert stat.S_IMODE(lz.tmp.stat().st_mode) == leasefiles.LEASE_FILE_MODE
    assert lz.tmp.read_bytes() == bytes(SIZE)
    assert st.reserved_bytes == SIZE and st.used_bytes == 0
    write_object(lz, LAYERS, o_direct=o_direct)
    assert st.publish_lease(lz) is True
    assert temp_files(st) == [] and objects(st) == [lz.final]
    assert stat.S_IMODE(lz.final.stat().st_mode) == leasefiles.PUBLISHED_MODE == 0o440
    assert st.reserved_bytes == 0 and st.used_bytes == SIZE
    assert st.get(TENANT, key(1)) == LAYERS
    rec = st.payload_info(TENANT, key(1))
    assert rec is not None
    assert rec.key_epoch == 0 and rec.created_ns == 77 and rec.payload == sum(LENGTHS)
    assert rec.expires_ns > rec.last_access_ns  # the lease's ttl made it to the index
    assert st.fsck(verify_data=True).clean
    # Stored: no second lease, and no temp file for one.
    assert st.lease_store(TENANT, NS, key(1), LENGTHS) is None
    assert temp_files(st) == [] and st.reserved_bytes == 0


def test_lease_publish_with_object_durability(tmp_path: Path, kek_file: Path) -> None:
    s = open_store(tmp_path, kek_file, durability="object")
    try:
        lz = lease(s, key(2))
        write_object(lz, LAYERS)
        assert s.publish_lease(lz)
        assert s.get(TENANT, key(2)) == LAYERS
        assert s.reserved_bytes == 0 and s.used_bytes == SIZE
    finally:
        s.close()


def test_large_direct_object_publishes(st: Store) -> None:
    layers = rand_layers(22, [(1 << 20) + 5, 3 << 20])
    lz = lease(st, key(3), [len(x) for x in layers])
    write_object(lz, layers, o_direct=False)
    assert st.publish_lease(lz)
    assert st.get(TENANT, key(3)) == layers


def test_lease_is_none_when_the_key_is_stored(st: Store) -> None:
    assert st.put(TENANT, NS, key(4), LAYERS, encrypt=False)
    assert st.put(TENANT, NS, key(5), LAYERS, encrypt=True)
    before = st.reserved_bytes
    assert st.lease_store(TENANT, NS, key(4), LENGTHS) is None
    assert st.lease_store(TENANT, NS, key(5), LENGTHS) is None
    assert temp_files(st) == [] and st.reserved_bytes == before == 0
    # Another tenant's copy of the key is not this tenant's: it gets a lease.
    other = st.lease_store("beta", NS, key(4), LENGTHS)
    assert other is not None
    st.cancel_lease(other)


def test_cancel_lease_removes_the_file_and_the_reservation(st: Store) -> None:
    a, b = lease(st, key(6)), lease(st, key(7))
    assert st.reserved_bytes == 2 * SIZE and len(temp_files(st)) == 2
    write_object(a, LAYERS)
    st.cancel_lease(a)
    assert not a.tmp.exists() and temp_files(st) == [b.tmp]
    assert st.reserved_bytes == SIZE
    st.cancel_lease(a)  # idempotent: nothing is released twice
    assert st.reserved_bytes == SIZE
    st.cancel_lease(b)
    assert_nothing_left(st, key(6))
    # A cancelled key can be leased again.
    st.cancel_lease(lease(st, key(6)))
    assert st.reserved_bytes == 0


def test_publish_of_an_unwritten_lease_is_refused(st: Store) -> None:
    lz = lease(st, key(8))
    corrupt = st.counters.corrupt
    with pytest.raises(LeaseInvalid):
        st.publish_lease(lz)
    assert st.counters.corrupt == corrupt + 1
    assert_nothing_left(st, key(8))


@pytest.mark.parametrize("change", [-4096, -1, 1, 4096])
def test_publish_after_the_worker_resized_the_file_is_refused(st: Store, change: int) -> None:
    lz = lease(st, key(9))
    write_object(lz, LAYERS)
    os.truncate(lz.tmp, SIZE + change)
    with pytest.raises(LeaseInvalid, match="bytes, leased"):
        st.publish_lease(lz)
    assert_nothing_left(st, key(9))


def test_publish_of_a_symlink_is_refused_and_its_target_kept(st: Store, tmp_path: Path) -> None:
    lz = lease(st, key(10))
    target = tmp_path / "elsewhere.kvo"
    target.write_bytes(sealed_plain(LAYERS, chunk_key=key(10), created_ns=1))  # a valid object
    lz.tmp.unlink()
    lz.tmp.symlink_to(target)
    with pytest.raises(LeaseInvalid):
        st.publish_lease(lz)
    assert not lz.tmp.is_symlink()
    assert target.read_bytes() == sealed_plain(LAYERS, chunk_key=key(10), created_ns=1)
    assert_nothing_left(st, key(10))


def test_publish_of_a_hard_linked_lease_file_is_refused(st: Store, tmp_path: Path) -> None:
    lz = lease(st, key(11))
    write_object(lz, LAYERS)
    keep = tmp_path / "kept-open-for-later"
    os.link(lz.tmp, keep)
    with pytest.raises(LeaseInvalid, match="links"):
        st.publish_lease(lz)
    assert_nothing_left(st, key(11))


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give the file away")
def test_publish_of_a_file_now_owned_by_someone_else_is_refused(st: Store) -> None:
    lz = lease(st, key(12))
    write_object(lz, LAYERS)
    os.chown(lz.tmp, 65534, -1)
    with pytest.raises(LeaseInvalid, match="owned by uid 65534"):
        st.publish_lease(lz)
    assert_nothing_left(st, key(12))


@pytest.mark.parametrize(
    "wrong",
    [
        {"chunk_key": key(99)},
        {"namespace": OTHER_NS},
        {"tenant": "beta"},
    ],
    ids=["chunk-key", "namespace", "tenant"],
)
def test_publish_of_another_chunks_object_is_refused(st: Store, wrong: dict[str, Any]) -> None:
    lz = lease(st, key(13))
    write_object(lz, LAYERS, **wrong)
    with pytest.raises(LeaseInvalid, match="another chunk key, tenant or namespace"):
        st.publish_lease(lz)
    assert_nothing_left(st, key(13))
    assert not st.contains(TENANT, key(99)) and not st.contains("beta", key(13))


def test_publish_with_other_layer_lengths_of_the_same_size_is_refused(st: Store) -> None:
    lz = lease(st, key(14), [5000, 3000])
    swapped = rand_layers(23, [3000, 5000])
    assert v1.object_size([3000, 5000], False) == lz.size
    write_object(lz, swapped)
    verify(lz.tmp.read_bytes(), chunk_key=key(14))  # a valid object, just not the leased one
    with pytest.raises(LeaseInvalid, match="layer lengths"):
        st.publish_lease(lz)
    assert_nothing_left(st, key(14))


def test_publish_of_a_sealed_object_is_refused(st: Store) -> None:
    small = rand_layers(24, [1000, 2000])
    lz = lease(st, key(15), [1000, 2000])
    out = bytearray(v1.object_size([1000, 2000], True))
    assert len(out) == lz.size  # the tags fit in the padding: only the flag tells
    v1.seal_into(
        memoryview(out),
        tenant=TENANT,
        namespace=NS,
        chunk_key=key(15),
        layers=small,
        aead=AESGCM(os.urandom(32)),
        key_epoch=1,
    )
    with open(lz.tmp, "r+b") as f:
        f.write(out)
    with pytest.raises(LeaseInvalid, match="plaintext"):
        st.publish_lease(lz)
    assert_nothing_left(st, key(15))


@pytest.mark.parametrize("where", ["layer", "padding", "header"])
def test_publish_of_a_damaged_object_is_refused(st: Store, where: str) -> None:
    lz = lease(st, key(16))
    write_object(lz, LAYERS)
    _, offsets = lz.offsets
    pos = {"layer": offsets[1] + 7, "padding": offsets[0] + 5000 + 3, "header": 100}[where]
    with open(lz.tmp, "r+b") as f:
        f.seek(pos)
        f.write(b"\xff")
    with pytest.raises(LeaseInvalid):
        st.publish_lease(lz)
    assert_nothing_left(st, key(16))


def test_publishing_twice_leaves_the_published_object_alone(st: Store) -> None:
    lz = lease(st, key(17))
    write_object(lz, LAYERS)
    assert st.publish_lease(lz)
    with pytest.raises(LeaseInvalid):
        st.publish_lease(lz)
    assert st.get(TENANT, key(17)) == LAYERS
    assert st.reserved_bytes == 0 and st.used_bytes == SIZE


def test_a_lease_over_the_capacity_is_store_full(tmp_path: Path, kek_file: Path) -> None:
    s = open_store(tmp_path, kek_file, capacity_bytes=SIZE - 1)
    try:
        with pytest.raises(StoreFull):
            s.lease_store(TENANT, NS, key(18), LENGTHS)
        assert not (s.root / "objects").exists() or temp_files(s) == []
        assert s.reserved_bytes == 0
        small = [b"x" * 100]
        lz = lease(s, key(19), [100])  # one that fits is leased
        assert s.reserved_bytes == lz.size == 8192
        write_object(lz, small)
        assert s.publish_lease(lz)
        assert s.get(TENANT, key(19)) == small
    finally:
        s.close()


def test_lease_store_refuses_bad_shapes(st: Store) -> None:
    for lengths in ([], [0], [10, 0]):
        with pytest.raises(ValueError):
            st.lease_store(TENANT, NS, key(20), lengths)
    with pytest.raises(ValueError):
        st.lease_store(TENANT, NS[:31], key(20), [10])
    assert temp_files(st) == [] and st.reserved_bytes == 0


def test_lease_load_then_worker_read(st: Store) -> None:
    lz = lease(st, key(21))
    write_object(lz, LAYERS)
    st.publish_lease(lz)
    rl = st.lease_load(TENANT, key(21))
    assert rl is not None
    assert rl.path == lz.final and rl.size == SIZE
    assert [le.length for le in rl.header.layers] == LENGTHS
    extents = [Extent(le.offset, le.length, le.check) for le in rl.header.layers]
    outs = [bytearray(n) for n in LENGTHS]
    assert PosixDirectIO().read_layers(str(rl.path), extents, outs)
    assert [bytes(o) for o in outs] == LAYERS
    # A chunk the sidecar wrote in plaintext is just as readable by the worker.
    assert st.put(TENANT, NS, key(22), LAYERS, encrypt=False)
    rl2 = st.lease_load(TENANT, key(22))
    assert rl2 is not None and [le.length for le in rl2.header.layers] == LENGTHS


def test_lease_load_misses_sealed_and_absent_chunks(st: Store) -> None:
    assert st.put(TENANT, NS, key(23), LAYERS, encrypt=True)
    assert st.lease_load(TENANT, key(23)) is None
    assert st.get(TENANT, key(23)) == LAYERS  # a miss for the worker, kept for the sidecar
    assert st.lease_load(TENANT, key(24)) is None
    assert st.lease_load("beta", key(23)) is None


@pytest.mark.parametrize("damage", ["header-byte", "truncated", "other-key"])
def test_lease_load_drops_a_chunk_with_a_bad_header(st: Store, damage: str) -> None:
    assert st.put(TENANT, NS, key(25), LAYERS, encrypt=False)
    path = st.root / v1.object_relpath(TENANT, key(25))
    path.chmod(0o600)
    if damage == "header-byte":
        with open(path, "r+b") as f:
            f.seek(50)
            b = f.read(1)
            f.seek(50)
            f.write(bytes([b[0] ^ 1]))
    elif damage == "truncated":
        os.truncate(path, SIZE - 4096)
    else:  # a valid object of another key under this key's name
        path.write_bytes(sealed_plain(LAYERS, chunk_key=key(26), created_ns=5))
    assert st.lease_load(TENANT, key(25)) is None
    assert not path.exists()
    assert not st.contains(TENANT, key(25)) and st.used_bytes == 0


def test_check_reported_keeps_a_good_chunk_and_drops_a_corrupt_one(st: Store) -> None:
    lz = lease(st, key(27))
    write_object(lz, LAYERS)
    st.publish_lease(lz)
    assert st.check_reported(TENANT, key(27)) is False
    assert st.get(TENANT, key(27)) == LAYERS and lz.final.exists()
    # A layer byte flips at rest: the header still checks, so the worker gets a lease
    # and finds the damage itself; the sidecar confirms and drops the chunk.
    os.chmod(lz.final, 0o600)
    _, offsets = lz.offsets
    with open(lz.final, "r+b") as f:
        f.seek(offsets[2] + 4000)
        b = f.read(1)
        f.seek(offsets[2] + 4000)
        f.write(bytes([b[0] ^ 0x10]))
    rl = st.lease_load(TENANT, key(27))
    assert rl is not None
    extents = [Extent(le.offset, le.length, le.check) for le in rl.header.layers]
    assert PosixDirectIO().read_layers(str(rl.path), extents, [bytearray(n) for n in LENGTHS]) is (
        False
    )
    corrupt = st.counters.corrupt
    assert st.check_reported(TENANT, key(27)) is True
    assert st.counters.corrupt == corrupt + 1
    assert not lz.final.exists() and not st.contains(TENANT, key(27))
    assert st.used_bytes == 0
    assert st.check_reported(TENANT, key(27)) is False  # gone: nothing to drop


def test_check_reported_keeps_a_good_sealed_chunk(st: Store) -> None:
    assert st.put(TENANT, NS, key(28), LAYERS, encrypt=True)
    assert st.check_reported(TENANT, key(28)) is False
    assert st.get(TENANT, key(28)) == LAYERS
