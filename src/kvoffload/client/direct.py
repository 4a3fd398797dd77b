"""The worker's half of the direct path: write and read leased layout-v1 objects itself.

For tenants whose policy says ``encryption = "none"`` and ``direct = true``
(``protocol-v1.md`` 5.14, 5.15; ``docs/spec/layout-v1.md`` §4.1) the KV bytes need not
pass through the sidecar's staging buffer: the sidecar leases a path, the
worker writes the object there (through GPUDirect Storage straight from GPU
memory where the node has it), and the sidecar verifies it before naming
it. Loads are the mirror: the sidecar checks the header and pins the
object, the worker reads the layers into their destinations and verifies
each layer's XXH3-128 against the header's.

Backends, chosen by ``KVOFFLOAD_DIRECT_IO`` (``auto`` by default):

``posix``
    ``pwritev``/``preadv`` on host memory. Writes go through O_DIRECT where
    the file system takes it (layers are copied into a page-aligned bounce
    buffer unless already aligned, which also writes their zero padding);
    reads through the page cache. A GPU tensor is copied to or from host
    memory first (``torch``).
``kvikio``
    ``kvikio.CuFile``: GDS between GPU memory and the file where the node
    has it, kvikio's POSIX compat mode otherwise; host buffers work too.
``auto``
    kvikio when the sidecar's safe GPU probe (:mod:`kvoffload.gpu_probe`:
    driver first, anything that could hang in a child with a timeout) says
    it can do I/O here, posix otherwise.

Checksums are XXH3-128 on the CPU. For a GPU layer that costs a copy to the
host (on save, before the write; on load, after the read): the direct path
removes the staging copy and the sidecar's hop, not the integrity check.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import xxhash

from kvoffload.errors import DirectIOError
from kvoffload.posix import ALIGN, O_DIRECT, ScratchBuffers, align_up, pread_all, pwrite_all

log = logging.getLogger(__name__)

ENV_VAR = "KVOFFLOAD_DIRECT_IO"
MODES = ("auto", "posix", "kvikio")


def is_device(obj: Any) -> bool:
    """A GPU buffer: a CUDA torch tensor or anything with ``__cuda_array_interface__``."""
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    dev = getattr(obj, "device", None)
    return getattr(dev, "type", None) == "cuda"


def _device_bytes(obj: Any) -> Any:
    """A flat uint8 view of a GPU tensor (torch) without copying."""
    import torch

    if not obj.is_contiguous():
        raise ValueError("a GPU layer must be contiguous")
    return obj.reshape(-1).view(torch.uint8)


def _device_nbytes(obj: Any) -> int:
    if hasattr(obj, "nbytes"):
        return int(obj.nbytes)
    cai = obj.__cuda_array_interface__
    n = 1
    for d in cai["shape"]:
        n *= int(d)
    return n * int(cai["typestr"][-1])


def to_host(obj: Any) -> memoryview:
    """The bytes of a GPU tensor, copied to host memory."""
    return memoryview(_device_bytes(obj).cpu().numpy()).cast("B")


def as_byte_view(obj: Any) -> memoryview:
    """A flat, read-only byte view of a layer, without copying."""
    if type(obj).__module__.partition(".")[0] == "torch":
        # torch tensors have no buffer protocol; importing torch here costs
        # nothing since the caller already has it loaded.
        import torch

        if obj.device.type != "cpu":
            raise ValueError(f"layer tensor must be on the CPU, not {obj.device}")
        if not obj.is_contiguous():
            raise ValueError("layer tensor must be contiguous")
        obj = obj.reshape(-1).view(torch.uint8).numpy()
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError(f"layer of type {type(obj).__name__} is not a buffer") from None
    if not mv.c_contiguous:
        raise ValueError("layer buffer must be C-contiguous")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv.toreadonly()


def copy_into(src: memoryview, dst: Any) -> None:
    """Copy host bytes into a destination layer: a host buffer or a GPU tensor."""
    if is_device(dst):
        _copy_to_device(src, dst)
    else:
        _host_view(dst, writable=True)[: src.nbytes] = src


def _host_view(obj: Any, writable: bool = False) -> memoryview:
    if writable:
        if type(obj).__module__.partition(".")[0] == "torch":  # a CPU tensor: no buffer protocol
            import torch

            if not obj.is_contiguous():
                raise ValueError("a load destination tensor must be contiguous")
            obj = obj.reshape(-1).view(torch.uint8).numpy()
        mv = memoryview(obj)
        if mv.readonly:
            raise ValueError("a load destination must be writable")
        return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    return as_byte_view(obj)


def writable_view(obj: Any) -> memoryview:
    """A flat, writable byte view of a host destination (buffer or CPU tensor)."""
    return _host_view(obj, writable=True)


def nbytes(obj: Any) -> int:
    return _device_nbytes(obj) if is_device(obj) else _host_view(obj).nbytes


def checks_of(layers: Sequence[Any]) -> list[bytes]:
    """XXH3-128 of each layer (GPU layers are copied to the host for it)."""
    out = []
    for x in layers:
        out.append(xxhash.xxh3_128_digest(to_host(x) if is_device(x) else _host_view(x)))
    return out


@dataclass(frozen=True)
class Extent:
    offset: int
    length: int
    check: bytes


class DirectIO(Protocol):
    name: str

    def sources(self, layers: Sequence[Any]) -> list[Any]:
        """The layers in the memory this backend writes them from.

        Call it once per object and pass the result to both :func:`checks_of`
        and :meth:`write_object`: a backend that moves GPU tensors through host
        memory then copies each one to the host once, not once per use.
        """

    def write_object(
        self,
        path: str,
        header_block: bytes,
        layers: Sequence[Any],
        offsets: Sequence[int],
        *,
        o_direct: bool | None = None,
    ) -> None:
        """Write the header block at 0 and layer i at offsets[i]; nothing else.

        ``o_direct``: bypass the page cache (None: the backend's default).
        The sidecar passes a hint with the lease (its durability setting):
        an object it will fsync anyway is best written with O_DIRECT; one it
        will not is best left in the page cache, where its verifying re-read
        then finds it.
        """

    def read_layers(self, path: str, extents: Sequence[Extent], dests: Sequence[Any]) -> bool:
        """Read each layer into its destination; False if any fails its checksum."""


#: Zeros for the padding between pieces (always shorter than a page).
_ZEROS = bytes(ALIGN)


def _pread_exact(fd: int, out: memoryview, offset: int) -> None:
    done = pread_all(fd, out, offset)
    if done < out.nbytes:
        raise DirectIOError(errno.EIO, f"object ends at {offset + done}, short of a layer")


class PosixDirectIO:
    """pwritev/preadv in the worker; O_DIRECT writes where the file system takes them."""

    name = "posix"

    def __init__(self, *, o_direct: bool = True) -> None:
        self.o_direct = o_direct and bool(O_DIRECT)
        # Page-aligned (O_DIRECT), per thread, only growing; not prefaulted.
        self._bounce = ScratchBuffers(prefault=False)

    def sources(self, layers: Sequence[Any]) -> list[Any]:
        return [to_host(x) if is_device(x) else x for x in layers]

    @staticmethod
    def _open_write(path: str, o_direct: bool) -> tuple[int, bool]:
        flags = os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW
        if o_direct:
            try:
                return os.open(path, flags | O_DIRECT), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
        return os.open(path, flags), False

    def write_object(
        self,
        path: str,
        header_block: bytes,
        layers: Sequence[Any],
        offsets: Sequence[int],
        *,
        o_direct: bool | None = None,
    ) -> None:
        want = self.o_direct if o_direct is None else (o_direct and bool(O_DIRECT))
        fd, direct = self._open_write(path, want)
        try:
            try:
                self._write(fd, direct, header_block, layers, offsets)
            except OSError as exc:
                if not (direct and exc.errno == errno.EINVAL):
                    raise
                # O_DIRECT refused at the first write (some FUSE, tmpfs): buffered.
                os.close(fd)
                fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
                self._write(fd, False, header_block, layers, offsets)
        finally:
            os.close(fd)

    def _write(
        self,
        fd: int,
        direct: bool,
        header_block: bytes,
        layers: Sequence[Any],
        offsets: Sequence[int],
    ) -> None:
        views = [memoryview(header_block)]
        views += [to_host(x) if is_device(x) else _host_view(x) for x in layers]
        offs = [0, *offsets]
        if not direct:
            # The page cache: one pwritev per piece costs a memcpy each, and the
            # padding is already zero (the sidecar allocated the file).
            for view, off in zip(views, offs, strict=True):
                pwrite_all(fd, view, off)
            return
        # O_DIRECT: the whole object image in one aligned buffer and one write.
        # A write per layer would cost a device round trip each (small chunks
        # pay that many times over); the copy runs at memcpy speed.
        size = align_up(offs[-1] + views[-1].nbytes)
        buf = self._bounce.get(size)
        for i, (view, off) in enumerate(zip(views, offs, strict=True)):
            end = off + view.nbytes
            nxt = offs[i + 1] if i + 1 < len(offs) else size
            if end > nxt:
                raise ValueError(f"piece {i} overlaps the next one")
            buf[off:end] = view
            buf[end:nxt] = _ZEROS[: nxt - end]
        pwrite_all(fd, buf, 0)

    def read_layers(self, path: str, extents: Sequence[Extent], dests: Sequence[Any]) -> bool:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        ok = True
        try:
            for ext, dst in zip(extents, dests, strict=True):
                if is_device(dst):
                    host = self._bounce.get(ext.length)
                    _pread_exact(fd, host, ext.offset)
                    ok &= xxhash.xxh3_128_digest(host) == ext.check
                    _copy_to_device(host, dst)
                else:
                    out = _host_view(dst, writable=True)[: ext.length]
                    _pread_exact(fd, out, ext.offset)
                    ok &= xxhash.xxh3_128_digest(out) == ext.check
        finally:
            os.close(fd)
        return ok


def _copy_to_device(host: memoryview, dst: Any) -> None:
    import torch

    src = torch.frombuffer(host, dtype=torch.uint8)
    _device_bytes(dst)[: host.nbytes].copy_(src)


class KvikioDirectIO:
    """kvikio.CuFile: GDS between GPU memory and the file, compat mode otherwise."""

    name = "kvikio"

    def __init__(self) -> None:
        import kvikio

        self._kvikio: Any = kvikio

    def sources(self, layers: Sequence[Any]) -> list[Any]:
        return list(layers)  # GPU tensors are written from GPU memory

    @staticmethod
    def _arr(obj: Any, writable: bool = False) -> Any:
        if is_device(obj):
            return _device_bytes(obj) if hasattr(obj, "is_contiguous") else obj
        import numpy as np

        return np.frombuffer(_host_view(obj, writable=writable), dtype=np.uint8)

    def write_object(
        self,
        path: str,
        header_block: bytes,
        layers: Sequence[Any],
        offsets: Sequence[int],
        *,
        o_direct: bool | None = None,
    ) -> None:
        # kvikio picks GDS or its compat-mode O_DIRECT/buffered split itself.
        import numpy as np

        head = np.frombuffer(header_block, dtype=np.uint8)
        try:
            with self._kvikio.CuFile(path, "r+") as f:
                futs = [(f.pwrite(head, len(header_block), 0), len(header_block))]
                for src, off in zip(layers, offsets, strict=True):
                    n = nbytes(src)
                    futs.append((f.pwrite(self._arr(src), n, off), n))
                for fut, n in futs:
                    if int(fut.get()) != n:
                        raise DirectIOError(errno.EIO, "kvikio wrote short")
        except RuntimeError as exc:
            raise DirectIOError(errno.EIO, f"kvikio write: {exc}") from exc

    def read_layers(self, path: str, extents: Sequence[Extent], dests: Sequence[Any]) -> bool:
        try:
            with self._kvikio.CuFile(path, "r") as f:
                futs = [
                    (f.pread(self._arr(d, writable=True), e.length, e.offset), e.length)
                    for e, d in zip(extents, dests, strict=True)
                ]
                for fut, n in futs:
                    if int(fut.get()) != n:
                        raise DirectIOError(errno.EIO, "kvikio read short")
        except RuntimeError as exc:
            raise DirectIOError(errno.EIO, f"kvikio read: {exc}") from exc
        ok = True
        for e, d in zip(extents, dests, strict=True):
            data = to_host(d)[: e.length] if is_device(d) else _host_view(d)[: e.length]
            ok &= xxhash.xxh3_128_digest(data) == e.check
        return ok


def decide(rep: Any, want: str = "auto") -> tuple[str, str]:
    """(backend, why) for a worker's direct path, from a GPU probe report
    (:class:`kvoffload.gpu_probe.GpuReport`); ``kvoffload doctor`` shows it."""
    if rep.kvikio_usable:
        how = "GPUDirect Storage" if rep.gds_available else "kvikio's compat mode (no GDS)"
        return "kvikio", f"{rep.kvikio_reason}: GPU tensors move through {how}"
    if want == "kvikio":
        return "none", rep.kvikio_reason
    return "posix", f"posix (GPU tensors bounce through host memory), because {rep.reason}"


_selected: DirectIO | None = None
_select_lock = threading.Lock()


def select(mode: str | None = None) -> DirectIO:
    """The worker's direct-path backend (``KVOFFLOAD_DIRECT_IO``), decided once per process."""
    global _selected
    want = (mode or os.environ.get(ENV_VAR) or "auto").strip().lower()
    if want not in MODES:
        raise ValueError(f"bad {ENV_VAR} {want!r}: expected {'|'.join(MODES)}")
    with _select_lock:
        if mode is None and _selected is not None:
            return _selected
        if want == "posix":
            name, why = "posix", f"{ENV_VAR}=posix"
        else:
            from ..gpu_probe import probe

            name, why = decide(probe(requested="kvikio" if want == "kvikio" else "auto"), want)
            if name != "kvikio" and want == "kvikio":
                raise DirectIOError(errno.ENODEV, f"{ENV_VAR}=kvikio: {why}")
        chosen: DirectIO = KvikioDirectIO() if name == "kvikio" else PosixDirectIO()
        log.info("direct-path I/O: %s (%s)", chosen.name, why)
        if mode is None:
            _selected = chosen
        return chosen


def reset_selection() -> None:
    """Forget the process's choice (tests)."""
    global _selected
    with _select_lock:
        _selected = None
