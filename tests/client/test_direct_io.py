"""Worker-side POSIX I/O of the direct path (O_DIRECT and buffered, every host buffer kind)
and the backend selection. Real files."""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from kvoffload.client import direct
from kvoffload.client.direct import DirectIOError, Extent, PosixDirectIO
from kvoffload.layouts import v1
from kvoffload.store.iobackend import probe_direct
from tests.direct_helpers import (
    HOST_KINDS,
    IO_SIZES,
    REPO,
    OpenFlags,
    key,
    lease_file,
    rand_layers,
    sealed_plain,
    verify,
    write_leased,
)
from tests.ramfs import run_on_ramfs

# ---------------------------------------------------------------- PosixDirectIO


@pytest.fixture
def odirect_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory whose file system takes O_DIRECT: tmp_path, else one under the repo."""
    if probe_direct(tmp_path).supported:
        yield tmp_path
        return
    d = REPO / f".pytest-direct-unit-{os.getpid()}"
    d.mkdir(exist_ok=True)
    try:
        rep = probe_direct(d)
        if not rep.supported:
            pytest.skip(f"no O_DIRECT here: {rep.detail}")
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("o_direct", [True, False], ids=["o_direct", "buffered"])
@pytest.mark.parametrize("kind", list(HOST_KINDS), ids=list(HOST_KINDS))
def test_posix_write_then_read_round_trips(
    odirect_dir: Path, monkeypatch: pytest.MonkeyPatch, kind: str, o_direct: bool
) -> None:
    raw = rand_layers(11, IO_SIZES)
    layers = [HOST_KINDS[kind](x) for x in raw]
    tmp = lease_file(odirect_dir, layers)
    spy = OpenFlags(monkeypatch, tmp)
    io = PosixDirectIO(o_direct=o_direct)
    extents = write_leased(io, tmp, layers, chunk_key=key(3), created_ns=99)
    monkeypatch.undo()
    # The write opened the file once, without following links, O_DIRECT as asked.
    assert len(spy.flags) == 1
    fl = spy.flags[0]
    assert fl & os.O_NOFOLLOW and not fl & os.O_CREAT and not fl & os.O_TRUNC
    assert bool(fl & direct.O_DIRECT) is o_direct
    # Byte for byte the object the sidecar itself would have written.
    on_disk = tmp.read_bytes()
    assert on_disk == sealed_plain(raw, chunk_key=key(3), created_ns=99)
    verify(on_disk, chunk_key=key(3))
    outs = [bytearray(len(x)) for x in raw]
    assert io.read_layers(str(tmp), extents, outs) is True
    assert [bytes(o) for o in outs] == raw


def test_posix_o_direct_writes_an_aligned_buffer_as_is(odirect_dir: Path) -> None:
    """A page-aligned buffer whose size is a multiple of 4 KiB skips the bounce buffer."""
    m = mmap.mmap(-1, 8192)
    m[:] = rand_layers(5, [8192])[0]
    layers: list[Any] = [memoryview(m), rand_layers(6, [700])[0]]
    tmp = lease_file(odirect_dir, layers)
    io = PosixDirectIO()
    extents = write_leased(io, tmp, layers, chunk_key=key(4))
    raw = [bytes(m), layers[1]]
    assert tmp.read_bytes() == sealed_plain(raw, chunk_key=key(4), created_ns=0)
    outs = [bytearray(8192), bytearray(700)]
    assert io.read_layers(str(tmp), extents, outs)
    assert [bytes(o) for o in outs] == raw
    layers.clear()
    m.close()


@pytest.mark.parametrize("o_direct", [True, False], ids=["o_direct", "buffered"])
def test_posix_read_reports_a_layer_corrupted_on_disk(odirect_dir: Path, o_direct: bool) -> None:
    raw = rand_layers(12, [5000, 4096, 300])
    tmp = lease_file(odirect_dir, raw)
    io = PosixDirectIO(o_direct=o_direct)
    extents = write_leased(io, tmp, raw, chunk_key=key(5))
    outs = [bytearray(len(x)) for x in raw]
    assert io.read_layers(str(tmp), extents, outs)
    with open(tmp, "r+b") as f:
        f.seek(extents[1].offset + 1000)
        byte = f.read(1)
        f.seek(extents[1].offset + 1000)
        f.write(bytes([byte[0] ^ 0x80]))
    outs = [bytearray(len(x)) for x in raw]
    assert io.read_layers(str(tmp), extents, outs) is False
    # The layers before and after were read intact; only layer 1 differs.
    assert bytes(outs[0]) == raw[0] and bytes(outs[2]) == raw[2]
    assert bytes(outs[1]) != raw[1]
    # A wrong expected checksum is a failure too, with correct bytes on disk.
    lying = [extents[0], extents[1], Extent(extents[2].offset, extents[2].length, bytes(16))]
    assert io.read_layers(str(tmp), [extents[0]], [bytearray(5000)]) is True
    assert io.read_layers(str(tmp), lying, [bytearray(len(x)) for x in raw]) is False


def test_posix_read_of_a_short_file_is_an_error(tmp_path: Path) -> None:
    raw = rand_layers(13, [5000, 300])
    tmp = lease_file(tmp_path, raw)
    io = PosixDirectIO(o_direct=False)
    extents = write_leased(io, tmp, raw, chunk_key=key(6))
    os.truncate(tmp, extents[1].offset + 10)
    with pytest.raises(DirectIOError, match="short of a layer"):
        io.read_layers(str(tmp), extents, [bytearray(5000), bytearray(300)])


def test_posix_io_refuses_to_follow_a_symlink(tmp_path: Path) -> None:
    raw = rand_layers(14, [100])
    tmp = lease_file(tmp_path, raw)
    link = tmp.parent / ".tmp-link"
    link.symlink_to(tmp)
    io = PosixDirectIO(o_direct=False)
    with pytest.raises(OSError):
        write_leased(io, link, raw, chunk_key=key(6))
    assert tmp.read_bytes() == bytes(tmp.stat().st_size)  # nothing written through it
    with pytest.raises(OSError):
        io.read_layers(str(link), [Extent(4096, 100, bytes(16))], [bytearray(100)])


def test_posix_read_into_other_writable_host_buffers(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    raw = rand_layers(15, [4000, 5000])
    tmp = lease_file(tmp_path, raw)
    io = PosixDirectIO(o_direct=False)
    extents = write_leased(io, tmp, raw, chunk_key=key(6))
    big = bytearray(9000)
    dests: list[Any] = [np.zeros(1000, dtype=np.float32), memoryview(big)[100:5100]]
    assert io.read_layers(str(tmp), extents, dests)
    assert dests[0].tobytes() == raw[0] and bytes(big[100:5100]) == raw[1]
    assert big[:100] == bytes(100) and big[5100:] == bytes(3900)  # nothing outside
    with pytest.raises(ValueError, match="writable"):
        io.read_layers(str(tmp), extents[:1], [raw[0]])  # bytes: read-only


def test_posix_o_direct_write_of_a_layer_over_one_mib(odirect_dir: Path) -> None:
    raw = rand_layers(16, [(2 << 20) + 1, 5000])
    tmp = lease_file(odirect_dir, raw)
    io = PosixDirectIO(o_direct=True)
    extents = write_leased(io, tmp, raw, chunk_key=key(9))
    verify(tmp.read_bytes(), chunk_key=key(9))
    outs = [bytearray(len(x)) for x in raw]
    assert io.read_layers(str(tmp), extents, outs)


def test_posix_buffered_write_of_a_layer_over_one_mib(tmp_path: Path) -> None:
    raw = rand_layers(16, [(2 << 20) + 1, 5000])
    tmp = lease_file(tmp_path, raw)
    io = PosixDirectIO(o_direct=False)
    extents = write_leased(io, tmp, raw, chunk_key=key(9))
    assert tmp.read_bytes() == sealed_plain(raw, chunk_key=key(9), created_ns=0)
    outs = [bytearray(len(x)) for x in raw]
    assert io.read_layers(str(tmp), extents, outs)
    assert [bytes(o) for o in outs] == raw


_RAMFS_CHILD = r"""
import json, os, sys
from pathlib import Path
from kvoffload.client import direct
from kvoffload.layouts import v1
from kvoffload.store import files as fileio
from kvoffload.store import leasefiles
from kvoffload.store.iobackend import mount_of
d = Path(sys.argv[1])
lay = [os.urandom(5000), os.urandom(4096), os.urandom(3)]
lengths = [len(x) for x in lay]
size = v1.object_size(lengths, False)
tmp = leasefiles.create_lease_file(d / "obj.kvo", size, durable_dirs=False, gid=None)
try:
    os.close(os.open(tmp, os.O_WRONLY | direct.O_DIRECT))
    refused = None
