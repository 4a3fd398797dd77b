"""Layout v1: golden files pin the bytes; every damage is detected, never returned."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path

import pytest
import xxhash
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvoffload.layouts import (
    SUPPORTED_LAYOUT_VERSIONS,
    CorruptObject,
    LayoutError,
    ObjectMismatch,
    UnknownLayoutVersion,
    create_root,
    migrations,
    read_layout,
    v1,
)

DATA = Path(__file__).parent / "data" / "v1"
_spec = importlib.util.spec_from_file_location(
    "make_golden", Path(__file__).parent.parent / "scripts" / "make_golden.py"
)
assert _spec is not None and _spec.loader is not None
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)

AEAD = AESGCM(golden.DEK)


def _open(buf: bytes | bytearray, *, sealed: bool = True, **over: object) -> bytes:
    kw: dict[str, object] = {
        "tenant": golden.TENANT,
        "namespace": golden.NAMESPACE,
        "chunk_key": golden.CHUNK_KEY,
        "aead_for_epoch": (lambda e: AEAD if e == 7 else None),
    }
    kw.update(over)
    out = bytearray(sum(golden.LAYER_SIZES))
    v1.open_into(memoryview(buf), memoryview(out), **kw)  # type: ignore[arg-type]
    return bytes(out)


@pytest.mark.parametrize("name,sealed", [("sealed.kvo", True), ("plain.kvo", False)])
def test_golden_bytes_are_reproduced(name: str, sealed: bool) -> None:
    assert golden.build(sealed) == (DATA / name).read_bytes()


@pytest.mark.parametrize("name", ["sealed.kvo", "plain.kvo"])
def test_golden_objects_open(name: str) -> None:
    assert _open((DATA / name).read_bytes()) == b"".join(golden.layers())
    h = v1.decode_header((DATA / name).read_bytes())
    assert h.tenant == golden.TENANT and h.chunk_key == golden.CHUNK_KEY
    assert [le.length for le in h.layers] == list(golden.LAYER_SIZES)
    assert all(le.offset % 4096 == 0 for le in h.layers)


def test_golden_layout_json_reads(tmp_path: Path) -> None:
    (tmp_path / "layout.json").write_bytes((DATA / "layout.json").read_bytes())
    info = read_layout(tmp_path)
    assert info.version == 1 and info.store_id.endswith("0001")


@pytest.mark.parametrize("name", ["sealed.kvo", "plain.kvo"])
def test_every_single_byte_flip_is_detected(name: str) -> None:
    original = (DATA / name).read_bytes()
    undetected = []
    for i in range(len(original)):
        bad = bytearray(original)
        bad[i] ^= 0x01
        try:
            _open(bad)
        except LayoutError:
            continue
        undetected.append(i)
    assert undetected == []


@pytest.mark.parametrize("name", ["sealed.kvo", "plain.kvo"])
def test_truncation_and_extension_detected(name: str) -> None:
    original = (DATA / name).read_bytes()
    for n in (0, 1, 9, 100, 4095, 4096, len(original) - 4096, len(original) - 1):
        with pytest.raises(LayoutError):
            _open(original[:n])
    with pytest.raises(CorruptObject):
        _open(original + bytes(4096))


def test_swapped_object_is_a_mismatch() -> None:
    blob = (DATA / "sealed.kvo").read_bytes()
    with pytest.raises(ObjectMismatch):
        _open(blob, chunk_key=bytes(32))
    with pytest.raises(ObjectMismatch):
        _open(blob, tenant="other")
    with pytest.raises(ObjectMismatch):
        _open(blob, namespace=bytes(32))


def test_object_relabelled_to_another_tenant_fails_authentication() -> None:
    # An attacker rewrites the header (valid checksum) to claim another tenant:
    # the AAD binds the tenant, so the tags no longer verify.
    blob = bytearray((DATA / "sealed.kvo").read_bytes())
    h = v1.decode_header(blob)
    forged = v1.encode_header(dataclasses.replace(h, tenant="mallory"))
    blob[: len(forged)] = forged
    with pytest.raises(CorruptObject, match="authentication"):
        _open(blob, tenant="mallory")


def test_wrong_key_or_missing_epoch() -> None:
    blob = (DATA / "sealed.kvo").read_bytes()
    with pytest.raises(CorruptObject, match="authentication"):
        _open(blob, aead_for_epoch=lambda e: AESGCM(os.urandom(32)))
    with pytest.raises(CorruptObject, match="no key"):
        _open(blob, aead_for_epoch=lambda e: None)


def test_unknown_object_version_refused_with_clear_error() -> None:
    blob = bytearray((DATA / "plain.kvo").read_bytes())
    blob[8:10] = (2).to_bytes(2, "little")
    # A flipped version with the old checksum is corruption (section 5: checksum first)…
    with pytest.raises(CorruptObject, match="checksum") as info:
        _open(blob)
    assert not isinstance(info.value, UnknownLayoutVersion)
    # …a header a newer writer checksummed is a version this reader does not know.
    hl = int.from_bytes(blob[12:16], "little")
    blob[hl - 16 : hl] = xxhash.xxh3_128_digest(bytes(blob[: hl - 16]))
    with pytest.raises(UnknownLayoutVersion, match="unknown layout version 2"):
        _open(blob)


@pytest.mark.parametrize("version", [0, 2, 99, "1", None])
def test_unknown_store_version_refused(tmp_path: Path, version: object) -> None:
    (tmp_path / "layout.json").write_text(
        json.dumps({"layout_version": version, "store_id": "x", "created": "y"})
    )
    with pytest.raises(UnknownLayoutVersion):
        read_layout(tmp_path)


def test_not_a_store(tmp_path: Path) -> None:
    with pytest.raises(LayoutError, match="not a kvoffload store"):
        read_layout(tmp_path)


@pytest.mark.parametrize("version", SUPPORTED_LAYOUT_VERSIONS)
def test_create_root_every_supported_version(tmp_path: Path, version: int) -> None:
    info = create_root(tmp_path / "s", version)
    assert info.version == version
    assert {p.name for p in (tmp_path / "s").iterdir()} >= {"layout.json", "keys", "objects"}
    # Idempotent: a second create keeps the store id.
    assert create_root(tmp_path / "s", version).store_id == info.store_id


def test_migrations_registry_covers_every_upgrade_step() -> None:
    steps = {m.from_version for m in migrations()}
    assert steps == set(SUPPORTED_LAYOUT_VERSIONS[:-1])


def test_paths_are_fanned_out() -> None:
    key = bytes.fromhex("ab" * 16 + "cd" * 16)
    assert v1.object_relpath("t", key, (2, 2)) == f"objects/t/ab/ab/{key.hex()}.kvo"
    assert v1.object_relpath("t", key, (2,)) == f"objects/t/ab/{key.hex()}.kvo"
    assert v1.object_relpath("t", key) == v1.object_relpath("t", key, v1.DEFAULT_FANOUT)


def test_seal_refuses_bad_input() -> None:
    buf = memoryview(bytearray(1 << 16))
    with pytest.raises(ValueError):
        v1.seal_into(buf, tenant="t", namespace=b"x", chunk_key=bytes(32), layers=[b"a"], aead=None)
    with pytest.raises(ValueError):
        v1.seal_into(
            buf, tenant="t", namespace=bytes(32), chunk_key=bytes(32), layers=[], aead=None
        )
    with pytest.raises(ValueError, match="too small"):
        v1.seal_into(
            memoryview(bytearray(10)),
            tenant="t",
            namespace=bytes(32),
            chunk_key=bytes(32),
            layers=[b"a"],
            aead=None,
        )
