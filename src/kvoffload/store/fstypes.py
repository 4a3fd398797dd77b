"""What a filesystem type says about sharing a store root (``kvoffload doctor``).

``statfs`` names the type (``stat -f -c %T``; FUSE filesystems report
``fuseblk``/``fuse`` and their name in ``/proc/mounts``, e.g. ``fuse.juicefs``).
A network or cluster filesystem is what several nodes share a root on; it is
also where the index must never live (LMDB needs a local filesystem).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["FsKind", "classify", "index_dir_kind", "juicefs_settings"]

#: type → (family, what it implies for a shared root)
_NETWORK: dict[str, tuple[str, str]] = {
    "nfs": (
        "NFS",
        "mount with lookupcache=positive (or none) and actimeo=1: by default "
        "'no such file' is cached for up to a minute, hiding other nodes' new objects",
    ),
    "nfs4": (
        "NFS",
        "mount with lookupcache=positive (or none) and actimeo=1: by default "
        "'no such file' is cached for up to a minute, hiding other nodes' new objects",
    ),
    "lustre": ("Lustre", "mount with flock (tenant creation serializes with flock)"),
    "gpfs": ("GPFS / Storage Scale", "coherent across nodes; defaults are fine"),
    "ceph": ("CephFS", "coherent across clients; ESTALE is handled as a miss"),
    "wekafs": ("WekaFS", "coherent across clients"),
    "beegfs": ("BeeGFS", "enable tuneUseGlobalFileLocks for flock across nodes"),
    "glusterfs": ("GlusterFS", "attribute caching delays other nodes' journal records"),
    "cifs": ("SMB/CIFS", "not recommended: weak rename and link semantics"),
    "smb2": ("SMB", "not recommended: weak rename and link semantics"),
    "smb3": ("SMB", "not recommended: weak rename and link semantics"),
    "fuse.juicefs": (
        "JuiceFS",
        "--attr-cache/--entry-cache (1 s by default) bound how "
        "soon other nodes' journal records are seen",
    ),
}


@dataclass(frozen=True)
class FsKind:
    fs_type: str
    #: True: a network/cluster filesystem; False: local; None: FUSE of unknown kind.
    network: bool | None
    family: str
    advice: str


def classify(fs_type: str | None, mount_source_type: str | None = None) -> FsKind:
    """Classify ``fs_type`` (statfs), refined by the type in /proc/mounts for FUSE."""
    t = (fs_type or "").lower()
    m = (mount_source_type or "").lower()
    for key in (m, t):
        if key in _NETWORK:
            fam, advice = _NETWORK[key]
            return FsKind(key, True, fam, advice)
    if t.startswith("fuse") or m.startswith("fuse"):
        return FsKind(
            m or t, None, "FUSE",
            "a FUSE filesystem: shared if its backend is (no inotify across clients; "
            "followers poll the journal directories)",
        )  # fmt: skip
    if not t:
        return FsKind("", None, "unknown", "the filesystem type could not be read")
    return FsKind(t, False, t, "a local filesystem: one node's store")


def index_dir_kind(index_dir: Path, mounts_file: Path = Path("/proc/self/mounts")) -> FsKind:
    """What holds ``index_dir`` (its nearest existing ancestor), from the mount
    table: ``network`` True means LMDB would live on a network or cluster
    filesystem, where it must not (locks and mmap are not coherent across
    clients; a second node's open is refused as "in use"). ``kvoffload serve``
    refuses such an index; ``doctor`` warns."""
    from .iobackend import mount_of

    m = mount_of(index_dir, mounts_file)
    return classify(m.fs_type if m else None, m.fs_type if m else None)


def juicefs_settings(mount_point: Path, timeout_s: float = 2.0) -> dict[str, Any]:
    """What a JuiceFS mount says of itself in its virtual ``.config`` file (JSON,
    readable by root only): the volume's trash days and the client's cache
    times. ``{"error": why}`` where it cannot be read within ``timeout_s`` (a
    hung mount never hangs the caller: the read runs in a daemon thread)."""
    box: dict[str, Any] = {}

    def read() -> None:
        try:
            with open(Path(mount_point) / ".config", "rb") as f:
                box["data"] = f.read(1 << 20)
        except OSError as exc:
            box["error"] = exc.strerror or str(exc)

    t = threading.Thread(target=read, name="juicefs-config", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        return {"error": f"no answer from {mount_point}/.config in {timeout_s:g} s"}
    if "error" in box:
        return {"error": f"cannot read {mount_point}/.config: {box['error']}"}
    try:
        doc = json.loads(box["data"])
        fmt = doc["Format"]
        out: dict[str, Any] = {"volume": fmt.get("Name"), "trash_days": int(fmt["TrashDays"])}
    except (ValueError, KeyError, TypeError) as exc:
        return {"error": f"{mount_point}/.config does not say the trash days ({exc})"}
    for key, name in (
        ("AttrTimeout", "attr_cache_s"),
        ("EntryTimeout", "entry_cache_s"),
        ("DirEntryTimeout", "dir_entry_cache_s"),
    ):
        if isinstance(doc.get(key), int):
            out[name] = doc[key] / 1e9  # nanoseconds
    return out
