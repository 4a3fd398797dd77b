"""Find out, safely and quickly, whether kvikio or cuFile can do I/O on this node.

Three traps decide the order of the checks:

- without the CUDA driver (``libcuda.so.1``) kvikio cannot do any I/O, not
  even in its POSIX compatibility mode;
- libcufile 1.20 spins forever in ``cuFileDriverOpen`` on a node without a
  GPU;
- cufile-python loads an unversioned ``libcufile.so`` that the NVIDIA wheels
  do not ship, so importing it can fail (or find a different libcufile).

So the probe first looks for the driver by ``dlopen("libcuda.so.1")`` (safe:
loading the driver library initialises nothing), the device nodes, the
kernel driver's ``/proc`` files and nvidia-fs. When the driver is absent the
answer is ``posix`` at once — no subprocess, no import of kvikio or cufile,
a few milliseconds. Only when the driver is present and kvikio or
cufile-python is installed does anything touch CUDA or cuFile, and then in a
child process (``python -m kvoffload.gpu_probe --child``) with a
timeout: a hang costs the timeout, never the sidecar (nor the worker).

:func:`probe` returns a :class:`GpuReport` with every finding, the backend
chosen among ``kvikio``, ``cufile`` and ``posix`` for the requested mode, and
why. The POSIX half of the decision (O_DIRECT or buffered, per file system)
is :mod:`kvoffload.store.iobackend`'s.

Standard library only, and nothing from the sidecar: the worker's direct path
(:func:`kvoffload.client.direct.select`) runs it too.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

#: Seconds a probe child may take before it is killed (override: KVOFFLOAD_GPU_PROBE_TIMEOUT).
DEFAULT_PROBE_TIMEOUT_S = 20.0
LIBCUDA = "libcuda.so.1"
KVIKIO_DISTS = ("kvikio-cu13", "kvikio-cu12", "kvikio-cu11", "kvikio")
CUFILE_PY_DISTS = ("cufile-python",)
LIBCUFILE_DISTS = ("nvidia-cufile-cu13", "nvidia-cufile-cu12", "nvidia-cufile")


def _dist_version(names: Sequence[str]) -> str | None:
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{name} {importlib.metadata.version(name)}"
    return None


def _default_dist_version(module: str) -> str | None:
    if module == "kvikio":
        return _dist_version(KVIKIO_DISTS)
    if module == "cufile":
        return _dist_version(CUFILE_PY_DISTS)
    if module == "libcufile":
        return _dist_version(LIBCUFILE_DISTS)
    return None


def _default_library_dirs() -> list[Path]:
    dirs = [Path(p) for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    dirs += [
        Path("/usr/local/cuda/lib64"),
        Path("/usr/local/cuda/targets/x86_64-linux/lib"),
        Path("/usr/local/cuda/targets/sbsa-linux/lib"),
        Path("/usr/lib/x86_64-linux-gnu"),
        Path("/usr/lib/aarch64-linux-gnu"),
        Path("/usr/lib64"),
        Path("/usr/lib"),
    ]
    # The NVIDIA wheels (nvidia-cufile-cu12, ...) put libcufile.so.0 here.
    for p in sys.path:
        dirs.append(Path(p) / "nvidia" / "cufile" / "lib")
        dirs.append(Path(p) / "nvidia" / "cu13" / "lib")
    return dirs


@dataclass
class ProbeEnv:
    """Everything the probe looks at, replaceable so tests can simulate other nodes.

    ``sysroot`` prefixes ``/dev`` and ``/proc``; ``load_library`` is
    ``ctypes.CDLL``; ``find_spec`` tells whether a module is installed without
    importing it; ``child_argv`` replaces the probe child's command line.
    """

    sysroot: Path = Path("/")
    load_library: Callable[[str], Any] = ctypes.CDLL
    find_spec: Callable[[str], object | None] = importlib.util.find_spec
    dist_version: Callable[[str], str | None] = _default_dist_version
    library_dirs: Callable[[], Sequence[Path]] = _default_library_dirs
    child_argv: Sequence[str] | None = None
    timeout_s: float | None = None
    probe_dir: Path | None = None  # where the child tries a small kvikio write/read


@dataclass
class ChildProbe:
    """What the probe child reported (or why it did not)."""

    argv: list[str]
    started: bool = False
    pid: int | None = None
    elapsed_s: float = 0.0
    timed_out: bool = False
    returncode: int | None = None
    result: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class GpuReport:
    """Every finding of :func:`probe`, the backend chosen and the reason."""

    requested: str = "auto"
    libcuda: str | None = None  # what was loaded, None if it could not be
    libcuda_error: str | None = None
    cuda_driver_version: str | None = None  # cuDriverGetVersion, e.g. "12.4"
    cuda_devices: int | None = None  # cuDeviceGetCount, from the probe child only
    nvidia_devices: list[str] = field(default_factory=list)
    nvidia_driver: str | None = None  # first line of /proc/driver/nvidia/version
    nvidia_fs: str | None = None  # /proc/driver/nvidia-fs/version (GDS kernel module)
    libcufile: str | None = None  # path of a libcufile found on disk (never loaded here)
    libcufile_version: str | None = None
    kvikio: str | None = None  # installed distribution and version
    cufile_python: str | None = None
    child: ChildProbe | None = None  # None: no subprocess was started
    kvikio_usable: bool = False
    kvikio_reason: str = ""
    cufile_usable: bool = False
    cufile_reason: str = ""
    gds_available: bool | None = None  # GPUDirect Storage (not just compat mode)
    backend: str = "posix"  # kvikio | cufile | posix
    reason: str = ""
    elapsed_s: float = 0.0

    @property
    def driver_present(self) -> bool:
        return self.libcuda is not None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["driver_present"] = self.driver_present
        return d


# ----------------------------------------------------------------- findings


def _read_first_line(path: Path) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline().strip() or None
    except OSError:
        return None


def _nvidia_fs(root: Path) -> str | None:
    d = root / "proc/driver/nvidia-fs"
    if not d.is_dir():
        return None
    version = _read_first_line(d / "version")
    return version or "loaded (no version file)"


def _devices(root: Path) -> list[str]:
    dev = root / "dev"
    try:
        names = sorted(p.name for p in dev.iterdir() if p.name.startswith("nvidia"))
    except OSError:
        return []
    return [f"/dev/{n}" for n in names]


def _libcufile(env: ProbeEnv) -> tuple[str | None, str | None]:
    """(path, version) of a libcufile on disk, found by name only (never dlopen'd here)."""
    for d in env.library_dirs():
        try:
            cands = sorted(d.glob("libcufile.so*"), key=lambda p: (-len(p.name), p.name))
        except OSError:
            continue
        for p in cands:
            if p.name.startswith("libcufile.so"):
                # libcufile.so.1.13.1 → "1.13.1"; the wheels ship libcufile.so.0 only.
                suffix = p.name[len("libcufile.so") :].lstrip(".")
                version = suffix if suffix.count(".") >= 1 else None
                return str(p), version or env.dist_version("libcufile")
    return None, env.dist_version("libcufile")


def _load_libcuda(env: ProbeEnv, rep: GpuReport) -> None:
    try:
        lib = env.load_library(LIBCUDA)
    except OSError as exc:
        missing = "cannot open shared object file" in str(exc)
        rep.libcuda_error = f"{LIBCUDA} not found" if missing else f"{LIBCUDA} not loadable: {exc}"
        return
    rep.libcuda = LIBCUDA
    # cuDriverGetVersion needs no cuInit and touches no device.
    with contextlib.suppress(AttributeError, TypeError, ValueError, OSError):
        v = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0 and v.value:
            rep.cuda_driver_version = f"{v.value // 1000}.{v.value % 1000 // 10}"


def cuda_driver_present(env: ProbeEnv | None = None) -> bool:
    """Whether ``libcuda.so.1`` loads here: the check that gates every CUDA-only path
    of the worker (pinned staging). ``dlopen`` only: nothing is initialised."""
    rep = GpuReport()
    _load_libcuda(env or ProbeEnv(), rep)
    return rep.driver_present


# -------------------------------------------------------------------- child


def run_child(argv: Sequence[str], timeout_s: float) -> ChildProbe:
    """Run a probe child in its own process group; kill the group on timeout.

    The child's stdout must be one JSON object. Never raises, never waits
    longer than ``timeout_s`` (plus the kill).
    """
    cp = ChildProbe(argv=list(argv))
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: a timeout kills grandchildren too
        )
    except OSError as exc:
        cp.error = f"could not start the probe child: {exc}"
        return cp
    cp.started = True
    cp.pid = proc.pid
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.kill()
        proc.communicate()
        cp.timed_out = True
        cp.elapsed_s = time.monotonic() - t0
        cp.returncode = proc.returncode
        cp.error = (
            f"the GPU probe child did not finish within {timeout_s:g} s and was killed "
            "(a cuFile driver that hangs on open, e.g. libcufile 1.20 without a usable GPU?)"
        )
        return cp
    cp.elapsed_s = time.monotonic() - t0
    cp.returncode = proc.returncode
    text = out.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text.splitlines()[-1]) if text else None
    except ValueError:
        data = None
    if not isinstance(data, dict):
        tail = err.decode("utf-8", "replace").strip().splitlines()[-3:]
        cp.error = f"the GPU probe child exited {proc.returncode} without a report: " + (
            " | ".join(tail) or "no output"
        )
        return cp
    cp.result = data
    return cp


