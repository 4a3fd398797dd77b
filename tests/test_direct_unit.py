"""The direct path below the server: layout-v1 objects built by a worker (header block
plus layers at the placement rule's offsets), worker-side POSIX I/O, the store's lease
lifecycle (lease, write, verify, publish or refuse), the lease messages, the policy keys
and the backend selection. Real files, real LMDB, real xxhash, real AES-GCM."""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import random
import shutil
import stat
import types
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgpack
import pytest
import xxhash
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvoffload import direct
from kvoffload import protocol as p
from kvoffload.direct import DirectIOError, Extent, PosixDirectIO
from kvoffload.layouts import CorruptObject, ObjectMismatch, v1
from kvoffload.protocol import ErrorCode, ProtocolError, StoreStatus
from kvoffload.sidecar import fileio
from kvoffload.sidecar.errors import LeaseInvalid, StoreFull
from kvoffload.sidecar.iobackend import probe_direct
from kvoffload.sidecar.keyring import Kek
from kvoffload.sidecar.policy import Policy, PolicyError, load_policy
from kvoffload.sidecar.store import Store, StoreConfig, StoreLease

from .ramfs import run_on_ramfs

REPO = Path(__file__).resolve().parent.parent
NS = bytes(range(32))
OTHER_NS = bytes(range(32, 64))
TENANT = "acme"


def key(i: int) -> bytes:
    return hashlib.blake2b(f"direct/{i}".encode(), digest_size=32).digest()


def rand_layers(seed: int, sizes: Sequence[int]) -> list[bytes]:
    rng = random.Random(seed)
    # Never all-zero: a zero layer would pass for the padding a lease file starts with.
    return [bytes([1 + i % 254]) + rng.randbytes(n - 1) if n else b"" for i, n in enumerate(sizes)]


def sealed_plain(
    layers: Sequence[bytes], *, chunk_key: bytes, created_ns: int, tenant: str = TENANT
) -> bytes:
    """The reference object: what v1.seal_into writes for a plaintext tenant."""
    out = bytearray(v1.object_size([len(x) for x in layers], False))
    n = v1.seal_into(
        memoryview(out),
        tenant=tenant,
        namespace=NS,
        chunk_key=chunk_key,
        layers=layers,
        aead=None,
        created_ns=created_ns,
    )
    assert n == len(out)
    return bytes(out)


def header_block(
    layers: Sequence[bytes],
    *,
    chunk_key: bytes,
    created_ns: int = 0,
    tenant: str = TENANT,
    namespace: bytes = NS,
) -> bytes:
    return v1.plain_header_block(
        tenant=tenant,
        namespace=namespace,
        chunk_key=chunk_key,
        lengths=[len(x) for x in layers],
        checks=[v1.layer_check(x) for x in layers],
        created_ns=created_ns,
    )


def assembled(layers: Sequence[bytes], *, chunk_key: bytes, created_ns: int = 0) -> bytearray:
    """An object as a direct-path writer makes it: a zeroed file, the header block at
    0, each layer at its planned offset, nothing else written."""
    lengths = [len(x) for x in layers]
    buf = bytearray(v1.object_size(lengths, False))
    head = header_block(layers, chunk_key=chunk_key, created_ns=created_ns)
    data_offset, offsets = v1.plan_offsets(len(layers), lengths, False)
    assert len(head) == data_offset
    buf[: len(head)] = head
    for x, off in zip(layers, offsets, strict=True):
        buf[off : off + len(x)] = x
    return buf


def verify(buf: bytes | bytearray, *, chunk_key: bytes, **kw: Any) -> v1.ObjectHeader:
    args: dict[str, Any] = {"tenant": TENANT, "namespace": NS, "chunk_key": chunk_key}
    args.update(kw)
    return v1.verify_plain(memoryview(buf), **args)


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


def lease_file(directory: Path, layers: Sequence[Any], name: str = "obj") -> Path:
    """A temp file as the sidecar leases it: created, allocated, all zeros."""
    size = v1.object_size([direct.nbytes(x) for x in layers], False)
    final = directory / "objects" / f"{name}{v1.OBJECT_SUFFIX}"
    tmp = fileio.create_lease_file(final, size, durable_dirs=False, gid=None)
    assert tmp.parent == final.parent and tmp.name.startswith(v1.TMP_PREFIX)
    assert tmp.stat().st_size == size and tmp.read_bytes() == bytes(size)
    return tmp


def write_leased(
    io: PosixDirectIO, tmp: Path, layers: Sequence[Any], *, chunk_key: bytes, created_ns: int = 0
) -> list[Extent]:
    """What the client does with a lease: header block and layers at the planned offsets."""
    lengths = [direct.nbytes(x) for x in layers]
    checks = direct.checks_of(layers)
    head = v1.plain_header_block(
        tenant=TENANT,
        namespace=NS,
        chunk_key=chunk_key,
        lengths=lengths,
        checks=checks,
        created_ns=created_ns,
    )
    _, offsets = v1.plan_offsets(len(layers), lengths, False)
    io.write_object(str(tmp), head, layers, offsets)
    return [Extent(o, n, c) for o, n, c in zip(offsets, lengths, checks, strict=True)]


