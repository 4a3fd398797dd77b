"""Retention that survives the index: ``<root>/journal/retention/<tenant>/<node>.log``.

The index holds each chunk's expiry, but the index is a cache that can be
rebuilt from the objects (layout-v1.md §1), and objects carry no expiry. So
every write with a TTL first appends a record here, and a rebuild reads them:
an index rebuilt from the files never revives a chunk whose TTL had passed.
Layout-v1.md §4.2 is the normative description. ::

    record (56 bytes)  chunk key (32) | created_ns u64 LE | expires_ns u64 LE |
                       XXH64 of the 48 bytes before, u64 LE

A record applies to the object of that key whose header says ``created_ns``
(so a re-save, with another creation time, is not bound by an older TTL).
Records failing their checksum (a torn append, a flipped byte) are skipped;
a trailing partial record is ignored. Each node appends to its own file
(``<node>`` is a random id kept in its index) and compacts only its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import xxhash

from kvoffload.contract import TENANT_RE

from ..posix import atomic_create, fsync_dir

log = logging.getLogger("kvoffload.store")

RETENTION_DIR = "journal/retention"
_REC = struct.Struct("<32sQQ")
_SUM = struct.Struct("<Q")
RECORD_SIZE = _REC.size + _SUM.size
#: A node's file of a tenant is compacted by the maintenance sweep past this size.
COMPACT_BYTES = 1 << 20

#: (tenant, chunk key, created_ns) -> expires_ns
Retention = dict[tuple[str, bytes, int], int]


def encode(key: bytes, created_ns: int, expires_ns: int) -> bytes:
    body = _REC.pack(key, created_ns, expires_ns)
    return body + _SUM.pack(xxhash.xxh64_intdigest(body))


def decode(tenant: str, data: bytes, out: Retention) -> int:
    """Add the valid records of ``data`` to ``out``; returns how many were skipped."""
    bad = 0
    for pos in range(0, len(data) - RECORD_SIZE + 1, RECORD_SIZE):
        body = data[pos : pos + _REC.size]
        (s,) = _SUM.unpack_from(data, pos + _REC.size)
        if xxhash.xxh64_intdigest(body) != s:
            bad += 1
            continue
        key, created, expires = _REC.unpack(body)
        out[(tenant, key, created)] = expires
    return bad


class RetentionJournal:
    """The retention records of one store root, written by this node as ``node``."""

    def __init__(self, root: Path, node: str) -> None:
        self.dir = Path(root) / RETENTION_DIR
        self.node = node
        self._mu = threading.Lock()

    def _file(self, tenant: str) -> Path:
        return self.dir / tenant / f"{self.node}.log"

    def record(
        self, tenant: str, key: bytes, created_ns: int, expires_ns: int, *, durable: bool
    ) -> None:
        """Append one record (before the object is written: an object never
        outlives its retention record). Raises OSError."""
        path = self._file(tenant)
        data = encode(key, created_ns, expires_ns)
        with self._mu:
            made = [p for p in (path.parent, path.parent.parent, self.dir) if not p.exists()]
            created = not path.exists()
            if made:
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, data)
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if durable and created:  # the new names survive a power loss too
                for d in [path.parent, *(m.parent for m in made)]:
                    fsync_dir(d)

    def load(self, tenants: Iterable[str] | None = None) -> Retention:
        """Every valid record of every node (of ``tenants``, or all)."""
        out: Retention = {}
        try:
            names = list(tenants) if tenants is not None else os.listdir(self.dir)
        except FileNotFoundError:
            return out
        for tenant in names:
            if not TENANT_RE.fullmatch(tenant):
                continue
            try:
                files = sorted((self.dir / tenant).iterdir())
            except (FileNotFoundError, NotADirectoryError):
                continue
            for f in files:
                try:
                    bad = decode(tenant, f.read_bytes(), out)
                except OSError as exc:
                    log.warning("retention journal %s unreadable: %s", f, exc)
                    continue
                if bad:
                    log.warning("retention journal %s: %d damaged records skipped", f, bad)
        return out

    def compact(self, tenant: str, keep: Callable[[bytes, int, int], bool]) -> None:
        """Rewrite this node's file of ``tenant`` with the records ``keep(key,
        created_ns, expires_ns)`` accepts (atomically: temp, fsync, rename)."""
        path = self._file(tenant)
        with self._mu:
            got: Retention = {}
            try:
                decode(tenant, path.read_bytes(), got)
            except FileNotFoundError:
                return
            data = b"".join(
                encode(key, created, expires)
                for (_t, key, created), expires in got.items()
                if keep(key, created, expires)
            )
            atomic_create(path, data, mode=0o600, replace=True)

    def big_files(self) -> list[str]:
        """Tenants whose file of this node has grown past :data:`COMPACT_BYTES`."""
        out = []
        with contextlib.suppress(FileNotFoundError):
            for tenant in os.listdir(self.dir):
                with contextlib.suppress(OSError):
                    if self._file(tenant).stat().st_size > COMPACT_BYTES:
                        out.append(tenant)
        return out

    def drop_tenant(self, tenant: str) -> int:
        """A purged tenant's records go with its objects; the number of this
        node's retention files removed."""
        d = self.dir / tenant
        removed = 0
        with contextlib.suppress(FileNotFoundError):
            for f in d.iterdir():
                with contextlib.suppress(FileNotFoundError):
                    f.unlink()
                    removed += 1
            d.rmdir()
        return removed


__all__ = ["RECORD_SIZE", "Retention", "RetentionJournal"]
