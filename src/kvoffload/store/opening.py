"""Opening a store: its root's ``layout.json`` (restored from this node's copy
when damaged), the index directory's lock, the keyring and its KEK check, the
index (moved aside and rebuilt when corrupt), the I/O backend, the shared
root and the RAM tier, gathered into the :class:`~.state.StoreState` the
:class:`~.store.Store` builds its parts on.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb

from ..errors import IndexCorrupt, IndexFailure, StoreError, StoreLocked
from ..layouts import (
    LAYOUT_FILE,
    LayoutError,
    LayoutInfo,
    UnknownLayoutVersion,
    create_root,
    read_layout,
    record_kek_id,
)
from ..layouts.store_root import ROOT_DIR_MODES
from ..posix import atomic_create
from .audit import AuditLog
from .config import StoreConfig
from .contracts import ContractRegistry
from .files import Durability
from .index import Index
from .iobackend import DIRECT_WRITE_MIN, IOPlan, select_backend
from .keys.keyring import Kek, Keyring
from .ramtier import RamTier, auto_capacity
from .retention import RetentionJournal
from .shared.root import POSITIONS_META, SharedRoot
from .state import StoreState, log

AuditFn = Callable[[str, dict[str, Any]], None]


def lock_index_dir(index_dir: Path) -> int:
    """Make the index directory and take its lock (one process opens an index);
    the lock file's descriptor, which holds it until closed."""
    index_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(index_dir / "kvoffload.lock", os.O_RDWR | os.O_CREAT, 0o640)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        os.close(fd)
        raise StoreLocked(
            f"the index at {index_dir} is in use by another process (a running sidecar?); "
            "use the sidecar's admin verbs or stop it first"
        ) from exc
    return fd


def open_state(
    config: StoreConfig,
    index_dir: Path,
    kek: Kek,
    layout: LayoutInfo,
    audit: AuditFn | None,
) -> tuple[StoreState, str | None]:
    """Keyring, index and I/O backend of a root whose layout is read; the state,
    and why the index must be rebuilt from the files (None: it need not). On
    failure, what was opened is closed (the caller closes the lock file)."""
    root = config.root
    audit_log = AuditLog(
        index_dir / "audit.jsonl", audit, max_bytes=config.audit_max_bytes, keep=config.audit_keep
    )
    keyring = Keyring(root / "keys", kek, cache_ttl_s=config.key_cache_ttl_s, audit=audit_log)
    layout = check_kek(root, layout, keyring, kek)
    keep_layout_copy(root, index_dir)
    index, rebuild = open_index(index_dir, rebuild_corrupt=config.rebuild_corrupt_index)
    try:
        store_id = index.get_meta("store_id")
        if store_id is None:
            index.set_meta("store_id", layout.store_id.encode())
            if rebuild is None and not config.shared and _holds_objects(root):
                # A lost or deleted index of a store with objects: rebuilt
                # from the files, so nothing stored is forgotten. Not on a
                # shared root: a new node catches up from the journals and
                # finds the rest by name, never by walking the object tree.
                rebuild = "the index is new but the store holds objects"
        elif store_id.decode() != layout.store_id:
            raise StoreError(
                f"index at {index_dir} belongs to store {store_id.decode()}, "
                f"not {layout.store_id}: point index_dir elsewhere or run fsck --repair"
            )
        node = index.get_meta("node_id")
        if node is None:
            node = os.urandom(8).hex().encode()
            index.set_meta("node_id", node)
        retention = RetentionJournal(root, node.decode())
        sel = select_backend(config.io, root / "objects", direct_read_min=config.direct_read_min)
        shared = None
        if config.shared:
            shared = SharedRoot(
                root,
                index_dir,
                durable=config.durability is not Durability.NONE,
                lease_ttl_s=config.evictor_lease_s,
                segment_bytes=config.journal_segment_bytes,
                index=index,
            )
            shared.restore_positions(index.get_meta(POSITIONS_META))
    except BaseException:
        index.close()
        raise
    state = StoreState(
        config=config,
        root=root,
        layout=layout,
        index=index,
        keyring=keyring,
        io=sel.backend,
        io_plan=sel.plan,
        audit=audit_log,
        contracts=ContractRegistry(root),
        retention=retention,
        shared=shared,
        ram=ram_tier(config, sel.plan),
    )
    return state, rebuild


