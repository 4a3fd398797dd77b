"""Child process of test_disk.py: one scenario on a store whose root and index
live where the test put them (small tmpfs mounts, or under strace's EIO
injection). Prints one JSON line: what held and what did not.

    python -m tests.faults.disk_child SCENARIO ROOT_DIR INDEX_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from kvoffload.errors import StoreError
from kvoffload.store import Store, StoreConfig

from .driver import NS, kek, key, layers


def cfg(root: Path, index: Path) -> StoreConfig:
    return StoreConfig(root=root / "store", index_dir=index / "index", durability="object")


def one_line(exc: BaseException) -> bool:
    return isinstance(exc, StoreError) and "\n" not in str(exc)


def fill_until_full(s: Store, tenant: str, first: int, out: dict[str, Any]) -> list[int]:
    stored = []
    for i in range(first, first + 4000):
        try:
            if s.put(
                tenant, NS, key(tenant, i), layers(tenant, 5) * 8, ttl_s=3600 if i % 2 else None
            ):
                stored.append(i)
        except Exception as exc:
            out["full_error"] = f"{type(exc).__name__}: {exc}"
            out["full_error_clean"] = one_line(exc)
            out["full_errno"] = getattr(exc, "errno", None)
            return stored
    out["never_full"] = True
    return stored


def expected(tenant: str) -> list[bytes]:
    return layers(tenant, 5) * 8


def reads_back(s: Store, tenant: str, idx: list[int]) -> list[int]:
    """The stored chunks that do not read back exactly."""
    return [i for i in idx if s.get(tenant, key(tenant, i)) != expected(tenant)]


def scenario(name: str, root: Path, index: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"scenario": name}
    if name in ("root-full", "index-full"):
        with Store(cfg(root, index), kek(root), create=True) as s:
            stored = fill_until_full(s, "aaa", 0, out)
            out["stored"] = len(stored)
            out["bad_reads"] = reads_back(s, "aaa", stored)  # after the disk filled
            out["bad_reads_again"] = reads_back(s, "aaa", stored)  # access times failing
            out["tmp_left"] = [p.name for p in (root / "store" / "objects").rglob(".tmp-*")]
            try:
                s.tenant_salt("newtenant")  # a key file (and audit line) on a full disk
                out["new_tenant"] = "created"
            except Exception as exc:
                out["new_tenant"] = (
                    "clean error" if one_line(exc) else f"{type(exc).__name__}: {exc}"
                )
            out["aaa_after_new_tenant"] = reads_back(s, "aaa", stored)
            for i in stored[:6]:
                s.delete("aaa", key("aaa", i))
            try:
                ok = s.put("aaa", NS, key("aaa", 9999), [b"after" * 100])
                out["put_after_freeing"] = bool(ok)
            except Exception as exc:
                out["put_after_freeing"] = f"{type(exc).__name__}: {exc}"
                out["put_after_freeing_clean"] = one_line(exc)
        with Store(cfg(root, index), kek(root)) as s:
            out["bad_after_restart"] = reads_back(s, "aaa", stored[6:])
            out["fsck_clean"] = s.fsck().clean
    elif name == "prefill":
        with Store(cfg(root, index), kek(root), create=True) as s:
            for i in range(6):
                s.put("aaa", NS, key("aaa", i), expected("aaa"))
    elif name == "read-eio":
        with Store(cfg(root, index), kek(root)) as s:
            got = []
            for i in range(6):
                try:
                    got.append(s.get("aaa", key("aaa", i)))
                except Exception as exc:
                    out.setdefault("read_errors", []).append(f"{type(exc).__name__}: {exc}")
            out["wrong"] = sum(1 for g in got if g is not None and g != expected("aaa"))
            out["served"] = sum(1 for g in got if g is not None)
    elif name == "write-eio":
        with Store(cfg(root, index), kek(root)) as s:
            try:
                s.put("aaa", NS, key("aaa", 100), expected("aaa"))
                out["put"] = "stored"
            except Exception as exc:
                out["put"] = "clean error" if one_line(exc) else f"{type(exc).__name__}: {exc}"
            out["tmp_left"] = [p.name for p in (root / "store" / "objects").rglob(".tmp-*")]
            out["bad_reads"] = reads_back(s, "aaa", list(range(6)))
    elif name == "verify":
        with Store(cfg(root, index), kek(root)) as s:
            out["bad_reads"] = reads_back(s, "aaa", list(range(6)))
            out["fsck_clean"] = s.fsck().clean
    else:
        raise SystemExit(f"unknown scenario {name}")
    return out


if __name__ == "__main__":
    print(json.dumps(scenario(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))))
