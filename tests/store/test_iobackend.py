"""I/O backends: posix buffered and O_DIRECT through the real store, the O_DIRECT
probe and its fallback on a file system that refuses it, GPU-probe decisions
with kvikio/cuFile absent (simulated by what the probe is given, never by
patching the decision), a probe child that hangs, and the batch API."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvoffload.errors import StoreFull, StoreIOError
from kvoffload.gpu_probe import GpuReport, ProbeEnv, probe
from kvoffload.layouts import v1
from kvoffload.store import Store, StoreConfig
from kvoffload.store import files as fileio
from kvoffload.store.files import Durability
from kvoffload.store.iobackend import (
    DIRECT_READ_MIN,
    DIRECT_WRITE_MIN,
    IOBackendUnavailable,
    IOMode,
    PosixBackend,
    mount_of,
    open_backend,
    plan,
    probe_direct,
    requested_mode,
)
from kvoffload.store.keys.keyring import Kek
from tests.helpers.direct_reads import DirectReads, cached_pages
from tests.helpers.stores import evict, make_store
from tests.ramfs import run_on_ramfs

NS = bytes(range(32))


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def layers(i: int, n: int = 3) -> list[bytes]:
    # Odd sizes: the object pads every layer to 4 KiB; O_DIRECT must still work.
    return [bytes([(i + j) % 251]) * (5000 + 777 * j + i) for j in range(n)]


def open_store(root: Path, kek_file: Path, **kw: Any) -> Store:
    kw.setdefault("durability", "none")
    return Store(StoreConfig(root=root, **kw), Kek.from_file(kek_file), create=True)


class OpenSpy:
    """Records the flags of every os.open below ``root`` (the store's objects/; the real
    call runs). Key files have temp names too: they are not objects."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
        self.calls: list[tuple[str, int]] = []
        real = os.open
        prefix = str(root)

        def spy(path: Any, flags: int, *a: Any, **kw: Any) -> int:
            if str(path).startswith(prefix):
                self.calls.append((str(path), flags))
            return real(path, flags, *a, **kw)

        monkeypatch.setattr(os, "open", spy)

    def objects(self, *, writes: bool) -> list[int]:
        out = []
        for p, fl in self.calls:
            name = Path(p).name
            if writes and name.startswith(v1.TMP_PREFIX) and fl & os.O_CREAT:
                out.append(fl)
            if not writes and name.endswith(v1.OBJECT_SUFFIX) and not fl & os.O_CREAT:
                out.append(fl)
        return out


def _round_trip(s: Store) -> None:
    for i in range(6):
        assert s.put("acme", NS, key(i), layers(i), encrypt=i % 2 == 0)
    assert not s.put("acme", NS, key(0), layers(0))  # already there: success, False
    for i in range(6):
        assert s.get("acme", key(i)) == layers(i)
    outs = [memoryview(bytearray(sum(map(len, layers(i))))) for i in range(6)]
    got = s.get_many_into("acme", [key(i) for i in range(6)], outs)
    assert got == [[len(x) for x in layers(i)] for i in range(6)]
    for i in range(6):
        assert bytes(outs[i]) == b"".join(layers(i))
    assert s.fsck(verify_data=True).clean


# ------------------------------------------------------------------ posix


