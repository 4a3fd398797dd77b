"""Keyring: real key files in a temp dir, real AES-GCM, real processes for races."""

from __future__ import annotations

import base64
import json
import logging
import multiprocessing
import os
import re
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvoffload.store.keys import keyring as keyring_mod
from kvoffload.store.keys.keyring import Kek, Keyring, KeyringError, TenantKeys

AAD = b"test-object"


@pytest.fixture
def keys_dir(tmp_path: Path) -> Path:
    return tmp_path / "store" / "keys"


@pytest.fixture
def kek_bytes() -> bytes:
    return os.urandom(32)


@pytest.fixture
def kek(kek_bytes: bytes) -> Kek:
    return Kek(kek_bytes)


def _doc(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_bytes())
    return doc


def _put_doc(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=2) + "\n")


def _seal(tk: TenantKeys, epoch: int, plaintext: bytes) -> tuple[bytes, bytes]:
    aead = tk.aead(epoch)
    assert aead is not None
    nonce = os.urandom(12)
    return nonce, aead.encrypt(nonce, plaintext, AAD)


def _open(tk: TenantKeys, epoch: int, sealed: tuple[bytes, bytes]) -> bytes:
    aead = tk.aead(epoch)
    assert aead is not None
    return aead.decrypt(sealed[0], sealed[1], AAD)


def _leftovers(keys_dir: Path) -> list[str]:
    """Files other than key files and the lock file: temp or erase leftovers."""
    return sorted(n for n in os.listdir(keys_dir) if not n.endswith(".key") and n != ".lock")


# -- round trip ----------------------------------------------------------------


def test_round_trip_across_restart(keys_dir: Path, kek: Kek, kek_bytes: bytes) -> None:
    tk = Keyring(keys_dir, kek).ensure_tenant("acme")
    assert tk.current_epoch == 1 and set(tk.deks) == {1}
    assert len(tk.salt) == 32 and len(tk.deks[1]) == 32
    sealed = _seal(tk, 1, b"kv bytes")

    again = Keyring(keys_dir, Kek(kek_bytes)).get("acme")  # a new process, same KEK
    assert again is not None
    assert again.salt == tk.salt and again.deks == tk.deks and again.current_epoch == 1
    assert _open(again, 1, sealed) == b"kv bytes"
    assert again.aead(2) is None
    assert Keyring(keys_dir, kek).ensure_tenant("acme").salt == tk.salt


def test_key_file_format_and_no_plaintext_secret(keys_dir: Path, kek: Kek) -> None:
    tk = Keyring(keys_dir, kek).ensure_tenant("acme")
    path = keys_dir / "acme.key"
    assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0
    text = path.read_text()
    doc = json.loads(text)
    assert doc["format"] == 1 and doc["tenant"] == "acme" and doc["kek_id"] == kek.key_id
    assert doc["current_epoch"] == 1 and set(doc["epochs"]) == {"1"}
    assert len(base64.b64decode(doc["salt"]["nonce"])) == 12
    assert len(base64.b64decode(doc["epochs"]["1"]["ct"])) == 32 + 16
    for secret in (tk.salt, tk.deks[1]):
        assert secret.hex() not in text and base64.b64encode(secret).decode() not in text
    assert tk.salt.hex() not in repr(tk) and "salt" not in repr(tk)
    assert _leftovers(keys_dir) == []


def test_get_unknown_tenant_and_listing(keys_dir: Path, kek: Kek) -> None:
    kr = Keyring(keys_dir, kek)
    assert kr.get("nobody") is None
    assert kr.tenants() == []
    for t in ("zeta", "Acme", "beta.2", "b-1"):
        kr.ensure_tenant(t)
    assert kr.tenants() == sorted(["zeta", "Acme", "beta.2", "b-1"])
    assert len({kr.ensure_tenant(t).salt for t in kr.tenants()}) == 4


@pytest.mark.parametrize(
    "tenant", ["", "-a", ".hidden", "_x", "a/b", "../x", "a" * 65, "é", "acme\n", "a b"]
)
def test_invalid_tenant_ids_are_refused(keys_dir: Path, kek: Kek, tenant: str) -> None:
    kr = Keyring(keys_dir, kek)
    with pytest.raises(KeyringError, match="invalid tenant id"):
        kr.ensure_tenant(tenant)
    with pytest.raises(KeyringError, match="invalid tenant id"):
        kr.get(tenant)
    assert kr.tenants() == [] and _leftovers(keys_dir) == []


