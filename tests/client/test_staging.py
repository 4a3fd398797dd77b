"""Staging buffer (memfd, seals, cross-process sharing) and the region allocator."""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
import textwrap
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.staging import PAGE, RegionAllocator, StagingBuffer, StagingError


def test_size_is_rounded_to_pages_and_zeroed() -> None:
    with StagingBuffer(5000) as buf:
        assert buf.size == 8192
        assert buf.view.nbytes == 8192
        assert bytes(buf.view[:16]) == b"\0" * 16
        assert os.fstat(buf.fd).st_size == 8192
    assert buf.closed


def test_buffer_is_sealed_against_shrink_and_grow() -> None:
    with StagingBuffer(PAGE) as buf:
        seals = fcntl.fcntl(buf.fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
        with pytest.raises(PermissionError):
            os.ftruncate(buf.fd, 0)


def test_descriptor_is_close_on_exec() -> None:
    with StagingBuffer(PAGE) as buf:
        assert not os.get_inheritable(buf.fd)


def _rss_kib_of_mapping(name: str) -> int:
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if f"/memfd:{name}" in line:
            for follow in lines[i + 1 :]:
                if follow.startswith("Rss:"):
                    return int(follow.split()[1])
    raise AssertionError(f"mapping {name} not found")


def test_buffer_is_prefaulted() -> None:
    name = f"kvo-test-{uuid.uuid4().hex[:8]}"
    with StagingBuffer(64 * PAGE, name=name) as buf:
        assert _rss_kib_of_mapping(name) == buf.size // 1024
    name2 = f"kvo-test-{uuid.uuid4().hex[:8]}"
    with StagingBuffer(64 * PAGE, name=name2, prefault=False):
        assert _rss_kib_of_mapping(name2) < 64 * PAGE // 1024


def test_close_is_idempotent_and_blocks_view() -> None:
    buf = StagingBuffer(PAGE)
    fd = buf.fd
    buf.close()
    buf.close()
    with pytest.raises(ValueError):
        _ = buf.view
    with pytest.raises(OSError):
        os.fstat(fd)


def test_from_fd_shares_pages_in_process() -> None:
    with StagingBuffer(2 * PAGE) as a:
        b = StagingBuffer.from_fd(os.dup(a.fd), a.size)
        try:
            a.view[100:105] = b"hello"
            assert bytes(b.view[100:105]) == b"hello"
            b.view[PAGE : PAGE + 3] = b"abc"
            assert bytes(a.view[PAGE : PAGE + 3]) == b"abc"
        finally:
            b.close()


def test_from_fd_refuses_unsealed_or_short_or_odd_files() -> None:
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, PAGE)
    with pytest.raises(StagingError, match="sealed"):
        StagingBuffer.from_fd(fd, PAGE)
    with pytest.raises(OSError):
        os.fstat(fd)  # ownership was taken: closed on error too
    with StagingBuffer(PAGE) as buf:
        with pytest.raises(StagingError, match="announced"):
            StagingBuffer.from_fd(os.dup(buf.fd), 2 * PAGE)
        with pytest.raises(StagingError, match="multiple"):
            StagingBuffer.from_fd(os.dup(buf.fd), 100)
    r, w = os.pipe()
    os.close(w)
    with pytest.raises(StagingError, match="regular"):
        StagingBuffer.from_fd(r, PAGE)


_CHILD = textwrap.dedent(
    """
    import socket, sys
    from kvoffload.staging import StagingBuffer
    sock = socket.socket(fileno=int(sys.argv[1]))
    msg, fds, _, _ = socket.recv_fds(sock, 64, 1)
    size = int(msg)
    buf = StagingBuffer.from_fd(fds[0], size)
    seen = bytes(buf.view[size - 8 :])
    buf.view[0:6] = b"child!"
    sock.sendall(seen)
    buf.close()
    """
)


def test_cross_process_visibility_via_scm_rights() -> None:
    """A fresh interpreter (no inherited mapping) maps the fd it got over a socket."""
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with StagingBuffer(4 * PAGE) as buf:
        buf.view[buf.size - 8 :] = b"parent!!"
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(child_sock.fileno())],
            pass_fds=[child_sock.fileno()],
        )
        child_sock.close()
        try:
            socket.send_fds(parent_sock, [str(buf.size).encode()], [buf.fd])
            parent_sock.settimeout(60)
            seen = b""
            while len(seen) < 8:
                chunk = parent_sock.recv(8)
                assert chunk, "child exited early"
                seen += chunk
        finally:
            assert proc.wait(timeout=60) == 0
            parent_sock.close()
        assert seen == b"parent!!"
        assert bytes(buf.view[0:6]) == b"child!"


# -- RegionAllocator ----------------------------------------------------------


def test_allocator_first_fit_and_exhaustion() -> None:
    a = RegionAllocator(4 * PAGE)
    assert a.alloc(1) == 0
    assert a.alloc(PAGE + 1) == PAGE
    assert a.alloc(PAGE) == 3 * PAGE
    assert a.alloc(1) is None
    a.free(PAGE)
    assert a.largest_free == 2 * PAGE
    assert a.alloc(2 * PAGE) == PAGE


def test_allocator_rejects_bad_free_and_sizes() -> None:
    a = RegionAllocator(4 * PAGE)
    off = a.alloc(10)
    assert off is not None
    with pytest.raises(ValueError):
        a.free(off + PAGE)
    a.free(off)
    with pytest.raises(ValueError):
        a.free(off)  # double free
    with pytest.raises(ValueError):
        a.alloc(0)
    with pytest.raises(ValueError):
        RegionAllocator(PAGE, align=3000)


def test_allocator_reset_frees_everything() -> None:
    a = RegionAllocator(3 * PAGE)
    while a.alloc(PAGE) is not None:
        pass
    a.reset()
    assert a.free_bytes == 3 * PAGE
    assert a.alloc(3 * PAGE) == 0


@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(1, 5 * PAGE), st.integers(0, 1000)),
        max_size=80,
    )
)
@settings(max_examples=300)
def test_allocator_never_overlaps_and_coalesces(ops: list[tuple[bool, int, int]]) -> None:
    size = 16 * PAGE
    a = RegionAllocator(size)
    live: dict[int, int] = {}
    for is_alloc, n, pick in ops:
        if is_alloc or not live:
            off = a.alloc(n)
            need = -(-n // PAGE) * PAGE
            if off is None:
                assert a.largest_free < need
                continue
            assert off % PAGE == 0
            assert off >= 0 and off + need <= size
            for o, m in live.items():
                assert off + need <= o or o + m <= off, "overlap"
            live[off] = need
        else:
            off = sorted(live)[pick % len(live)]
            a.free(off)
            del live[off]
        assert a.allocations == live
        assert a.free_bytes == size - sum(live.values())
    for off in list(live):
        a.free(off)
    # Fully coalesced again: one region spanning the buffer.
    assert a.largest_free == size
    assert a.alloc(size) == 0