def _holds_objects(root: Path) -> bool:
    """Whether ``objects/`` holds any file."""
    objects = root / "objects"
    if not objects.is_dir():
        return False
    return any(files for _dirpath, _dirs, files in os.walk(objects))


def open_index(index_dir: Path, *, rebuild_corrupt: bool) -> tuple[Index, str | None]:
    """Open the index; a corrupt one (garbage ``data.mdb``, undecodable records,
    an unknown schema) is moved aside to ``lmdb.corrupt-<time>`` (kept for
    forensics) and a new one returned, to be rebuilt from the files
    (layout-v1.md §1), when ``rebuild_corrupt``; else the error stands. The
    index, and why it must be rebuilt (None: it need not)."""
    path = index_dir / "lmdb"
    index: Index | None = None
    try:
        if rebuild_corrupt:
            why = probe_in_child(path)
            if why is not None:
                raise IndexCorrupt(f"LMDB index is corrupt: {why}")
        index = Index(path)
        for _rec in index.records():  # every record decodes, every page is reachable
            pass
        index.usage()
        return index, None
    except IndexFailure as exc:
        if index is not None:
            index.close()
        if not rebuild_corrupt or _environmental(exc):
            raise
        aside = index_dir / f"lmdb.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        os.rename(path, aside)
        log.error(
            "the index at %s is unusable (%s): moved aside to %s; rebuilding it from the files",
            path, exc, aside.name,
        )  # fmt: skip
        return Index(path), f"the index was unusable ({exc})"


_PROBE = """
import sys, lmdb
env = lmdb.open(sys.argv[1], subdir=True, readonly=True, lock=False, max_dbs=16)
try:
    with env.begin() as txn:
        names = [k for k, _ in txn.cursor()]
        for name in names:
            db = env.open_db(name, txn=txn, create=False)
            for _ in txn.cursor(db=db):
                pass
except lmdb.Error as exc:
    print(exc)
    sys.exit(3)
"""