def _child_timeout(env: ProbeEnv) -> float:
    if env.timeout_s is not None:
        return env.timeout_s
    raw = os.environ.get("KVOFFLOAD_GPU_PROBE_TIMEOUT")
    try:
        return float(raw) if raw else DEFAULT_PROBE_TIMEOUT_S
    except ValueError:
        return DEFAULT_PROBE_TIMEOUT_S


def _child_argv(env: ProbeEnv, rep: GpuReport, kvikio: bool, cufile: bool) -> list[str]:
    if env.child_argv is not None:
        return list(env.child_argv)
    argv = [sys.executable, "-m", "kvoffload.gpu_probe", "--child"]
    if kvikio:
        argv.append("--kvikio")
    if cufile and rep.libcufile is not None:
        argv += ["--cufile", rep.libcufile]
    if rep.nvidia_fs is not None:
        argv.append("--gds")
    if env.probe_dir is not None:
        argv += ["--dir", str(env.probe_dir)]
    return argv


# ------------------------------------------------------------------- decide


def probe(env: ProbeEnv | None = None, *, requested: str = "auto") -> GpuReport:
    """Look, decide, explain. Fast and subprocess-free when the driver is absent.

    ``requested`` is the I/O mode asked for (``auto``, ``kvikio``, ``cufile``,
    or a posix mode, for which nothing GPU-related is probed at all).
    """
    env = env or ProbeEnv()
    t0 = time.perf_counter()
    rep = GpuReport(requested=requested)
    root = env.sysroot
    rep.nvidia_devices = _devices(root)
    rep.nvidia_driver = _read_first_line(root / "proc/driver/nvidia/version")
    rep.nvidia_fs = _nvidia_fs(root)
    rep.libcufile, rep.libcufile_version = _libcufile(env)
    # find_spec locates a module without importing it (importing may load libcufile).
    if env.find_spec("kvikio") is not None:
        rep.kvikio = env.dist_version("kvikio") or "installed (version unknown)"
    if env.find_spec("cufile") is not None:
        rep.cufile_python = env.dist_version("cufile") or "installed (version unknown)"

    if requested.startswith("posix"):
        rep.kvikio_reason = rep.cufile_reason = f"not probed: KVOFFLOAD_IO={requested}"
        rep.backend, rep.reason = "posix", f"KVOFFLOAD_IO={requested} asks for POSIX I/O"
        rep.elapsed_s = time.perf_counter() - t0
        return rep

    _load_libcuda(env, rep)
    if not rep.driver_present:
        why = (
            f"{rep.libcuda_error}: without the CUDA driver kvikio cannot do I/O "
            "(not even in compat mode) and cuFile cannot open"
        )
        rep.kvikio_reason = rep.cufile_reason = why
    else:
        if rep.kvikio is None:
            rep.kvikio_reason = "kvikio is not installed (pip install 'kvoffload[gds]')"
        if rep.cufile_python is None:
            rep.cufile_reason = "cufile-python is not installed (pip install 'kvoffload[gds]')"
        elif rep.libcufile is None:
            rep.cufile_reason = (
                "no libcufile found (cufile-python loads an unversioned libcufile.so that "
                "the NVIDIA wheels do not ship; install the CUDA toolkit's libcufile)"
            )
        want_kvikio = rep.kvikio is not None
        want_cufile = rep.cufile_python is not None and rep.libcufile is not None
        if want_kvikio or want_cufile:
            rep.child = run_child(
                _child_argv(env, rep, want_kvikio, want_cufile), _child_timeout(env)
            )
            _apply_child(rep, want_kvikio, want_cufile)
    _decide(rep)
    rep.elapsed_s = time.perf_counter() - t0
    return rep