@pytest.mark.parametrize("tenant", ["A", "a" * 64, "a.b_c-d", "0"])
def test_valid_tenant_ids(keys_dir: Path, kek: Kek, tenant: str) -> None:
    kr = Keyring(keys_dir, kek)
    kr.ensure_tenant(tenant)
    assert kr.tenants() == [tenant]


def test_kek_id_test_vector() -> None:
    # Pinned in docs/spec/keys-v1.md section 4: key files written today must name
    # their KEK the same way tomorrow.
    assert Kek(bytes(range(32))).key_id == "717af2e5a83d5d10"
    assert repr(Kek(bytes(range(32)))) == "Kek(key_id='717af2e5a83d5d10')"


def test_wrong_kek_names_both_ids(keys_dir: Path, kek: Kek) -> None:
    Keyring(keys_dir, kek).ensure_tenant("acme")
    other = Kek(os.urandom(32))
    with pytest.raises(KeyringError) as ei:
        Keyring(keys_dir, other).get("acme")
    msg = str(ei.value)
    assert f"wrapped by KEK {kek.key_id}" in msg and f"loaded KEK is {other.key_id}" in msg
    assert kek.key_id != other.key_id and re.fullmatch(r"[0-9a-f]{16}", kek.key_id)


# -- KEK files -----------------------------------------------------------------


def _kek_file(tmp_path: Path, data: bytes, mode: int = 0o600) -> Path:
    p = tmp_path / "kek.cred"
    p.write_bytes(data)
    p.chmod(mode)
    return p


def _binary_key() -> bytes:
    while True:  # a raw key that is not, by chance, all printable text
        key = os.urandom(32)
        if any(b >= 0x7F or b < 0x20 for b in key):
            return key


@pytest.mark.parametrize(
    "encode",
    [
        lambda k: k,
        lambda k: k.hex().encode(),
        lambda k: k.hex().upper().encode() + b"\n",
        lambda k: b"  " + base64.b64encode(k) + b"\r\n",
        lambda k: base64.b64encode(k)[:20] + b"\n" + base64.b64encode(k)[20:],
    ],
    ids=["raw", "hex", "HEX-newline", "base64-padded-ws", "base64-wrapped"],
)
def test_kek_file_formats(tmp_path: Path, encode: Any) -> None:
    key = _binary_key()
    loaded = Kek.from_file(_kek_file(tmp_path, encode(key)))
    assert loaded.key_id == Kek(key).key_id
    assert loaded.source == tmp_path / "kek.cred"


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\n",
        os.urandom(31),
        b"\x00" + os.urandom(32),
        os.urandom(32).hex()[:62].encode(),
        os.urandom(16).hex().encode(),  # a 128-bit key: 32 printable characters
        base64.b64encode(os.urandom(16)),
        b"correct horse battery staple 12",
        os.urandom(32).hex().encode() + b"zz",
        os.urandom(5000),
    ],
    ids=[
        "empty",
        "newline",
        "raw31",
        "raw33",
        "hex62",
        "hex-128bit",
        "b64-16",
        "pass",
        "hexzz",
        "big",
    ],
)
def test_malformed_kek_file(tmp_path: Path, data: bytes) -> None:
    with pytest.raises(KeyringError, match="KEK file"):
        Kek.from_file(_kek_file(tmp_path, data))


def test_missing_kek_file(tmp_path: Path) -> None:
    with pytest.raises(KeyringError, match="cannot read KEK file"):
        Kek.from_file(tmp_path / "absent")


def test_kek_file_permissions_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    key = os.urandom(32).hex().encode()
    with caplog.at_level(logging.WARNING, logger=keyring_mod.__name__):
        Kek.from_file(_kek_file(tmp_path, key, 0o600))
        assert not caplog.records
        Kek.from_file(_kek_file(tmp_path, key, 0o640))
    assert any("readable by its group or by others" in r.getMessage() for r in caplog.records)