def _as_bytes(x: bytes) -> Any:
    return x


def _as_numpy(x: bytes) -> Any:
    np = pytest.importorskip("numpy")
    return np.frombuffer(x, dtype=np.uint8).copy()


def _as_numpy_f32(x: bytes) -> Any:
    # A multi-byte dtype: the layer is its bytes, not its element count.
    np = pytest.importorskip("numpy")
    return np.frombuffer(x, dtype=np.float32).copy()


def _as_torch(x: bytes) -> Any:
    torch = pytest.importorskip("torch")
    return torch.frombuffer(bytearray(x), dtype=torch.uint8).clone()


def _as_torch_bf16(x: bytes) -> Any:
    torch = pytest.importorskip("torch")
    return torch.frombuffer(bytearray(x), dtype=torch.bfloat16).clone().reshape(2, -1)


HOST_KINDS: dict[str, Callable[[bytes], Any]] = {
    "bytes": _as_bytes,
    "bytearray": bytearray,
    "memoryview": lambda x: memoryview(bytearray(x)),
    "numpy-u8": _as_numpy,
    "numpy-f32": _as_numpy_f32,
    "torch-cpu-u8": _as_torch,
    "torch-cpu-bf16": _as_torch_bf16,
}
# Even sizes, multiples of 4 (the f32 / 2-row bf16 views need it), most not of 4096.
IO_SIZES = [5000, 4096, 8, 12_292, 8192]


