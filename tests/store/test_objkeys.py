"""Per-object keys (keys-v1.md §14, layout-v1.md §3.3) and the store's sealed
leases (protocol-v1.md §5.32), on a real store: real files, LMDB, AES-GCM.

A handed key opens its own object and nothing else (not another object of
the tenant, not another tenant's); objects sealed under the DEK itself, as
earlier builds wrote them, still load and are never handed out; a purge
stops every hand-out.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvoffload.errors import CorruptObject, ObjectMismatch
from kvoffload.layouts import objkey, v1
from kvoffload.store import SealedLease, Store, StoreConfig
from kvoffload.store.keys.keyring import Kek

NS = bytes(range(32))


def key(tag: str) -> bytes:
    return hashlib.blake2b(tag.encode(), digest_size=32).digest()


def layers(tag: str) -> list[bytes]:
    r = random.Random(tag)
    return [r.randbytes(3000 + 517 * j) for j in range(3)]


def open_store(root: Path, kek_file: Path, **kw: object) -> Store:
    return Store(
        StoreConfig(root=root, durability="none", ram_cache=0, **kw),  # type: ignore[arg-type]
        Kek.from_file(kek_file),
        create=True,
    )


@pytest.fixture
def store(tmp_path: Path, kek_file: Path) -> Iterator[Store]:
    s = open_store(tmp_path / "store", kek_file)
    yield s
    s.close()


def lease(s: Store, tenant: str, k: bytes) -> SealedLease:
    got = s.sealed_lease(tenant, k)
    assert got is not None and got.fd is not None
    return got


def read_with(got: SealedLease, tenant: str, k: bytes, handed_key: bytes) -> list[bytes]:
    """What a worker does with a descriptor and a key: verify and decrypt."""
    assert got.fd is not None
    buf = os.pread(got.fd, got.size, 0)
    h = v1.decode_header(buf)
    outs = [memoryview(bytearray(le.length)) for le in h.layers]
    aead = AESGCM(handed_key)
    objkey.open_layers_into(
        memoryview(buf),
        outs,
        tenant=tenant,
        namespace=got.namespace,
        chunk_key=k,
        object_aead=lambda _h: aead,
    )
    return [bytes(o) for o in outs]


def header(created_ns: int) -> v1.ObjectHeader:
    flags = v1.FLAG_SEALED | v1.FLAG_OBJECT_KEY
    ck, ns = bytes([1]) * 32, bytes([2]) * 32
    return v1.ObjectHeader(1, flags, 7, created_ns, ck, ns, "acme", 4096, ())


def test_the_derivation_is_hkdf_sha256_of_the_dek_over_the_object_identity() -> None:
    dek = bytes(range(32))
    h = header(1_700_000_000_000_000_000)
    info = (
        b"kvo-objkey-v1"
        + (7).to_bytes(4, "little")
        + (1_700_000_000_000_000_000).to_bytes(8, "little")
        + bytes([1]) * 32
        + bytes([2]) * 32
        + (4).to_bytes(2, "little")
        + b"acme"
    )
    want = HKDF(hashes.SHA256(), 32, salt=bytes(32), info=info).derive(dek)
    assert objkey.derive_object_key(dek, h) == want
    # The test vector of keys-v1.md §14.
    assert want.hex() == KEYS_SPEC_VECTOR
    other = header(1_700_000_000_000_000_001)
    assert objkey.derive_object_key(dek, other) != want  # another object, another key


KEYS_SPEC_VECTOR = "d74b66413ed9c57ab8f2c16a97cbe557d44fc9d3e5827a10f736a92f0262f941"


def test_new_objects_are_sealed_under_their_own_key_and_load(store: Store) -> None:
    k = key("a")
    assert store.put("acme", NS, k, layers("a"))
    h = v1.decode_header((store.root / v1.object_relpath("acme", k)).read_bytes())
    assert h.sealed and h.flags & v1.FLAG_OBJECT_KEY
    assert store.get("acme", k) == layers("a")


def test_a_handed_key_opens_its_object_and_no_other(store: Store) -> None:
    for tag in ("a", "b"):
        assert store.put("acme", NS, key(tag), layers(tag))
    assert store.put("beta", NS, key("a"), layers("beta-a"))
    a, b = lease(store, "acme", key("a")), lease(store, "acme", key("b"))
    beta = lease(store, "beta", key("a"))
    try:
        assert len(a.key) == 32 and a.namespace == NS
        assert read_with(a, "acme", key("a"), a.key) == layers("a")
        assert read_with(b, "acme", key("b"), b.key) == layers("b")
        assert len({a.key, b.key, beta.key}) == 3
        # Another object of the same tenant, another tenant's object of the
        # same chunk key: the handed key authenticates neither.
        with pytest.raises(CorruptObject):
            read_with(b, "acme", key("b"), a.key)
        with pytest.raises(CorruptObject):
            read_with(beta, "beta", key("a"), a.key)
        # The key is not the tenant's DEK: the DEK itself does not open the object.
        dek = store.keyring.get("acme").deks[1]  # type: ignore[union-attr]
        assert a.key != dek
        with pytest.raises(CorruptObject):
            read_with(a, "acme", key("a"), dek)
    finally:
        for x in (a, b, beta):
            assert x.fd is not None
            os.close(x.fd)


def test_the_handed_descriptor_is_read_only(store: Store) -> None:
    assert store.put("acme", NS, key("a"), layers("a"))
    got = lease(store, "acme", key("a"))
    assert got.fd is not None
    try:
        with pytest.raises(OSError):
            os.pwrite(got.fd, b"x", 0)
    finally:
        os.close(got.fd)


def test_objects_sealed_under_the_dek_still_load_and_are_not_handed(
    tmp_path: Path, kek_file: Path
) -> None:
    root = tmp_path / "store"
    old = open_store(root, kek_file, object_keys=False)  # what builds before it wrote
    assert old.put("acme", NS, key("old"), layers("old"))
    old.close()
    s = open_store(root, kek_file)
    try:
        h = v1.decode_header((root / v1.object_relpath("acme", key("old"))).read_bytes())
        assert h.sealed and not h.flags & v1.FLAG_OBJECT_KEY
        assert s.get("acme", key("old")) == layers("old")
        got = s.sealed_lease("acme", key("old"))
        assert got is not None and got.fd is None and got.key == b""
        assert s.put("acme", NS, key("new"), layers("new"))
        assert s.get("acme", key("new")) == layers("new")
        assert lease(s, "acme", key("new")).fd is not None
    finally:
        s.close()


def test_a_worker_cannot_open_a_dek_sealed_object_with_any_handed_key(
    tmp_path: Path, kek_file: Path
) -> None:
    root = tmp_path / "store"
    old = open_store(root, kek_file, object_keys=False)
    assert old.put("acme", NS, key("old"), layers("old"))
    buf = (root / v1.object_relpath("acme", key("old"))).read_bytes()
    old.close()
    with pytest.raises(ObjectMismatch):
        objkey.open_layers_into(
            memoryview(buf),
            [memoryview(bytearray(len(x))) for x in layers("old")],
            tenant="acme",
            namespace=NS,
            chunk_key=key("old"),
            object_aead=lambda _h: AESGCM(bytes(32)),
        )


def test_no_lease_after_a_purge(store: Store) -> None:
    assert store.put("acme", NS, key("a"), layers("a"))
    got = lease(store, "acme", key("a"))
    store.purge("acme")
    assert store.sealed_lease("acme", key("a")) is None
    assert store.keyring.get("acme") is None
    # What a worker already holds: that object, until it closes it (§5.32).
    assert got.fd is not None
    try:
        assert read_with(got, "acme", key("a"), got.key) == layers("a")
    finally:
        os.close(got.fd)


def test_a_torn_or_flipped_object_is_a_miss_for_the_lease_or_the_reader(store: Store) -> None:
    for tag in ("torn", "flip"):
        assert store.put("acme", NS, key(tag), layers(tag))
    torn = store.root / v1.object_relpath("acme", key("torn"))
    with open(torn, "r+b") as f:
        f.truncate(torn.stat().st_size - 4096)
    assert store.sealed_lease("acme", key("torn")) is None  # size checked at hand-out
    assert store.get("acme", key("torn")) is None
    got = lease(store, "acme", key("flip"))
    assert got.fd is not None
    try:
        path = store.root / v1.object_relpath("acme", key("flip"))
        h = v1.decode_header(path.read_bytes())
        data = bytearray(path.read_bytes())
        data[h.layers[1].offset + 5] ^= 0x40
        path.write_bytes(bytes(data))  # in place: the descriptor sees it
        with pytest.raises(CorruptObject):
            read_with(got, "acme", key("flip"), got.key)
        # The worker reports it; the store checks for itself and drops it.
        assert store.check_reported("acme", key("flip")) is True
        assert store.lookup("acme", [key("flip")]) == 0
    finally:
        os.close(got.fd)