def test_posix_buffered_round_trips_without_o_direct(
    tmp_path: Path, kek_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = open_store(tmp_path / "store", kek_file, io="posix-buffered")
    try:
        assert s.io.name == "posix"
        assert s.io.describe()["o_direct_write"] is False
        assert s.io.describe()["o_direct_read"] is False
        spy = OpenSpy(monkeypatch, s.root / "objects")
        _round_trip(s)
        assert spy.objects(writes=True) and spy.objects(writes=False)
        assert not any(fl & fileio.O_DIRECT for fl in spy.objects(writes=True))
        assert not any(fl & fileio.O_DIRECT for fl in spy.objects(writes=False))
    finally:
        s.close()


@pytest.mark.parametrize("durability", ["none", "object"])
def test_posix_direct_round_trips_with_o_direct(
    direct_dir: Path, kek_file: Path, monkeypatch: pytest.MonkeyPatch, durability: str
) -> None:
    s = open_store(direct_dir / "store", kek_file, io="posix-direct", durability=durability)
    try:
        assert s.io_plan.direct_probe is not None and s.io_plan.direct_probe.supported
        assert s.io.describe()["o_direct_write"] and s.io.describe()["o_direct_read"]
        spy = OpenSpy(monkeypatch, s.root / "objects")
        _round_trip(s)
        writes, reads = spy.objects(writes=True), spy.objects(writes=False)
        assert writes and reads
        # Every object write and read really went through O_DIRECT.
        assert all(fl & fileio.O_DIRECT for fl in writes)
        assert all(fl & fileio.O_DIRECT for fl in reads)
    finally:
        s.close()
    # ... and the files are the same bytes a buffered store reads back.
    s2 = make_store(
        direct_dir / "store",
        kek_file,
        durability=Durability.NONE,
        io="posix-buffered",
        create=False,
    )
    try:
        for i in range(6):
            assert s2.get("acme", key(i)) == layers(i)
    finally:
        s2.close()


@pytest.mark.parametrize("durability", ["none", "object"])
def test_default_posix_direct_writes_for_fsynced_or_large_objects_page_cache_reads(
    direct_dir: Path, kek_file: Path, monkeypatch: pytest.MonkeyPatch, durability: str
) -> None:
    s = open_store(direct_dir / "store", kek_file, io="posix", durability=durability)
    try:
        assert s.io.describe()["o_direct_write_min"] == DIRECT_WRITE_MIN
        spy = OpenSpy(monkeypatch, s.root / "objects")
        _round_trip(s)  # small objects
        small = spy.objects(writes=True)
        assert small and all(bool(fl & fileio.O_DIRECT) is (durability == "object") for fl in small)
        assert not any(fl & fileio.O_DIRECT for fl in spy.objects(writes=False))
        spy.calls.clear()
        big = [os.urandom(1 << 20) for _ in range(DIRECT_WRITE_MIN >> 20)]
        assert s.put("acme", NS, key(100), big)
        assert all(fl & fileio.O_DIRECT for fl in spy.objects(writes=True))
        assert "page-cache reads" in s.io_plan.reason
    finally:
        s.close()


@pytest.mark.parametrize("direct_read_min", [None, 0])
def test_a_large_object_not_in_the_page_cache_is_read_with_o_direct_a_cached_one_from_memory(
    direct_dir: Path, kek_file: Path, monkeypatch: pytest.MonkeyPatch, direct_read_min: int | None
) -> None:
    s = open_store(direct_dir / "store", kek_file, io="posix", direct_read_min=direct_read_min)
    try:
        on = direct_read_min is None
        assert s.io.describe()["o_direct_read_min"] == (DIRECT_READ_MIN if on else 0)
        big = [os.urandom(1 << 20) for _ in range(DIRECT_READ_MIN >> 20)]
        small = [os.urandom(1 << 16)]
        assert s.put("acme", NS, key(1), big) and s.put("acme", NS, key(2), small)
        path, small_path = s._path("acme", key(1)), s._path("acme", key(2))
        evict([path, small_path])
        if cached_pages(path) is None:
            pytest.skip("cachestat(2) needs Linux 6.5+: reads stay in the page cache")
        assert cached_pages(path) == 0
        spy = DirectReads(monkeypatch)
        assert s.get("acme", key(1)) == big
        assert s.get("acme", key(2)) == small
        # On: the large cold object came off the device around the page cache;
        # the small one, and everything where it is off, through it.
        assert spy.count == (1 if on else 0)
        assert (cached_pages(path) == 0) is on
        assert cached_pages(small_path)
        # With several I/O streams, that one read came in parts at once (PartReader).
        assert (s._state.streams.parts is not None) == (on and s.io_streams > 1)
        # A cached large object is served from memory, the batch API alike.
        path.read_bytes()
        spy.count = 0
        outs = [memoryview(bytearray(sum(map(len, big))))]
        assert s.get_many_into("acme", [key(1)], outs) == [[1 << 20] * len(big)]
        assert bytes(outs[0]) == b"".join(big) and spy.count == 0
        # Cold again and damaged: the O_DIRECT read (which sees the dirty page
        # written through the cache) verifies like every other read: a miss.
        evict([path])
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 1]))
        assert s.get("acme", key(1)) is None
        assert spy.count == (1 if on else 0)
        assert not s.contains("acme", key(1))
    finally:
        s.close()