def test_generate_dev_creates_0600_and_reuses(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "dev" / "kek"
    with caplog.at_level(logging.WARNING, logger=keyring_mod.__name__):
        first = Kek.generate_dev(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert any("DEVELOPMENT KEK" in r.getMessage() for r in caplog.records)
    assert Kek.generate_dev(path).key_id == first.key_id
    assert Kek.from_file(path).key_id == first.key_id
    assert os.listdir(path.parent) == ["kek"]  # no temp file left behind


def test_kek_inside_keys_dir_is_refused(keys_dir: Path) -> None:
    keys_dir.mkdir(parents=True)
    kek = Kek.generate_dev(keys_dir / "kek")
    with pytest.raises(KeyringError, match="inside the keys directory"):
        Keyring(keys_dir, kek)


# -- tampering and corruption -----------------------------------------------------


def test_every_bit_flip_outside_timestamps_is_refused(keys_dir: Path, kek: Kek) -> None:
    kr = Keyring(keys_dir, kek, cache_ttl_s=0)
    kr.ensure_tenant("acme")
    kr.rotate_dek("acme")
    path = keys_dir / "acme.key"
    good = path.read_bytes()
    # Timestamps are informational and unauthenticated by design (see the spec).
    skip: set[int] = set()
    for m in re.finditer(rb'"created": "([^"]*)"', good):
        skip.update(range(m.start(1), m.end(1)))
    tried = 0
    for i in range(len(good)):
        if i in skip:
            continue
        bad = bytearray(good)
        bad[i] ^= 0x01
        path.write_bytes(bytes(bad))
        with pytest.raises(KeyringError):
            kr.get("acme")
        tried += 1
    assert tried > 300
    path.write_bytes(good)
    assert kr.get("acme") is not None


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) // 2],
        lambda b: b"",
        lambda b: os.urandom(len(b)),
        lambda b: b"[]",
        lambda b: b.replace(b'"format": 1', b'"format": true'),
    ],
    ids=["truncated", "empty", "random", "array", "format-bool"],
)
def test_damaged_key_file_is_keyring_error(keys_dir: Path, kek: Kek, damage: Any) -> None:
    Keyring(keys_dir, kek).ensure_tenant("acme")
    path = keys_dir / "acme.key"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(KeyringError):
        Keyring(keys_dir, kek).get("acme")


def test_authentication_failure_is_chained(keys_dir: Path, kek: Kek) -> None:
    Keyring(keys_dir, kek).ensure_tenant("acme")
    path = keys_dir / "acme.key"
    doc = _doc(path)
    ct = bytearray(base64.b64decode(doc["epochs"]["1"]["ct"]))
    ct[5] ^= 0x80
    doc["epochs"]["1"]["ct"] = base64.b64encode(bytes(ct)).decode()
    _put_doc(path, doc)
    with pytest.raises(KeyringError, match="epoch 1 fails authentication") as ei:
        Keyring(keys_dir, kek).get("acme")
    assert type(ei.value.__cause__).__name__ == "InvalidTag"


def test_unknown_format_and_fields(keys_dir: Path, kek: Kek) -> None:
    Keyring(keys_dir, kek).ensure_tenant("acme")
    path = keys_dir / "acme.key"
    good = _doc(path)
    _put_doc(path, {**good, "format": 2})
    with pytest.raises(KeyringError, match="unknown format 2"):
        Keyring(keys_dir, kek).get("acme")
    _put_doc(path, {**good, "comment": "hi"})
    with pytest.raises(KeyringError, match="comment"):
        Keyring(keys_dir, kek).get("acme")
    path.write_bytes(path.read_bytes().replace(b'"comment": "hi"', b'"format": 1'))
    with pytest.raises(KeyringError, match="duplicate field"):
        Keyring(keys_dir, kek).get("acme")


def test_wrapped_secrets_do_not_move_between_tenants_or_epochs(keys_dir: Path, kek: Kek) -> None:
    kr = Keyring(keys_dir, kek, cache_ttl_s=0)
    kr.ensure_tenant("alice")
    kr.ensure_tenant("bob")
    kr.rotate_dek("bob")
    alice, bob = _doc(keys_dir / "alice.key"), _doc(keys_dir / "bob.key")

    _put_doc(keys_dir / "bob.key", {**bob, "epochs": {**bob["epochs"], "1": alice["epochs"]["1"]}})
    with pytest.raises(KeyringError, match="epoch 1 fails authentication"):
        kr.get("bob")

    _put_doc(keys_dir / "bob.key", {**bob, "salt": alice["salt"]})
    with pytest.raises(KeyringError, match="salt fails authentication"):
        kr.get("bob")

    swapped = {"1": bob["epochs"]["2"], "2": bob["epochs"]["1"]}
    _put_doc(keys_dir / "bob.key", {**bob, "epochs": swapped})
    with pytest.raises(KeyringError, match="fails authentication"):
        kr.get("bob")

    # The whole file moved under another tenant's name names the wrong tenant.
    _put_doc(keys_dir / "bob.key", alice)
    with pytest.raises(KeyringError, match="names tenant 'alice'"):
        kr.get("bob")

    _put_doc(keys_dir / "bob.key", bob)
    assert kr.get("bob") is not None


