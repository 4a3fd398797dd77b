"""The store root: ``layout.json`` and the migration interface."""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..errors import LayoutError, UnknownLayoutVersion
from ..posix import NO_DIRSYNC_ERRNOS, atomic_create, fsync_dir

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
    "record_kek_id",
]

LAYOUT_FILE = "layout.json"
MIN_LAYOUT_VERSION = 1
MAX_LAYOUT_VERSION = 1
SUPPORTED_LAYOUT_VERSIONS = tuple(range(MIN_LAYOUT_VERSION, MAX_LAYOUT_VERSION + 1))
#: What :class:`UnknownLayoutVersion` reports as readable.
SUPPORTED_RANGE = (MIN_LAYOUT_VERSION, MAX_LAYOUT_VERSION)


#: Modes the sidecar sets on the store root's directories, whatever the umask
#: (layout-v1.md §2): nothing below keys/ or objects/ is listable by other uids.
#: objects/ may be traversed (0711): a direct-path tenant's group reaches its own
#: directory (mode 2770) through it without seeing the other tenants' names.
ROOT_DIR_MODES = {"keys": 0o700, "objects": 0o711, "journal": 0o700}

_KEK_ID_RE = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class LayoutInfo:
    version: int
    store_id: str
    created: str
    params: dict[str, Any]
    #: The KEK id (keys-v1.md §4) of the store's KEK; None in a root created
    #: before it was recorded (the first open records it).
    kek_id: str | None = None
    #: During a KEK rotation: the id of the KEK being replaced, still accepted.
    kek_id_previous: str | None = None
    #: ``params.fanout`` (layout-v1.md §2): where objects live below objects/<tenant>/.
    fanout: tuple[int, ...] = (2, 2)


def create_root(
    root: Path, version: int = MAX_LAYOUT_VERSION, *, kek_id: str | None = None
) -> LayoutInfo:
    """Create a store root (idempotent: an existing valid root is returned as is)."""
    if version not in SUPPORTED_LAYOUT_VERSIONS:
        raise UnknownLayoutVersion(version, SUPPORTED_RANGE)
    root = Path(root)
    made = [p for p in (root, *root.parents) if not p.exists()]
    root.mkdir(parents=True, exist_ok=True)
    for d in reversed(made):  # a power loss must not take the new root's name
        fsync_dir(d.parent)
    for sub, mode in ROOT_DIR_MODES.items():
        (root / sub).mkdir(mode=mode, exist_ok=True)
    if (root / LAYOUT_FILE).exists():
        return read_layout(root)
    from . import v1

    info: dict[str, Any] = {
        "layout_version": version,
        "store_id": str(uuid.uuid4()),
        "created": datetime.now(UTC).isoformat(),
        "params": v1.default_params(),
    }
    if kek_id is not None:
        info["kek_id"] = _checked_kek_id(kek_id)
    data = _encode(info)
    try:
        # Linked, never replaced: if another creator won the race, theirs stands.
        atomic_create(
            root / LAYOUT_FILE,
            data,
            mode=0o644,
            tmp_name=f".{LAYOUT_FILE}.{uuid.uuid4().hex}.tmp",
        )
    except FileExistsError:
        fsync_dir(root)
    return read_layout(root)


def _checksum(fields: dict[str, Any]) -> str:
    """§2: the first 16 hex digits of SHA-256 over the canonical JSON of every
    other field (sorted keys, no whitespace)."""
    body = {k: v for k, v in fields.items() if k != "checksum"}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()[:16]


def _encode(fields: dict[str, Any]) -> bytes:
    fields = {**fields, "checksum": _checksum(fields)}
    return (json.dumps(fields, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _checked_kek_id(kek_id: str) -> str:
    if not _KEK_ID_RE.fullmatch(kek_id):
        raise ValueError(f"a KEK id is 16 lower-case hex digits, not {kek_id!r}")
    return kek_id


def record_kek_id(root: Path, kek_id: str, previous: str | None = None) -> LayoutInfo:
    """Record the store's KEK id in ``layout.json`` (and, during a rotation, the id
    still accepted); replaced atomically (temp, fsync, rename, fsync dir)."""
    path = Path(root) / LAYOUT_FILE
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LayoutError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise LayoutError(f"{path}: not a JSON object")
    raw["kek_id"] = _checked_kek_id(kek_id)
    raw.pop("kek_id_previous", None)
    if previous is not None and previous != kek_id:
        raw["kek_id_previous"] = _checked_kek_id(previous)
    data = _encode(raw)
    atomic_create(
        path, data, mode=0o644, replace=True, tmp_name=f".{LAYOUT_FILE}.{uuid.uuid4().hex}.tmp"
    )
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
    if "checksum" in raw and raw["checksum"] != _checksum(raw):
        raise LayoutError(f"{path} is damaged: its checksum does not match its fields")
    version = raw.get("layout_version")
    if not isinstance(version, int) or version not in SUPPORTED_LAYOUT_VERSIONS:
        raise UnknownLayoutVersion(version, SUPPORTED_RANGE, str(path))
    ids: dict[str, str | None] = {}
    for field in ("kek_id", "kek_id_previous"):
        value = raw.get(field)
        if value is not None and not (isinstance(value, str) and _KEK_ID_RE.fullmatch(value)):
            raise LayoutError(f"{path}: {field} must be 16 lower-case hex digits, not {value!r}")
        ids[field] = value
    from . import v1

    params = raw.get("params", {})
    try:
        fanout = v1.parse_fanout(params.get("fanout") if isinstance(params, dict) else None)
    except ValueError as exc:
        raise LayoutError(f"{path}: params.{exc}") from exc
    try:
        return LayoutInfo(
            fanout=fanout,
            version=version,
            store_id=str(raw["store_id"]),
            created=str(raw["created"]),
            params=dict(raw.get("params", {})),
            kek_id=ids["kek_id"],
            kek_id_previous=ids["kek_id_previous"],
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise LayoutError(f"{path}: field {exc.args[0]!r} is missing or invalid") from exc


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
