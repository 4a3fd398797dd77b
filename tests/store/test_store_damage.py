"""Damaged objects (issue 11, items 2, 6): a miss for that chunk alone, never a
poisoned key, never an exception out of a load batch. Real files, real LMDB."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest
import xxhash

from kvoffload.layouts import v1
from kvoffload.store import Store
from kvoffload.store import files as fileio

NS = bytes(range(32))


@pytest.fixture(autouse=True, params=["whole", "streamed"])
def _reads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every case twice: objects read whole, and (small as they are) read one
    layer slot at a time (``fileio.streamed_object``, on a local file system)."""
    if request.param == "streamed":
        monkeypatch.setattr(fileio, "STREAM_MIN_BYTES", 1)
        monkeypatch.setattr(fileio, "MAP_MIN_BYTES", 1)  # no small page-cache hits in a batch


def key(i: int) -> bytes:
    return hashlib.blake2b(f"acme/{i}".encode(), digest_size=32).digest()


def layers(seed: int, sizes: tuple[int, ...] = (3000, 3001, 3002)) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(n) for n in sizes]


def path(s: Store, k: bytes, tenant: str = "acme") -> Path:
    return s.root / v1.object_relpath(tenant, k)


def load(s: Store, keys: list[bytes]) -> list[list[int] | None]:
    """What the server does: output buffers sized from the index records."""
    outs = []
    for k in keys:
        rec = s.payload_info("acme", k)
        outs.append(memoryview(bytearray(rec.payload if rec else 1)))
    return s.get_many_into("acme", keys, outs)


@pytest.mark.parametrize("encrypt", [True, False])
def test_flipped_version_bit_is_corruption_and_a_resave_replaces_it(
    store: Store, encrypt: bool
) -> None:
    data = layers(1)
    store.put("acme", NS, key(1), data, encrypt=encrypt)
    p = path(store, key(1))
    raw = bytearray(p.read_bytes())
    raw[8] ^= 0x02  # version 1 -> 3, the header checksum not updated
    p.write_bytes(raw)
    assert store.get("acme", key(1)) is None
    assert not p.exists()  # out of its name: quarantined
    assert list((store.root / "quarantine").iterdir())
    assert store.lookup("acme", [key(1)]) == 0
    assert store.put("acme", NS, key(1), data, encrypt=encrypt) is True
    assert store.get("acme", key(1)) == data


@pytest.mark.parametrize("encrypt", [True, False])
def test_exists_on_publish_only_if_the_existing_object_verifies(
    store: Store, encrypt: bool
) -> None:
    data = layers(2)
    store.put("acme", NS, key(2), data, encrypt=encrypt)
    # A damaged object at the name and no index entry (a crash, a torn copy).
    store.index.remove("acme", key(2))
    p = path(store, key(2))
    raw = bytearray(p.read_bytes())
    raw[-5000] ^= 0x40  # inside the last layer
    p.write_bytes(raw)
    assert store.put("acme", NS, key(2), data, encrypt=encrypt) is True
    assert store.get("acme", key(2)) == data
    # An intact object at the name stays: "exists" is success then.
    store.index.remove("acme", key(2))
    assert store.put("acme", NS, key(2), data, encrypt=encrypt) is False
    assert store.get("acme", key(2)) == data


@pytest.mark.parametrize("encrypt", [True, False])
@pytest.mark.parametrize("sizes", [(9000,), (100, 200, 300)])  # larger, smaller payload
def test_object_of_another_shape_is_a_miss_and_earlier_chunks_still_load(
    store: Store, encrypt: bool, sizes: tuple[int, ...]
) -> None:
    for i in range(3):
        store.put("acme", NS, key(i), layers(i), encrypt=encrypt)
    # Chunk 1's file replaced by a valid object of the same key with other layer sizes.
    tk = store.keyring.ensure_tenant("acme")
    other = layers(7, sizes)
    lengths = [len(x) for x in other]
    buf = memoryview(bytearray(v1.object_size(lengths, encrypt)))
    v1.seal_into(
        buf, tenant="acme", namespace=NS, chunk_key=key(1), layers=other,
        aead=tk.aead(tk.current_epoch) if encrypt else None,
        key_epoch=tk.current_epoch if encrypt else 0,
    )  # fmt: skip
    path(store, key(1)).write_bytes(buf)
    res = load(store, [key(0), key(1), key(2)])
    assert res[0] == [3000, 3001, 3002]  # never withheld
    assert res[1] is None and res[2] is None
    # The record that sized the read was dropped; the object, valid by its own
    # header, is indexed from it (so the index now tells the truth).
    rec = store.payload_info("acme", key(1))
    assert rec is not None and rec.payload == sum(sizes)
    assert load(store, [key(1)])[0] == list(sizes)
    # A re-save of the engine's shape replaces it (equal keys must mean equal content).
    assert store.put("acme", NS, key(1), layers(1), encrypt=encrypt) is True
    assert store.get("acme", key(1)) == layers(1)


def test_every_exception_of_a_damaged_file_is_a_miss(store: Store) -> None:
    for i in range(3):
        store.put("acme", NS, key(i), layers(i))
    p = path(store, key(1))
    raw = bytearray(p.read_bytes())
    # A header that checksums but whose tenant field is not UTF-8 (decoding raises).
    raw[104] = 0xFF
    hl = int.from_bytes(raw[12:16], "little")
    raw[hl - 16 : hl] = xxhash.xxh3_128_digest(bytes(raw[: hl - 16]))
    p.write_bytes(raw)
    res = load(store, [key(0), key(1), key(2)])
    assert res[0] is not None and res[1] is None


def test_access_bookkeeping_failing_never_fails_a_read(store: Store) -> None:
    store.put("acme", NS, key(1), layers(1))

    def broken(*_a: object, **_k: object) -> None:
        raise OSError(28, "No space left on device")

    store.index.touch = broken  # type: ignore[method-assign]
    store._state.access.flushed = 0  # the next hit flushes
    assert store.get("acme", key(1)) == layers(1)
    assert store.get("acme", key(1)) == layers(1)


def test_a_purge_removes_the_tenants_quarantined_objects(store: Store) -> None:
    for t in ("acme", "acme.b"):
        store.put(t, NS, key(1), layers(1), encrypt=False)
        p = path(store, key(1), t)
        raw = bytearray(p.read_bytes())
        raw[-100] ^= 1
        p.write_bytes(raw)
        assert store.get(t, key(1)) is None
    q = store.root / "quarantine"
    assert len(list(q.iterdir())) == 2
    store.purge_tenant("acme", wait=True)
    assert [p.name.startswith("acme.b.") for p in q.iterdir()] == [True]
