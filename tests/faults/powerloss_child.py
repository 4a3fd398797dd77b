"""Child of the power-loss family, run in a private user+mount namespace:
mounts :mod:`powerfs` at MNT, serves it from a forked process, saves chunks to
a store rooted there (index outside it), lets the power go at the n-th
mutating request, then opens the store on what survived as a restarted
sidecar would. Prints one JSON line.

    python -m tests.faults.powerloss_child MNT OUT INDEX DURABILITY N
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from . import driver, powerfs


def main(mnt: Path, out: Path, index: Path, durability: str, n: int) -> dict[str, Any]:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open("/dev/fuse", os.O_RDWR)
    opts = f"fd={fd},rootmode=40000,user_id=0,group_id=0".encode()
    if libc.mount(b"powerfs", str(mnt).encode(), b"fuse.powerfs", 0, opts) != 0:
        raise SystemExit(77)
    pid = os.fork()
    if pid == 0:  # the file system
        try:
            powerfs.serve(fd, n, out)
        finally:
            os._exit(0)
    os.close(fd)
    res: dict[str, Any] = {"acked": [], "cut": False}
    cfg = driver.config(mnt, durability)
    cfg.index_dir = index
    try:
        with driver.Store(cfg, driver.kek(mnt), create=True) as s:
            for i in range(6):
                for t, enc in (("aaa", True), ("ppp", False)):
                    if s.put(t, driver.NS, driver.key(t, i), driver.layers(t, i), encrypt=enc):
                        res["acked"].append(f"{t}/{i}")
    except Exception as exc:
        res["cut"] = True
        res["writer_error"] = f"{type(exc).__name__}: {exc}"[:300]
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGUSR1)  # the power goes now if it has not already
    libc.umount2(str(mnt).encode(), 2)  # MNT_DETACH
    os.waitpid(pid, 0)
    # The restart, on what a power loss left.
    cfg2 = driver.config(out)
    cfg2.index_dir = index
    try:
        with driver.Store(cfg2, driver.kek(mnt), create=True) as s:
            res["opened"] = True
            wrong, lost = [], []
            for t in ("aaa", "ppp"):
                for i in range(6):
                    got = s.get(t, driver.key(t, i))
                    if got is not None and got != driver.layers(t, i):
                        wrong.append(f"{t}/{i}")
                    if got is None and f"{t}/{i}" in res["acked"]:
                        lost.append(f"{t}/{i}")
            res["wrong"], res["lost"] = wrong, lost
            res["fsck_clean"] = s.fsck(repair=True).repaired and s.fsck().clean
    except Exception as exc:
        res["opened"] = False
        res["error"] = f"{type(exc).__name__}: {exc}"[:500]
    return res


if __name__ == "__main__":
    a = sys.argv
    print(json.dumps(main(Path(a[1]), Path(a[2]), Path(a[3]), a[4], int(a[5]))))
