"""The store end to end: real files, real LMDB, real AES-GCM."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import threading
from pathlib import Path

import pytest
import xxhash
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvoffload.errors import StoreFull, StoreLocked
from kvoffload.layouts import UnknownLayoutVersion, store_root, v1
from kvoffload.store import Store
from kvoffload.store.keys.keyring import Kek, Keyring
from tests.helpers.stores import NS, key, layers, open_store


def disk_usage(root: Path) -> int:
    total = 0
    for p in (root / "objects").rglob("*.kvo"):
        with contextlib.suppress(FileNotFoundError):  # evicted while we walked
            total += p.stat().st_size
    return total


def object_path(s: Store, tenant: str, k: bytes) -> Path:
    return s.root / v1.object_relpath(tenant, k)


@pytest.mark.parametrize("encrypt", [True, False])
def test_roundtrip_random_chunks(store: Store, encrypt: bool) -> None:
    data = {i: layers(i, n=1 + i % 5, size=random.Random(i).randrange(1, 20000)) for i in range(20)}
    for i, ls in data.items():
        assert store.put("acme", NS, key(i), ls, encrypt=encrypt) is True
    for i, ls in data.items():
        assert store.get("acme", key(i)) == ls
    # Same chunk again: "already exists" is success, and changes nothing.
    used = store.used_bytes
    assert store.put("acme", NS, key(0), data[0], encrypt=encrypt) is False
    assert store.used_bytes == used


def test_sealed_objects_hold_no_plaintext(store: Store) -> None:
    ls = [b"SECRET-KV-" * 400]
    store.put("acme", NS, key(1), ls)
    assert b"SECRET-KV-" not in object_path(store, "acme", key(1)).read_bytes()
    store.put("acme", NS, key(2), ls, encrypt=False)
    assert b"SECRET-KV-" in object_path(store, "acme", key(2)).read_bytes()


def test_lookup_counts_leading_chunks(store: Store) -> None:
    for i in (0, 1, 3):
        store.put("acme", NS, key(i), layers(i))
    assert store.lookup("acme", [key(0), key(1), key(2), key(3)]) == 2
    assert store.lookup("acme", [key(3)]) == 1
    assert store.lookup("acme", []) == 0
    # Another tenant sees nothing of acme's chunks, even with the same keys.
    assert store.lookup("beta", [key(0), key(1)]) == 0
    assert store.get("beta", key(0)) is None


def test_deleted_object_is_a_miss_and_drops_the_entry(store: Store) -> None:
    store.put("acme", NS, key(1), layers(1))
    object_path(store, "acme", key(1)).unlink()
    assert store.get("acme", key(1)) is None
    assert store.index.get("acme", key(1)) is None
    assert store.used_bytes == 0


def test_corrupt_object_is_never_returned(store: Store) -> None:
    store.put("acme", NS, key(1), layers(1))
    p = object_path(store, "acme", key(1))
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    p.write_bytes(raw)
    assert store.get("acme", key(1)) is None
    assert store.index.get("acme", key(1)) is None
    assert not p.exists()  # a corrupt file is useless: removed
    assert store.counters.corrupt == 1


def test_truncated_object_is_a_miss(store: Store) -> None:
    store.put("acme", NS, key(1), layers(1))
    p = object_path(store, "acme", key(1))
    with open(p, "r+b") as f:
        f.truncate(p.stat().st_size - 4096)
    assert store.get("acme", key(1)) is None


def test_swapped_files_are_both_misses(store: Store) -> None:
    store.put("acme", NS, key(1), layers(1))
    store.put("acme", NS, key(2), layers(2))
    a, b = object_path(store, "acme", key(1)), object_path(store, "acme", key(2))
    tmp = a.with_suffix(".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    assert store.get("acme", key(1)) is None
    assert store.get("acme", key(2)) is None


def test_restart_keeps_the_index(tmp_path: Path, kek_file: Path) -> None:
    s = open_store(tmp_path, kek_file)
    for i in range(10):
        s.put("acme", NS, key(i), layers(i))
    before = sorted((r.chunk_key, r.size, r.last_access_ns) for r in s.index.records())
    used = s.used_bytes
    s.close()
    s2 = open_store(tmp_path, kek_file)
    try:
        assert sorted((r.chunk_key, r.size, r.last_access_ns) for r in s2.index.records()) == before
        assert s2.used_bytes == used
        assert s2.get("acme", key(3)) == layers(3)
    finally:
        s2.close()


def test_second_open_of_the_same_index_is_refused(store: Store, kek_file: Path) -> None:
    with pytest.raises(StoreLocked, match="in use"):
        Store(store.config, Kek.from_file(kek_file))


def test_lost_index_is_rebuilt_by_fsck_repair(tmp_path: Path, kek_file: Path) -> None:
    s = open_store(tmp_path, kek_file)
    for i in range(12):
        s.put("acme" if i % 2 else "beta", NS, key(i), layers(i), encrypt=bool(i % 3))
    want = sorted(
        (r.tenant, r.chunk_key, r.namespace, r.size, r.key_epoch) for r in s.index.records()
    )
    s.close()
    shutil.rmtree(s.config.resolved_index_dir())
    s2 = Store(s.config, Kek.from_file(kek_file))
    try:
        assert s2.lookup("acme", [key(1)]) == 1  # found by probing the file (shared-FS path)
        assert s2.fsck().clean  # a new index of a store with objects is rebuilt at open
        s2.fsck(repair=True, verify_data=True)
        assert s2.fsck().clean
        got = sorted(
            (r.tenant, r.chunk_key, r.namespace, r.size, r.key_epoch) for r in s2.index.records()
        )
        assert got == want
        assert s2.used_bytes == sum(w[3] for w in want)
        for i in range(12):
            assert s2.get("acme" if i % 2 else "beta", key(i)) == layers(i)
    finally:
        s2.close()


def test_fsck_reports_and_repairs_damage(store: Store) -> None:
    for i in range(4):
        store.put("acme", NS, key(i), layers(i))
    object_path(store, "acme", key(0)).unlink()  # index says present, file gone
    p1 = object_path(store, "acme", key(1))
    raw = bytearray(p1.read_bytes())
    raw[100] ^= 1
    p1.write_bytes(raw)
    tmp = p1.parent / (v1.TMP_PREFIX + "dead-1")
    tmp.write_bytes(b"half an object")
    os.utime(tmp, (1, 1))  # older than tmp_max_age_s
    rep = store.fsck()
    assert len(rep.missing_files) == 1 and len(rep.corrupt_files) == 1
    assert len(rep.orphan_tmp_files) == 1
    assert tmp.exists() and p1.exists()  # no repair: nothing touched
    store.fsck(repair=True)
    assert store.fsck().clean
    assert not tmp.exists() and not p1.exists()
    assert store.lookup("acme", [key(2), key(3)]) == 2
    assert store.index.count() == 2


def test_collect_garbage_removes_only_old_temp_files(store: Store) -> None:
    store.put("acme", NS, key(1), layers(1))
    d = object_path(store, "acme", key(1)).parent
    old, fresh = d / (v1.TMP_PREFIX + "old-1"), d / (v1.TMP_PREFIX + "new-1")
    old.write_bytes(b"x")
    fresh.write_bytes(b"x")
    os.utime(old, (1, 1))
    assert store.collect_garbage() == 1
    assert not old.exists() and fresh.exists()


def test_capacity_never_exceeded_by_a_stream_larger_than_the_store(
    tmp_path: Path, kek_file: Path
) -> None:
    obj = v1.object_size([8192] * 2, True)
    cap = obj * 10
    s = open_store(tmp_path, kek_file, capacity_bytes=cap, high_watermark=0.9, low_watermark=0.6)
    peak = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, s.accounted_bytes)

    w = threading.Thread(target=watch)
    w.start()
    try:
        errors: list[BaseException] = []

        def writer(t: int) -> None:
            try:
                for i in range(40):
                    s.put("acme", NS, key(t * 1000 + i), [os.urandom(8192), os.urandom(8192)])
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        ts = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert errors == []
    finally:
        stop.set()
        w.join()
    assert peak <= cap
    assert s.used_bytes <= cap
    # Quiescent: the files on disk are exactly what the accounting says.
    assert disk_usage(s.root) == s.used_bytes
    # One writer: at every point between writes the disk holds at most the limit.
    for i in range(30):
        s.put("acme", NS, key(9000 + i), [os.urandom(8192), os.urandom(8192)])
        assert disk_usage(s.root) <= cap
    assert s.counters.evictions >= 160 - 10
    # The most recent chunks are the ones kept, the oldest went.
    assert s.lookup("acme", [key(9029), key(9028)]) == 2
    assert s.lookup("acme", [key(9000)]) == 0
    s.close()


def test_lru_keeps_recently_read_chunks(tmp_path: Path, kek_file: Path) -> None:
    obj = v1.object_size([4096], True)
    s = open_store(
        tmp_path, kek_file, capacity_bytes=obj * 4, high_watermark=1.0, low_watermark=1.0
    )
    for i in range(4):
        s.put("acme", NS, key(i), [os.urandom(4096)])
    assert s.get("acme", key(0)) is not None  # now the most recent
    s.put("acme", NS, key(4), [os.urandom(4096)])
    assert s.lookup("acme", [key(0)]) == 1
    assert s.lookup("acme", [key(1)]) == 0  # the least recently used went
    s.close()


def test_write_that_cannot_fit_fails_cleanly(tmp_path: Path, kek_file: Path) -> None:
    obj = v1.object_size([4096], True)
    s = open_store(
        tmp_path, kek_file, capacity_bytes=obj * 2, high_watermark=1.0, low_watermark=1.0
    )
    with pytest.raises(StoreFull):
        s.put("acme", NS, key(0), [os.urandom(4096 * 6)])
    s.put("acme", NS, key(1), [os.urandom(4096)])
    s.put("acme", NS, key(2), [os.urandom(4096)])
    s.pin("acme", [key(1), key(2)])  # being loaded: not evictable
    with pytest.raises(StoreFull):
        s.put("acme", NS, key(3), [os.urandom(4096)])
    assert s.used_bytes == obj * 2 and s.reserved_bytes == 0
    assert not list((s.root / "objects").rglob(v1.TMP_PREFIX + "*"))
    s.unpin("acme", [key(1), key(2)])
    s.put("acme", NS, key(3), [os.urandom(4096)])
    assert s.used_bytes <= obj * 2
    s.close()


def test_full_disk_is_a_clear_error_and_loses_nothing(store: Store) -> None:
    from kvoffload.errors import StoreIOError
    from kvoffload.store import files as fileio

    store.put("acme", NS, key(1), layers(1))
    real = fileio._write_all

    def enospc(fd: int, data: memoryview) -> None:
        raise OSError(28, "No space left on device")

    fileio._write_all = enospc  # type: ignore[assignment]
    try:
        with pytest.raises(StoreIOError, match="permanent") as ei:
            store.put("acme", NS, key(2), layers(2))
        assert ei.value.errno == 28
    finally:
        fileio._write_all = real  # type: ignore[assignment]
    assert store.reserved_bytes == 0
    assert store.get("acme", key(1)) == layers(1)
    assert store.lookup("acme", [key(2)]) == 0
    assert not list((store.root / "objects").rglob(v1.TMP_PREFIX + "*"))


def test_ttl_expiry(store: Store) -> None:
    store.put("acme", NS, key(1), layers(1), ttl_s=1e-9)
    store.put("acme", NS, key(2), layers(2), ttl_s=3600)
    assert store.get("acme", key(1)) is None
    assert store.lookup("acme", [key(2)]) == 1
    assert store.expire() == 0  # key(1) already dropped on access


def test_purge_tenant_is_a_crypto_erase(tmp_path: Path, kek_file: Path) -> None:
    s = open_store(tmp_path, kek_file)
    secret = [b"acme-private-" * 300]
    for i in range(5):
        s.put("acme", NS, key(i), secret)
        s.put("beta", NS, key(i, "beta"), layers(i))
    # An attacker's copy of the raw files, taken before the purge (backup, SSD remnants).
    stolen = {i: object_path(s, "acme", key(i)).read_bytes() for i in range(5)}
    acme_dek = s.keyring.get("acme").deks[1]  # type: ignore[union-attr]
    s.purge_tenant("acme", wait=True)

    assert s.get("acme", key(0)) is None and s.lookup("acme", [key(0)]) == 0
    assert not (s.root / "keys" / "acme.key").exists()
    assert not (s.root / "objects" / "acme").exists()
    assert list(s.index.records(tenant="acme")) == []
    assert s.get("beta", key(0, "beta")) == layers(0)  # others untouched
    s.close()

    # With the KEK, every key file left and the index, nothing opens the stolen objects.
    kek = Kek.from_file(kek_file)
    ring = Keyring(s.root / "keys", kek, cache_ttl_s=0)
    assert ring.get("acme") is None
    candidate_keys = [dek for t in ring.tenants() for dek in ring.get(t).deks.values()]  # type: ignore[union-attr]
    for blob in stolen.values():
        for dek in candidate_keys:
            with pytest.raises(v1.CorruptObject):
                out = bytearray(len(secret[0]))
                v1.open_into(
                    memoryview(blob),
                    memoryview(out),
                    tenant="acme",
                    namespace=NS,
                    chunk_key=v1.decode_header(blob).chunk_key,
                    aead_for_epoch=lambda e, d=dek: AESGCM(d),
                )
    # And the DEK itself is nowhere in the store root or the index.
    for p in list(s.root.rglob("*")) + list(s.config.resolved_index_dir().rglob("*")):
        if p.is_file():
            assert acme_dek not in p.read_bytes(), p
    audit = (s.config.resolved_index_dir() / "audit.jsonl").read_text()
    assert '"event": "purge_tenant"' in audit and '"tenant": "acme"' in audit


def test_purged_tenant_starts_over_with_new_keys(store: Store) -> None:
    salt = store.tenant_salt("acme")
    store.put("acme", NS, key(1), layers(1))
    store.purge_tenant("acme", wait=True)
    assert store.tenant_salt("acme") != salt


def test_purge_namespace_only_touches_that_namespace(store: Store) -> None:
    other = bytes(32)
    store.put("acme", NS, key(1), layers(1))
    store.put("acme", other, key(2), layers(2))
    assert store.purge_namespace("acme", NS) == 1
    assert store.lookup("acme", [key(1)]) == 0 and store.lookup("acme", [key(2)]) == 1


def test_kek_rotation_keeps_data_and_retires_the_old_kek(tmp_path: Path, kek_file: Path) -> None:
    s = open_store(tmp_path, kek_file)
    s.put("acme", NS, key(1), layers(1))
    new_file = tmp_path / "kek2"
    new_file.write_bytes(os.urandom(32))
    new_file.chmod(0o600)
    assert s.rotate_kek(Kek.from_file(new_file)) == 1
    s.close()
    from kvoffload.store.keys.keyring import KeyringError

    with pytest.raises(KeyringError):
        Keyring(s.root / "keys", Kek.from_file(kek_file), cache_ttl_s=0).get("acme")
    s2 = Store(s.config, Kek.from_file(new_file))
    try:
        assert s2.get("acme", key(1)) == layers(1)
    finally:
        s2.close()


def test_nonce_budget_rotates_the_data_key(tmp_path: Path, kek_file: Path) -> None:
    s = open_store(tmp_path, kek_file, max_segments_per_epoch=8)
    for i in range(6):
        s.put("acme", NS, key(i), layers(i, n=2))
    epochs = {r.key_epoch for r in s.index.records()}
    assert len(epochs) >= 2, epochs
    for i in range(6):
        assert s.get("acme", key(i)) == layers(i, n=2)  # old epochs still read
    s.close()


def test_unknown_layout_version_refused(tmp_path: Path, kek_file: Path) -> None:
    s = open_store(tmp_path, kek_file)
    s.close()
    lj = s.root / "layout.json"
    doc = json.loads(lj.read_text())
    doc["layout_version"] = 2
    doc["checksum"] = store_root._checksum(doc)  # a newer kvoffload's, intact
    lj.write_text(json.dumps(doc))
    with pytest.raises(UnknownLayoutVersion):
        Store(s.config, Kek.from_file(kek_file))


def test_object_of_a_future_version_is_a_miss_not_a_crash(store: Store) -> None:
    store.put("acme", NS, key(1), layers(1))
    p = object_path(store, "acme", key(1))
    raw = bytearray(p.read_bytes())
    raw[8:10] = (9).to_bytes(2, "little")
    hl = int.from_bytes(raw[12:16], "little")
    raw[hl - 16 : hl] = xxhash.xxh3_128_digest(bytes(raw[: hl - 16]))  # a newer writer's
    p.write_bytes(raw)
    assert store.get("acme", key(1)) is None
    assert p.exists()  # a newer writer's object is left alone on read


def test_lookup_cached_answers_from_the_index_or_defers(store: Store) -> None:
    for i in range(3):
        store.put("acme", NS, key(i), layers(i))
    assert store.lookup_cached("acme", [key(0), key(1), key(2)]) == 3
    # A miss may be another node's file: only the full lookup (which probes) may say.
    assert store.lookup_cached("acme", [key(0), key(9)]) is None
    assert store.lookup("acme", [key(0), key(9)]) == 1
