"""kvoffload.posix: atomic_create, fsync_dir, pread_all/pwrite_all, aligned buffers."""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload import posix


@pytest.fixture
def umask022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _names(d: Path) -> list[str]:
    return sorted(os.listdir(d))


class _Killed(BaseException):
    """Stands for SIGKILL / KeyboardInterrupt: not an OSError."""


# -- atomic_create ---------------------------------------------------------------


def test_atomic_create_writes_the_bytes_with_the_mode(tmp_path: Path, umask022: None) -> None:
    target = tmp_path / "a.key"
    posix.atomic_create(target, b"secret\n", mode=0o600)
    assert target.read_bytes() == b"secret\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert target.stat().st_nlink == 1  # the temp name is gone
    assert _names(tmp_path) == ["a.key"]

    other = tmp_path / "b.json"
    posix.atomic_create(other, memoryview(b"{}\n"), mode=0o640, durable=False)
    assert stat.S_IMODE(other.stat().st_mode) == 0o640
    assert _names(tmp_path) == ["a.key", "b.json"]


def test_atomic_create_mode_is_filtered_by_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        posix.atomic_create(tmp_path / "f", b"x", mode=0o666)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == 0o600


def test_atomic_create_refuses_an_existing_file_and_leaves_it(tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_bytes(b"the first one")
    with pytest.raises(FileExistsError):
        posix.atomic_create(target, b"the second one")
    assert target.read_bytes() == b"the first one"
    assert _names(tmp_path) == ["f"]


def test_atomic_create_replace(tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_bytes(b"old, and longer than the new")
    posix.atomic_create(target, b"new", replace=True)
    assert target.read_bytes() == b"new"
    assert _names(tmp_path) == ["f"]


def test_atomic_create_uses_the_given_temp_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []
    real_link = os.link

    def spy(src: Any, dst: Any, *args: Any, **kw: Any) -> None:
        seen.append(os.path.basename(src))
        real_link(src, dst, *args, **kw)

    monkeypatch.setattr(os, "link", spy)
    posix.atomic_create(tmp_path / "f", b"x", tmp_name=".tmp-0123456789abcdef-t")
    assert seen == [".tmp-0123456789abcdef-t"]
    assert _names(tmp_path) == ["f"]


def test_atomic_create_does_not_touch_a_colliding_temp(tmp_path: Path) -> None:
    (tmp_path / ".busy").write_bytes(b"another writer's")
    with pytest.raises(FileExistsError):
        posix.atomic_create(tmp_path / "f", b"x", tmp_name=".busy")
    assert (tmp_path / ".busy").read_bytes() == b"another writer's"
    assert not (tmp_path / "f").exists()


def _fail_pwritev_after(monkeypatch: pytest.MonkeyPatch, good: int, exc: BaseException) -> None:
    """os.pwritev writes at most ``good`` bytes, then raises ``exc``."""
    real = os.pwritev
    left = good

    def flaky(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        nonlocal left
        if left <= 0:
            raise exc
        view = memoryview(buffers[0])[:left]
        n = real(fd, [view], offset, *args)
        left -= n
        return n

    monkeypatch.setattr(os, "pwritev", flaky)


@pytest.mark.parametrize("replace", [False, True])
@pytest.mark.parametrize(
    "exc", [OSError(errno.ENOSPC, "No space left on device"), _Killed()], ids=["enospc", "killed"]
)
def test_a_failed_write_leaves_no_final_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replace: bool, exc: BaseException
) -> None:
    _fail_pwritev_after(monkeypatch, 5, exc)
    with pytest.raises(type(exc)):
        posix.atomic_create(tmp_path / "f", b"0123456789" * 100, replace=replace)
    assert _names(tmp_path) == []


def test_a_failed_write_leaves_the_old_file_when_replacing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "f").write_bytes(b"old")
    _fail_pwritev_after(monkeypatch, 3, OSError(errno.EIO, "I/O error"))
    with pytest.raises(OSError, match="I/O error"):
        posix.atomic_create(tmp_path / "f", b"brand new", replace=True)
    assert (tmp_path / "f").read_bytes() == b"old"
    assert _names(tmp_path) == ["f"]


@pytest.mark.parametrize("replace", [False, True])
def test_a_failed_file_fsync_leaves_no_final_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replace: bool
) -> None:
    def no_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "fsync failed")

    monkeypatch.setattr(os, "fsync", no_fsync)
    with pytest.raises(OSError, match="fsync failed"):
        posix.atomic_create(tmp_path / "f", b"data", replace=replace)
    assert _names(tmp_path) == []


def test_a_short_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A file system that reports a write it did not keep: the size check catches it.
    real_fstat = os.fstat

    class _St:
        def __init__(self, st: os.stat_result) -> None:
            self._st = st

        def __getattr__(self, name: str) -> Any:
            return 1 if name == "st_size" else getattr(self._st, name)

    monkeypatch.setattr(os, "fstat", lambda fd: _St(real_fstat(fd)))
    with pytest.raises(OSError, match="size after write differs"):
        posix.atomic_create(tmp_path / "f", b"data")
    assert _names(tmp_path) == []


def test_a_failed_link_leaves_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_link(src: Any, dst: Any, *args: Any, **kw: Any) -> None:
        raise OSError(errno.EPERM, "hard links not allowed")

    monkeypatch.setattr(os, "link", no_link)
    with pytest.raises(OSError, match="hard links"):
        posix.atomic_create(tmp_path / "f", b"data")
    assert _names(tmp_path) == []


