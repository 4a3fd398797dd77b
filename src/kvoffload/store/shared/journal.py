"""Per-node append-only journals under a shared store root (shared-root-v1.md §1–3).

Each sidecar appends what it stores, touches and removes to its own journal
under ``<root>/journal/nodes/<node-id>/``; the others follow those journals to
learn of objects before they ever miss on them, reading only the journal
directory and never the object tree. Journals are hints: nothing here is ever
served without the object verifying, so a torn, lost or damaged journal costs
existence checks, never a wrong byte.

* :class:`JournalWriter` — the node's own journal: registration, segments,
  rotation, checkpoint compaction.
* :class:`JournalFollower` — every other node's journal, from remembered
  positions, tolerant of torn tails, damage and compaction.
* :func:`load_or_create_node_id` — the node's stable id, kept on node-local
  disk next to the index.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import json
import os
import re
import socket
import struct
import time
import uuid
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from ...errors import JournalError
from ...posix import atomic_create, fsync_dir, pwrite_all

__all__ = [
    "JOURNAL_VERSION",
    "FollowerStats",
    "JournalFollower",
    "JournalRecord",
    "JournalWriter",
    "Op",
    "Reason",
    "decode_records",
    "encode_record",
    "is_node_id",
    "load_or_create_node_id",
    "node_dir",
]

JOURNAL_VERSION = 1
MAGIC = b"KVOJ"
FLAG_CHECKPOINT = 0x1
_HEADER = struct.Struct("<4sHHQ12sI")
HEADER_SIZE = _HEADER.size  # 32
_FRAME = struct.Struct("<II")
_BODY_HEAD = struct.Struct("<BBHQ")
_STORE_TAIL = struct.Struct("<32s32sQQIIQQ")
MAX_BODY = 4096
KEY_SIZE = 32
DEFAULT_SEGMENT_BYTES = 8 << 20

_NODE_ID_RE = re.compile(r"^[0-9a-f]{32}$")
_SEG_RE = re.compile(r"^seg-(\d{20})\.kvj$")
NODE_ID_FILE = "node-id"


class Op(enum.IntEnum):
    STORE = 1
    TOUCH = 2
    REMOVE = 3
    PURGE_TENANT = 4
    PURGE_NAMESPACE = 5


class Reason(enum.IntEnum):
    NONE = 0
    EVICTED = 1
    EXPIRED = 2
    PURGED = 3
    FAILED_VERIFICATION = 4
    OTHER = 5


@dataclass(frozen=True)
class JournalRecord:
    """One journal record; which fields matter depends on ``op`` (spec §3.2)."""

    op: Op
    tenant: str
    time_ns: int = 0
    key: bytes = b""
    namespace: bytes = b""
    size: int = 0
    expires_ns: int = 0
    reason: Reason = Reason.NONE
    payload: int = 0
    key_epoch: int = 0
    num_layers: int = 0
    grant_epoch: int = 0

    @classmethod
    def store(
        cls,
        tenant: str,
        key: bytes,
        namespace: bytes,
        size: int,
        *,
        payload: int = 0,
        key_epoch: int = 0,
        num_layers: int = 0,
        expires_ns: int = 0,
        time_ns: int | None = None,
        grant_epoch: int = 0,
    ) -> JournalRecord:
        return cls(
            Op.STORE,
            tenant,
            time.time_ns() if time_ns is None else time_ns,
            key,
            namespace,
            size,
            expires_ns,
            payload=payload,
            key_epoch=key_epoch,
            num_layers=num_layers,
            grant_epoch=grant_epoch,
        )

    @classmethod
    def touch(cls, tenant: str, key: bytes) -> JournalRecord:
        return cls(Op.TOUCH, tenant, time.time_ns(), key)

    @classmethod
    def remove(
        cls, tenant: str, key: bytes, reason: Reason, *, lease_epoch: int = 0
    ) -> JournalRecord:
        """``lease_epoch``: for an eviction, the evictor lease epoch it was made under."""
        return cls(Op.REMOVE, tenant, time.time_ns(), key, reason=reason, grant_epoch=lease_epoch)

    @classmethod
    def purge_tenant(cls, tenant: str) -> JournalRecord:
        return cls(Op.PURGE_TENANT, tenant, time.time_ns(), reason=Reason.PURGED)

    @classmethod
    def purge_namespace(cls, tenant: str, namespace: bytes) -> JournalRecord:
        return cls(Op.PURGE_NAMESPACE, tenant, time.time_ns(), namespace=namespace)


def _u64(name: str, value: int) -> int:
    if not 0 <= value < 1 << 64:
        raise ValueError(f"{name} out of range: {value}")
    return value


def encode_record(rec: JournalRecord) -> bytes:
    """The framed bytes of one record: ``u32 len | u32 crc32 | body``."""
    tenant = rec.tenant.encode("utf-8")
    if not 0 < len(tenant) <= 255:
        raise ValueError(f"tenant id of {len(tenant)} bytes")
    body = bytearray(_BODY_HEAD.pack(rec.op, rec.reason, len(tenant), _u64("time", rec.time_ns)))
    body += tenant
    if rec.op in (Op.STORE, Op.TOUCH, Op.REMOVE) and len(rec.key) != KEY_SIZE:
        raise ValueError(f"{rec.op.name} needs a {KEY_SIZE}-byte key")
    if rec.op is Op.STORE:
        if len(rec.namespace) != KEY_SIZE:
            raise ValueError(f"STORE needs a {KEY_SIZE}-byte namespace")
        if not (0 <= rec.key_epoch < 1 << 32 and 0 <= rec.num_layers < 1 << 32):
            raise ValueError("key epoch or layer count out of range")
        body += _STORE_TAIL.pack(
            rec.key,
            rec.namespace,
            _u64("size", rec.size),
            _u64("payload", rec.payload),
            rec.key_epoch,
            rec.num_layers,
            _u64("expires", rec.expires_ns),
            _u64("grant epoch", rec.grant_epoch),
        )
    elif rec.op is Op.TOUCH:
        body += rec.key
    elif rec.op is Op.REMOVE:
        body += rec.key + struct.pack("<Q", _u64("lease epoch", rec.grant_epoch))
    elif rec.op is Op.PURGE_NAMESPACE:
        if len(rec.namespace) != KEY_SIZE:
            raise ValueError(f"PURGE_NAMESPACE needs a {KEY_SIZE}-byte namespace")
        body += rec.namespace
    return _FRAME.pack(len(body), zlib.crc32(body)) + bytes(body)


def _decode_body(body: bytes) -> JournalRecord:
    if len(body) < _BODY_HEAD.size:
        raise JournalError("record body too short")
    op_raw, reason_raw, tlen, time_ns = _BODY_HEAD.unpack_from(body)
    try:
        op = Op(op_raw)
        reason = Reason(reason_raw)
    except ValueError as exc:
        raise JournalError(f"unknown op {op_raw} or reason {reason_raw}") from exc
    pos = _BODY_HEAD.size
    try:
        tenant = body[pos : pos + tlen].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JournalError("tenant id is not UTF-8") from exc
    if len(tenant.encode("utf-8")) != tlen or tlen == 0:
        raise JournalError("tenant id truncated")
    pos += tlen
    rest = body[pos:]
    if op is Op.STORE:
        if len(rest) != _STORE_TAIL.size:
            raise JournalError("STORE record of the wrong size")
        key, ns, size, payload, epoch, layers, expires, grant = _STORE_TAIL.unpack(rest)
        return JournalRecord(
            op, tenant, time_ns, key, ns, size, expires, reason, payload, epoch, layers, grant
        )
    if op is Op.TOUCH:
        if len(rest) != KEY_SIZE:
            raise JournalError("TOUCH record of the wrong size")
        return JournalRecord(op, tenant, time_ns, bytes(rest), reason=reason)
    if op is Op.REMOVE:
        if len(rest) != KEY_SIZE + 8:
            raise JournalError("REMOVE record of the wrong size")
        (lease_epoch,) = struct.unpack_from("<Q", rest, KEY_SIZE)
        return JournalRecord(
            op, tenant, time_ns, bytes(rest[:KEY_SIZE]), reason=reason, grant_epoch=lease_epoch
        )
    if op is Op.PURGE_NAMESPACE:
        if len(rest) != KEY_SIZE:
            raise JournalError("PURGE_NAMESPACE record of the wrong size")
        return JournalRecord(op, tenant, time_ns, namespace=bytes(rest), reason=reason)
    if rest:
        raise JournalError(f"{op.name} record with trailing bytes")
    return JournalRecord(op, tenant, time_ns, reason=reason)


class _Torn(Exception):
    """The bytes after the position do not (yet) hold a whole, checked record."""


def decode_records(data: bytes, offset: int = 0) -> tuple[list[JournalRecord], int]:
    """Decode whole records from ``data[offset:]``; the records and the new offset.

    Stops before an incomplete tail. Raises :class:`_Torn` (internal) on a
    CRC mismatch, :class:`JournalError` on a record that does not parse.
    """
    out: list[JournalRecord] = []
    pos = offset
    end = len(data)
    while end - pos >= _FRAME.size:
        blen, crc = _FRAME.unpack_from(data, pos)
        if blen > MAX_BODY:
            raise JournalError(f"record length {blen} over the limit {MAX_BODY}")
        if end - pos - _FRAME.size < blen:
            break
        body = bytes(data[pos + _FRAME.size : pos + _FRAME.size + blen])
        if zlib.crc32(body) != crc:
            raise _Torn(pos)
        out.append(_decode_body(body))
        pos += _FRAME.size + blen
    return out, pos


def _encode_header(segment: int, node_id: str, flags: int) -> bytes:
    head = struct.pack("<4sHHQ12s", MAGIC, JOURNAL_VERSION, flags, segment, _node_prefix(node_id))
    return head + struct.pack("<I", zlib.crc32(head))


def _node_prefix(node_id: str) -> bytes:
    return bytes.fromhex(node_id)[:12]


def _decode_header(data: bytes, segment: int, node_id: str) -> int:
    """Check a segment header; its flags. JournalError on damage or a foreign version."""
    if len(data) < HEADER_SIZE:
        raise _Torn(0)
    magic, version, flags, seg, prefix, crc = _HEADER.unpack_from(data)
    if zlib.crc32(data[: HEADER_SIZE - 4]) != crc:
        raise JournalError("segment header checksum mismatch")
    if magic != MAGIC:
        raise JournalError("not a journal segment (bad magic)")
    if version != JOURNAL_VERSION:
        raise _UnknownVersion(version)
    if flags & ~FLAG_CHECKPOINT:
        raise JournalError(f"unknown segment flags {flags:#x}")
    if seg != segment or prefix != _node_prefix(node_id):
        raise JournalError("segment header names another segment or node")
    return int(flags)


class _UnknownVersion(JournalError):
    def __init__(self, version: int) -> None:
        super().__init__(
            f"journal version {version} is not supported "
            f"(this kvoffload reads version {JOURNAL_VERSION})"
        )
        self.version = version


def is_node_id(name: str) -> bool:
    """Whether ``name`` is a node id (32 lower-case hex digits, spec §1)."""
    return _NODE_ID_RE.match(name) is not None


def node_dir(root: Path, node_id: str) -> Path:
    return Path(root) / "journal" / "nodes" / node_id


def _seg_name(n: int) -> str:
    return f"seg-{n:020d}.kvj"


def _segments(directory: Path) -> list[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = _SEG_RE.match(name)
        if m:
            out.append(int(m.group(1)))
    return sorted(out)


def _mkdir_private(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(PermissionError):
        os.chmod(path, 0o700)


def load_or_create_node_id(state_dir: Path) -> str:
    """The node's stable id (32 hex), kept in ``state_dir/node-id`` on node-local disk."""
    state_dir = Path(state_dir)
    path = state_dir / NODE_ID_FILE
    try:
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        text = ""
    except (OSError, UnicodeDecodeError) as exc:
        raise JournalError(f"cannot read the node id in {path}: {exc}") from exc
    if _NODE_ID_RE.match(text):
        return text
    if text:
        raise JournalError(f"{path} does not hold a node id (32 hex digits); remove it")
    _mkdir_private(state_dir)
    new = uuid.uuid4().hex
    try:
        atomic_create(path, (new + "\n").encode("ascii"), mode=0o600)
    except FileExistsError:
        return load_or_create_node_id(state_dir)
    return new


