"""The region file of issue 31: a peer's unsealable file, read and written by
position only, never mapped (src/kvoffload/sidecar/region.py).

Real descriptors throughout: /dev/shm files, memfds, pipes, directories, a
file chowned to another uid (the suite runs as root here; skipped otherwise),
and a truncation by another process while the region is in use.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.errors import RegionError
from kvoffload.sidecar.region import RegionFile

SIZE = 64 * 1024
MAX = 1 << 30


@pytest.fixture
def shm_file() -> Iterator[Path]:
    p = Path("/dev/shm") / f"kvo-region-test-{os.getpid()}-{id(object())}"
    with open(p, "wb") as f:
        f.truncate(SIZE)
    p.chmod(0o600)
    yield p
    p.unlink(missing_ok=True)


def _open(p: Path, flags: int = os.O_RDWR) -> int:
    return os.open(p, flags | os.O_CLOEXEC)


def test_store_and_load_in_place_are_bit_exact(shm_file: Path) -> None:
    fd = _open(shm_file)
    region = RegionFile.from_fd(fd, SIZE, peer_uid=os.getuid(), max_size=MAX)
    try:
        payload = os.urandom(3 * 4096 + 17)
        with open(shm_file, "r+b") as f:  # the client writes its row...
            f.seek(8192)
            f.write(payload)
        got = bytearray(len(payload))
        head, tail = memoryview(got)[:100], memoryview(got)[100:]
        region.read_into(8192, [head, tail])  # ...the server reads it in place
        assert bytes(got) == payload
        back = os.urandom(5000)
        region.write_from(40960, [memoryview(back[:1]), memoryview(back[1:])])
        assert shm_file.read_bytes()[40960 : 40960 + 5000] == back
    finally:
        region.close()


def test_memfd_is_accepted() -> None:
    fd = os.memfd_create("kvo-region", os.MFD_CLOEXEC)
    os.ftruncate(fd, SIZE)
    region = RegionFile.from_fd(fd, SIZE, peer_uid=os.getuid(), max_size=MAX)
    region.write_from(0, [memoryview(b"abc")])
    out = bytearray(3)
    region.read_into(0, [memoryview(out)])
    assert out == b"abc"
    region.close()


def _refused(fd: int, match: str, size: int = SIZE, uid: int | None = None) -> None:
    with pytest.raises(RegionError, match=match) as info:
        RegionFile.from_fd(fd, size, peer_uid=os.getuid() if uid is None else uid, max_size=MAX)
    assert "\n" not in str(info.value)
    with pytest.raises(OSError):  # the refused descriptor was closed
        os.fstat(fd)


def test_a_pipe_is_refused() -> None:
    r, w = os.pipe()
    try:
        _refused(r, "not a regular file")
    finally:
        os.close(w)


def test_a_directory_is_refused(tmp_path: Path) -> None:
    _refused(os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY), "not a regular file")


def test_an_o_path_handle_of_a_symlink_is_refused(shm_file: Path, tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(shm_file)
    _refused(os.open(link, os.O_PATH | os.O_NOFOLLOW), "O_PATH")


def test_a_socket_is_refused() -> None:
    import socket

    a, b = socket.socketpair()
    try:
        _refused(a.detach(), "not a regular file")
    finally:
        b.close()


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")
def test_a_file_of_another_uid_is_refused(shm_file: Path) -> None:
    os.chown(shm_file, 12345, 12345)
    _refused(_open(shm_file), "owned by uid 12345")


def test_a_file_of_the_right_owner_but_another_peer_is_refused(shm_file: Path) -> None:
    _refused(_open(shm_file), "not the peer's", uid=os.getuid() + 1)


def test_read_only_descriptor_is_refused(shm_file: Path) -> None:
    _refused(_open(shm_file, os.O_RDONLY), "O_RDWR")


def test_bad_sizes_are_refused(shm_file: Path) -> None:
    _refused(_open(shm_file), "exceeds", size=2 * MAX)
    _refused(_open(shm_file), "positive multiple", size=SIZE - 1)
    _refused(_open(shm_file), f"{SIZE} bytes, {2 * SIZE} announced", size=2 * SIZE)


def test_offsets_past_the_end_are_refused(shm_file: Path) -> None:
    region = RegionFile.from_fd(_open(shm_file), SIZE, peer_uid=os.getuid(), max_size=MAX)
    try:
        with pytest.raises(RegionError, match="exceeds the region"):
            region.read_into(SIZE - 10, [memoryview(bytearray(11))])
        with pytest.raises(RegionError, match="exceeds the region"):
            region.write_from(SIZE, [memoryview(b"x")])
        with pytest.raises(RegionError, match="exceeds the region"):
            region.read_into(-1, [memoryview(bytearray(1))])
        assert shm_file.stat().st_size == SIZE  # nothing grew the file
    finally:
        region.close()


def test_truncation_by_the_peer_is_a_short_read_not_a_crash(shm_file: Path) -> None:
    """Another process truncates the file under an open region: the next read
    fails with one error for that access, and the region keeps working for
    ranges that still exist."""
    region = RegionFile.from_fd(_open(shm_file), SIZE, peer_uid=os.getuid(), max_size=MAX)
    try:
        subprocess.run(
            [sys.executable, "-c", f"import os; os.truncate({str(shm_file)!r}, 4096)"],
            check=True,
        )
        with pytest.raises(RegionError, match=r"short .*truncated"):
            region.read_into(8192, [memoryview(bytearray(4096))])
        with pytest.raises(RegionError, match="short"):
            region.read_into(0, [memoryview(bytearray(8192))])
        ok = bytearray(4096)
        region.read_into(0, [memoryview(ok)])
        assert ok == bytes(4096)
    finally:
        region.close()
