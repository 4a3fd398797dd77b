"""The facts of the machine a benchmark ran on, printed and kept in its JSON."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import numpy as np

from benchlib.method import cmd


def _proc_field(path: str, name: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k.strip() == name:
                    return v.strip()
    except OSError:
        return None
    return None


_CPU_FLAGS = ("aes", "vaes", "pclmulqdq", "vpclmulqdq", "avx2", "avx512f", "erms", "fsrm")


def machine_facts(d: Path) -> dict[str, str]:
    import cryptography
    from cryptography.hazmat.backends.openssl.backend import backend

    flags = (_proc_field("/proc/cpuinfo", "flags") or "").split()
    mem = _proc_field("/proc/meminfo", "MemTotal")
    return {
        "cores": f"{os.cpu_count()} (usable: {len(os.sched_getaffinity(0))})",
        "cpu": f"{_proc_field('/proc/cpuinfo', 'model name') or platform.processor() or '?'}"
        + " (flags: "
        + " ".join(f for f in _CPU_FLAGS if f in flags)
        + ")",
        "memory": f"{int(mem.split()[0]) / (1 << 20):.1f} GiB" if mem else "?",
        "kernel": platform.release(),
        "dir": str(d),
        "filesystem (stat -f -c %T)": cmd(["stat", "-f", "-c", "%T", str(d)]),
        "mount (findmnt)": cmd(["findmnt", "-no", "SOURCE,FSTYPE,OPTIONS", "--target", str(d)]),
        "python": sys.version.split()[0],
        "cryptography": cryptography.__version__,
        "openssl": backend.openssl_version_text(),
        "numpy": np.__version__,
    }


def git_state() -> str:
    """The commit of the checkout and the files that differ from it (the sidecar runs them)."""
    root = Path(__file__).resolve().parents[2]
    head = cmd(["git", "-C", str(root), "rev-parse", "--short", "HEAD"])
    dirty = cmd(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"])
    # "XY path" lines; _cmd strips the output, so the first line may have lost its X column
    files = [
        ln.split(maxsplit=1)[-1]
        for ln in dirty.splitlines()
        if ln.strip() and not ln.startswith("unknown")
    ]
    return f"git {head}" + (f" + uncommitted changes in {', '.join(files)}" if files else "")