except OSError as exc:
    refused = exc.errno
_, offs = v1.plan_offsets(len(lay), lengths, False)
checks = direct.checks_of(lay)
hb = v1.plain_header_block(
    tenant="acme", namespace=bytes(32), chunk_key=b"k" * 32, lengths=lengths, checks=checks
)
io = direct.PosixDirectIO()
io.write_object(str(tmp), hb, lay, offs)
buf = tmp.read_bytes()
v1.verify_plain(memoryview(buf), tenant="acme", namespace=bytes(32), chunk_key=b"k" * 32)
outs = [bytearray(n) for n in lengths]
ok = io.read_layers(str(tmp), [direct.Extent(*t) for t in zip(offs, lengths, checks)], outs)
print(json.dumps({
    "fs": mount_of(d).fs_type, "refused": refused, "o_direct": io.o_direct, "ok": ok,
    "same": [bytes(o) for o in outs] == lay, "size": len(buf) == size,
    "left": sorted(os.listdir(d)),
}))
"""


def test_posix_o_direct_write_on_a_file_system_that_refuses_it(tmp_path: Path) -> None:
    """ramfs refuses O_DIRECT (EINVAL): the write goes buffered and still succeeds.
    Mounted in a private user+mount namespace, so nothing outside this test sees it."""
    r = run_on_ramfs(tmp_path, _RAMFS_CHILD)
    assert r["fs"] == "ramfs"
    assert r["refused"] == 22  # EINVAL: the kernel really refuses O_DIRECT there
    assert r["o_direct"] is True  # the backend asked for it all the same
    assert r["ok"] and r["same"] and r["size"]
    assert len(r["left"]) == 1 and r["left"][0].startswith(".tmp-")


def test_device_detection_and_host_copies() -> None:
    np = pytest.importorskip("numpy")
    assert not direct.is_device(b"x")
    assert not direct.is_device(bytearray(3))
    assert not direct.is_device(memoryview(b"x"))
    assert not direct.is_device(np.zeros(4))
    assert direct.is_device(types.SimpleNamespace(__cuda_array_interface__={}))
    assert direct.is_device(types.SimpleNamespace(device=types.SimpleNamespace(type="cuda")))
    assert not direct.is_device(types.SimpleNamespace(device=types.SimpleNamespace(type="cpu")))
    dst = bytearray(10)
    direct.copy_into(memoryview(b"abcdef"), dst)
    assert dst == b"abcdef" + bytes(4)
    arr = np.zeros(2, dtype=np.float32)
    direct.copy_into(memoryview(b"\x01" * 8), arr)
    assert arr.tobytes() == b"\x01" * 8
    with pytest.raises(ValueError, match="writable"):
        direct.copy_into(memoryview(b"ab"), b"xx")


@pytest.mark.parametrize("kind", list(HOST_KINDS), ids=list(HOST_KINDS))
def test_checks_and_sizes_of_host_layers(kind: str) -> None:
    raw = rand_layers(17, [8, 4096, 1028])
    layers = [HOST_KINDS[kind](x) for x in raw]
    assert [direct.nbytes(x) for x in layers] == [len(x) for x in raw]
    assert direct.checks_of(layers) == [xxhash.xxh3_128_digest(x) for x in raw]
    assert direct.checks_of(layers) == [v1.layer_check(x) for x in raw]


# ---------------------------------------------------------------------- select


@pytest.fixture
def fresh_selection() -> Iterator[None]:
    direct.reset_selection()
    yield
    direct.reset_selection()


def _driver_present() -> bool:
    from kvoffload.gpu_probe import probe

    return probe().driver_present


def test_select_posix_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, fresh_selection: None
) -> None:
    monkeypatch.setenv(direct.ENV_VAR, "posix")
    io = direct.select()
    assert isinstance(io, PosixDirectIO) and io.name == "posix"
    assert direct.select() is io  # decided once per process
    monkeypatch.setenv(direct.ENV_VAR, "kvikio")
    assert direct.select() is io  # ...even if the environment changes afterwards
    direct.reset_selection()
    monkeypatch.setenv(direct.ENV_VAR, " PoSiX ")
    again = direct.select()
    assert isinstance(again, PosixDirectIO) and again is not io


def test_select_auto_without_a_gpu_is_posix_with_a_reason(
    monkeypatch: pytest.MonkeyPatch, fresh_selection: None, caplog: pytest.LogCaptureFixture
) -> None:
    if _driver_present():
        pytest.skip("this node has a CUDA driver: auto may pick kvikio")
    for env in ("auto", None):
        direct.reset_selection()
        if env is None:
            monkeypatch.delenv(direct.ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(direct.ENV_VAR, env)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kvoffload.client.direct"):
            io = direct.select()
        assert isinstance(io, PosixDirectIO)
        msgs = [r.getMessage() for r in caplog.records if r.name == "kvoffload.client.direct"]
        assert len(msgs) == 1, msgs
        assert msgs[0].startswith("direct-path I/O: posix (posix")
        assert "because" in msgs[0] and "libcuda" in msgs[0]


def test_select_kvikio_without_a_gpu_names_libcuda(
    monkeypatch: pytest.MonkeyPatch, fresh_selection: None
) -> None:
    if _driver_present():
        pytest.skip("this node has a CUDA driver")
    monkeypatch.setenv(direct.ENV_VAR, "kvikio")
    with pytest.raises(DirectIOError, match=r"KVOFFLOAD_DIRECT_IO=kvikio: .*libcuda"):
        direct.select()
    with pytest.raises(DirectIOError, match="libcuda"):
        direct.select("kvikio")
    # The failure chose nothing: posix can still be selected.
    monkeypatch.setenv(direct.ENV_VAR, "posix")
    assert isinstance(direct.select(), PosixDirectIO)


def test_select_refuses_a_bad_value(monkeypatch: pytest.MonkeyPatch, fresh_selection: None) -> None:
    monkeypatch.setenv(direct.ENV_VAR, "gds")
    with pytest.raises(ValueError, match=r"KVOFFLOAD_DIRECT_IO 'gds'.*auto\|posix\|kvikio"):
        direct.select()
    with pytest.raises(ValueError):
        direct.select("cufile")
    # An explicit mode wins over the environment and is not cached.
    io = direct.select("posix")
    assert isinstance(io, PosixDirectIO)
    monkeypatch.setenv(direct.ENV_VAR, "posix")
    assert direct.select() is not io


def test_decide_from_a_probe_report() -> None:
    def rep(usable: bool, gds: bool = False) -> Any:
        return types.SimpleNamespace(
            kvikio_usable=usable,
            gds_available=gds,
            kvikio_reason="kvikio 25.x usable" if usable else "kvikio unusable: no libcuda",
            reason="no GPU here",
        )

    name, why = direct.decide(rep(True, gds=True))
    assert name == "kvikio" and "GPUDirect Storage" in why and "kvikio 25.x usable" in why
    name, why = direct.decide(rep(True, gds=False), "kvikio")
    assert name == "kvikio" and "compat mode" in why
    assert direct.decide(rep(False), "kvikio") == ("none", "kvikio unusable: no libcuda")
    name, why = direct.decide(rep(False))
    assert name == "posix" and why.endswith("because no GPU here")


def test_posix_reads_into_cpu_torch_tensors(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    raw = rand_layers(31, [6000, 4096])
    tmp = lease_file(tmp_path, raw)
    io = PosixDirectIO(o_direct=False)
    extents = write_leased(io, tmp, raw, chunk_key=key(31))
    outs = [torch.zeros(len(x), dtype=torch.uint8) for x in raw]
    assert io.read_layers(str(tmp), extents, outs)
    assert [bytes(t.numpy()) for t in outs] == raw
    halves = [torch.zeros(len(x) // 2, dtype=torch.bfloat16) for x in raw]
    from kvoffload.client.direct import copy_into

    copy_into(memoryview(raw[0]), halves[0])
    assert halves[0].view(torch.uint8).numpy().tobytes() == raw[0]


def test_posix_sources_leave_host_layers_uncopied() -> None:
    """sources() is where GPU layers go to the host (once); host layers pass as they are."""
    raw = rand_layers(32, [5000, 4096])
    layers: list[Any] = [raw[0], bytearray(raw[1])]
    got = PosixDirectIO().sources(layers)
    assert len(got) == 2 and all(a is b for a, b in zip(got, layers, strict=True))