class JournalWriter:
    """The node's own journal: one active segment, appended to with whole records."""

    def __init__(
        self,
        root: Path,
        node_id: str,
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        durable: bool = True,
    ) -> None:
        if not _NODE_ID_RE.match(node_id):
            raise JournalError(f"not a node id: {node_id!r}")
        self.root = Path(root)
        self.node_id = node_id
        self.dir = node_dir(self.root, node_id)
        self.segment_bytes = segment_bytes
        self.durable = durable
        self.incarnation = os.urandom(8).hex()
        self._fd: int | None = None
        self.segment = 0
        self._size = 0

    def open(self) -> None:
        """Register the node and start a fresh segment (never append to an old one)."""
        _mkdir_private(self.dir)
        info = {
            "journal_version": JOURNAL_VERSION,
            "node_id": self.node_id,
            "hostname": socket.gethostname(),
            "incarnation": self.incarnation,
            "opened": datetime.now(UTC).isoformat(),
        }
        data = (json.dumps(info, sort_keys=True) + "\n").encode("utf-8")
        atomic_create(self.dir / "node.json", data, mode=0o600, replace=True)
        existing = _segments(self.dir)
        self._start_segment((existing[-1] + 1) if existing else 1, 0)

    def _start_segment(self, number: int, flags: int) -> None:
        path = self.dir / _seg_name(number)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            pwrite_all(fd, _encode_header(number, self.node_id, flags), 0)
            if self.durable:
                os.fsync(fd)
                fsync_dir(self.dir)
        except BaseException:
            os.close(fd)
            raise
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self.segment, self._size = fd, number, HEADER_SIZE

    def append(self, records: Iterable[JournalRecord]) -> None:
        """Append records (each whole); fsync once per call when durable."""
        if self._fd is None:
            raise JournalError("journal writer is not open")
        data = b"".join(encode_record(r) for r in records)
        if not data:
            return
        if self._size + len(data) > self.segment_bytes and self._size > HEADER_SIZE:
            self._start_segment(self.segment + 1, 0)
        _write_all(self._fd, data)
        if self.durable:
            os.fsync(self._fd)
        self._size += len(data)

    def compact(self, live: Sequence[JournalRecord]) -> None:
        """Write a checkpoint of ``live`` (STORE records) and remove older segments."""
        if self._fd is None:
            raise JournalError("journal writer is not open")
        old = [s for s in _segments(self.dir) if s <= self.segment]
        self._start_segment(self.segment + 1, FLAG_CHECKPOINT)
        data = b"".join(encode_record(r) for r in live)
        if data:
            _write_all(self._fd, data)
            if self.durable:
                os.fsync(self._fd)
            self._size += len(data)
        for s in old:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.dir / _seg_name(s))
        # The next append goes to a fresh, non-checkpoint segment.
        self._start_segment(self.segment + 1, 0)

    def segment_count(self) -> int:
        return len(_segments(self.dir))

    def own_records(self) -> list[JournalRecord]:
        """Every record of this node's journal, oldest first (damage skipped, as a
        follower skips it): what :meth:`compact`'s caller replays."""
        return [r for _, r in JournalFollower(self.root).read_node(self.node_id)]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except InterruptedError:
            continue
        if n <= 0:
            raise OSError(errno.EIO, "short write to the journal")
        view = view[n:]


