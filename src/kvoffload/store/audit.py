"""The audit log: hash-chained JSON lines beside the index (docs/spec/audit-v1.md).

Files in the index directory::

    audit.jsonl                    the active file, one record a line
    audit-<first seq, 16 digits>.jsonl   rotated files, oldest pruned past ``keep``
    audit.head                     the anchor: version, last seq and hash, oldest seq
    audit.lock                     fcntl lock: one writer at a time, any process

Every record carries ``v``, ``seq`` (1, 2, … across rotations), ``prev`` (the
hash of the record before; 64 zeros for seq 1) and ``hash`` (SHA-256 of the
record's canonical JSON without ``hash``). A writer takes the lock, reads the
anchor and the active file's last line, appends its line, fsyncs it, then
rewrites the anchor in place and fsyncs that, so that a removed, reordered or
edited line anywhere, and a cut at the tail, breaks the chain or disagrees
with the anchor (:func:`verify`). A sidecar and an offline CLI may write at
once: each append re-reads the state under the lock.

Refused accesses are coalesced per (event, peer uid, tenant, verb): within
:data:`COALESCE_S` of a written one, later ones are only counted and the
count rides on the next line written for that key (``"coalesced": n``); the
size-based rotation bounds the disk use of any flood.

The chain is tamper-*evident* against edits made without rewriting the rest
of the chain and the anchor; whoever may rewrite every file can forge a
consistent one. Ship the lines off the node (every record is also logged at
INFO, so journald has a copy) where that matters.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from kvoffload.errors import AuditFormatError

from ..errors import StoreIOError

log = logging.getLogger("kvoffload.store")

AUDIT_VERSION: Final = 1
ACTIVE: Final = "audit.jsonl"
HEAD: Final = "audit.head"
LOCK: Final = "audit.lock"
ZERO_HASH: Final = "0" * 64
#: Defaults of ``[audit] max_bytes`` and ``[audit] keep``.
DEFAULT_MAX_BYTES: Final = 16 << 20
DEFAULT_KEEP: Final = 8
#: Refused accesses of one key within this many seconds are counted, not written.
COALESCE_S: Final = 60.0
#: Distinct tenants of one (uid, verb) written per window before the rest are
#: coalesced under tenant "*".
PEER_KEYS: Final = 16
#: Events coalesced (floods a peer can cause).
COALESCED_EVENTS: Final = frozenset({"refused_access"})
#: Field names a record never carries (its own fields) or must never hold (secrets).
RESERVED: Final = frozenset({"v", "seq", "prev", "hash", "ts", "event"})
SECRET_NAMES: Final = frozenset(
    {"key", "keys", "dek", "kek", "salt", "salts", "token", "tokens", "secret", "data"}
)
_HEAD_SIZE: Final = 512
_ROTATED_RE: Final = re.compile(r"^audit-(\d{16})\.jsonl$")
_TAIL_READ: Final = 1 << 16


def canonical(record: dict[str, Any]) -> bytes:
    """The bytes a record's hash covers, and (with ``hash``) the line written:
    keys sorted, ASCII only, separators ``", "`` and ``": "`` (audit-v1 §2)."""
    return json.dumps(record, sort_keys=True, ensure_ascii=True, allow_nan=False).encode("ascii")


def record_hash(record: dict[str, Any]) -> str:
    body = {k: v for k, v in record.items() if k != "hash"}
    return hashlib.sha256(canonical(body)).hexdigest()


@dataclass
class _Head:
    seq: int = 0
    hash: str = ZERO_HASH
    oldest: int = 1  # the seq of the first record of the oldest file kept

    def encode(self) -> bytes:
        doc = {"v": AUDIT_VERSION, "seq": self.seq, "hash": self.hash, "oldest": self.oldest}
        body = json.dumps(doc, sort_keys=True).encode()
        check = hashlib.sha256(body).hexdigest()[:16]
        line = body[:-1] + f', "check": "{check}"}}'.encode() + b"\n"
        return line.ljust(_HEAD_SIZE, b" ")


def _read_head(path: Path) -> _Head | None:
    """The anchor, None if there is none; AuditFormatError if it is damaged."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw.decode("ascii").strip())
        if doc.get("v") != AUDIT_VERSION:
            raise AuditFormatError(
                f"{path}: audit anchor version {doc.get('v')!r}; this kvoffload reads "
                f"version {AUDIT_VERSION}"
            )
        check = doc.pop("check")
        body = json.dumps(doc, sort_keys=True).encode()
        if hashlib.sha256(body).hexdigest()[:16] != check:
            raise AuditFormatError(f"{path}: the audit anchor fails its checksum")
        return _Head(int(doc["seq"]), str(doc["hash"]), int(doc["oldest"]))
    except AuditFormatError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise AuditFormatError(f"{path}: the audit anchor is unreadable ({exc})") from exc


