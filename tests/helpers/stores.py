"""Helpers shared by the tests (moved out of test_store.py)."""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from kvoffload.layouts import store_root
from kvoffload.store import Store, StoreConfig
from kvoffload.store import files as fileio
from kvoffload.store.keys.keyring import Kek
from tests.helpers.paths import DATA

NS = bytes(range(32))


def key(i: int, tenant: str = "acme") -> bytes:
    import hashlib

    return hashlib.blake2b(f"{tenant}/{i}".encode(), digest_size=32).digest()


def layers(seed: int, n: int = 4, size: int = 3000) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(size + i) for i in range(n)]


def make_store(
    root: Path, kek_file: Path, *, create: bool = True, durability: object = "none", **cfg: object
) -> Store:
    """A real store at ``root`` sealed under the KEK in ``kek_file``: the one way the
    tests build a store on a plain config (``cfg`` are ``StoreConfig`` fields)."""
    config = StoreConfig(root=root, durability=durability, **cfg)  # type: ignore[arg-type]
    return Store(config, Kek.from_file(kek_file), create=create)


def open_store(tmp_path: Path, kek_file: Path, **kw: object) -> Store:
    return make_store(tmp_path / "store", kek_file, **kw)


def evict(paths: Iterable[Path]) -> bool:
    """Drop the files from the page cache, dirty pages written back first; False
    where the kernel kept some (tmpfs): checked with mincore(2), since a probe
    read, even with RWF_NOWAIT, may start readahead."""
    paths = list(paths)
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return not any(resident_pages(path) for path in paths)


def nowait_reads_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test double of the kernel's answer to an ``RWF_NOWAIT`` read: "not all in
    the page cache" (EAGAIN), always. The real answer races the device: such a
    read starts readahead, and on a fast device (this VM's disk, served by its
    host) the pages of a just-dropped small file can be in before it returns,
    making a cold read a cached one at random. Other reads stay real."""
    real = os.preadv

    def preadv(fd: int, buffers: Any, offset: int, flags: int = 0) -> int:
        if flags & fileio.RWF_NOWAIT:
            raise BlockingIOError(errno.EAGAIN, "test double: not in the page cache")
        return real(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "preadv", preadv)


def root_with_fanout(root: Path, fanout: Any) -> None:
    """A store root whose layout.json says ``fanout`` (as an older build wrote it)."""

    raw = json.loads((DATA / "v1" / "layout-fanout-2-2.json").read_text())
    raw["params"]["fanout"] = fanout
    root.mkdir(parents=True)
    for sub in ("keys", "objects", "journal"):
        (root / sub).mkdir(mode=0o700)
    (root / "layout.json").write_bytes(store_root._encode(raw))


def resident_pages(path: Path) -> int:
    """Pages of ``path`` in the page cache (mincore(2)), without reading any."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        m = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    try:
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        rc = libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec)
        assert rc == 0, os.strerror(ctypes.get_errno())
        return sum(v & 1 for v in vec)
    finally:
        m.close()
