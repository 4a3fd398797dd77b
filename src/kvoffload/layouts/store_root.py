"""The store root: ``layout.json`` and the migration interface."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..posix import NO_DIRSYNC_ERRNOS, atomic_create, fsync_dir
from .errors import LayoutError, UnknownLayoutVersion

__all__ = [
    "LAYOUT_FILE",
    "MAX_LAYOUT_VERSION",
    "MIN_LAYOUT_VERSION",
    "NO_DIRSYNC_ERRNOS",
    "SUPPORTED_LAYOUT_VERSIONS",
    "LayoutInfo",
    "Migration",
    "create_root",
    "fsync_dir",
    "migrations",
    "read_layout",
]

LAYOUT_FILE = "layout.json"
MIN_LAYOUT_VERSION = 1
MAX_LAYOUT_VERSION = 1
SUPPORTED_LAYOUT_VERSIONS = tuple(range(MIN_LAYOUT_VERSION, MAX_LAYOUT_VERSION + 1))


@dataclass(frozen=True)
class LayoutInfo:
    version: int
    store_id: str
    created: str
    params: dict[str, Any]


def create_root(root: Path, version: int = MAX_LAYOUT_VERSION) -> LayoutInfo:
    """Create a store root (idempotent: an existing valid root is returned as is)."""
    if version not in SUPPORTED_LAYOUT_VERSIONS:
        raise UnknownLayoutVersion(version)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    if (root / LAYOUT_FILE).exists():
        return read_layout(root)
    from . import v1

    info = {
        "layout_version": version,
        "store_id": str(uuid.uuid4()),
        "created": datetime.now(UTC).isoformat(),
        "params": v1.default_params(),
    }
    for sub in ("keys", "objects", "journal"):
        (root / sub).mkdir(exist_ok=True)
    data = (json.dumps(info, indent=2, sort_keys=True) + "\n").encode("utf-8")
    try:
        # Linked, never replaced: if another creator won the race, theirs stands.
        atomic_create(
            root / LAYOUT_FILE,
            data,
            mode=0o666,  # as open(): the umask decides
            tmp_name=f".{LAYOUT_FILE}.{uuid.uuid4().hex}.tmp",
        )
    except FileExistsError:
        fsync_dir(root)
    return read_layout(root)


def read_layout(root: Path) -> LayoutInfo:
    path = Path(root) / LAYOUT_FILE
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise LayoutError(f"{root} is not a kvoffload store: {LAYOUT_FILE} is missing") from exc
    except (OSError, ValueError) as exc:
        raise LayoutError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise LayoutError(f"{path}: not a JSON object")
    version = raw.get("layout_version")
    if not isinstance(version, int) or version not in SUPPORTED_LAYOUT_VERSIONS:
        raise UnknownLayoutVersion(version, str(path))
    try:
        return LayoutInfo(
            version=version,
            store_id=str(raw["store_id"]),
            created=str(raw["created"]),
            params=dict(raw.get("params", {})),
        )
    except KeyError as exc:
        raise LayoutError(f"{path}: field {exc.args[0]!r} is missing") from exc


@dataclass(frozen=True)
class Migration:
    """Upgrade a store root from ``from_version`` to ``from_version + 1`` in place.

    ``apply(root)`` must be restartable: killed half-way, running it again
    finishes the job. v1 is the first version, so the registry is empty.
    """

    from_version: int
    description: str
    apply: Callable[[Path], None]


def migrations() -> list[Migration]:
    return []