def test_a_missing_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        posix.atomic_create(tmp_path / "nope" / "f", b"data")
    assert _names(tmp_path) == []


def test_racing_creators_one_wins_whole(tmp_path: Path) -> None:
    target = tmp_path / "f"
    results: list[str] = []
    barrier = threading.Barrier(8)

    def create(i: int) -> None:
        barrier.wait()
        try:
            posix.atomic_create(target, bytes([65 + i]) * 4096, durable=False)
            results.append("won")
        except FileExistsError:
            results.append("lost")

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["lost"] * 7 + ["won"]
    data = target.read_bytes()
    assert len(data) == 4096 and len(set(data)) == 1
    assert _names(tmp_path) == ["f"]


# -- fsync_dir -------------------------------------------------------------------


def test_fsync_dir_tolerates_unsupported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    posix.fsync_dir(tmp_path)

    def einval(fd: int) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "fsync", einval)
    posix.fsync_dir(tmp_path)  # accepted

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "fsync", eio)
    with pytest.raises(OSError, match="I/O error"):
        posix.fsync_dir(tmp_path)


def test_store_root_reexports_fsync_dir() -> None:
    from kvoffload.layouts import store_root
    from kvoffload.store import files as fileio

    assert store_root.fsync_dir is posix.fsync_dir
    assert fileio.fsync_dir is posix.fsync_dir


# -- pwrite_all / pread_all ------------------------------------------------------


def _short_pwritev(monkeypatch: pytest.MonkeyPatch, step: int) -> list[int]:
    """os.pwritev writes at most ``step`` bytes a call, with an EINTR now and then."""
    real = os.pwritev
    calls: list[int] = []

    def short(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        calls.append(offset)
        if len(calls) % 3 == 2:
            raise InterruptedError(errno.EINTR, "Interrupted system call")
        return real(fd, [memoryview(buffers[0])[:step]], offset, *args)

    monkeypatch.setattr(os, "pwritev", short)
    return calls


def test_pwrite_all_loops_on_short_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(10_000)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        calls = _short_pwritev(monkeypatch, 777)
        posix.pwrite_all(fd, b"\0" * 100, 0)
        posix.pwrite_all(fd, data, 100)
        assert len(calls) > 10_000 // 777
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"\0" * 100 + data


def test_pwrite_all_zero_bytes_written_is_eio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "pwritev", lambda fd, bufs, off, *a: 0)
    with pytest.raises(OSError, match="short write") as info:
        posix.pwrite_all(99, b"abc", 0)
    assert info.value.errno == errno.EIO


def test_pwrite_all_on_error_may_retry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwritev
    failed: list[int | None] = []

    def einval_once(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        if not failed:
            failed.append(errno.EINVAL)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset, *args)

    def retry(exc: OSError) -> bool:
        return exc.errno == errno.EINVAL

    monkeypatch.setattr(os, "pwritev", einval_once)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        posix.pwrite_all(fd, b"hello", 0, on_error=retry)
        with pytest.raises(OSError, match="Invalid"):
            failed.clear()
            posix.pwrite_all(fd, b"hello", 0)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"hello"


def test_pread_all_loops_on_short_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(10_000)
    (tmp_path / "f").write_bytes(data)
    real = os.preadv
    calls = 0

    def short(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        nonlocal calls
        calls += 1
        if calls % 4 == 3:
            raise InterruptedError(errno.EINTR, "Interrupted system call")
        return real(fd, [memoryview(buffers[0])[:333]], offset, *args)

    monkeypatch.setattr(os, "preadv", short)
    partials: list[int] = []
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        out = bytearray(9_000)
        assert posix.pread_all(fd, out, 1_000, on_partial=partials.append) == 9_000
        assert bytes(out) == data[1_000:]
        # At end of file it stops short and says how much it got.
        tail = bytearray(500)
        assert posix.pread_all(fd, memoryview(tail), 9_800) == 200
        assert bytes(tail[:200]) == data[9_800:]
    finally:
        os.close(fd)
    assert partials == list(range(333, 9_000, 333))


# -- buffers ---------------------------------------------------------------------


@pytest.mark.parametrize("prefault", [True, False])
def test_scratch_buffers_are_aligned_and_grow(prefault: bool) -> None:
    sb = posix.ScratchBuffers(prefault=prefault)
    a = sb.get(10)
    assert a.nbytes == 10 and posix.is_aligned(a)
    a[:] = b"x" * 10
    b = sb.get(3 << 20)
    assert b.nbytes == 3 << 20 and posix.is_aligned(b)
    assert bytes(a) == b"x" * 10  # the outgrown buffer is still valid while viewed
    seen: list[memoryview] = []
    t = threading.Thread(target=lambda: seen.append(sb.get(10)))
    t.start()
    t.join()
    assert posix.buffer_address(seen[0]) != posix.buffer_address(sb.get(10))


def test_alignment_helpers() -> None:
    assert posix.align_up(0) == 0 and posix.align_up(1) == 4096 and posix.align_up(4096) == 4096
    assert posix.buffer_address(memoryview(b"read-only")) is None
    assert not posix.is_aligned(memoryview(b"read-only"))
    buf = posix.ScratchBuffers().get(8192)
    assert posix.is_aligned(buf) and not posix.is_aligned(buf[1:])