# -- destroy -----------------------------------------------------------------------


def test_destroy(keys_dir: Path, kek: Kek) -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    kr = Keyring(keys_dir, kek, audit=lambda e, d: events.append((e, d)))
    old_salt = kr.ensure_tenant("victim").salt
    kr.ensure_tenant("keeper")
    path = keys_dir / "victim.key"
    original = path.read_bytes()
    with open(path, "rb") as held:  # the same inode, seen through an open descriptor
        assert kr.destroy("victim") is True
        held.seek(0)
        after = held.read()
    assert len(after) == len(original) and after != original  # overwritten in place
    assert not path.exists()
    assert kr.get("victim") is None
    assert Keyring(keys_dir, kek).get("victim") is None
    assert kr.tenants() == ["keeper"]
    assert _leftovers(keys_dir) == []
    assert kr.destroy("victim") is False
    assert [e for e, _ in events] == ["create_tenant", "create_tenant", "destroy", "destroy"]
    assert events[2][1] == {"tenant": "victim", "existed": True}
    # A new tenant of the same name gets new keys.
    assert kr.ensure_tenant("victim").salt != old_salt


def test_destroy_erases_the_tenants_stale_temp_files_only(keys_dir: Path, kek: Kek) -> None:
    kr = Keyring(keys_dir, kek)
    kr.ensure_tenant("acme")
    kr.ensure_tenant("acme-2")
    mine = keys_dir / f".tmp-{'a' * 16}-acme"
    theirs = keys_dir / f".tmp-{'b' * 16}-acme-2"
    mine.write_bytes((keys_dir / "acme.key").read_bytes())  # as a crashed writer leaves it
    theirs.write_bytes(b"x")
    assert kr.destroy("acme")
    assert not mine.exists() and theirs.exists()


def test_interrupted_destroy_is_finished_on_open(keys_dir: Path, kek: Kek) -> None:
    Keyring(keys_dir, kek).ensure_tenant("acme")
    grave = keys_dir / f".erase-{'c' * 16}-acme"
    os.rename(keys_dir / "acme.key", grave)  # killed after the rename, before the overwrite
    kr = Keyring(keys_dir, kek)
    assert not grave.exists()
    assert kr.get("acme") is None


def test_destroyed_tenant_copy_is_useless_after_kek_rotation(keys_dir: Path, kek: Kek) -> None:
    kr = Keyring(keys_dir, kek)
    victim = kr.ensure_tenant("victim")
    keeper = kr.ensure_tenant("keeper")
    stale = (keys_dir / "victim.key").read_bytes()  # e.g. a snapshot or a remapped sector
    assert kr.destroy("victim")

    new = Kek(os.urandom(32))
    assert kr.rotate_kek(new) == 1
    (keys_dir / "victim.key").write_bytes(stale)

    with pytest.raises(KeyringError) as ei:
        Keyring(keys_dir, new).get("victim")
    assert kek.key_id in str(ei.value) and new.key_id in str(ei.value)
    kept = Keyring(keys_dir, new).get("keeper")
    assert kept is not None and kept.salt == keeper.salt
    # The residual risk the spec states: the stale copy plus the *old* KEK.
    revived = Keyring(keys_dir, kek).get("victim")
    assert revived is not None and revived.salt == victim.salt


# -- rotations ---------------------------------------------------------------------