def test_read_uncached_leaves_what_it_cannot_do_to_the_page_cache(
    direct_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = direct_dir / "obj"
    path.write_bytes(os.urandom(1 << 20))
    evict([path])
    scratch = fileio.ScratchBuffers()
    if cached_pages(path) is None:
        pytest.skip("cachestat(2) needs Linux 6.5+")
    with pytest.raises(OSError) as exc:
        fileio.read_uncached(path, scratch.get, 1 << 19, 0)  # over the object limit
    assert exc.value.errno == errno.EFBIG
    assert fileio.read_uncached(path, scratch.get, 4 << 20, 2 << 20) is None  # too small
    got = fileio.read_uncached(path, scratch.get, 4 << 20, 1 << 20)
    assert got is not None and bytes(got) == path.read_bytes()  # now cached
    assert fileio.read_uncached(path, scratch.get, 4 << 20, 1 << 20) is None  # cached
    evict([path])
    unaligned = memoryview(bytearray(2 << 20))
    assert fileio.read_uncached(path, lambda n: unaligned[1 : n + 1], 4 << 20, 1) is None
    monkeypatch.setattr(fileio, "_cachestat_ok", False)  # an older kernel: cannot tell
    assert fileio.read_uncached(path, scratch.get, 4 << 20, 1) is None


def test_a_large_uncached_read_comes_in_parts_at_once_and_counts_only_contiguous_bytes(
    direct_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = direct_dir / "obj"
    data = os.urandom((16 << 20) + 12345)  # an object whose size is no 4 KiB multiple
    path.write_bytes(data)
    evict([path])
    if cached_pages(path) is None:
        pytest.skip("cachestat(2) needs Linux 6.5+")
    scratch = fileio.ScratchBuffers()
    reader = fileio.PartReader(4)
    try:
        calls: list[tuple[int, int]] = []
        real = fileio._pread_into

        def spy(fd: int, buf: memoryview, offset: int, want: int) -> int:
            calls.append((offset, want))
            return real(fd, buf, offset, want)

        monkeypatch.setattr(fileio, "_pread_into", spy)
        got = fileio.read_uncached(path, scratch.get, 64 << 20, 1 << 20, parts=reader)
        assert got is not None and bytes(got) == data
        want = v1.align_up(len(data), v1.ALIGN)
        step = v1.align_up(-(-want // 4), v1.ALIGN)
        assert sorted(calls) == [(o, min(step, want - o)) for o in range(0, want, step)]
        assert all(o % v1.ALIGN == 0 for o, _ in calls)  # O_DIRECT: aligned offsets

        # A file shorter than asked (it shrank): the bytes after the short part do not count.
        short = direct_dir / "short"
        short.write_bytes(data[: 10 << 20])
        buf = scratch.get(16 << 20)
        fd = os.open(short, os.O_RDONLY)
        try:
            assert reader.read(fd, buf[: 16 << 20], 16 << 20) == 10 << 20
        finally:
            os.close(fd)

        # A part that fails: the error is raised only once every part is done with the buffer.
        finished: list[int] = []

        def failing(fd: int, buf: memoryview, offset: int, want: int) -> int:
            if offset == step:
                raise OSError(errno.EIO, "a bad sector")
            time.sleep(0.05)
            n = real(fd, buf, offset, want)
            finished.append(offset)
            return n

        monkeypatch.setattr(fileio, "_pread_into", failing)
        evict([path])
        with pytest.raises(OSError) as exc:
            fileio.read_uncached(path, scratch.get, 64 << 20, 1 << 20, parts=reader)
        assert exc.value.errno == errno.EIO
        assert sorted(finished) == [o for o in range(0, want, step) if o != step]
        # Small reads are one request: no part of them waits on another thread.
        calls.clear()
        monkeypatch.setattr(fileio, "_pread_into", spy)
        fd = os.open(short, os.O_RDONLY)
        try:
            assert reader.read(fd, buf[: 6 << 20], 6 << 20) == 6 << 20
        finally:
            os.close(fd)
        assert calls == [(0, 6 << 20)]
    finally:
        reader.close()


def test_o_direct_write_of_an_unaligned_buffer_falls_back_at_run_time(direct_dir: Path) -> None:
    # A real EINVAL from the kernel: O_DIRECT fd, buffer neither aligned nor a block multiple.
    path = direct_dir / "unaligned"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | fileio.O_DIRECT, 0o600)
    try:
        data = memoryview(b"x" * 5001)  # read-only bytes: no 4 KiB alignment
        with pytest.raises(OSError):
            os.pwrite(fd, data, 0)
        fileio._write_all(fd, data)  # clears O_DIRECT and goes on
        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & fileio.O_DIRECT
    finally:
        os.close(fd)
    assert path.read_bytes() == b"x" * 5001
    # write_atomic never asks for O_DIRECT with a buffer that cannot take it.
    final = direct_dir / "obj.kvo"
    assert fileio.write_atomic(final, data, Durability.NONE, direct=True)
    assert final.read_bytes() == bytes(data)


def test_layer_range_reads(direct_dir: Path, kek_file: Path) -> None:
    s = open_store(direct_dir / "store", kek_file, io="posix-direct")
    try:
        s.put("acme", NS, key(1), layers(1), encrypt=False)
        path = s._path("acme", key(1))
        whole = path.read_bytes()
        h = v1.decode_header(whole)
        for backend in (s.io, PosixBackend(direct_write=False, direct_read=False)):
            for le in h.layers:
                # Aligned (O_DIRECT-able): the layer rounded up to 4 KiB, into an mmap.
                out = fileio.ScratchBuffers().get(v1.align_up(le.length))
                n = backend.read_range(path, le.offset, out)
                assert bytes(out[: le.length]) == whole[le.offset : le.offset + le.length]
                assert n == min(len(out), len(whole) - le.offset)
                # Unaligned: exactly the layer, into a bytearray.
                exact = memoryview(bytearray(le.length))
                assert backend.read_range(path, le.offset, exact) == le.length
                assert bytes(exact) == whole[le.offset : le.offset + le.length]
    finally:
        s.close()


# ------------------------------------------------------------ O_DIRECT probe


def test_o_direct_probe_leaves_nothing_behind(tmp_path: Path) -> None:
    rep = probe_direct(tmp_path)
    assert rep.supported is not None, rep.detail
    assert rep.fs_type
    assert list(tmp_path.iterdir()) == []
    missing = probe_direct(tmp_path / "nope")
    assert missing.supported is None and "does not exist" in missing.detail


def test_o_direct_probe_agrees_with_the_kernel_on_tmpfs() -> None:
    shm = Path("/dev/shm")
    m = mount_of(shm)
    if m is None or m.fs_type != "tmpfs" or not os.access(shm, os.W_OK):
        pytest.skip("no writable tmpfs at /dev/shm")
    # tmpfs refused O_DIRECT before Linux 6.6 and takes it since: ask the kernel ourselves.
    p = shm / f"kvoffload-odirect-{os.getpid()}"
    try:
        fd = os.open(p, os.O_RDWR | os.O_CREAT | fileio.O_DIRECT, 0o600)
        os.close(fd)
        kernel_says = True
    except OSError:
        kernel_says = False
    finally:
        p.unlink(missing_ok=True)
    rep = probe_direct(shm)
    print(f"tmpfs on {os.uname().release}: O_DIRECT {rep.supported} ({rep.detail})")
    assert rep.fs_type == "tmpfs"
    assert rep.supported is kernel_says


_RAMFS_CHILD = r"""
import json, os, sys
from pathlib import Path
from kvoffload.store import files as fileio
from kvoffload.store.files import Durability
from kvoffload.store.iobackend import plan, probe_direct, IOBackendUnavailable, open_backend
d = Path(sys.argv[1])
rep = probe_direct(d)
auto = plan("posix", d)
strict = plan("posix-direct", d)
buf = fileio.ScratchBuffers().get(3 * 4096)
buf[:] = os.urandom(len(buf))
# The write path asked for O_DIRECT all the same: open() is refused, the bytes go buffered.
ok = fileio.write_atomic(d / "obj.kvo", buf, Durability.OBJECT, direct=True)
back = fileio.read_file(d / "obj.kvo", fileio.ScratchBuffers(), 1 << 20, direct=True)
try:
    open_backend(strict)
    strict_error = None
except IOBackendUnavailable as exc:
    strict_error = str(exc)
print(json.dumps({
    "fs": rep.fs_type, "supported": rep.supported, "detail": rep.detail,
    "plan_direct_write": auto.direct_write, "plan_reason": auto.reason,
    "strict_error": strict_error, "written": ok, "same": bytes(back) == bytes(buf),
    "left": sorted(os.listdir(d)),
}))
"""


def test_o_direct_probe_falls_back_on_a_file_system_that_refuses_it(tmp_path: Path) -> None:
    """ramfs refuses O_DIRECT with EINVAL (as tmpfs did before Linux 6.6). Mounted in a
    private user+mount namespace, so nothing outside this test sees it."""
    r = run_on_ramfs(tmp_path, _RAMFS_CHILD)
    assert r["fs"] == "ramfs"
    assert r["supported"] is False and "EINVAL" in r["detail"]
    assert r["plan_direct_write"] is False and "no O_DIRECT" in r["plan_reason"]
    assert r["strict_error"] and "O_DIRECT does not work" in r["strict_error"]
    assert r["written"] and r["same"]
    assert r["left"] == ["obj.kvo"]  # the refused O_DIRECT temp file was removed


def test_mount_table_parsing(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "/dev/vda / ext4 rw 0 0\n"
        "srv:/x /mnt/with\\040space nfs4 rw 0 0\n"
        "tmpfs /mnt/with\\040space/sub tmpfs rw 0 0\n"
        "overlay /mnt/with\\040space/sub fuse.sshfs rw 0 0\n"
    )
    # A real path is needed for realpath(); map through the nearest existing ancestor.
    assert mount_of(Path("/"), mounts) == mount_of(Path("/nonexistent/deeper"), mounts)
    root = mount_of(Path("/"), mounts)
    assert root is not None and root.fs_type == "ext4"
    real = mount_of(Path("/proc/self"))
    assert real is not None and real.fs_type == "proc"


def test_mount_table_longest_prefix_and_stacking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = tmp_path / "with space"
    (base / "sub" / "deep").mkdir(parents=True)
    esc = str(base).replace(" ", "\\040")
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "/dev/vda / ext4 rw 0 0\n"
        f"srv:/x {esc} nfs4 rw 0 0\n"
        f"tmpfs {esc}/sub tmpfs rw 0 0\n"
        f"sshfs#h {esc}/sub fuse.sshfs rw 0 0\n"
        f"tmpfs {esc}/subway tmpfs rw 0 0\n"
    )
    m = mount_of(base / "sub" / "deep", mounts)
    assert m is not None and m.fs_type == "fuse.sshfs" and m.mount_point == f"{base}/sub"
    m = mount_of(base / "other", mounts)
    assert m is not None and m.fs_type == "nfs4" and m.mount_point == str(base)


# ------------------------------------------------------------------ GPU probe


class _FakeCuda:
    """What ``ctypes.CDLL('libcuda.so.1')`` returns on a node with a 12.4 driver."""

    def cuDriverGetVersion(self, out: Any) -> int:
        out._obj.value = 12040
        return 0


def _no_cuda(name: str) -> Any:
    raise OSError(f"{name}: cannot open shared object file: No such file or directory")


def _cuda_present(name: str) -> Any:
    assert name == "libcuda.so.1"
    return _FakeCuda()


@pytest.fixture
def no_subprocess(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Fail the test if the probe starts any process."""
    started: list[Any] = []

    def boom(*a: Any, **kw: Any) -> Any:
        started.append(a)
        raise AssertionError(f"the probe started a subprocess: {a}")

    monkeypatch.setattr(subprocess, "Popen", boom)  # gpu_probe calls subprocess.Popen
    return started


def _env(tmp_path: Path, **kw: Any) -> ProbeEnv:
    sysroot = tmp_path / "sysroot"
    (sysroot / "dev").mkdir(parents=True, exist_ok=True)
    (sysroot / "proc").mkdir(exist_ok=True)
    base: dict[str, Any] = {
        "sysroot": sysroot,
        "load_library": _no_cuda,
        "find_spec": lambda name: None,
        "dist_version": lambda name: None,
        "library_dirs": lambda: [],
    }
    base.update(kw)
    return ProbeEnv(**base)


def test_no_libcuda_means_posix_without_a_subprocess(
    tmp_path: Path, no_subprocess: list[Any]
) -> None:
    # Even with kvikio and cufile-python "installed", no driver means nothing is tried.
    env = _env(tmp_path, find_spec=lambda name: object(), dist_version=lambda n: f"{n} 1.0")
    rep = probe(env)
    assert rep.backend == "posix"
    assert rep.child is None and not no_subprocess
    assert "libcuda.so.1 not found" in rep.reason
    assert "libcuda.so.1 not found" in rep.kvikio_reason
    assert "libcuda.so.1 not found" in rep.cufile_reason
    assert not rep.kvikio_usable and not rep.cufile_usable
    for mode in ("kvikio", "cufile"):
        p = plan(mode, tmp_path, probe_env=env)
        assert p.error is not None and "libcuda.so.1 not found" in p.error
        with pytest.raises(IOBackendUnavailable, match=r"libcuda\.so\.1 not found"):
            open_backend(p)


def test_auto_on_this_node(tmp_path: Path, no_subprocess: list[Any]) -> None:
    """The real probe of this machine. On a GPU-less node: posix, no subprocess."""
    t0 = time.perf_counter()
    rep = probe()
    wall = time.perf_counter() - t0
    print(f"auto decided {rep.backend} in {wall * 1e3:.1f} ms: {rep.reason}")
    if rep.driver_present:
        pytest.skip(f"this node has a CUDA driver ({rep.cuda_driver_version}): not GPU-less")
    assert rep.backend == "posix"
    assert rep.child is None and not no_subprocess
    assert rep.libcuda_error is not None and "libcuda.so.1" in rep.libcuda_error
    p = plan(IOMode.AUTO, tmp_path)
    assert p.backend == "posix" and p.error is None
    assert p.gpu.child is None


def test_store_on_auto_opens_posix_here(tmp_path: Path, kek_file: Path) -> None:
    t0 = time.perf_counter()
    s = open_store(tmp_path / "store", kek_file, io="auto")
    print(f"store open with io=auto: {(time.perf_counter() - t0) * 1e3:.0f} ms")
    try:
        if s.io_plan.gpu.driver_present:
            pytest.skip("this node has a CUDA driver")
        assert s.io.name == "posix"
        assert s.io_plan.gpu.child is None
        assert s.stats()["io"]["backend"] == "posix"
        _round_trip(s)
    finally:
        s.close()


def test_driver_without_kvikio_or_cufile_is_posix_without_a_subprocess(
    tmp_path: Path, no_subprocess: list[Any]
) -> None:
    env = _env(tmp_path, load_library=_cuda_present)
    (env.sysroot / "dev" / "nvidia0").touch()
    (env.sysroot / "proc/driver/nvidia").mkdir(parents=True)
    (env.sysroot / "proc/driver/nvidia/version").write_text("NVRM version: 550.54.15\n")
    rep = probe(env)
    assert rep.driver_present and rep.cuda_driver_version == "12.4"
    assert rep.nvidia_devices == ["/dev/nvidia0"]
    assert rep.nvidia_driver == "NVRM version: 550.54.15"
    assert rep.nvidia_fs is None
    assert rep.backend == "posix" and rep.child is None
    assert "kvikio is not installed" in rep.reason


def test_cufile_python_without_libcufile_is_explained(
    tmp_path: Path, no_subprocess: list[Any]
) -> None:
    env = _env(
        tmp_path,
        load_library=_cuda_present,
        find_spec=lambda name: object() if name == "cufile" else None,
    )
    rep = probe(env, requested="cufile")
    assert rep.child is None
    assert rep.backend == "none" and "no libcufile" in rep.cufile_reason
    assert "unversioned libcufile.so" in rep.cufile_reason


def test_libcufile_and_nvidia_fs_are_reported(tmp_path: Path) -> None:
    libdir = tmp_path / "lib"
    libdir.mkdir()
    (libdir / "libcufile.so.1.13.1").touch()
    env = _env(tmp_path, library_dirs=lambda: [libdir])
    (env.sysroot / "proc/driver/nvidia-fs").mkdir(parents=True)
    (env.sysroot / "proc/driver/nvidia-fs/version").write_text("2.20.5\n")
    rep = probe(env)
    assert rep.libcufile == str(libdir / "libcufile.so.1.13.1")
    assert rep.libcufile_version == "1.13.1"
    assert rep.nvidia_fs == "2.20.5"
    assert rep.backend == "posix" and rep.child is None  # still no driver


def test_a_hanging_probe_child_is_killed_and_becomes_a_reason(tmp_path: Path) -> None:
    """Stands in for cuFileDriverOpen spinning forever (libcufile 1.20, no GPU): the
    child and a grandchild sleep; the probe kills the whole group at the timeout."""
    pidfile = tmp_path / "grandchild.pid"
    hang = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(120)\n"
    )
    env = _env(
        tmp_path,
        load_library=_cuda_present,
        find_spec=lambda name: object() if name == "kvikio" else None,
        dist_version=lambda name: "kvikio-cu12 25.4.0" if name == "kvikio" else None,
        child_argv=[sys.executable, "-c", hang],
        timeout_s=1.5,
    )
    t0 = time.monotonic()
    rep = probe(env)
    wall = time.monotonic() - t0
    print(f"hanging child: probe returned after {wall:.2f} s: {rep.kvikio_reason}")
    assert wall < 60  # it returned (the child would sleep 120 s)
    assert rep.child is not None and rep.child.started and rep.child.timed_out
    assert rep.backend == "posix"
    assert "did not finish within 1.5 s" in rep.kvikio_reason
    assert "did not finish" in rep.reason
    for pid in (rep.child.pid, int(pidfile.read_text()) if pidfile.exists() else None):
        if pid is None:
            continue
        for _ in range(50):
            if not _alive(pid):
                break
            time.sleep(0.1)
        assert not _alive(pid), f"process {pid} survived the probe timeout"
    with pytest.raises(IOBackendUnavailable, match="did not finish"):
        open_backend(plan("kvikio", tmp_path, gpu_report=rep))


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_probe_child_report_selects_kvikio_and_a_missing_module_is_an_error(
    tmp_path: Path,
) -> None:
    """A child that reports a working kvikio (what a GPU node's child prints): auto picks
    kvikio. Opening it here fails honestly, because kvikio is not installed."""
    report = {"cuda_devices": 1, "kvikio_ok": True, "kvikio_version": "25.04.00"}
    env = _env(
        tmp_path,
        load_library=_cuda_present,
        find_spec=lambda name: object() if name == "kvikio" else None,
        child_argv=[sys.executable, "-c", f"print({json.dumps(json.dumps(report))})"],
        timeout_s=30,
    )
    rep = probe(env)
    assert rep.child is not None and rep.child.error is None
    assert rep.cuda_devices == 1 and rep.kvikio_usable
    assert rep.backend == "kvikio" and "did a test write/read" in rep.reason
    p = plan("auto", tmp_path, gpu_report=rep)
    assert p.backend == "kvikio" and p.error is None
    with pytest.raises(IOBackendUnavailable, match="kvikio does not import"):
        open_backend(p)


def test_probe_child_that_crashes_is_a_reason(tmp_path: Path) -> None:
    env = _env(
        tmp_path,
        load_library=_cuda_present,
        find_spec=lambda name: object() if name == "kvikio" else None,
        child_argv=[
            sys.executable,
            "-c",
            "import sys; sys.stderr.write('segfault-ish\\n'); sys.exit(3)",
        ],
        timeout_s=30,
    )
    rep = probe(env)
    assert rep.backend == "posix"
    assert "exited 3 without a report" in rep.kvikio_reason and "segfault-ish" in rep.kvikio_reason


def test_the_real_probe_child_runs_here() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvoffload.gpu_probe", "--child", "--kvikio"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    r = json.loads(out.stdout)
    assert isinstance(r["cuda_devices"], int)
    if r["cuda_devices"] == 0:
        assert r["kvikio_ok"] is False and "kvikio unusable" in r["kvikio_error"]


def test_explicit_kvikio_or_cufile_here_is_a_clear_error(
    tmp_path: Path, kek_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if probe().driver_present:
        pytest.skip("this node has a CUDA driver")
    for mode in ("kvikio", "cufile"):
        with pytest.raises(IOBackendUnavailable) as ei:
            open_store(tmp_path / "store", kek_file, io=mode)
        msg = str(ei.value)
        assert f"KVOFFLOAD_IO={mode}" in msg and "libcuda.so.1 not found" in msg
        assert "KVOFFLOAD_IO=auto" in msg
    monkeypatch.setenv("KVOFFLOAD_IO", "kvikio")
    with pytest.raises(IOBackendUnavailable, match=r"libcuda\.so\.1"):
        open_store(tmp_path / "store", kek_file)  # io=None: the environment decides
    monkeypatch.setenv("KVOFFLOAD_IO", "posix-buffered")
    s = open_store(tmp_path / "store", kek_file)  # the failed opens released the index lock
    try:
        assert s.io.describe()["o_direct_write"] is False
    finally:
        s.close()


def test_mode_parsing() -> None:
    assert requested_mode(None, {}) is IOMode.AUTO
    assert requested_mode(None, {"KVOFFLOAD_IO": "POSIX-Direct"}) is IOMode.POSIX_DIRECT
    assert requested_mode("kvikio", {"KVOFFLOAD_IO": "posix"}) is IOMode.KVIKIO
    with pytest.raises(ValueError, match="auto\\|posix"):
        requested_mode("gds", {})


def test_config_io_setting(tmp_path: Path) -> None:
    from kvoffload.sidecar.config import ConfigError, load_config

    assert load_config(env={}).io is IOMode.AUTO
    assert load_config(env={"KVOFFLOAD_IO": "posix-buffered"}).io is IOMode.POSIX_BUFFERED
    cfg = tmp_path / "c.toml"
    cfg.write_text('[store]\nio = "posix-direct"\n')
    c = load_config(cfg, env={})
    assert c.io is IOMode.POSIX_DIRECT and c.store_config().io is IOMode.POSIX_DIRECT
    with pytest.raises(ConfigError, match="bad I/O backend"):
        load_config(env={"KVOFFLOAD_IO": "nvme"})


@pytest.mark.gds
def test_direct_path_from_gpu_memory(tmp_path: Path, kek_file: Path) -> None:
    """A plaintext layout-v1 object written from GPU memory through GDS and read back
    into GPU memory, then verified by the store like any other object."""
    rep = probe(ProbeEnv(probe_dir=tmp_path))
    if not rep.gds_available or not (rep.kvikio_usable or rep.cufile_usable):
        why = (
            rep.kvikio_reason
            if not rep.driver_present
            else (
                f"GDS unavailable (nvidia-fs: {rep.nvidia_fs or 'not loaded'}; "
                f"kvikio: {rep.kvikio_reason}; cufile: {rep.cufile_reason})"
            )
        )
        pytest.skip(why)
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    s = open_store(tmp_path / "store", kek_file)
    try:
        lay = layers(7, 4)
        size = v1.object_size([len(x) for x in lay], False)
        host = fileio.ScratchBuffers().get(size)
        v1.seal_into(host, tenant="acme", namespace=NS, chunk_key=key(7), layers=lay, aead=None)
        dev = torch.frombuffer(bytearray(host), dtype=torch.uint8).cuda()
        mode = "kvikio" if rep.kvikio_usable else "cufile"
        backend: Any = open_backend(plan(mode, tmp_path / "store" / "objects", gpu_report=rep))
        final = s._path("acme", key(7))
        final.parent.mkdir(parents=True, exist_ok=True)
        assert backend.write_device(final, dev, size, Durability.OBJECT)
        back = torch.zeros(size, dtype=torch.uint8, device="cuda")
        assert backend.read_device(final, 0, back, size) == size
        assert torch.equal(back, dev)
        assert s.get("acme", key(7)) == lay  # adopted from the file, every byte verified
    finally:
        s.close()


# ------------------------------------------------------------------ batch API


def test_put_many_and_get_many_into(store: Store) -> None:
    chunks = [(key(i), layers(i)) for i in range(5)]
    assert store.put_many("acme", NS, chunks[:2]) == [True, True]
    assert store.put_many("acme", NS, chunks) == [False, False, True, True, True]
    assert store.put_many("acme", NS, [], encrypt=False) == []
    outs = [memoryview(bytearray(20000)) for _ in range(5)]
    got = store.get_many_into("acme", [key(i) for i in range(5)], outs)
    for i in range(5):
        n = got[i]
        assert n is not None and bytes(outs[i][: sum(n)]) == b"".join(layers(i))
    assert store.stats()["reserved_bytes"] == 0


@pytest.mark.parametrize("io", ["posix", "posix-direct", "posix-buffered"])
def test_batches_of_growing_objects(tmp_path: Path, kek_file: Path, io: str) -> None:
    """Objects larger than the scratch buffers (1 MiB to start) make them grow mid-batch,
    while the other buffer is in flight."""
    s = open_store(tmp_path / "store", kek_file, io=io)
    try:
        sizes = [1 << 19, 3 << 19, 3 << 20, 5 << 20, 1 << 18, 9 << 20]
        chunks = [
            (key(i), [os.urandom(n // 2), os.urandom(n // 2 + 7)]) for i, n in enumerate(sizes)
        ]
        assert s.put_many("acme", NS, chunks) == [True] * len(sizes)
        outs = [memoryview(bytearray(n + 8)) for n in sizes]
        got = s.get_many_into("acme", [k for k, _ in chunks], outs)
        for (_k, lay), out, n in zip(chunks, outs, got, strict=True):
            assert n == [len(x) for x in lay] and bytes(out[: sum(n)]) == b"".join(lay)
        for k, lay in chunks:
            assert s.get("acme", k) == lay
    finally:
        s.close()


def test_get_many_into_stops_at_the_first_miss(store: Store) -> None:
    store.put_many("acme", NS, [(key(i), layers(i)) for i in range(4)], encrypt=False)
    # Corrupt chunk 1 on disk: a miss, its file and entry dropped.
    p = store._path("acme", key(1))
    raw = bytearray(p.read_bytes())
    raw[-5000] ^= 1
    p.write_bytes(bytes(raw))
    outs = [memoryview(bytearray(20000)) for _ in range(4)]
    keys = [key(i) for i in range(4)]
    got = store.get_many_into("acme", keys, outs)
    assert got[0] is not None and got[1:] == [None, None, None]
    assert not p.exists() and store.lookup("acme", keys) == 1
    got = store.get_many_into("acme", keys, outs, stop_at_miss=False)
    assert got[0] is not None and got[1] is None and got[2] is not None and got[3] is not None
    got = store.get_many_into("acme", [key(99), key(0)], outs[:2])
    assert got == [None, None]
    with pytest.raises(ValueError):
        store.get_many_into("acme", keys, outs[:1])


def test_put_many_stops_at_an_error_and_holds_nothing(
    tmp_path: Path, kek_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    obj = v1.object_size([len(x) for x in layers(0)], True)
    s = open_store(
        tmp_path / "store", kek_file, capacity_bytes=obj * 3, high_watermark=1.0, low_watermark=1.0
    )
    try:
        s.pin("acme", [key(0), key(1), key(2)])  # nothing evictable
        with pytest.raises(StoreFull):
            s.put_many("acme", NS, [(key(i), layers(i)) for i in range(5)])
        assert [s.contains("acme", key(i)) for i in range(5)] == [True, True, True, False, False]
        assert s.reserved_bytes == 0 and s.used_bytes == obj * 3

        real = fileio._write_all

        def enospc_on_second(fd: int, data: memoryview) -> None:
            # The second chunk's write, by its key in the header: the batch's
            # writes run in parallel, so "the second call" would be any of them.
            if bytes(data[: v1.header_length(3)]).find(key(11)) >= 0:
                raise OSError(28, "No space left on device")
            real(fd, data)

        s.unpin("acme", [key(0), key(1), key(2)])
        s.purge_older_than(0)
        monkeypatch.setattr(fileio, "_write_all", enospc_on_second)
        with pytest.raises(StoreIOError, match="permanent"):
            s.put_many("acme", NS, [(key(i), layers(i)) for i in range(10, 14)])
        # In flight with it or not, nothing after the failing chunk is stored.
        assert [s.contains("acme", key(i)) for i in range(10, 14)] == [True, False, False, False]
        assert s.reserved_bytes == 0
        assert s.used_bytes == v1.object_size([len(x) for x in layers(10)], True)
        assert not list((s.root / "objects").rglob(v1.TMP_PREFIX + "*"))
    finally:
        s.close()


def test_report_serialises(tmp_path: Path) -> None:
    rep = probe(_env(tmp_path))
    d = plan("posix", tmp_path, gpu_report=rep).to_dict()
    json.dumps(d)
    assert d["backend"] == "posix" and d["gpu"]["driver_present"] is False
    assert isinstance(GpuReport().to_dict(), dict)


def test_only_posix_page_cache_reads_plan_o_direct_for_uncached_large_objects(
    direct_dir: Path,
) -> None:
    def read_min(mode: str, **kw: Any) -> int:
        p = plan(mode, direct_dir, **kw)
        assert p.to_dict()["o_direct_read_min"] == p.direct_read_min
        return p.direct_read_min

    assert read_min("posix") == DIRECT_READ_MIN
    assert "O_DIRECT for uncached objects >= 16.0 MiB" in plan("posix", direct_dir).describe()
    assert read_min("posix", direct_read_min=64 << 20) == 64 << 20
    assert read_min("posix", direct_read_min=0) == 0
    # Page cache only; O_DIRECT for every read already; not the posix backend's reads.
    for mode in ("posix-buffered", "posix-direct", "kvikio", "cufile"):
        assert read_min(mode) == 0, mode