def probe_in_child(path: Path, timeout_s: float = 120.0) -> str | None:
    """Read every page of the index at ``path`` in a child process: why it is
    unusable, or None. LMDB trusts its file: a truncated or damaged one can make
    the reading process die of SIGBUS or SIGSEGV, which must not be the sidecar
    (a start that crashes every time). A child that cannot run says nothing."""
    import subprocess
    import sys

    if not (path / "data.mdb").exists():
        return None
    try:
        p = subprocess.run(
            [sys.executable, "-I", "-c", _PROBE, str(path)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if p.returncode < 0:
        return f"reading it killed a process with signal {-p.returncode}"
    if p.returncode == 3:
        return p.stdout.strip() or "LMDB error"
    return None


def check_kek(root: Path, layout: LayoutInfo, keyring: Keyring, kek: Kek) -> LayoutInfo:
    """A wrong KEK stops us here (layout-v1.md §2): later, every object would
    look corrupt. Checked against the KEK id the root records, never against
    a key file, so one corrupt key file is its tenant's problem only. A root
    without one (older stores) learns it now, from the ids the key files
    name, refusing a KEK that none of them names. The layout, as recorded now."""
    ours = kek.key_id
    keyring.check_store_kek(layout, root)  # the check itself: also `config check`'s
    if layout.kek_id is None:
        log.info("store %s: KEK id %s recorded in layout.json", layout.store_id, ours)
        return record_kek_id(root, ours)
    if ours != layout.kek_id:
        log.warning(
            "store %s: a KEK rotation to id %s is unfinished; opened with the previous "
            "KEK %s: run `kvoffload keys rotate-kek` again to finish it",
            layout.store_id, layout.kek_id, ours,
        )  # fmt: skip
    return layout


def ram_tier(config: StoreConfig, plan: IOPlan) -> RamTier | None:
    """The RAM tier this store's settings and I/O plan call for: objects the
    backend writes or reads around the page cache (posix: those of at least
    direct_read_min, 16 MiB), sized by ``ram_cache``. None where it is 0, or
    where the page cache already keeps every object (posix-buffered)."""
    capacity = auto_capacity() if config.ram_cache is None else config.ram_cache
    if not capacity or not (plan.direct_write or plan.direct_read or plan.direct_read_min):
        return None
    min_size = plan.direct_read_min or plan.direct_write_min or DIRECT_WRITE_MIN
    return RamTier(capacity, min_size)


def load_layout(root: Path, index_dir: Path, kek: Kek, create: bool) -> LayoutInfo:
    """The root's ``layout.json``; a damaged one (unparseable, invalid, or failing its
    checksum: layout-v1.md §2) is restored from the copy this node keeps in its
    index directory, when that copy is intact and names this KEK; the damaged
    file is kept beside it. Without such a copy the error stands (one line)."""
    try:
        return create_root(root, kek_id=kek.key_id) if create else read_layout(root)
    except UnknownLayoutVersion:
        raise
    except LayoutError as exc:
        path = root / LAYOUT_FILE
        if not path.exists() or not (index_dir / LAYOUT_FILE).exists():
            raise
        try:
            copy = read_layout(index_dir)
        except LayoutError:
            raise exc from None
        if kek.key_id not in (copy.kek_id, copy.kek_id_previous):
            raise
        aside = root / f"{LAYOUT_FILE}.damaged-{time.strftime('%Y%m%dT%H%M%S')}"
        os.replace(path, aside)
        atomic_create(path, (index_dir / LAYOUT_FILE).read_bytes(), mode=0o644)
        log.error(
            "%s (%s); restored from %s, the damaged file kept as %s",
            path, exc, index_dir / LAYOUT_FILE, aside.name,
        )  # fmt: skip
        return read_layout(root)


def keep_layout_copy(root: Path, index_dir: Path) -> None:
    """This node's copy of a verified ``layout.json``, to restore a damaged one."""
    data = (root / LAYOUT_FILE).read_bytes()
    copy = index_dir / LAYOUT_FILE
    try:
        if copy.read_bytes() == data:
            return
    except FileNotFoundError:
        pass
    try:
        atomic_create(copy, data, mode=0o600, replace=True)
    except OSError as exc:
        log.warning("keeping a copy of %s failed: %s", LAYOUT_FILE, exc)


_ENVIRONMENTAL = (
    lmdb.ReadonlyError,
    lmdb.DiskError,
    lmdb.MapFullError,
    lmdb.LockError,
    lmdb.ReadersFullError,
    lmdb.TlsFullError,
    lmdb.MemoryError,
)
_ENVIRONMENTAL_TEXT = (
    "Permission denied",
    "No space left",
    "Read-only file system",
    "Too many open files",
    "Cannot allocate memory",
    "Disk quota",
    "is closed",
)


def _environmental(exc: IndexFailure) -> bool:
    """An index failure of the machine (permissions, space, limits), not of the
    index's bytes: moving the index aside would not help and loses nothing less."""
    cause = exc.__cause__
    if isinstance(cause, (*_ENVIRONMENTAL, OSError)):
        return True
    return any(t in str(exc) for t in _ENVIRONMENTAL_TEXT)


def tighten_modes(root: Path) -> None:
    """Set the modes of the root's directories (layout-v1.md §2), whatever the umask
    they were made under; a directory that is not ours is left as it is."""
    for sub, mode in ROOT_DIR_MODES.items():
        d = root / sub
        try:
            if d.stat().st_mode & 0o7777 != mode:
                d.chmod(mode)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("cannot set mode %04o on %s: %s", mode, d, exc)


__all__ = [
    "check_kek",
    "keep_layout_copy",
    "load_layout",
    "lock_index_dir",
    "open_index",
    "open_state",
    "probe_in_child",
    "ram_tier",
    "tighten_modes",
]
