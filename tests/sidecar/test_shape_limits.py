"""Hostile chunk shapes (issue 11, item 9): padding is bounded (layout-v1.md §3.2)
and scratch buffers shrink after an outsized object."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from kvoffload import protocol as p
from kvoffload.layouts import v1
from kvoffload.posix import ScratchBuffers
from kvoffload.protocol import ErrorCode, StoreStatus
from kvoffload.staging import PAGE
from kvoffload.store import Store
from tests.helpers.server import NS, FakeStore, Raw, key, start

ONE_BYTE_LAYERS = (1,) * 65535


def test_shape_bound() -> None:
    assert v1.shape_ok([300_000] * 80, True)  # a real model's chunk
    assert v1.shape_ok([100] * 4, False)  # a tiny test chunk
    assert v1.shape_ok([1], True)
    assert not v1.shape_ok(list(ONE_BYTE_LAYERS), True)  # 256 MiB on disk for 64 KiB
    assert not v1.shape_ok([1] * 512, False)
    assert not v1.shape_ok([], False)


def test_the_store_refuses_padding_beyond_the_bound(store: Store) -> None:
    with pytest.raises(ValueError, match="padding"):
        store.put("acme", NS, key(1), [b"x"] * 4096)
    assert not (store.root / "objects" / "acme").exists() or not any(
        (store.root / "objects" / "acme").rglob("*.kvo")
    )
    assert store.used_bytes == 0
    assert store.put("acme", NS, key(2), [b"x" * 5000] * 8) is True


def test_the_server_rejects_a_hostile_shape_as_too_large() -> None:
    d = Path(tempfile.mkdtemp(prefix="kvo-", dir="/tmp"))
    st = start(d, FakeStore())
    try:
        raw = Raw(st)
        raw.hello()
        raw.register(256 * PAGE)
        reply = raw.call(
            p.PrepareStore(
                "acme",
                NS,
                (p.ChunkSpec(key(1), ONE_BYTE_LAYERS), p.ChunkSpec(key(2), (PAGE, PAGE))),
            )
        )
        assert isinstance(reply, p.PrepareStoreReply)
        assert [(s.status, s.code) for s in reply.chunks] == [
            (StoreStatus.REJECTED, ErrorCode.TOO_LARGE),
            (StoreStatus.WRITE, ErrorCode.OK),
        ]
        raw.close()
    finally:
        st.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_scratch_buffers_shrink_after_an_outsized_object() -> None:
    sb = ScratchBuffers(prefault=False)
    big = sb.get(64 << 20)
    assert len(big.obj) >= 64 << 20  # type: ignore[arg-type]
    del big
    for _ in range(ScratchBuffers.SHRINK_AFTER):
        view = sb.get(1 << 20)
    assert len(view.obj) < 16 << 20  # type: ignore[arg-type]
    # A size that keeps coming back is kept, not re-mapped each time.
    again = sb.get(1 << 20)
    assert again.obj is view.obj