def test_rotate_dek_keeps_old_epochs(keys_dir: Path, kek: Kek) -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    kr = Keyring(keys_dir, kek, audit=lambda e, d: events.append((e, d)))
    tk1 = kr.ensure_tenant("acme")
    old = _seal(tk1, 1, b"epoch one")
    nonce_before = _doc(keys_dir / "acme.key")["epochs"]["1"]["nonce"]
    assert kr.rotate_dek("acme") == 2
    assert kr.rotate_dek("acme") == 3
    tk = kr.get("acme")
    assert tk is not None and tk.current_epoch == 3 and set(tk.deks) == {1, 2, 3}
    assert len({tk.deks[1], tk.deks[2], tk.deks[3]}) == 3
    assert tk.salt == tk1.salt and tk.deks[1] == tk1.deks[1]
    assert kr.ensure_tenant("acme").current_epoch == 3  # the cache follows the rotation
    # Every rewrite re-wraps everything with fresh nonces (spec section 6).
    assert _doc(keys_dir / "acme.key")["epochs"]["1"]["nonce"] != nonce_before
    fresh = Keyring(keys_dir, kek).get("acme")
    assert fresh is not None and fresh.current_epoch == 3
    assert _open(fresh, 1, old) == b"epoch one"
    assert events[-1] == ("rotate_dek", {"tenant": "acme", "epoch": 3, "previous_epoch": 2})
    with pytest.raises(KeyringError, match="no keys"):
        kr.rotate_dek("nobody")


def test_rotate_kek_rewraps_all(keys_dir: Path, kek: Kek) -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    kr = Keyring(keys_dir, kek, audit=lambda e, d: events.append((e, d)))
    before = {t: kr.ensure_tenant(t) for t in ("a", "b", "c")}
    kr.rotate_dek("b")
    before["b"] = kr.ensure_tenant("b")
    new = Kek(os.urandom(32))

    assert kr.rotate_kek(new) == 3
    assert kr.kek_id == new.key_id
    assert {_doc(keys_dir / f"{t}.key")["kek_id"] for t in before} == {new.key_id}
    for t in before:
        with pytest.raises(KeyringError, match=f"wrapped by KEK {new.key_id}"):
            Keyring(keys_dir, kek).get(t)
        got = Keyring(keys_dir, new).get(t)
        assert got is not None
        assert got.salt == before[t].salt and got.deks == before[t].deks
    assert kr.rotate_kek(new) == 0
    assert events[-2][0] == "rotate_kek"
    assert events[-2][1] == {
        "kek_id": new.key_id,
        "previous_kek_id": kek.key_id,
        "rewrapped": 3,
        "failed": [],
    }
    assert _leftovers(keys_dir) == []


class _Killed(BaseException):
    """Stands for SIGKILL: nothing below may catch it."""


def test_rotate_kek_is_restartable(
    keys_dir: Path, kek: Kek, monkeypatch: pytest.MonkeyPatch
) -> None:
    kr = Keyring(keys_dir, kek)
    salts = {t: kr.ensure_tenant(t).salt for t in ("a", "b", "c", "d")}
    new = Kek(os.urandom(32))
    real_replace = os.replace
    calls = 0

    def dying_replace(src: Any, dst: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise _Killed
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", dying_replace)
    with pytest.raises(_Killed):
        kr.rotate_kek(new)
    monkeypatch.setattr(os, "replace", real_replace)

    ids = [_doc(keys_dir / f"{t}.key")["kek_id"] for t in sorted(salts)]
    assert ids == [new.key_id, new.key_id, kek.key_id, kek.key_id]
    with pytest.raises(KeyringError):
        Keyring(keys_dir, new).get("c")

    restarted = Keyring(keys_dir, new, previous_keks=[kek])
    assert all(restarted.get(t) is not None for t in salts)  # both KEKs read meanwhile
    assert restarted.rotate_kek(new) == 2
    only_new = Keyring(keys_dir, new)
    for t, salt in salts.items():
        got = only_new.get(t)
        assert got is not None and got.salt == salt
    assert _leftovers(keys_dir) == []


def test_rotate_kek_reports_files_it_cannot_read(keys_dir: Path, kek: Kek) -> None:
    kr = Keyring(keys_dir, kek)
    kr.ensure_tenant("good")
    stranger = Kek(os.urandom(32))
    Keyring(keys_dir, stranger).ensure_tenant("foreign")
    new = Kek(os.urandom(32))
    with pytest.raises(KeyringError, match=r"re-wrapped 1 key files, 1 failed: foreign"):
        kr.rotate_kek(new)
    assert _doc(keys_dir / "good.key")["kek_id"] == new.key_id
    assert _doc(keys_dir / "foreign.key")["kek_id"] == stranger.key_id


# -- cache bound -------------------------------------------------------------------


def test_destroy_reaches_another_instance_after_ttl(keys_dir: Path, kek: Kek) -> None:
    node_a = Keyring(keys_dir, kek, cache_ttl_s=0.2)
    node_b = Keyring(keys_dir, kek, cache_ttl_s=0.2)
    node_a.ensure_tenant("acme")
    assert node_b.get("acme") is not None
    node_a.destroy("acme")
    time.sleep(0.3)
    assert node_b.get("acme") is None


def test_cache_serves_within_ttl_only(keys_dir: Path, kek: Kek) -> None:
    now = [100.0]
    node_a = Keyring(keys_dir, kek, cache_ttl_s=0)
    node_b = Keyring(keys_dir, kek, cache_ttl_s=30, clock=lambda: now[0])
    node_a.ensure_tenant("acme")
    cached = node_b.get("acme")
    assert cached is not None
    node_a.destroy("acme")
    now[0] += 29.9
    assert node_b.get("acme") is cached  # the bound is real: still served from memory
    now[0] += 0.2
    assert node_b.get("acme") is None
    # cache_ttl_s=0: a destroy elsewhere is seen at once.
    node_a.ensure_tenant("acme")
    assert node_a.get("acme") is not None
    Keyring(keys_dir, kek).destroy("acme")
    assert node_a.get("acme") is None


# -- concurrency --------------------------------------------------------------------


def _ensure_in_child(
    keys_dir: str, kek_hex: str, tenants: list[str], barrier: Any, out: Any
) -> None:
    kr = Keyring(keys_dir, Kek(bytes.fromhex(kek_hex)), cache_ttl_s=0)
    barrier.wait()
    out.put({t: kr.ensure_tenant(t).salt.hex() for t in tenants})


def test_two_processes_racing_ensure_tenant_agree(keys_dir: Path) -> None:
    key = os.urandom(32)
    tenants = [f"t{i}" for i in range(16)]
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_ensure_in_child, args=(str(keys_dir), key.hex(), tenants, barrier, out))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0] == results[1]
    assert len(set(results[0].values())) == len(tenants)
    kr = Keyring(keys_dir, Kek(key))
    assert {t: kr.ensure_tenant(t).salt.hex() for t in tenants} == results[0]
    assert _leftovers(keys_dir) == []


