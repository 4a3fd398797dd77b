"""The direct path's objects: a header block plus layers at the placement rule's offsets is
the staging path's plaintext object, and verify_plain refuses every damage."""

from __future__ import annotations

import os
from typing import Any

import pytest
import xxhash
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvoffload.layouts import CorruptObject, ObjectMismatch, v1
from tests.direct_helpers import (
    NS,
    OTHER_NS,
    TENANT,
    assembled,
    header_block,
    key,
    rand_layers,
    sealed_plain,
    verify,
)

# ----------------------------------------------------------------------- layout

SHAPES = {
    "one-byte": [1],
    "one-page": [4096],
    "one-odd": [5000],
    "pages": [4096, 8192, 4096 * 3],
    "odd-many": [1, 4095, 4097, 10_000, 12_289, 7],
    "with-empty-layer": [300, 0, 4096, 5],
    # 100 layers: the header (192 + 48 x 100 bytes) spills past the first 4 KiB.
    "header-two-pages": [97 + 13 * i for i in range(100)],
}


@pytest.mark.parametrize("sizes", list(SHAPES.values()), ids=list(SHAPES))
def test_header_block_plus_placed_layers_is_the_sealed_plaintext_object(sizes: list[int]) -> None:
    layers = rand_layers(len(sizes), sizes)
    created = 1_700_000_000_123_456_789 + len(sizes)
    built = assembled(layers, chunk_key=key(1), created_ns=created)
    assert bytes(built) == sealed_plain(layers, chunk_key=key(1), created_ns=created)
    h = verify(built, chunk_key=key(1))
    assert not h.sealed and h.key_epoch == 0 and h.created_ns == created
    assert [le.length for le in h.layers] == sizes
    assert [le.check for le in h.layers] == [xxhash.xxh3_128_digest(x) for x in layers]
    assert h.data_offset == (8192 if len(sizes) == 100 else 4096)
    assert h.total_size == len(built)


def test_header_block_differs_with_created_time_and_identity() -> None:
    layers = rand_layers(2, [5000])
    a = header_block(layers, chunk_key=key(1), created_ns=1)
    assert a != header_block(layers, chunk_key=key(1), created_ns=2)
    assert a != header_block(layers, chunk_key=key(2), created_ns=1)
    assert a != header_block(layers, chunk_key=key(1), created_ns=1, tenant="beta")
    assert len(a) == 4096 and a[v1.header_length(1) :] == bytes(4096 - v1.header_length(1))


def test_header_block_refuses_bad_arguments() -> None:
    ok: dict[str, Any] = {
        "tenant": TENANT,
        "namespace": NS,
        "chunk_key": key(1),
        "lengths": [10, 20],
        "checks": [bytes(16), bytes(16)],
    }
    v1.plain_header_block(**ok)
    for bad in (
        {"chunk_key": key(1)[:31]},
        {"namespace": NS + b"x"},
        {"lengths": [], "checks": []},
        {"checks": [bytes(16)]},
        {"checks": [bytes(16), bytes(15)]},
        {"lengths": [10, -1]},
        {"tenant": ""},
        {"tenant": "t" * 65},
    ):
        with pytest.raises(ValueError):
            v1.plain_header_block(**{**ok, **bad})


@pytest.fixture
def good_object() -> tuple[list[bytes], bytearray]:
    # Layer 0 ends mid-page: there is layer padding to flip.
    layers = rand_layers(7, [5000, 4096, 300])
    return layers, assembled(layers, chunk_key=key(7), created_ns=42)


def test_verify_plain_refuses_a_sealed_object(good_object: tuple[list[bytes], bytearray]) -> None:
    layers, _ = good_object
    lengths = [len(x) for x in layers]
    out = bytearray(v1.object_size(lengths, True))
    v1.seal_into(
        memoryview(out),
        tenant=TENANT,
        namespace=NS,
        chunk_key=key(7),
        layers=layers,
        aead=AESGCM(os.urandom(32)),
        key_epoch=1,
    )
    assert v1.decode_header(bytes(out)).sealed  # a valid sealed object...
    with pytest.raises(CorruptObject, match="plaintext") as ei:
        verify(out, chunk_key=key(7))
    assert not isinstance(ei.value, ObjectMismatch)


def _padding_after(h: v1.ObjectHeader, i: int) -> int:
    le = h.layers[i]
    return le.offset + le.length


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("layer0", "layer 0: checksum"),
        ("layer2-last-byte", "layer 2: checksum"),
        ("layer-padding", "padding after layer 0"),
        ("file-tail-padding", "padding after layer 2"),
        ("header-padding", "padding after header"),
        ("header-chunk-key", "header checksum"),
        ("header-checksum", "header checksum"),
        ("layer-table-check", "header checksum"),
    ],
)
def test_verify_plain_refuses_any_flipped_byte(
    good_object: tuple[list[bytes], bytearray], where: str, message: str
) -> None:
    _, buf = good_object
    h = verify(buf, chunk_key=key(7))
    hl = v1.header_length(3)
    pos = {
        "layer0": h.layers[0].offset + 17,
        "layer2-last-byte": h.layers[2].offset + h.layers[2].length - 1,
        "layer-padding": _padding_after(h, 0) + 5,
        "file-tail-padding": len(buf) - 1,
        "header-padding": hl + 1,
        "header-chunk-key": 40,
        "header-checksum": hl - 1,
        "layer-table-check": 176 + 48 + 30,
    }[where]
    buf[pos] ^= 0x01
    with pytest.raises(CorruptObject, match=message):
        verify(buf, chunk_key=key(7))


@pytest.mark.parametrize(
    "wrong",
    [{"tenant": "beta"}, {"namespace": OTHER_NS}, {"chunk_key": key(8)}],
    ids=["tenant", "namespace", "chunk-key"],
)
def test_verify_plain_refuses_another_identity(
    good_object: tuple[list[bytes], bytearray], wrong: dict[str, Any]
) -> None:
    _, buf = good_object
    args: dict[str, Any] = {"chunk_key": key(7), **wrong}
    with pytest.raises(ObjectMismatch):
        verify(buf, **args)


@pytest.mark.parametrize("delta", [-4096, -1, 1, 4096])
def test_verify_plain_refuses_truncated_and_extended_buffers(
    good_object: tuple[list[bytes], bytearray], delta: int
) -> None:
    _, buf = good_object
    changed = buf[:delta] if delta < 0 else buf + bytes(delta)
    with pytest.raises(CorruptObject, match="bytes, header says"):
        verify(changed, chunk_key=key(7))


def test_verify_plain_refuses_a_buffer_cut_inside_the_header(
    good_object: tuple[list[bytes], bytearray],
) -> None:
    _, buf = good_object
    for n in (0, 9, 100, v1.header_length(3) - 1):
        with pytest.raises(CorruptObject):
            verify(buf[:n], chunk_key=key(7))