@dataclass
class FollowerStats:
    records: int = 0
    damaged_segments: int = 0
    skipped_nodes: int = 0
    polls: int = 0
    messages: list[str] = field(default_factory=list)


@dataclass
class _Position:
    segment: int = 0
    offset: int = 0
    torn_at: tuple[int, int] | None = None  # (segment, offset) of a CRC mismatch seen


class JournalFollower:
    """Follows every other node's journal from remembered positions.

    :meth:`poll` returns the new records as ``(node_id, record)`` pairs in
    each node's order. :meth:`positions` / :meth:`restore` let the caller keep
    the positions in its index, so a restart catches up from where it was.
    """

    def __init__(self, root: Path, own_node_id: str | None = None) -> None:
        self.root = Path(root)
        self.own = own_node_id
        self._pos: dict[str, _Position] = {}
        self._refused: set[str] = set()
        self.stats = FollowerStats()

    def positions(self) -> dict[str, tuple[int, int]]:
        return {n: (p.segment, p.offset) for n, p in self._pos.items()}

    def restore(self, positions: dict[str, tuple[int, int]]) -> None:
        for node, (seg, off) in positions.items():
            if _NODE_ID_RE.match(node) and seg >= 0 and off >= 0:
                self._pos[node] = _Position(seg, off)

    def nodes(self) -> list[str]:
        try:
            names = os.listdir(self.root / "journal" / "nodes")
        except FileNotFoundError:
            return []
        return sorted(n for n in names if _NODE_ID_RE.match(n) and n != self.own)

    def poll(self) -> list[tuple[str, JournalRecord]]:
        self.stats.polls += 1
        out: list[tuple[str, JournalRecord]] = []
        for node in self.nodes():
            if node in self._refused:
                continue
            for rec in self._follow(node):
                out.append((node, rec))
        self.stats.records += len(out)
        return out

    def read_node(self, node: str) -> list[tuple[str, JournalRecord]]:
        """The new records of one node's journal (any node, this one's included)."""
        return [(node, r) for r in self._follow(node)]

    def _note(self, message: str) -> None:
        if len(self.stats.messages) < 100:
            self.stats.messages.append(message)

    def _follow(self, node: str) -> list[JournalRecord]:
        pos = self._pos.setdefault(node, _Position())
        directory = node_dir(self.root, node)
        out: list[JournalRecord] = []
        while True:
            segs = _segments(directory)
            if not segs:
                return out
            if pos.segment not in segs:
                later = [s for s in segs if s > pos.segment]
                if not later:
                    return out
                pos.segment, pos.offset, pos.torn_at = later[0], 0, None
            newest = pos.segment == segs[-1]
            try:
                records, done = self._read_segment(directory, node, pos)
            except _UnknownVersion as exc:
                self._refused.add(node)
                self.stats.skipped_nodes += 1
                self._note(f"journal of node {node}: {exc}; skipped")
                return out
            except FileNotFoundError:
                continue  # compacted away meanwhile: re-list
            except _Torn as torn:
                at = (pos.segment, int(torn.args[0]) if torn.args else pos.offset)
                if newest and pos.torn_at != at:
                    pos.torn_at = at  # maybe still being written: retry next poll
                    return out
                if newest:
                    return out
                records, done = [], True
                self._damaged(node, pos.segment, "checksum mismatch")
            except JournalError as exc:
                records, done = [], True
                self._damaged(node, pos.segment, str(exc))
            out.extend(records)
            if not done or newest:
                return out
            later = [s for s in segs if s > pos.segment]
            pos.segment, pos.offset, pos.torn_at = later[0], 0, None

    def _damaged(self, node: str, segment: int, why: str) -> None:
        self.stats.damaged_segments += 1
        self._note(f"journal of node {node}, segment {segment}: {why}; rest of segment skipped")

    def _read_segment(
        self, directory: Path, node: str, pos: _Position
    ) -> tuple[list[JournalRecord], bool]:
        """Read new records of the position's segment; (records, reached a clean end)."""
        path = directory / _seg_name(pos.segment)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ESTALE):
                raise FileNotFoundError(str(path)) from exc
            raise JournalError(f"cannot read {path.name}: {exc}") from exc
        if pos.offset == 0:
            _decode_header(data, pos.segment, node)
            pos.offset = HEADER_SIZE
        if pos.offset > len(data):
            raise JournalError("segment is shorter than the position reached")
        try:
            records, new_off = decode_records(data, pos.offset)
        except _Torn as torn:
            # Keep what decoded before the bad record: re-decode up to it.
            bad = int(torn.args[0])
            records, new_off = decode_records(data[:bad], pos.offset)
            pos.offset = new_off
            if records:
                return records, False
            raise
        pos.offset = new_off
        pos.torn_at = None
        return records, new_off == len(data)