def _rotate_in_child(keys_dir: str, kek_hex: str, n: int, barrier: Any, out: Any) -> None:
    kr = Keyring(keys_dir, Kek(bytes.fromhex(kek_hex)), cache_ttl_s=0)
    barrier.wait()
    out.put([kr.rotate_dek("acme") for _ in range(n)])


def test_two_processes_rotating_one_tenant_lose_no_epoch(keys_dir: Path) -> None:
    key = os.urandom(32)
    Keyring(keys_dir, Kek(key)).ensure_tenant("acme")
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    out = ctx.Queue()
    n = 15
    procs = [
        ctx.Process(target=_rotate_in_child, args=(str(keys_dir), key.hex(), n, barrier, out))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    # A lost update would hand the same new epoch to both, one with a DEK that is gone.
    assert sorted(results[0] + results[1]) == list(range(2, 2 * n + 2))
    final = Keyring(keys_dir, Kek(key)).get("acme")
    assert final is not None and set(final.deks) == set(range(1, 2 * n + 2))


def test_losing_the_creation_link_adopts_the_winner(
    keys_dir: Path, kek: Kek, monkeypatch: pytest.MonkeyPatch
) -> None:
    winner = Keyring(keys_dir, kek).ensure_tenant("acme")
    loser = Keyring(keys_dir, kek, cache_ttl_s=0)
    real_load = loser._load
    blind = [True]

    def load_missing_once(tenant: str, path: Path) -> Any:
        # As on a node whose flock does not reach the others: the file appears
        # between the loser's check and its link().
        if blind[0]:
            blind[0] = False
            return None
        return real_load(tenant, path)

    monkeypatch.setattr(loser, "_load", load_missing_once)
    got = loser.ensure_tenant("acme")
    assert not blind[0]
    assert got.salt == winner.salt and got.deks == winner.deks
    assert _leftovers(keys_dir) == []


def test_threads_share_one_keyring(keys_dir: Path, kek: Kek) -> None:
    kr = Keyring(keys_dir, kek, cache_ttl_s=0)
    salts: list[bytes] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(20):
                salts.append(kr.ensure_tenant("acme").salt)
                got = kr.get("acme")
                assert got is not None
                salts.append(got.salt)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(salts) == 8 * 40 and len(set(salts)) == 1