def _apply_child(rep: GpuReport, want_kvikio: bool, want_cufile: bool) -> None:
    cp = rep.child
    assert cp is not None
    if cp.error is not None:
        if want_kvikio:
            rep.kvikio_reason = cp.error
        if want_cufile:
            rep.cufile_reason = cp.error
        return
    r = cp.result
    if isinstance(r.get("cuda_devices"), int):
        rep.cuda_devices = r["cuda_devices"]
    if isinstance(r.get("libcufile_version"), str):
        rep.libcufile_version = r["libcufile_version"]
    if isinstance(r.get("gds_available"), bool):
        rep.gds_available = r["gds_available"]
    if want_kvikio:
        if r.get("kvikio_ok") is True:
            rep.kvikio_usable = True
            how = "GDS" if rep.gds_available else "compat mode (POSIX in kvikio's thread pool)"
            version = r.get("kvikio_version", "?")
            rep.kvikio_reason = f"kvikio {version} did a test write/read in {how}"
        else:
            rep.kvikio_reason = str(r.get("kvikio_error") or "the kvikio probe failed")
    if want_cufile:
        if r.get("cufile_ok") is True:
            rep.cufile_usable = True
            rep.cufile_reason = "the cuFile driver opened in the probe child"
        else:
            rep.cufile_reason = str(r.get("cufile_error") or "the cuFile probe failed")