class OpenFlags:
    """The flags of every os.open of one path (the real call runs)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
        self.flags: list[int] = []
        real = os.open

        def spy(p_: Any, flags: int, *a: Any, **kw: Any) -> int:
            if str(p_) == str(path):
                self.flags.append(flags)
            return real(p_, flags, *a, **kw)

        monkeypatch.setattr(os, "open", spy)


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
from kvoffload import direct
from kvoffload.layouts import v1
from kvoffload.sidecar import fileio
from kvoffload.sidecar.iobackend import mount_of
d = Path(sys.argv[1])
lay = [os.urandom(5000), os.urandom(4096), os.urandom(3)]
lengths = [len(x) for x in lay]
size = v1.object_size(lengths, False)
tmp = fileio.create_lease_file(d / "obj.kvo", size, durable_dirs=False, gid=None)
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


# ------------------------------------------------------------ store lease lifecycle


def open_store(tmp_path: Path, kek_file: Path, name: str = "store", **kw: Any) -> Store:
    kw.setdefault("durability", "none")
    cfg = StoreConfig(root=tmp_path / name, **kw)
    return Store(cfg, Kek.from_file(kek_file), create=True)


@pytest.fixture
def st(tmp_path: Path, kek_file: Path) -> Iterator[Store]:
    s = open_store(tmp_path, kek_file)
    yield s
    s.close()


def temp_files(s: Store) -> list[Path]:
    return sorted(p for p in (s.root / "objects").rglob(f"{v1.TMP_PREFIX}*"))


def objects(s: Store) -> list[Path]:
    return sorted((s.root / "objects").rglob(f"*{v1.OBJECT_SUFFIX}"))


LAYERS = rand_layers(21, [5000, 3000, 4096])
LENGTHS = [len(x) for x in LAYERS]
SIZE = v1.object_size(LENGTHS, False)


def lease(s: Store, k: bytes, lengths: Sequence[int] = LENGTHS, **kw: Any) -> StoreLease:
    got = s.lease_store(TENANT, NS, k, lengths, **kw)
    assert got is not None
    return got


def write_object(
    lz: StoreLease, layers: Sequence[bytes], *, chunk_key: bytes | None = None, **kw: Any
) -> None:
    lengths = [len(x) for x in layers]
    head = v1.plain_header_block(
        tenant=kw.pop("tenant", TENANT),
        namespace=kw.pop("namespace", NS),
        chunk_key=chunk_key or lz.chunk_key,
        lengths=lengths,
        checks=[v1.layer_check(x) for x in layers],
        created_ns=77,
    )
    _, offsets = v1.plan_offsets(len(layers), lengths, False)
    PosixDirectIO(**kw).write_object(str(lz.tmp), head, layers, offsets)


def assert_nothing_left(s: Store, k: bytes) -> None:
    assert temp_files(s) == []
    assert objects(s) == []
    assert not s.contains(TENANT, k)
    assert s.get(TENANT, k) is None
    assert s.reserved_bytes == 0 and s.used_bytes == 0


@pytest.mark.parametrize("o_direct", [True, False], ids=["o_direct", "buffered"])
def test_lease_write_publish_get(st: Store, o_direct: bool) -> None:
    lz = lease(st, key(1), ttl_s=3600.0)
    assert lz.size == SIZE and lz.tmp.parent == lz.final.parent
    assert lz.final == st.root / v1.object_relpath(TENANT, key(1))
    assert lz.offsets == v1.plan_offsets(3, LENGTHS, False)
    assert temp_files(st) == [lz.tmp]
    assert stat.S_IMODE(lz.tmp.stat().st_mode) == fileio.LEASE_FILE_MODE
    assert lz.tmp.read_bytes() == bytes(SIZE)
    assert st.reserved_bytes == SIZE and st.used_bytes == 0
    write_object(lz, LAYERS, o_direct=o_direct)
    assert st.publish_lease(lz) is True
    assert temp_files(st) == [] and objects(st) == [lz.final]
    assert stat.S_IMODE(lz.final.stat().st_mode) == fileio.PUBLISHED_MODE == 0o440
    assert st.reserved_bytes == 0 and st.used_bytes == SIZE
    assert st.get(TENANT, key(1)) == LAYERS
    rec = st.payload_info(TENANT, key(1))
    assert rec is not None
    assert rec.key_epoch == 0 and rec.created_ns == 77 and rec.payload == sum(LENGTHS)
    assert rec.expires_ns > rec.last_access_ns  # the lease's ttl made it to the index
    assert st.fsck(verify_data=True).clean
    # Stored: no second lease, and no temp file for one.
    assert st.lease_store(TENANT, NS, key(1), LENGTHS) is None
    assert temp_files(st) == [] and st.reserved_bytes == 0


def test_lease_publish_with_object_durability(tmp_path: Path, kek_file: Path) -> None:
    s = open_store(tmp_path, kek_file, durability="object")
    try:
        lz = lease(s, key(2))
        write_object(lz, LAYERS)
        assert s.publish_lease(lz)
        assert s.get(TENANT, key(2)) == LAYERS
        assert s.reserved_bytes == 0 and s.used_bytes == SIZE
    finally:
        s.close()


def test_large_direct_object_publishes(st: Store) -> None:
    layers = rand_layers(22, [(1 << 20) + 5, 3 << 20])
    lz = lease(st, key(3), [len(x) for x in layers])
    write_object(lz, layers, o_direct=False)
    assert st.publish_lease(lz)
    assert st.get(TENANT, key(3)) == layers


def test_lease_is_none_when_the_key_is_stored(st: Store) -> None:
    assert st.put(TENANT, NS, key(4), LAYERS, encrypt=False)
    assert st.put(TENANT, NS, key(5), LAYERS, encrypt=True)
    before = st.reserved_bytes
    assert st.lease_store(TENANT, NS, key(4), LENGTHS) is None
    assert st.lease_store(TENANT, NS, key(5), LENGTHS) is None
    assert temp_files(st) == [] and st.reserved_bytes == before == 0
    # Another tenant's copy of the key is not this tenant's: it gets a lease.
    other = st.lease_store("beta", NS, key(4), LENGTHS)
    assert other is not None
    st.cancel_lease(other)


def test_cancel_lease_removes_the_file_and_the_reservation(st: Store) -> None:
    a, b = lease(st, key(6)), lease(st, key(7))
    assert st.reserved_bytes == 2 * SIZE and len(temp_files(st)) == 2
    write_object(a, LAYERS)
    st.cancel_lease(a)
    assert not a.tmp.exists() and temp_files(st) == [b.tmp]
    assert st.reserved_bytes == SIZE
    st.cancel_lease(a)  # idempotent: nothing is released twice
    assert st.reserved_bytes == SIZE
    st.cancel_lease(b)
    assert_nothing_left(st, key(6))
    # A cancelled key can be leased again.
    st.cancel_lease(lease(st, key(6)))
    assert st.reserved_bytes == 0


def test_publish_of_an_unwritten_lease_is_refused(st: Store) -> None:
    lz = lease(st, key(8))
    corrupt = st.counters.corrupt
    with pytest.raises(LeaseInvalid):
        st.publish_lease(lz)
    assert st.counters.corrupt == corrupt + 1
    assert_nothing_left(st, key(8))


@pytest.mark.parametrize("change", [-4096, -1, 1, 4096])
def test_publish_after_the_worker_resized_the_file_is_refused(st: Store, change: int) -> None:
    lz = lease(st, key(9))
    write_object(lz, LAYERS)
    os.truncate(lz.tmp, SIZE + change)
    with pytest.raises(LeaseInvalid, match="bytes, leased"):
        st.publish_lease(lz)
    assert_nothing_left(st, key(9))


def test_publish_of_a_symlink_is_refused_and_its_target_kept(st: Store, tmp_path: Path) -> None:
    lz = lease(st, key(10))
    target = tmp_path / "elsewhere.kvo"
    target.write_bytes(sealed_plain(LAYERS, chunk_key=key(10), created_ns=1))  # a valid object
    lz.tmp.unlink()
    lz.tmp.symlink_to(target)
    with pytest.raises(LeaseInvalid):
        st.publish_lease(lz)
    assert not lz.tmp.is_symlink()
    assert target.read_bytes() == sealed_plain(LAYERS, chunk_key=key(10), created_ns=1)
    assert_nothing_left(st, key(10))


def test_publish_of_a_hard_linked_lease_file_is_refused(st: Store, tmp_path: Path) -> None:
    lz = lease(st, key(11))
    write_object(lz, LAYERS)
    keep = tmp_path / "kept-open-for-later"
    os.link(lz.tmp, keep)
    with pytest.raises(LeaseInvalid, match="links"):
        st.publish_lease(lz)
    assert_nothing_left(st, key(11))


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give the file away")
def test_publish_of_a_file_now_owned_by_someone_else_is_refused(st: Store) -> None:
    lz = lease(st, key(12))
    write_object(lz, LAYERS)
    os.chown(lz.tmp, 65534, -1)
    with pytest.raises(LeaseInvalid, match="owned by uid 65534"):
        st.publish_lease(lz)
    assert_nothing_left(st, key(12))


@pytest.mark.parametrize(
    "wrong",
    [
        {"chunk_key": key(99)},
        {"namespace": OTHER_NS},
        {"tenant": "beta"},
    ],
    ids=["chunk-key", "namespace", "tenant"],
)
def test_publish_of_another_chunks_object_is_refused(st: Store, wrong: dict[str, Any]) -> None:
    lz = lease(st, key(13))
    write_object(lz, LAYERS, **wrong)
    with pytest.raises(LeaseInvalid, match="another chunk key, tenant or namespace"):
        st.publish_lease(lz)
    assert_nothing_left(st, key(13))
    assert not st.contains(TENANT, key(99)) and not st.contains("beta", key(13))


def test_publish_with_other_layer_lengths_of_the_same_size_is_refused(st: Store) -> None:
    lz = lease(st, key(14), [5000, 3000])
    swapped = rand_layers(23, [3000, 5000])
    assert v1.object_size([3000, 5000], False) == lz.size
    write_object(lz, swapped)
    verify(lz.tmp.read_bytes(), chunk_key=key(14))  # a valid object, just not the leased one
    with pytest.raises(LeaseInvalid, match="layer lengths"):
        st.publish_lease(lz)
    assert_nothing_left(st, key(14))


def test_publish_of_a_sealed_object_is_refused(st: Store) -> None:
    small = rand_layers(24, [1000, 2000])
    lz = lease(st, key(15), [1000, 2000])
    out = bytearray(v1.object_size([1000, 2000], True))
    assert len(out) == lz.size  # the tags fit in the padding: only the flag tells
    v1.seal_into(
        memoryview(out),
        tenant=TENANT,
        namespace=NS,
        chunk_key=key(15),
        layers=small,
        aead=AESGCM(os.urandom(32)),
        key_epoch=1,
    )
    with open(lz.tmp, "r+b") as f:
        f.write(out)
    with pytest.raises(LeaseInvalid, match="plaintext"):
        st.publish_lease(lz)
    assert_nothing_left(st, key(15))


@pytest.mark.parametrize("where", ["layer", "padding", "header"])
def test_publish_of_a_damaged_object_is_refused(st: Store, where: str) -> None:
    lz = lease(st, key(16))
    write_object(lz, LAYERS)
    _, offsets = lz.offsets
    pos = {"layer": offsets[1] + 7, "padding": offsets[0] + 5000 + 3, "header": 100}[where]
    with open(lz.tmp, "r+b") as f:
        f.seek(pos)
        f.write(b"\xff")
    with pytest.raises(LeaseInvalid):
        st.publish_lease(lz)
    assert_nothing_left(st, key(16))


def test_publishing_twice_leaves_the_published_object_alone(st: Store) -> None:
    lz = lease(st, key(17))
    write_object(lz, LAYERS)
    assert st.publish_lease(lz)
    with pytest.raises(LeaseInvalid):
        st.publish_lease(lz)
    assert st.get(TENANT, key(17)) == LAYERS
    assert st.reserved_bytes == 0 and st.used_bytes == SIZE


def test_a_lease_over_the_capacity_is_store_full(tmp_path: Path, kek_file: Path) -> None:
    s = open_store(tmp_path, kek_file, capacity_bytes=SIZE - 1)
    try:
        with pytest.raises(StoreFull):
            s.lease_store(TENANT, NS, key(18), LENGTHS)
        assert not (s.root / "objects").exists() or temp_files(s) == []
        assert s.reserved_bytes == 0
        small = [b"x" * 100]
        lz = lease(s, key(19), [100])  # one that fits is leased
        assert s.reserved_bytes == lz.size == 8192
        write_object(lz, small)
        assert s.publish_lease(lz)
        assert s.get(TENANT, key(19)) == small
    finally:
        s.close()


def test_lease_store_refuses_bad_shapes(st: Store) -> None:
    for lengths in ([], [0], [10, 0]):
        with pytest.raises(ValueError):
            st.lease_store(TENANT, NS, key(20), lengths)
    with pytest.raises(ValueError):
        st.lease_store(TENANT, NS[:31], key(20), [10])
    assert temp_files(st) == [] and st.reserved_bytes == 0


def test_lease_load_then_worker_read(st: Store) -> None:
    lz = lease(st, key(21))
    write_object(lz, LAYERS)
    st.publish_lease(lz)
    rl = st.lease_load(TENANT, key(21))
    assert rl is not None
    assert rl.path == lz.final and rl.size == SIZE
    assert [le.length for le in rl.header.layers] == LENGTHS
    extents = [Extent(le.offset, le.length, le.check) for le in rl.header.layers]
    outs = [bytearray(n) for n in LENGTHS]
    assert PosixDirectIO().read_layers(str(rl.path), extents, outs)
    assert [bytes(o) for o in outs] == LAYERS
    # A chunk the sidecar wrote in plaintext is just as readable by the worker.
    assert st.put(TENANT, NS, key(22), LAYERS, encrypt=False)
    rl2 = st.lease_load(TENANT, key(22))
    assert rl2 is not None and [le.length for le in rl2.header.layers] == LENGTHS


def test_lease_load_misses_sealed_and_absent_chunks(st: Store) -> None:
    assert st.put(TENANT, NS, key(23), LAYERS, encrypt=True)
    assert st.lease_load(TENANT, key(23)) is None
    assert st.get(TENANT, key(23)) == LAYERS  # a miss for the worker, kept for the sidecar
    assert st.lease_load(TENANT, key(24)) is None
    assert st.lease_load("beta", key(23)) is None


@pytest.mark.parametrize("damage", ["header-byte", "truncated", "other-key"])
def test_lease_load_drops_a_chunk_with_a_bad_header(st: Store, damage: str) -> None:
    assert st.put(TENANT, NS, key(25), LAYERS, encrypt=False)
    path = st.root / v1.object_relpath(TENANT, key(25))
    path.chmod(0o600)
    if damage == "header-byte":
        with open(path, "r+b") as f:
            f.seek(50)
            b = f.read(1)
            f.seek(50)
            f.write(bytes([b[0] ^ 1]))
    elif damage == "truncated":
        os.truncate(path, SIZE - 4096)
    else:  # a valid object of another key under this key's name
        path.write_bytes(sealed_plain(LAYERS, chunk_key=key(26), created_ns=5))
    assert st.lease_load(TENANT, key(25)) is None
    assert not path.exists()
    assert not st.contains(TENANT, key(25)) and st.used_bytes == 0


def test_check_reported_keeps_a_good_chunk_and_drops_a_corrupt_one(st: Store) -> None:
    lz = lease(st, key(27))
    write_object(lz, LAYERS)
    st.publish_lease(lz)
    assert st.check_reported(TENANT, key(27)) is False
    assert st.get(TENANT, key(27)) == LAYERS and lz.final.exists()
    # A layer byte flips at rest: the header still checks, so the worker gets a lease
    # and finds the damage itself; the sidecar confirms and drops the chunk.
    os.chmod(lz.final, 0o600)
    _, offsets = lz.offsets
    with open(lz.final, "r+b") as f:
        f.seek(offsets[2] + 4000)
        b = f.read(1)
        f.seek(offsets[2] + 4000)
        f.write(bytes([b[0] ^ 0x10]))
    rl = st.lease_load(TENANT, key(27))
    assert rl is not None
    extents = [Extent(le.offset, le.length, le.check) for le in rl.header.layers]
    assert PosixDirectIO().read_layers(str(rl.path), extents, [bytearray(n) for n in LENGTHS]) is (
        False
    )
    corrupt = st.counters.corrupt
    assert st.check_reported(TENANT, key(27)) is True
    assert st.counters.corrupt == corrupt + 1
    assert not lz.final.exists() and not st.contains(TENANT, key(27))
    assert st.used_bytes == 0
    assert st.check_reported(TENANT, key(27)) is False  # gone: nothing to drop


def test_check_reported_keeps_a_good_sealed_chunk(st: Store) -> None:
    assert st.put(TENANT, NS, key(28), LAYERS, encrypt=True)
    assert st.check_reported(TENANT, key(28)) is False
    assert st.get(TENANT, key(28)) == LAYERS


# --------------------------------------------------------------------- protocol

K = [bytes([i]) * 32 for i in range(4)]


def wire(msg: dict[str, Any]) -> dict[str, Any]:
    """Through real framing: encode_frame → (length, msgpack body) → decode_body."""
    frame = p.encode_frame(msg)
    (n,) = p._LENGTH.unpack_from(frame, 0)
    assert n == len(frame) - p.LENGTH_SIZE
    return p.decode_body(frame[p.LENGTH_SIZE :])


WRITE_SLOT = p.LeaseSlot(
    StoreStatus.WRITE,
    path="/srv/kvo/objects/acme/01/01/.tmp-0123456789abcdef-42",
    size=16384,
    data_offset=4096,
    offsets=(4096, 12288),
)
FOUND_SLOT = p.ReadSlot(
    True,
    "/srv/kvo/objects/acme/01/01/0101.kvo",
    12288,
    (p.LayerExtent(4096, 5000, b"c" * 16), p.LayerExtent(12288, 1, b"d" * 16)),
)

LEASE_REQUESTS: list[Any] = [
    p.LeaseStore(
        TENANT, NS, (p.ChunkSpec(K[0], (5000, 1)), p.ChunkSpec(K[1], (4096,))), ttl_s=60.0
    ),
    p.LeaseStore(TENANT, NS, (p.ChunkSpec(K[2], (7,)),)),
    p.LeaseLoad(TENANT, (K[0], K[1], K[2])),
    p.CompleteLoad(9, (0, 2)),
    p.CompleteLoad(9),
]

LEASE_REPLIES: list[Any] = [
    p.LeaseStoreReply(
        3,
        4096,
        (
            WRITE_SLOT,
            p.LeaseSlot(StoreStatus.EXISTS),
            p.LeaseSlot(StoreStatus.REJECTED, code=ErrorCode.NO_SPACE),
        ),
    ),
    p.LeaseStoreReply(0, 4096, (p.LeaseSlot(StoreStatus.EXISTS),)),
    p.LeaseLoadReply(5, ErrorCode.NOT_FOUND, (FOUND_SLOT, p.ReadSlot(False))),
    p.LeaseLoadReply(5, ErrorCode.OK, (FOUND_SLOT, FOUND_SLOT)),
    p.LeaseLoadReply(0, ErrorCode.NOT_FOUND, (p.ReadSlot(False), p.ReadSlot(False))),
    p.LeaseLoadReply(5, ErrorCode.BUSY, (FOUND_SLOT, p.ReadSlot(False))),
    p.HelloReply(1, "srv", "store", {TENANT: b"s" * 32}, direct={TENANT: True, "beta": False}),
    p.HelloReply(1, "srv", "store", {TENANT: b"s" * 32}),
]


@pytest.mark.parametrize("req", LEASE_REQUESTS, ids=lambda r: type(r).__name__)
def test_lease_request_roundtrip(req: Any) -> None:
    msg = wire(p.request_message(17, req))
    assert msg["op"] == req.OP.value
    rid, back = p.parse_request(msg)
    assert rid == 17 and back == req and type(back) is type(req)


def test_lease_requests_are_not_their_staging_twins() -> None:
    store = LEASE_REQUESTS[0]
    twin = p.PrepareStore(store.tenant, store.namespace, store.chunks, store.ttl_s)
    assert store != twin
    _, back = p.parse_request(wire(p.request_message(1, store)))
    assert isinstance(back, p.LeaseStore) and back.OP is p.Op.LEASE_STORE
    _, back = p.parse_request(wire(p.request_message(1, p.LeaseLoad(TENANT, (K[0],)))))
    assert isinstance(back, p.LeaseLoad) and back.OP is p.Op.LEASE_LOAD
    assert "corrupt" not in p.CompleteLoad(9).to_wire()


@pytest.mark.parametrize("reply", LEASE_REPLIES, ids=lambda r: type(r).__name__)
def test_lease_reply_roundtrip(reply: Any) -> None:
    rid, back = p.parse_reply(wire(p.reply_message(23, reply)))
    assert rid == 23 and back == reply and type(back) is type(reply)


def test_hello_reply_without_direct_reads_as_an_empty_map() -> None:
    msg = p.reply_message(1, p.HelloReply(1, "srv", "store", {TENANT: b"s" * 32}))
    del msg["direct"]  # an older sidecar
    _, back = p.parse_reply(wire(msg))
    assert isinstance(back, p.HelloReply) and dict(back.direct) == {}
    msg = p.reply_message(
        1, p.HelloReply(1, "srv", "store", {TENANT: b"s" * 32}, direct={TENANT: True})
    )
    _, back = p.parse_reply(wire(msg))
    assert isinstance(back, p.HelloReply) and dict(back.direct) == {TENANT: True}
    for bad in ({"bad tenant!": True}, {TENANT: 1}, [TENANT]):
        with pytest.raises(ProtocolError):
            p.parse_reply({**msg, "direct": bad})


def _store_reply() -> dict[str, Any]:
    return p.reply_message(1, LEASE_REPLIES[0])


def _load_reply() -> dict[str, Any]:
    return p.reply_message(1, LEASE_REPLIES[2])


def _with_write(**fields: Any) -> dict[str, Any]:
    msg = _store_reply()
    msg["chunks"] = [{**msg["chunks"][0], **fields}, *msg["chunks"][1:]]
    return msg


def _with_found(**fields: Any) -> dict[str, Any]:
    msg = _load_reply()
    msg["chunks"] = [{**msg["chunks"][0], **fields}, *msg["chunks"][1:]]
    return msg


def _with_extent(i: int, value: Any) -> dict[str, Any]:
    ext = list(_load_reply()["chunks"][0]["layers"][0])
    ext[i] = value
    return _with_found(layers=[ext])


MALFORMED_REPLIES: dict[str, Callable[[], dict[str, Any]]] = {
    "store-relative-path": lambda: _with_write(path="objects/acme/x"),
    "store-nul-in-path": lambda: _with_write(path="/srv/a\0b"),
    "store-path-not-a-string": lambda: _with_write(path=b"/srv/x"),
    "store-unaligned-offset": lambda: _with_write(offsets=[4096, 12289]),
    "store-no-offsets": lambda: _with_write(offsets=[]),
    "store-unaligned-size": lambda: _with_write(size=16385),
    "store-unaligned-data-offset": lambda: _with_write(data_offset=100),
    "store-missing-path": lambda: {
        **_store_reply(),
        "chunks": [{k: v for k, v in _store_reply()["chunks"][0].items() if k != "path"}],
    },
    "store-handle-0-with-write": lambda: {**_store_reply(), "handle": 0},
    "store-handle-without-write": lambda: {
        **_store_reply(),
        "chunks": [{"status": "exists"}],
    },
    "store-unknown-status": lambda: _with_write(status="maybe"),
    "store-alignment-too-small": lambda: {**_store_reply(), "alignment": 512},
    "load-relative-path": lambda: _with_found(path="relative.kvo"),
    "load-unaligned-size": lambda: _with_found(size=12289),
    "load-unaligned-offset": lambda: _with_extent(0, 4097),
    "load-short-check": lambda: _with_extent(2, b"c" * 15),
    "load-long-check": lambda: _with_extent(2, b"c" * 17),
    "load-check-not-bin": lambda: _with_extent(2, "c" * 16),
    "load-extent-of-two": lambda: _with_found(layers=[[4096, 10]]),
    "load-no-layers": lambda: _with_found(layers=[]),
    "load-found-after-miss": lambda: {
        **_load_reply(),
        "chunks": list(reversed(_load_reply()["chunks"])),
    },
    "load-stop-ok-with-a-miss": lambda: {**_load_reply(), "stop": 0},
    "load-stop-miss-all-found": lambda: {
        **_load_reply(),
        "chunks": [_load_reply()["chunks"][0]] * 2,
    },
    "load-handle-0-with-found": lambda: {**_load_reply(), "handle": 0},
    "load-handle-without-found": lambda: {
        **_load_reply(),
        "chunks": [{"found": False}],
    },
}


@pytest.mark.parametrize("name", list(MALFORMED_REPLIES), ids=list(MALFORMED_REPLIES))
def test_malformed_lease_replies_are_protocol_errors(name: str) -> None:
    msg = MALFORMED_REPLIES[name]()
    body = msgpack.packb(msg, use_bin_type=True)
    with pytest.raises(ProtocolError) as ei:
        p.parse_reply(p.decode_body(body))
    assert ei.value.code is ErrorCode.BAD_REQUEST


def test_the_malformed_replies_start_from_good_ones() -> None:
    # So each malformed case fails for its one change, not for its base.
    for base in (_store_reply(), _load_reply()):
        p.parse_reply(wire(base))


@pytest.mark.parametrize(
    "corrupt", [[1, 1], [-1], [p.MAX_BATCH], ["0"], 3, [True]], ids=lambda c: repr(c)
)
def test_complete_load_refuses_bad_corrupt_lists(corrupt: Any) -> None:
    msg = {**p.request_message(4, p.CompleteLoad(9, (1,))), "corrupt": corrupt}
    with pytest.raises(ProtocolError, match="corrupt"):
        p.parse_request(msg)


def test_complete_load_corrupt_bounds() -> None:
    msg = {**p.request_message(4, p.CompleteLoad(9)), "corrupt": [0, p.MAX_BATCH - 1]}
    assert p.parse_request(msg) == (4, p.CompleteLoad(9, (0, p.MAX_BATCH - 1)))
    assert p.parse_request({**msg, "corrupt": []}) == (4, p.CompleteLoad(9))


# ----------------------------------------------------------------------- policy


def policy_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / f"policy-{uuid.uuid4().hex[:8]}.toml"
    path.write_text(text, encoding="utf-8")
    return path


def refused(tmp_path: Path, text: str, line: int, *needles: str) -> PolicyError:
    path = policy_file(tmp_path, text)
    with pytest.raises(PolicyError) as ei:
        load_policy(path)
    err = ei.value
    assert err.line == line, str(err)
    assert str(err).startswith(f"{path}:{line}:"), str(err)
    for n in needles:
        assert n in str(err), str(err)
    return err


def test_policy_direct_with_plaintext_encryption(tmp_path: Path) -> None:
    pol = load_policy(
        policy_file(
            tmp_path,
            'version = 1\n\n[tenants.acme]\nencryption = "none"\ndirect = true\n\n'
            "[tenants.beta]\nencryption = \"none\"\n\n[tenants.gamma]\nencryption = 'none'\n"
            "direct = false\n",
        )
    )
    acme = pol.tenant("acme")
    assert acme.direct is True and acme.encryption is False and acme.direct_gid is None
    assert pol.tenant("beta").direct is False
    assert pol.tenant("gamma").direct is False
    assert pol.tenant("unlisted").direct is False and pol.defaults.direct is False


def test_policy_direct_inherits_plaintext_from_defaults(tmp_path: Path) -> None:
    pol = load_policy(
        policy_file(
            tmp_path, 'version = 1\n[defaults]\nencryption = "none"\n[tenants.a]\ndirect = true\n'
        )
    )
    assert pol.tenant("a").direct is True and pol.tenant("a").encryption is False


def test_policy_direct_with_sealed_encryption_is_refused(tmp_path: Path) -> None:
    refused(tmp_path, "version = 1\n\n[tenants.acme]\ndirect = true\n", 4, "direct", '"none"')
    refused(
        tmp_path,
        'version = 1\n[defaults]\nencryption = "none"\n[tenants.acme]\n'
        'encryption = "aes-256-gcm"\nquota = "1GiB"\ndirect = true\n',
        7,
        'encryption = "none"',
    )


@pytest.mark.parametrize(
    ("value", "gid"),
    [("0", 0), ('"root"', 0), (str(os.getgid()), os.getgid()), ("12345", 12345)],
)
def test_policy_direct_group_by_gid_or_name(tmp_path: Path, value: str, gid: int) -> None:
    pol = load_policy(
        policy_file(
            tmp_path,
            f'version = 1\n[tenants.acme]\nencryption = "none"\ndirect = true\n'
            f"direct_group = {value}\n",
        )
    )
    assert pol.tenant("acme").direct_gid == gid and pol.tenant("acme").direct


def test_policy_direct_group_errors(tmp_path: Path) -> None:
    head = 'version = 1\n[tenants.acme]\nencryption = "none"\n'
    missing = f"kvo-no-such-group-{uuid.uuid4().hex[:12]}"
    refused(
        tmp_path, head + f'direct = true\ndirect_group = "{missing}"\n', 5, "unknown group", missing
    )
    refused(tmp_path, head + 'direct_group = "root"\n', 4, "direct_group", "direct = true")
    refused(tmp_path, head + 'direct = false\ndirect_group = "root"\n', 5, "direct = true")
    refused(tmp_path, head + "direct = true\ndirect_group = -1\n", 5, "out of range")
    refused(tmp_path, head + 'direct = true\ndirect_group = ""\n', 5, "group name or gid")
    refused(tmp_path, head + "direct = true\ndirect_group = true\n", 5, "group name or gid")
    refused(tmp_path, head + "direct = true\ndirect_group = [0]\n", 5, "group name or gid")


def test_policy_direct_keys_are_per_tenant_only(tmp_path: Path) -> None:
    for k, v in (("direct", "true"), ("direct_group", '"root"')):
        refused(
            tmp_path,
            f'version = 1\n[defaults]\nencryption = "none"\n{k} = {v}\n',
            4,
            k,
            "per tenant",
        )


@pytest.mark.parametrize("value", ['"yes"', "1", "0", '"true"', "[true]"])
def test_policy_direct_must_be_a_bool(tmp_path: Path, value: str) -> None:
    refused(
        tmp_path,
        f'version = 1\n[tenants.acme]\nencryption = "none"\ndirect = {value}\n',
        4,
        "direct must be true or false",
    )


def test_policy_text_api_agrees(tmp_path: Path) -> None:
    text = 'version = 1\n[tenants.acme]\nencryption = "none"\ndirect = true\ndirect_group = 0\n'
    pol = Policy.from_toml_text(text)
    assert pol.tenant("acme") == load_policy(policy_file(tmp_path, text)).tenant("acme")


# ---------------------------------------------------------------------- select


@pytest.fixture
def fresh_selection() -> Iterator[None]:
    direct.reset_selection()
    yield
    direct.reset_selection()


def _driver_present() -> bool:
    from kvoffload.sidecar.gpu_probe import probe

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
        with caplog.at_level(logging.INFO, logger="kvoffload.direct"):
            io = direct.select()
        assert isinstance(io, PosixDirectIO)
        msgs = [r.getMessage() for r in caplog.records if r.name == "kvoffload.direct"]
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
    from kvoffload.direct import copy_into

    copy_into(memoryview(raw[0]), halves[0])
    assert halves[0].view(torch.uint8).numpy().tobytes() == raw[0]


def test_posix_sources_leave_host_layers_uncopied() -> None:
    """sources() is where GPU layers go to the host (once); host layers pass as they are."""
    raw = rand_layers(32, [5000, 4096])
    layers: list[Any] = [raw[0], bytearray(raw[1])]
    got = PosixDirectIO().sources(layers)
    assert len(got) == 2 and all(a is b for a, b in zip(got, layers, strict=True))
