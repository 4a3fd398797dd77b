"""I/O backends: how the store moves a complete object image to and from a file.

The store seals an object into a page-aligned host buffer and hands it to an
:class:`IOBackend`, which writes it atomically (temp file with O_EXCL in the
object's directory → write → optional fsync → rename → optional directory
fsync; "already exists" is success; ENOSPC and friends become
:class:`~.errors.StoreIOError`), and reads a whole object, or one layer's byte
range, into a buffer the caller provides.

Backends, chosen by ``KVOFFLOAD_IO`` (or ``[store] io``):

``posix``
    ``pwritev``/``preadv`` and ``fallocate``. Where the store's file system
    accepts O_DIRECT (probed once per store directory at start: an aligned
    O_DIRECT write and read of a probe file; tmpfs before Linux 6.6, ramfs
    and some FUSE file systems refuse with EINVAL), objects that are fsync'd
    (durability ``object``) or large (≥ :data:`DIRECT_WRITE_MIN`) are written
    with O_DIRECT, smaller unsynced ones through the page cache. Reads of
    objects in the page cache are served from it; a large object
    (≥ :data:`DIRECT_READ_MIN`) mostly not in it is read with O_DIRECT, as
    it was written (see :data:`POSIX_SPLIT_WHY`).
``posix-direct``
    O_DIRECT for writes and reads; the store refuses to open where the probe
    fails.
``posix-buffered``
    The page cache for both.
``kvikio``
    ``kvikio.CuFile`` parallel reads/writes from host buffers (GDS where the
    node has it, kvikio's POSIX compat mode otherwise). Needs the CUDA driver:
    without ``libcuda.so.1`` kvikio cannot do I/O even in compat mode.
``cufile``
    cufile-python for GPU buffers (:meth:`CufileBackend.write_device`,
    :meth:`CufileBackend.read_device`); host buffers, which is all the sealed
    path has, go through the posix backend.
``auto`` (default)
    kvikio when the GPU probe (:mod:`.gpu_probe`) shows it can do I/O here,
    else posix; the choice and the reason are logged and kept in
    :attr:`IOSelection.reason`.

An explicit ``kvikio``, ``cufile`` or ``posix-direct`` that cannot work here is
an error (:class:`IOBackendUnavailable`, the store does not open) naming the
reason: an operator who pinned a backend wants to hear that it is missing,
not to run silently on another one. ``auto`` never fails: it falls back.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import logging
import mmap
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from kvoffload.errors import IOBackendUnavailable
from kvoffload.units import format_size

from ..gpu_probe import GpuReport, ProbeEnv, probe, redecide
from ..layouts import v1
from . import files as fileio
from .files import O_DIRECT, AllocFn, Durability

log = logging.getLogger("kvoffload.io")

ENV_VAR = "KVOFFLOAD_IO"


class IOMode(enum.StrEnum):
    AUTO = "auto"
    POSIX = "posix"  # O_DIRECT where the file system takes it, buffered elsewhere
    POSIX_DIRECT = "posix-direct"
    POSIX_BUFFERED = "posix-buffered"
    KVIKIO = "kvikio"
    CUFILE = "cufile"


def parse_mode(value: object) -> IOMode:
    try:
        return IOMode(str(value).strip().lower())
    except ValueError:
        choices = "|".join(m.value for m in IOMode)
        raise ValueError(f"bad I/O backend {value!r}: expected {choices}") from None


def requested_mode(configured: str | IOMode | None, env: Mapping[str, str] | None = None) -> IOMode:
    """The configured mode, else ``$KVOFFLOAD_IO``, else auto."""
    if configured is not None:
        return parse_mode(configured)
    env = os.environ if env is None else env
    return parse_mode(env.get(ENV_VAR) or IOMode.AUTO)


# ------------------------------------------------------------------ interface


class IOBackend(Protocol):
    """What the store needs of an I/O backend. Implementations are thread-safe."""

    #: "posix", "kvikio" or "cufile"
    name: str

    def write_object(self, final: Path, data: memoryview, durability: Durability) -> bool:
        """Write the complete object ``data`` atomically as ``final``.

        True if written, False if ``final`` already existed (success: objects
        are immutable). Raises :class:`~.errors.StoreIOError` (errno kept) on failure.
        """
        ...

    def read_object(self, path: Path, alloc: AllocFn, max_size: int) -> memoryview:
        """Read the whole file into ``alloc(n)`` (n ≥ its size); return the bytes read.

        Raises OSError (ENOENT, ESTALE, EIO, EFBIG over ``max_size``): a miss.
        """
        ...

    def read_range(self, path: Path, offset: int, out: memoryview) -> int:
        """Read ``len(out)`` bytes at ``offset`` (one layer) into ``out``; the count read."""
        ...

    def describe(self) -> dict[str, Any]:
        """What this backend is doing, for logs, stats and ``kvoffload doctor``."""
        ...

    def close(self) -> None: ...


# --------------------------------------------------------- file system facts


@dataclass(frozen=True)
class MountInfo:
    mount_point: str
    fs_type: str
    source: str
    options: str


_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(s: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m[1], 8)), s)


def mount_of(path: Path, mounts_file: Path = Path("/proc/self/mounts")) -> MountInfo | None:
    """The mount holding ``path`` (its nearest existing ancestor), from /proc/self/mounts.

    ``statvfs`` cannot name the file system type; the mount table can (the
    longest mount point that is a prefix of the real path wins; of stacked
    mounts on one point, the last).
    """
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    real = os.path.realpath(p)
    best: MountInfo | None = None
    try:
        lines = mounts_file.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) < 4:
            continue
        mp = _unescape(parts[1])
        inside = real == mp or real.startswith(mp.rstrip("/") + "/")
        if inside and (best is None or len(mp) >= len(best.mount_point)):
            best = MountInfo(mp, parts[2], _unescape(parts[0]), parts[3])
    return best


#: File systems where another host may shrink a file under a mapping (a read
#: then faults with SIGBUS): loads there read into a buffer instead.
SHARED_FS = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs",
     "9p", "virtiofs", "afs", "ocfs2", "gfs2", "orangefs", "weka", "wekafs"}
)  # fmt: skip


def local_fs(path: Path, mounts_file: Path = Path("/proc/self/mounts")) -> bool:
    """Whether ``path`` is on a node-local file system (not shared, not FUSE)."""
    m = mount_of(path, mounts_file)
    if m is None:
        return False
    t = m.fs_type
    return t not in SHARED_FS and not t.startswith("fuse")


@dataclass
class DirectProbe:
    """Whether O_DIRECT works in one directory, and how we know."""

    path: str
    fs_type: str | None = None
    mount_point: str | None = None
    supported: bool | None = None  # None: not probed (directory missing or not writable)
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def probe_direct(directory: Path) -> DirectProbe:
    """Create a probe file in ``directory`` with O_DIRECT, write and read 4 KiB aligned.

    The probe file has a temp-file name (``.tmp-…``), so if we are killed
    between create and unlink the collector removes it like any orphan.
    """
    directory = Path(directory)
    m = mount_of(directory)
    rep = DirectProbe(
        str(directory), m.fs_type if m else None, m.mount_point if m else None, None, ""
    )
    if not O_DIRECT:
        rep.supported, rep.detail = False, "this platform has no O_DIRECT"
        return rep
    if not directory.is_dir():
        rep.detail = "directory does not exist (probed when the store opens)"
        return rep
    path = directory / v1.tmp_name()
    buf = mmap.mmap(-1, fileio.DIRECT_ALIGN)  # page-aligned
    try:
        buf.write(b"kvoffload O_DIRECT probe\n".ljust(fileio.DIRECT_ALIGN, b"\0"))
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | O_DIRECT, 0o600)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                rep.supported = False
                rep.detail = f"open(O_DIRECT) refused with EINVAL on {rep.fs_type or '?'}"
            else:
                rep.detail = f"could not create a probe file: {exc.strerror} ({exc.errno})"
            return rep
        try:
            if os.pwritev(fd, [buf], 0) != len(buf):
                raise OSError(errno.EIO, "short O_DIRECT write")
            back = mmap.mmap(-1, fileio.DIRECT_ALIGN)
            try:
                if os.preadv(fd, [back], 0) != len(back) or back[:] != buf[:]:
                    raise OSError(errno.EIO, "O_DIRECT read returned other bytes")
            finally:
                back.close()
        except OSError as exc:
            rep.supported = False
            rep.detail = (
                f"aligned O_DIRECT I/O failed on {rep.fs_type or '?'}: "
                f"{exc.strerror or exc} ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
            )
            return rep
        finally:
            os.close(fd)
        rep.supported = True
        rep.detail = f"aligned 4 KiB O_DIRECT write+read worked on {rep.fs_type or '?'}"
        return rep
    finally:
        buf.close()
        with contextlib.suppress(OSError):
            path.unlink()


# ------------------------------------------------------------------- posix


#: ``posix`` writes an object with O_DIRECT when it is fsync'd or at least this big;
#: below, without fsync, the page cache took bursts faster (crossover ~8 MiB here).
DIRECT_WRITE_MIN = 16 << 20
#: ``posix`` reads an object of at least this size with O_DIRECT where less than
#: half of it is in the page cache (cachestat(2); Linux 6.5+, else through the
#: page cache). Cold 32 MiB objects, 4 at a time through a sidecar: 1.7-2.7
#: GB/s with O_DIRECT against 0.7-1.0 through the page cache (ext4 on virtio).
DIRECT_READ_MIN = DIRECT_WRITE_MIN


class PosixBackend:
    """pwritev/preadv and fallocate; O_DIRECT for writes and/or reads where asked.

    ``direct_write_min``: O_DIRECT writes only for objects of at least this
    size, unless the write is fsync'd anyway (durability ``object``).
    ``direct_read_min`` (where reads otherwise go through the page cache): the
    store reads an object of at least this size that is mostly not in the page
    cache with O_DIRECT (:func:`~.fileio.read_uncached`); 0: never. O_DIRECT
    is only used for a request whose buffer address, offset and length are
    4 KiB-aligned (the store's always are); anything else, and any file
    system that turns O_DIRECT down at run time, goes through the page cache.
    """

    name = "posix"

    def __init__(
        self,
        *,
        direct_write: bool,
        direct_read: bool,
        direct_write_min: int = 0,
        direct_read_min: int = 0,
        detail: str = "",
    ) -> None:
        self.direct_write = direct_write and bool(O_DIRECT)
        self.direct_read = direct_read and bool(O_DIRECT)
        self.direct_write_min = direct_write_min
        self.direct_read_min = direct_read_min if O_DIRECT and not self.direct_read else 0
        self.detail = detail
        #: Loads read through the page cache of a local file system: a large
        #: object layer slot by layer slot (:func:`~.fileio.streamed_object`), a
        #: layer-wise load from a mapping (:func:`~.fileio.map_opened`); set by
        #: :func:`select_backend` where reads go through the page cache and the
        #: file system is local.
        self.map_reads = False

    def write_object(self, final: Path, data: memoryview, durability: Durability) -> bool:
        direct = self.direct_write and (
            durability is Durability.OBJECT or len(data) >= self.direct_write_min
        )
        return fileio.write_atomic(final, data, durability, direct=direct)

    def read_object(self, path: Path, alloc: AllocFn, max_size: int) -> memoryview:
        return fileio.read_file(path, alloc, max_size, direct=self.direct_read)

    def read_range(self, path: Path, offset: int, out: memoryview) -> int:
        return fileio.read_range(path, offset, out, direct=self.direct_read)

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "o_direct_write": self.direct_write,
            "o_direct_read": self.direct_read,
            "o_direct_write_min": self.direct_write_min,
            "o_direct_read_min": self.direct_read_min,
            "mapped_reads": self.map_reads,
            "detail": self.detail,
        }

    def close(self) -> None:
        pass


# ------------------------------------------------------------------ kvikio


#: ``write_atomic``'s data for a GPU buffer: the bytes come through ``fill``.
_NOTHING = memoryview(b"")


def _host_array(buf: memoryview) -> Any:
    import numpy as np

    return np.frombuffer(buf, dtype=np.uint8)


class KvikioBackend:
    """kvikio.CuFile from host buffers: parallel tasks in kvikio's thread pool.

    kvikio raises RuntimeError for I/O failures; they are mapped to OSError
    (EIO) so that a failed read is a miss and a failed write a StoreIOError.
    """

    name = "kvikio"

    def __init__(self, detail: str = "") -> None:
        import kvikio

        self._kvikio: Any = kvikio
        self.detail = detail

    def _fill(self, fd: int, tmp: Path, data: memoryview) -> None:
        try:
            with self._kvikio.CuFile(tmp, "r+") as f:
                n = int(f.write(_host_array(data)))
        except RuntimeError as exc:
            raise OSError(errno.EIO, f"kvikio write: {exc}") from exc
        if n != len(data):
            raise OSError(errno.EIO, f"kvikio wrote {n} of {len(data)} bytes")

    def write_object(self, final: Path, data: memoryview, durability: Durability) -> bool:
        return fileio.write_atomic(final, data, durability, fill=self._fill)

    def read_object(self, path: Path, alloc: AllocFn, max_size: int) -> memoryview:
        size = path.stat().st_size
        if size > max_size:
            raise OSError(errno.EFBIG, f"{path.name}: {size} bytes exceeds the object limit")
        buf = alloc(size)[:size]
        try:
            with self._kvikio.CuFile(path, "r") as f:
                n = int(f.read(_host_array(buf)))
        except RuntimeError as exc:
            raise OSError(errno.EIO, f"kvikio read: {exc}") from exc
        return buf[:n]

    def read_range(self, path: Path, offset: int, out: memoryview) -> int:
        try:
            with self._kvikio.CuFile(path, "r") as f:
                return int(f.pread(_host_array(out), len(out), offset).get())
        except RuntimeError as exc:
            raise OSError(errno.EIO, f"kvikio read: {exc}") from exc

    # GPU buffers (objects with __cuda_array_interface__): the direct path.
    def write_device(self, final: Path, dev: Any, nbytes: int, durability: Durability) -> bool:
        def fill(fd: int, tmp: Path, _data: memoryview) -> None:
            try:
                with self._kvikio.CuFile(tmp, "r+") as f:
                    n = int(f.write(dev, nbytes))
            except RuntimeError as exc:
                raise OSError(errno.EIO, f"kvikio write: {exc}") from exc
            if n != nbytes:
                raise OSError(errno.EIO, f"kvikio wrote {n} of {nbytes} bytes")

        return fileio.write_atomic(final, _NOTHING, durability, fill=fill, size=nbytes)

    def read_device(self, path: Path, offset: int, dev: Any, nbytes: int) -> int:
        with self._kvikio.CuFile(path, "r") as f:
            return int(f.pread(dev, nbytes, offset).get())

    def describe(self) -> dict[str, Any]:
        version = getattr(self._kvikio, "__version__", "?")
        return {"backend": self.name, "kvikio": version, "detail": self.detail}

    def close(self) -> None:
        pass


# ------------------------------------------------------------------ cufile


def _device_pointer(dev: Any) -> int:
    cai = getattr(dev, "__cuda_array_interface__", None)
    if cai is None:
        raise TypeError("a GPU buffer must expose __cuda_array_interface__ (torch, cupy)")
    return int(cai["data"][0])


class CufileBackend:
    """cufile-python (cuFileRead/cuFileWrite) for GPU buffers; host buffers via posix."""

    name = "cufile"

    def __init__(self, host: PosixBackend, detail: str = "") -> None:
        import cufile

        self._cufile: Any = cufile
        self._host = host
        self.detail = detail

    def write_object(self, final: Path, data: memoryview, durability: Durability) -> bool:
        return self._host.write_object(final, data, durability)

    def read_object(self, path: Path, alloc: AllocFn, max_size: int) -> memoryview:
        return self._host.read_object(path, alloc, max_size)

    def read_range(self, path: Path, offset: int, out: memoryview) -> int:
        return self._host.read_range(path, offset, out)

    def write_device(self, final: Path, dev: Any, nbytes: int, durability: Durability) -> bool:
        import ctypes

        ptr = ctypes.c_void_p(_device_pointer(dev))

        def fill(fd: int, tmp: Path, _data: memoryview) -> None:
            with self._cufile.CuFile(str(tmp), "r+") as f:
                n = int(f.write(ptr, nbytes, file_offset=0, dev_offset=0))
            if n != nbytes:
                raise OSError(errno.EIO, f"cuFileWrite wrote {n} of {nbytes} bytes")

        return fileio.write_atomic(final, _NOTHING, durability, fill=fill, size=nbytes)

    def read_device(self, path: Path, offset: int, dev: Any, nbytes: int) -> int:
        import ctypes

        ptr = ctypes.c_void_p(_device_pointer(dev))
        with self._cufile.CuFile(str(path), "r") as f:
            n = int(f.read(ptr, nbytes, file_offset=offset, dev_offset=0))
        if n > nbytes:  # cuFileRead's -1 comes back as a huge size_t
            raise OSError(errno.EIO, f"cuFileRead failed ({n})")
        return n

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "host": self._host.describe(), "detail": self.detail}

    def close(self) -> None:
        pass


# --------------------------------------------------------------- selection


@dataclass
class IOPlan:
    """The decision, before anything is opened: which backend, where O_DIRECT, why."""

    requested: str
    backend: str  # posix | kvikio | cufile
    direct_write: bool  # posix O_DIRECT (also cufile's host I/O)
    direct_read: bool
    reason: str
    gpu: GpuReport
    direct_probe: DirectProbe | None = None
    error: str | None = None  # set when an explicit request cannot be met
    #: with direct_write: O_DIRECT only for fsync'd objects and objects of at least this size
    direct_write_min: int = 0
    #: without direct_read: O_DIRECT reads of objects of at least this size mostly
    #: not in the page cache (0: none)
    direct_read_min: int = 0

    def describe(self) -> str:
        if self.backend == "kvikio":
            return "kvikio"
        if self.direct_probe is not None and self.direct_probe.supported is None:
            return f"{self.backend} (O_DIRECT decided when the store opens)"
        how = {
            (True, True): "O_DIRECT writes and reads",
            (True, False): "O_DIRECT writes, page-cache reads",
            (False, False): "page-cache writes and reads",
            (False, True): "page-cache writes, O_DIRECT reads",
        }[(self.direct_write, self.direct_read)]
        if self.direct_write and self.direct_write_min:
            mib = self.direct_write_min >> 20
            how = how.replace(
                "O_DIRECT writes", f"O_DIRECT writes of fsync'd objects and objects >= {mib} MiB"
            )
        if not self.direct_read and self.direct_read_min:
            big = format_size(self.direct_read_min)
            how = how.replace(
                "page-cache reads", f"page-cache reads, O_DIRECT for uncached objects >= {big}"
            )
        return f"{self.backend} ({how})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "requested": self.requested,
            "backend": self.backend,
            "o_direct_write": self.direct_write,
            "o_direct_read": self.direct_read,
            "o_direct_write_min": self.direct_write_min,
            "o_direct_read_min": self.direct_read_min,
            "summary": self.describe(),
            "reason": self.reason,
            "error": self.error,
            "direct_probe": self.direct_probe.to_dict() if self.direct_probe else None,
            "gpu": self.gpu.to_dict(),
        }


#: Why ``posix`` (and ``auto`` falling back to it) writes with O_DIRECT but reads
#: through the page cache; measured with scripts/bench_store.py on ext4/virtio.
POSIX_SPLIT_WHY = (
    "O_DIRECT writes skip the page-cache copy and the dirty-page flush (1.5-2x faster "
    "with fsync, and for objects of 32 MiB without it), while the page cache absorbs "
    "bursts of small unsynced objects faster; page-cache reads serve hot objects from "
    "memory (about 2x O_DIRECT), and cold large objects come off the device 2-3x faster "
    "with O_DIRECT, without evicting hot ones"
)


def plan(
    mode: str | IOMode | None,
    objects_dir: Path,
    *,
    probe_env: ProbeEnv | None = None,
    direct_probe: Callable[[Path], DirectProbe] = probe_direct,
    gpu_report: GpuReport | None = None,
    direct_read_min: int | None = None,
) -> IOPlan:
    """Decide the backend for a store whose objects live in ``objects_dir``. Never raises
    for an unmet request: :attr:`IOPlan.error` says what is missing.

    ``gpu_report``: reuse the findings of an earlier :func:`~.gpu_probe.probe`
    instead of probing again (``kvoffload doctor`` plans twice).
    """
    req = requested_mode(mode)
    dp = direct_probe(objects_dir)
    ok = bool(dp.supported)
    if dp.supported:
        fs_why = f"O_DIRECT works in {dp.path}: {dp.detail}"
    elif dp.supported is False:
        fs_why = f"no O_DIRECT in {dp.path}: {dp.detail}"
    else:
        fs_why = f"O_DIRECT not probed: {dp.detail}"
    posix_why = f"{fs_why}; {POSIX_SPLIT_WHY}" if ok else fs_why
    if gpu_report is not None:
        gpu = redecide(gpu_report, req.value)
    else:
        env = probe_env or ProbeEnv()
        if env.probe_dir is None and objects_dir.is_dir():
            env = replace(env, probe_dir=objects_dir)  # kvikio's test I/O goes where objects go
        gpu = probe(env, requested=req.value)
    p = IOPlan(
        req.value,
        "posix",
        ok,
        False,
        "",
        gpu,
        dp,
        direct_write_min=DIRECT_WRITE_MIN,
        direct_read_min=(DIRECT_READ_MIN if direct_read_min is None else direct_read_min)
        if ok
        else 0,
    )
    if req is IOMode.POSIX_BUFFERED:
        p.direct_write, p.direct_read_min = False, 0
        p.reason = f"{ENV_VAR}=posix-buffered: page-cache I/O"
    elif req is IOMode.POSIX_DIRECT:
        p.direct_read, p.direct_write_min, p.direct_read_min = ok, 0, 0
        p.reason = f"{ENV_VAR}=posix-direct: {fs_why}"
        if not ok:
            p.error = f"O_DIRECT does not work in {dp.path}: {dp.detail}"
    elif req is IOMode.POSIX:
        p.reason = f"{ENV_VAR}=posix: {posix_why}"
    elif req is IOMode.KVIKIO:
        p.backend, p.direct_write, p.direct_read_min = "kvikio", False, 0
        p.reason = gpu.kvikio_reason
        if not gpu.kvikio_usable:
            p.error = gpu.kvikio_reason
    elif req is IOMode.CUFILE:
        p.backend, p.direct_read_min = "cufile", 0  # its host reads are whole-object preadv
        p.reason = f"{gpu.cufile_reason}; host buffers through posix: {posix_why}"
        if not gpu.cufile_usable:
            p.error = gpu.cufile_reason
    elif gpu.backend == "kvikio":
        p.backend, p.direct_write, p.direct_read_min = "kvikio", False, 0
        p.reason = f"auto: {gpu.reason}"
    else:
        p.reason = f"auto: posix, because {gpu.reason}; {posix_why}"
    return p


def open_backend(p: IOPlan) -> IOBackend:
    """Build the backend a plan names; :class:`IOBackendUnavailable` if it cannot be met."""
    if p.error is not None:
        raise IOBackendUnavailable(p.requested, p.error)
    posix = PosixBackend(
        direct_write=p.direct_write,
        direct_read=p.direct_read,
        direct_write_min=p.direct_write_min,
        direct_read_min=p.direct_read_min,
        detail=p.reason,
    )
    if p.backend == "kvikio":
        try:
            return KvikioBackend(p.reason)
        except ImportError as exc:
            raise IOBackendUnavailable(p.requested, f"kvikio does not import: {exc}") from exc
    if p.backend == "cufile":
        try:
            return CufileBackend(posix, p.reason)
        except (ImportError, OSError) as exc:
            raise IOBackendUnavailable(p.requested, f"cufile does not import: {exc}") from exc
    return posix


@dataclass
class IOSelection:
    backend: IOBackend
    plan: IOPlan

    @property
    def reason(self) -> str:
        return self.plan.reason


def select_backend(
    mode: str | IOMode | None,
    objects_dir: Path,
    *,
    probe_env: ProbeEnv | None = None,
    direct_read_min: int | None = None,
) -> IOSelection:
    """Plan, open and log the backend for the store whose objects live in ``objects_dir``.

    ``direct_read_min``: ``[store] direct_read_min`` (None: :data:`DIRECT_READ_MIN`)."""
    p = plan(mode, objects_dir, probe_env=probe_env, direct_read_min=direct_read_min)
    backend = open_backend(p)
    if isinstance(backend, PosixBackend):
        backend.map_reads = not backend.direct_read and local_fs(objects_dir)
    log.info(
        "I/O backend %s (requested %s): %s (`kvoffload doctor` says why)",
        p.backend,
        p.requested,
        short_reason(p.reason),
    )
    log.debug(
        "I/O backend %s: %s [decided in %.0f ms]", p.describe(), p.reason, p.gpu.elapsed_s * 1e3
    )
    return IOSelection(backend, p)


def short_reason(reason: str, limit: int = 80) -> str:
    """The first clause of a backend choice's reason, at most ``limit`` characters."""
    first = reason.split(";", 1)[0].strip()
    if len(first) <= limit:
        return first
    return first[: limit - 1].rsplit(" ", 1)[0] + "…"