def redecide(rep: GpuReport, requested: str) -> GpuReport:
    """The same findings, decided for another requested mode (no probing)."""
    out = replace(rep, requested=requested)
    if requested.startswith("posix"):
        out.backend, out.reason = "posix", f"KVOFFLOAD_IO={requested} asks for POSIX I/O"
    else:
        _decide(out)
    return out


def _decide(rep: GpuReport) -> None:
    req = rep.requested
    if req == "kvikio":
        rep.backend = "kvikio" if rep.kvikio_usable else "none"
        rep.reason = rep.kvikio_reason
    elif req == "cufile":
        rep.backend = "cufile" if rep.cufile_usable else "none"
        rep.reason = rep.cufile_reason
    elif rep.kvikio_usable:
        rep.backend = "kvikio"
        rep.reason = (
            f"{rep.kvikio_reason}; kvikio splits each object into parallel reads/writes, "
            "which POSIX single-stream I/O does not"
        )
    else:
        rep.backend = "posix"
        rep.reason = f"kvikio unusable: {rep.kvikio_reason}"


# -------------------------------------------------------------------- child


def _child_main(args: argparse.Namespace) -> dict[str, Any]:
    """Runs in the probe subprocess: may hang (that is why it is a subprocess)."""
    res: dict[str, Any] = {}
    try:
        cuda = ctypes.CDLL(LIBCUDA)
        rc = cuda.cuInit(0)
        n = ctypes.c_int(0)
        if rc == 0 and cuda.cuDeviceGetCount(ctypes.byref(n)) == 0:
            res["cuda_devices"] = n.value
        else:
            res["cuda_devices"] = 0
            res["cuinit_error"] = int(rc)
    except OSError as exc:
        res["cuda_devices"] = 0
        res["cuinit_error"] = str(exc)
    if args.kvikio:
        try:
            import kvikio

            res["kvikio_version"] = str(getattr(kvikio, "__version__", "?"))
            d = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
            # A temp-file name of layout v1: if we are killed, the collector removes it.
            path = d / f".tmp-{os.urandom(8).hex()}-{os.getpid()}"
            try:
                data = bytearray(os.urandom(1 << 16))
                with kvikio.CuFile(path, "w") as f:
                    n_w = f.write(data)
                back = bytearray(len(data))
                with kvikio.CuFile(path, "r") as f:
                    n_r = f.read(back)
            finally:
                with contextlib.suppress(OSError):
                    path.unlink()
            if n_w != len(data) or n_r != len(data) or back != data:
                raise RuntimeError("kvikio test write/read returned different bytes")
            res["kvikio_ok"] = True
            with contextlib.suppress(Exception):
                res["gds_available"] = bool(
                    args.gds and not kvikio.defaults.is_compat_mode_preferred()
                )
        except Exception as exc:  # anything kvikio raises is a reason, not a crash
            res["kvikio_ok"] = False
            res["kvikio_error"] = f"kvikio unusable: {type(exc).__name__}: {exc}"
    if args.cufile:
        try:
            lib = ctypes.CDLL(args.cufile)
            with contextlib.suppress(AttributeError):
                v = ctypes.c_int(0)
                if lib.cuFileGetVersion(ctypes.byref(v)) == 0 and v.value:
                    res["libcufile_version"] = (
                        f"{v.value // 1000}.{v.value % 1000 // 10}.{v.value % 10}"
                    )
            import cufile  # noqa: F401  (cufile-python: loads libcufile.so)

            class _Err(ctypes.Structure):
                _fields_ = [("err", ctypes.c_int), ("cu_err", ctypes.c_int)]

            lib.cuFileDriverOpen.restype = _Err
            e = lib.cuFileDriverOpen()  # the call that spins on libcufile 1.20 without a GPU
            if e.err != 0:
                raise RuntimeError(f"cuFileDriverOpen failed: err={e.err} cu_err={e.cu_err}")
            res["cufile_ok"] = True
            if args.gds:
                res.setdefault("gds_available", True)
        except Exception as exc:
            res["cufile_ok"] = False
            res["cufile_error"] = f"cufile unusable: {type(exc).__name__}: {exc}"
    return res


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="kvoffload GPU I/O probe")
    p.add_argument("--child", action="store_true", help="run the (possibly hanging) probe")
    p.add_argument("--kvikio", action="store_true")
    p.add_argument("--cufile", default=None, metavar="LIBCUFILE", help="path of libcufile")
    p.add_argument("--gds", action="store_true")
    p.add_argument("--dir", default=None)
    args = p.parse_args(argv)
    if args.child:
        sys.stdout.write(json.dumps(_child_main(args)) + "\n")
    else:
        sys.stdout.write(json.dumps(probe().to_dict(), indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