def _last_line(path: Path) -> tuple[bytes | None, int, bool]:
    """(the last complete line, the offset just past it, whether a partial line follows)."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(0, size - _TAIL_READ)
            f.seek(start)
            tail = f.read()
    except FileNotFoundError:
        return None, 0, False
    torn = bool(tail) and not tail.endswith(b"\n")
    end = tail.rfind(b"\n")
    if end < 0:
        return None, start if start else 0, torn
    begin = tail.rfind(b"\n", 0, end) + 1
    if begin == 0 and start > 0:
        return None, start + end + 1, torn  # a line longer than the tail window
    return tail[begin:end], start + end + 1, torn


def _first_seq(path: Path) -> int | None:
    try:
        with path.open("rb") as f:
            line = f.readline()
        return int(json.loads(line)["seq"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def rotated_files(directory: Path) -> list[tuple[int, Path]]:
    """Rotated files as (seq in the name, path), oldest first."""
    out = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(directory):
            m = _ROTATED_RE.match(name)
            if m:
                out.append((int(m.group(1)), directory / name))
    return sorted(out)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class _Pending:
    written_at: float
    suppressed: int = 0


@dataclass
class AuditLog:
    """Append-only, hash-chained, fsync'd, rotated; ``hook`` (the server's) sees each record.

    ``path`` is the active file (``<index_dir>/audit.jsonl``); the anchor, lock and
    rotated files sit beside it.
    """

    path: Path
    hook: Callable[[str, dict[str, Any]], None] | None = None
    max_bytes: int = DEFAULT_MAX_BYTES
    keep: int = DEFAULT_KEEP
    coalesce_s: float = COALESCE_S
    clock: Callable[[], float] = time.time
    _mu: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _pending: dict[tuple[str, int, str, str], _Pending] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        if self.max_bytes < 4096:
            raise ValueError("audit max_bytes must be at least 4 KiB")
        if self.keep < 1:
            raise ValueError("audit keep must be at least 1")

    @property
    def directory(self) -> Path:
        return self.path.parent

    def __call__(self, event: str, details: dict[str, Any]) -> None:
        self.record(event, details)

    def record(self, event: str, details: dict[str, Any]) -> bool:
        """Append one record; False if it was coalesced into a later one. Raises
        StoreIOError when the disk refuses it, ValueError for a forbidden field."""
        for k in details:
            if k in RESERVED or k.lower() in SECRET_NAMES:
                raise ValueError(f"audit record {event!r}: field {k!r} is not allowed")
        details = dict(details)
        if event in COALESCED_EVENTS and not self._admit(event, details):
            return False
        try:
            line = self._append(event, details)
        except OSError as exc:  # a full or failing disk: one clear error, not a traceback
            raise StoreIOError(
                f"writing the audit log {self.path} failed: {exc}", exc.errno
            ) from exc
        # A JSON log (serve --log-format json) writes the record as an object.
        log.info("audit: %s", line, extra={"audit": json.loads(line)})
        if self.hook is not None:
            self.hook(event, details)
        return True

    def _admit(self, event: str, details: dict[str, Any]) -> bool:
        """Coalescing (audit-v1 §3): whether to write this record now; adds
        ``coalesced`` (records left out before it) when it is written. Per
        (uid, tenant, verb); past :data:`PEER_KEYS` tenants a minute for one
        (uid, verb), the rest of that peer's are coalesced under tenant "*"."""
        uid = int(details.get("uid", -1))
        verb = str(details.get("verb", ""))
        now = self.clock()
        with self._mu:
            peer = (event, uid, "\x00peer", verb)
            seen = self._pending.get(peer)
            if seen is None or now - seen.written_at >= self.coalesce_s:
                seen = self._pending[peer] = _Pending(now)
            ck = (event, uid, str(details.get("tenant", "")), verb)
            if ck not in self._pending:
                seen.suppressed += 1  # distinct tenants of this peer in the window
                if seen.suppressed > PEER_KEYS:
                    ck = (event, uid, "*", verb)
                    details["tenant"] = "*"
            p = self._pending.get(ck)
            if p is not None and now - p.written_at < self.coalesce_s:
                p.suppressed += 1
                return False
            if p is not None and p.suppressed:
                details["coalesced"] = p.suppressed
            self._pending[ck] = _Pending(now)
            if len(self._pending) > 4096:  # a flood of distinct keys: forget the oldest
                by_age = sorted(self._pending, key=lambda k: self._pending[k].written_at)
                for old in by_age[:2048]:
                    del self._pending[old]
        return True

    # -- the writer ----------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.directory / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _append(self, event: str, details: dict[str, Any]) -> str:
        with self._mu, self._locked():
            head = self._current_head()
            rec: dict[str, Any] = {
                **details,
                "v": AUDIT_VERSION,
                "seq": head.seq + 1,
                "ts": round(self.clock(), 6),
                "event": event,
                "prev": head.hash,
            }
            rec["hash"] = record_hash(rec)
            data = canonical(rec) + b"\n"
            if self._size() + len(data) > self.max_bytes and self._size() > 0:
                head.oldest = self._rotate(head)
            created = not self.path.exists()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                # 0600 whatever the umask: tenant names and their create/purge events.
                if os.fstat(fd).st_mode & 0o077:
                    os.fchmod(fd, 0o600)
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            if created:
                _fsync_dir(self.directory)
            head.seq, head.hash = rec["seq"], rec["hash"]
            self._write_head(head)
            return data.decode("ascii").rstrip("\n")

    def _size(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def _current_head(self) -> _Head:
        """The anchor, reconciled with the active file's tail (audit-v1 §4)."""
        head_path = self.directory / HEAD
        try:
            head = _read_head(head_path)
        except AuditFormatError as exc:
            # Never write past an anchor we cannot read: that would hide the damage.
            raise OSError(f"{exc}; move it aside to start a new chain") from None
        last, end, torn = _last_line(self.path)
        if head is None:
            return self._start(last)
        if torn:
            # A line cut by a crash before its fsync returned: it was never
            # acknowledged, and the anchor does not count it.
            with open(self.path, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
            log.warning("audit log %s: removed a partial last line (a crash)", self.path)
        if last is not None:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                rec = json.loads(last)
                if (
                    rec.get("seq") == head.seq + 1
                    and rec.get("prev") == head.hash
                    and rec.get("hash") == record_hash(rec)
                ):
                    # Appended and fsync'd, but the anchor was not updated (a crash).
                    head.seq, head.hash = rec["seq"], rec["hash"]
        return head

    def _start(self, last: bytes | None) -> _Head:
        """No anchor: a new log, or an older unchained one (moved aside), or a
        lost anchor (continued, with a record saying so)."""
        head = _Head()
        if last is None and not rotated_files(self.directory):
            return head
        rec: dict[str, Any] = {}
        with contextlib.suppress(ValueError, TypeError):
            rec = json.loads(last) if last is not None else {}
        if last is not None and "seq" not in rec:
            aside = self.directory / f"audit.legacy-{time.strftime('%Y%m%dT%H%M%S')}.jsonl"
            os.rename(self.path, aside)
            log.warning(
                "audit log %s has no hash chain (older kvoffload): moved to %s",
                self.path,
                aside.name,
            )
            return head
        # The anchor is gone but chained files are here: continue the chain and
        # say so in it (verify reports the record: the tail may have been cut).
        if rec.get("seq") is not None:
            head.seq, head.hash = int(rec["seq"]), str(rec["hash"])
        else:
            rot = rotated_files(self.directory)
            if rot:
                tail, _e, _t = _last_line(rot[-1][1])
                with contextlib.suppress(ValueError, TypeError, KeyError):
                    r = json.loads(tail) if tail else {}
                    head.seq, head.hash = int(r["seq"]), str(r["hash"])
        rot = rotated_files(self.directory)
        head.oldest = rot[0][0] if rot else (_first_seq(self.path) or 1)
        lost: dict[str, Any] = {
            "v": AUDIT_VERSION,
            "seq": head.seq + 1,
            "ts": round(self.clock(), 6),
            "event": "audit_anchor_lost",
            "prev": head.hash,
            "last_seq_found": head.seq,
        }
        lost["hash"] = record_hash(lost)
        with open(self.path, "ab") as f:
            f.write(canonical(lost) + b"\n")
            os.fsync(f.fileno())
        log.error(
            "audit log %s: its anchor %s was missing; continued after seq %d",
            self.path,
            HEAD,
            head.seq,
        )
        head.seq, head.hash = lost["seq"], lost["hash"]
        return head

    def _rotate(self, head: _Head) -> int:
        """Rename the active file after its first seq, prune past ``keep``; the new
        oldest seq. It advances only past the files this writer prunes, each the
        one that starts at the oldest seq: a file removed by anyone else stays a
        gap that ``verify`` reports, whatever is rotated or pruned after it."""
        first = _first_seq(self.path) or head.seq
        os.rename(self.path, self.directory / f"audit-{first:016d}.jsonl")
        rot = rotated_files(self.directory)
        oldest = head.oldest
        excess = max(0, len(rot) - self.keep)
        for i, (seq, p) in enumerate(rot[:excess]):
            if seq == oldest:  # the oldest file of the chain: pruned, the next one is
                oldest = rot[i + 1][0]
            p.unlink()
        _fsync_dir(self.directory)
        return oldest

    def _write_head(self, head: _Head) -> None:
        path = self.directory / HEAD
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            # One 512-byte write in place (a sector), with its own checksum.
            os.pwrite(fd, head.encode(), 0)
            os.fsync(fd)
        finally:
            os.close(fd)


# -- reading and verifying --------------------------------------------------------


@dataclass(frozen=True)
class AuditProblem:
    file: str
    line: int  # 0: the file as a whole
    reason: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where}: {self.reason}"


@dataclass
class AuditReport:
    records: list[dict[str, Any]] = field(default_factory=list)
    problems: list[AuditProblem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)

    @property
    def intact(self) -> bool:
        return not self.problems


def log_files(directory: Path) -> list[Path]:
    """Every file of the chain, oldest first (rotated files, then the active one)."""
    files = [p for _s, p in rotated_files(directory)]
    if (directory / ACTIVE).exists():
        files.append(directory / ACTIVE)
    return files


def _check(
    rec: dict[str, Any],
    seq: int,
    named: int | None,
    expect: int | None,
    prev: str | None,
    notes: list[str],
) -> str | None:
    """Why one record breaks the chain (audit-v1 §5), or None."""
    if named is not None and named != seq:
        return f"the file is named for seq {named} but starts at seq {seq}"
    if rec.get("hash") != record_hash(rec):
        return "the record was edited (its hash does not match)"
    if expect is not None and seq != expect:
        what = "missing records before it" if seq > expect else "out of order"
        return f"seq {seq} where {expect} was expected ({what})"
    if prev is None:
        if seq == 1 and rec.get("prev") != ZERO_HASH:
            return "seq 1 does not start a chain"
        if seq != 1:
            notes.append(f"records before seq {seq} were rotated away")
    elif rec.get("prev") != prev:
        return (
            "the link to the record before is broken (a record was removed, replaced or reordered)"
        )
    if rec.get("event") == "audit_anchor_lost":
        return (
            f"the anchor was lost after seq {rec.get('last_seq_found')}: the log may "
            "have been cut there"
        )
    return None


def verify(directory: Path) -> AuditReport:
    """Read every file of the log in ``directory`` and check the chain and the anchor.

    Raises AuditFormatError for a file or anchor of an unknown version (the
    reader refuses it rather than misjudge it)."""
    rep = AuditReport()
    head = _read_head(directory / HEAD)
    files = log_files(directory)
    rep.files = [str(p) for p in files]
    if head is None:
        if files:
            rep.problems.append(
                AuditProblem(str(directory / HEAD), 0, "the anchor is missing (removed?)")
            )
        return rep
    prev: str | None = None
    expect: int | None = head.oldest
    last: dict[str, Any] | None = None
    last_where = AuditProblem(str(directory / HEAD), 0, "")
    for path in files:
        m = _ROTATED_RE.match(path.name)
        try:
            data = path.read_bytes()
        except OSError as exc:
            rep.problems.append(AuditProblem(str(path), 0, f"unreadable: {exc}"))
            continue
        lines = data.split(b"\n")
        torn = lines.pop() if lines else b""
        for i, raw in enumerate(lines, start=1):
            try:
                rec = json.loads(raw)
                if not isinstance(rec, dict):
                    raise ValueError("not an object")
            except ValueError as exc:
                rep.problems.append(AuditProblem(str(path), i, f"not a JSON record ({exc})"))
                continue
            if rec.get("v") != AUDIT_VERSION:
                raise AuditFormatError(
                    f"{path}:{i}: audit record version {rec.get('v')!r}; this kvoffload "
                    f"reads version {AUDIT_VERSION}"
                )
            seq = rec.get("seq")
            if not isinstance(seq, int) or isinstance(seq, bool):
                rep.problems.append(AuditProblem(str(path), i, "the record has no seq"))
                continue
            named = int(m.group(1)) if m is not None and i == 1 else None
            reason = _check(rec, seq, named, expect, prev, rep.notes)
            if reason is not None:
                rep.problems.append(AuditProblem(str(path), i, reason))
            # Go on from this record: every later break is reported too, and
            # the records stay readable.
            prev = rec.get("hash")
            expect = seq + 1
            last = rec
            last_where = AuditProblem(str(path), i, "")
            rep.records.append(rec)
        if torn:
            if path.name != ACTIVE:
                rep.problems.append(
                    AuditProblem(str(path), len(lines) + 1, "a partial line in a rotated file")
                )
                continue
            rep.notes.append(
                f"{path}:{len(lines) + 1}: a partial last line (a crash while writing it); ignored"
            )
    _check_anchor(rep, directory, head, last, last_where)
    return rep


def _check_anchor(
    rep: AuditReport,
    directory: Path,
    head: _Head,
    last: dict[str, Any] | None,
    last_where: AuditProblem,
) -> None:
    """Whether the log's last record (``last``, found at ``last_where``) is the
    one its anchor names (audit-v1 §5): a problem in ``rep`` where it is not."""
    end_seq = last["seq"] if last is not None else 0
    end_hash = last["hash"] if last is not None else ZERO_HASH
    if last is None and head.seq == 0:
        return
    if (end_seq, end_hash) == (head.seq, head.hash):
        return
    if last is not None and end_seq == head.seq + 1 and last.get("prev") == head.hash:
        rep.notes.append(
            f"the anchor is one record behind (seq {head.seq}; a crash before its update)"
        )
        return
    where = last_where.file if last is not None else str(directory / ACTIVE)
    line = last_where.line if last is not None else 0
    if end_seq < head.seq:
        reason = (
            f"the log ends at seq {end_seq} but its anchor says {head.seq}: "
            f"{head.seq - end_seq} record(s) cut from the tail"
        )
    else:
        reason = (
            f"the last record (seq {end_seq}) does not match the anchor (seq {head.seq}): "
            "the tail was replaced"
        )
    rep.problems.append(AuditProblem(where, line, reason))


__all__ = [
    "ACTIVE",
    "AUDIT_VERSION",
    "HEAD",
    "AuditFormatError",
    "AuditLog",
    "AuditProblem",
    "AuditReport",
    "canonical",
    "log_files",
    "record_hash",
    "rotated_files",
    "verify",
]
