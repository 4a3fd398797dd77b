"""Per-tenant secrets (salt and data keys), wrapped by a key-encryption key.

``docs/spec/keys-v1.md`` is the normative description of the key files; this
module implements it. ::

    Kek           the node's or cluster's key-encryption key, read from a
                  credential file outside the store (systemd LoadCredential=)
    TenantKeys    one tenant's unwrapped salt and AES-256 data keys (DEKs), by epoch
    Keyring       <store>/keys/<tenant>.key: create, read (cached at most
                  cache_ttl_s), rotate the DEK, crypto-erase, re-wrap under a new KEK
    KeyringError  everything that goes wrong here: wrong KEK, corrupt or unknown
                  key file, I/O errors (lower-layer errors are chained as __cause__)

Purges travel between nodes sharing a store through the key files alone: a
destroyed file makes every node's ``get`` return None once its cached copy,
at most ``cache_ttl_s`` old, expires.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvoffload.contract import TENANT_RE
from kvoffload.errors import KeyringError

from ..posix import atomic_create, fsync_dir, pwrite_all

__all__ = [
    "DEK_SIZE",
    "FORMAT_VERSION",
    "KEK_SIZE",
    "KEY_SUFFIX",
    "MAX_EPOCH",
    "SALT_SIZE",
    "AuditHook",
    "Kek",
    "Keyring",
    "KeyringError",
    "TenantKeys",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
KEK_SIZE = 32
DEK_SIZE = 32
SALT_SIZE = 32
NONCE_SIZE = 12
TAG_SIZE = 16
#: Object headers store the key epoch as a u32, and 0 means "not sealed".
MAX_EPOCH = 2**32 - 1
KEY_SUFFIX = ".key"
LOCK_NAME = ".lock"

AuditHook = Callable[[str, dict[str, Any]], None]

_WRAP_PREFIX = b"kvo-wrap-v1"
_KEK_ID_PERSON = b"kvo-kek-id"
# Tenant ids may contain '-' and '.', so the random part comes first and the
# tenant is everything after it: a prefix match can never catch "acme-2" for "acme".
_SCRATCH_RE = re.compile(r"\.(?:tmp|erase)-[0-9a-f]{16}-(.+)")
_MAX_KEY_FILE = 16 * 2**20
_MAX_KEK_FILE = 4096
_HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")
_TOP_FIELDS = frozenset(
    {"format", "tenant", "kek_id", "created", "current_epoch", "salt", "epochs"}
)
_SALT_FIELDS = frozenset({"nonce", "ct"})
_EPOCH_FIELDS = frozenset({"nonce", "ct", "created"})
# A reader that opened a key file just before a destroy renamed and overwrote
# it reads random bytes; it retries when the name no longer points at that inode.
_READ_ATTEMPTS = 3
# After losing a creation race the winner's file is there by definition, but an
# NFS client may still hold a negative lookup for it for a moment.
_LOST_RACE_WAITS_S = (0.0, 0.05, 0.1, 0.2, 0.4)
_NO_LOCK_ERRNOS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})


def _salt_aad(tenant: str) -> bytes:
    return b"|".join((_WRAP_PREFIX, b"salt", tenant.encode("ascii")))


def _dek_aad(tenant: str, epoch: int) -> bytes:
    return b"|".join((_WRAP_PREFIX, b"dek", tenant.encode("ascii"), str(epoch).encode("ascii")))


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _fsync_dir(path: Path) -> None:
    try:
        fsync_dir(path)
    except OSError as exc:
        raise KeyringError(f"cannot fsync directory {path}: {exc}") from exc


def _looks_like_text(data: bytes) -> bool:
    return all(0x20 <= b < 0x7F or b in b"\t\n\r" for b in data)


def _parse_kek(data: bytes, where: Path) -> bytes:
    # A raw key is exactly 32 bytes and binary. 32 printable characters are far
    # likelier a 16-byte hex key or a password than a random key (chance of a
    # random key being all printable: ~1e-14), so they are refused, not used.
    if len(data) == KEK_SIZE and not _looks_like_text(data):
        return data
    text = b"".join(data.split())
    if len(text) == 2 * KEK_SIZE and all(c in _HEX_DIGITS for c in text):
        return bytes.fromhex(text.decode("ascii"))
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) == KEK_SIZE:
        return raw
    raise KeyringError(
        f"KEK file {where}: expected 32 raw bytes, 64 hex digits or base64 of 32 bytes "
        f"(whitespace ignored); found {len(data)} bytes of something else"
    )


class Kek:
    """A 32-byte key-encryption key; it wraps the tenants' secrets in key files.

    The KEK lives outside the store (systemd ``LoadCredential=``), never in it:
    whoever holds both the store and the KEK holds every tenant's keys.
    ``key_id`` names it in key files without revealing it.
    """

    __slots__ = ("_aead", "key_id", "source")

    def __init__(self, key: bytes, *, source: Path | None = None) -> None:
        if len(key) != KEK_SIZE:
            raise KeyringError(f"a KEK is {KEK_SIZE} bytes, got {len(key)}")
        # Only the AESGCM object keeps the key: one copy fewer in memory.
        self._aead = AESGCM(bytes(key))
        self.key_id: str = hashlib.blake2b(
            bytes(key), digest_size=8, person=_KEK_ID_PERSON
        ).hexdigest()
        self.source: Path | None = source

    def __repr__(self) -> str:
        return f"Kek(key_id={self.key_id!r})"

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Kek:
        """Load a KEK from 32 raw bytes, 64 hex digits or base64 of 32 bytes."""
        p = Path(path)
        try:
            with open(p, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                data = f.read(_MAX_KEK_FILE + 1)
        except OSError as exc:
            raise KeyringError(f"cannot read KEK file {p}: {exc.strerror or exc}") from exc
        if mode & 0o044:
            log.warning(
                "KEK file %s is readable by its group or by others (mode %03o); "
                "anyone who can read it can unwrap every tenant's keys: chmod 0400 it",
                p,
                mode & 0o777,
            )
        if len(data) > _MAX_KEK_FILE:
            raise KeyringError(f"KEK file {p}: too large to be a key")
        return cls(_parse_kek(data, p), source=p)

    @classmethod
    def generate_dev(cls, path: str | os.PathLike[str]) -> Kek:
        """Create a random KEK file (mode 0600) for development, or load the existing one.

        Safe against a concurrent creator: the file is written under a temp name
        and linked into place, so a loser loads the winner's complete file.
        """
        p = Path(path)
        try:
            p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            data = os.urandom(KEK_SIZE).hex().encode("ascii") + b"\n"
            created = True
            try:
                atomic_create(p, data, mode=0o600)  # linked: never replaces
            except FileExistsError:
                created = False
        except OSError as exc:
            raise KeyringError(f"cannot create development KEK {p}: {exc}") from exc
        if not created:
            _fsync_dir(p.parent)  # the winner's name, durable before we rely on it
        kek = cls.from_file(p)
        log.warning(
            "\n%s\nDEVELOPMENT KEK %s (id %s) %s. It sits in a plain file on this machine: "
            "anyone who can read it can decrypt every tenant's cached KV. NEVER use it in "
            "production; give the sidecar a KEK through systemd LoadCredential= instead.\n%s",
            "!" * 78,
            p,
            kek.key_id,
            "was just generated" if created else "is in use",
            "!" * 78,
        )
        return kek

    def _wrap(self, secret: bytes, aad: bytes) -> dict[str, str]:
        # Random nonces: a KEK wraps a few values per tenant and rotation,
        # nowhere near the 2**32 bound on random 96-bit GCM nonces.
        nonce = os.urandom(NONCE_SIZE)
        ct = self._aead.encrypt(nonce, secret, aad)
        return {"nonce": base64.b64encode(nonce).decode(), "ct": base64.b64encode(ct).decode()}

    def _unwrap(self, nonce: bytes, ct: bytes, aad: bytes) -> bytes:
        return self._aead.decrypt(nonce, ct, aad)


@dataclass(frozen=True, eq=False)
class TenantKeys:
    """One tenant's unwrapped secrets.

    Hold one only for the operation at hand and ask the keyring again for the
    next: the keyring's cache bound is what makes a purge reach this process.
    ``repr`` never shows a secret.
    """

    tenant: str
    #: 32 secret bytes, the BLAKE2b key of the tenant's chunk keys; fixed for life.
    salt: bytes = field(repr=False)
    #: The epoch new objects are sealed under.
    current_epoch: int
    #: AES-256 data keys by epoch; old epochs stay so that old objects open.
    deks: dict[int, bytes] = field(repr=False)
    _aeads: dict[int, AESGCM] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.salt) != SALT_SIZE:
            raise ValueError(f"tenant salt must be {SALT_SIZE} bytes")
        if any(len(k) != DEK_SIZE for k in self.deks.values()):
            raise ValueError(f"data keys must be {DEK_SIZE} bytes")
        if self.current_epoch not in self.deks:
            raise ValueError(f"no data key for the current epoch {self.current_epoch}")

    def aead(self, epoch: int) -> AESGCM | None:
        """The AES-256-GCM of ``epoch``, or None when the tenant has no such epoch."""
        aead = self._aeads.get(epoch)
        if aead is None:
            dek = self.deks.get(epoch)
            if dek is None:
                return None
            # setdefault: two threads racing here end up sharing one object.
            aead = self._aeads.setdefault(epoch, AESGCM(dek))
        return aead


@dataclass(frozen=True)
class _Record:
    """A decoded key file: the secrets plus the metadata a rewrite must keep."""

    keys: TenantKeys
    kek_id: str
    created: str
    epoch_created: dict[int, str]


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate field {k!r}")
        out[k] = v
    return out


class Keyring:
    """The tenants' key files in ``keys_dir`` (``<store root>/keys``), one per tenant.

    Reads accept a file wrapped by ``kek`` or by any of ``previous_keks``
    (matched by ``kek_id``); every write wraps with ``kek``. That is what makes
    a KEK rotation restartable and rolling:

    1. give every node the new KEK as ``kek`` and the old one in
       ``previous_keks`` (restart them); from then on every write uses the new KEK;
    2. on one node call ``rotate_kek(new_kek)``; if it is killed half-way, old-
       and new-wrapped files coexist and calling it again finishes the job
       (it returns how many files it re-wrapped, 0 once none is left);
    3. drop the old KEK from every node and destroy every copy of it. Only then
       are stale copies of key files (backups, snapshots, remapped sectors),
       including those of destroyed tenants, useless.

    Unwrapped keys are cached in memory for at most ``cache_ttl_s`` seconds,
    counted from the start of the read that produced them; ``0`` disables the
    cache. That bound is how a ``destroy`` on one node reaches every node that
    shares the store. Mutations hold an advisory ``flock`` on ``keys_dir/.lock``
    so that processes (and nodes, where the filesystem supports it) never lose
    each other's updates; all methods are thread-safe.

    ``audit(event, details)`` is called after ``ensure_tenant`` created a
    tenant ("create_tenant"), ``destroy``, ``rotate_dek`` and ``rotate_kek``,
    with details that hold no secret. An exception it raises propagates.
    """

    def __init__(
        self,
        keys_dir: str | os.PathLike[str],
        kek: Kek,
        cache_ttl_s: float = 30.0,
        *,
        previous_keks: Sequence[Kek] = (),
        audit: AuditHook | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not cache_ttl_s >= 0:
            raise ValueError(f"cache_ttl_s must be >= 0, got {cache_ttl_s!r}")
        self._dir = Path(keys_dir)
        self._kek = kek
        self._keks: dict[str, Kek] = {kek.key_id: kek}
        for old in previous_keks:
            self._keks.setdefault(old.key_id, old)
        self._ttl = float(cache_ttl_s)
        self._audit = audit
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, TenantKeys]] = {}
        self._warned_no_flock = False
        for k in self._keks.values():
            self._check_kek_location(k)
        try:
            self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise KeyringError(f"cannot create keys directory {self._dir}: {exc}") from exc
        self._finish_interrupted_erasures()

    @property
    def keys_dir(self) -> Path:
        return self._dir

    @property
    def kek_id(self) -> str:
        """Id of the KEK that new writes use."""
        return self._kek.key_id

    @property
    def cache_ttl_s(self) -> float:
        return self._ttl

    # -- public operations ---------------------------------------------------

    def get(self, tenant: str) -> TenantKeys | None:
        """The tenant's keys, or None when it has no key file (never created, or destroyed)."""
        path = self._path(tenant)
        with self._lock:
            now = self._clock()
            hit = self._cache.get(tenant)
            if hit is not None and now < hit[0]:
                return hit[1]
            self._cache.pop(tenant, None)
            rec = self._load(tenant, path)
            if rec is None:
                return None
            self._remember(rec.keys, now)
            return rec.keys

    def ensure_tenant(self, tenant: str) -> TenantKeys:
        """The tenant's keys, created (salt + DEK of epoch 1) if it has none.

        Racing creators, in this or another process or node, all end up with
        the keys of the one whose file was linked into place first.
        """
        path = self._path(tenant)
        with self._lock:
            hit = self._cache.get(tenant)
            if hit is not None and self._clock() < hit[0]:
                return hit[1]
        created = False
        with self._locked():
            now = self._clock()
            rec = self._load(tenant, path)
            if rec is None:
                fresh = self._new_record(tenant)
                try:
                    # Linked, never replaced: if another creator got there
                    # first (a node without working flock), theirs stands.
                    atomic_create(
                        path,
                        self._encode(fresh, self._kek),
                        mode=0o600,
                        tmp_name=self._tmp_name(tenant),
                    )
                    created = True
                except FileExistsError:
                    _fsync_dir(self._dir)
                except OSError as exc:
                    raise KeyringError(f"cannot create key file {path}: {exc}") from exc
                rec = fresh if created else self._load_after_lost_race(tenant, path)
            self._remember(rec.keys, now)
        if created:
            self._emit("create_tenant", {"tenant": tenant, "epoch": 1, "kek_id": self.kek_id})
        return rec.keys

    def tenants(self) -> list[str]:
        """Tenants that have a key file, sorted."""
        try:
            names = os.listdir(self._dir)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise KeyringError(f"cannot list {self._dir}: {exc}") from exc
        out = []
        for name in names:
            if name.endswith(KEY_SUFFIX):
                tenant = name[: -len(KEY_SUFFIX)]
                if TENANT_RE.fullmatch(tenant):
                    out.append(tenant)
        return sorted(out)

    def rotate_dek(self, tenant: str) -> int:
        """Add a new epoch with a fresh DEK and make it current; returns the new epoch.

        Old epochs stay, so objects sealed under them still open. This is how
        the number of GCM nonces drawn under one DEK stays below 2**32.
        """
        path = self._path(tenant)
        with self._locked():
            now = self._clock()
            rec = self._load(tenant, path)
            if rec is None:
                raise KeyringError(f"tenant {tenant!r} has no keys to rotate")
            old = rec.keys.current_epoch
            new = old + 1
            if new > MAX_EPOCH:
                raise KeyringError(f"tenant {tenant!r} has used every key epoch")
            deks = dict(rec.keys.deks)
            deks[new] = os.urandom(DEK_SIZE)
            rotated = _Record(
                keys=TenantKeys(tenant, rec.keys.salt, new, deks),
                kek_id=self._kek.key_id,
                created=rec.created,
                epoch_created={**rec.epoch_created, new: _now()},
            )
            self._replace(tenant, path, self._encode(rotated, self._kek))
            self._remember(rotated.keys, now)
        self._emit("rotate_dek", {"tenant": tenant, "epoch": new, "previous_epoch": old})
        return new

    def destroy(self, tenant: str) -> bool:
        """Crypto-erase the tenant: its key file is overwritten with random bytes and removed.

        Returns whether a key file existed. Leftover temp files of the tenant
        are erased too, so that afterwards nothing in ``keys_dir`` unwraps its
        salt or DEKs. Other nodes stop using their cached copy within their
        ``cache_ttl_s``. Copies outside the live file (journal, snapshots,
        backups, remapped sectors) are not reached: see ``rotate_kek``.
        """
        path = self._path(tenant)
        with self._locked():
            self._cache.pop(tenant, None)
            # Rename first, erase after: a reader then sees the whole old file
            # or no file, never the random bytes, and the inode (and so the
            # blocks being overwritten) stays the same.
            grave = self._dir / f".erase-{os.urandom(8).hex()}-{tenant}"
            try:
                os.rename(path, grave)
                existed = True
            except FileNotFoundError:
                existed = False
            except OSError as exc:
                raise KeyringError(f"cannot destroy key file {path}: {exc}") from exc
            for p in self._scratch_files(tenant):
                self._erase(p)
            _fsync_dir(self._dir)
            self._cache.pop(tenant, None)
        self._emit("destroy", {"tenant": tenant, "existed": existed})
        return existed

    def rotate_kek(self, new_kek: Kek) -> int:
        """Re-wrap every tenant's salt and DEKs under ``new_kek``; returns files re-wrapped.

        From the call on, this keyring writes with ``new_kek`` and still reads
        files wrapped by its former KEKs. Files already wrapped by ``new_kek``
        are skipped, so a run that was killed half-way is finished by calling
        this again (with the old KEK among ``previous_keks`` after a restart).
        Each file is replaced atomically and fsync'd. Files that cannot be
        re-wrapped (unknown KEK, corrupt) do not stop the others; a
        ``KeyringError`` naming them is raised at the end.
        """
        self._check_kek_location(new_kek)
        with self._lock:
            previous_id = self._kek.key_id
            self._keks = {new_kek.key_id: new_kek, **self._keks}
            self._kek = new_kek
        rewrapped = 0
        failed: dict[str, str] = {}
        for tenant in self.tenants():
            path = self._path(tenant)
            try:
                with self._locked():
                    rec = self._load(tenant, path)
                    if rec is None or rec.kek_id == new_kek.key_id:
                        continue
                    self._replace(tenant, path, self._encode(rec, new_kek))
                    rewrapped += 1
            except KeyringError as exc:
                failed[tenant] = str(exc)
        self._emit(
            "rotate_kek",
            {
                "kek_id": new_kek.key_id,
                "previous_kek_id": previous_id,
                "rewrapped": rewrapped,
                "failed": sorted(failed),
            },
        )
        if failed:
            detail = "; ".join(f"{t}: {msg}" for t, msg in sorted(failed.items()))
            raise KeyringError(
                f"rotate_kek re-wrapped {rewrapped} key files, {len(failed)} failed: {detail}"
            )
        return rewrapped

    # -- internals -----------------------------------------------------------

    def _path(self, tenant: str) -> Path:
        if not isinstance(tenant, str) or not TENANT_RE.fullmatch(tenant):
            raise KeyringError(
                f"invalid tenant id {tenant!r}: 1-64 characters of [A-Za-z0-9._-], "
                "starting with a letter or digit"
            )
        return self._dir / f"{tenant}{KEY_SUFFIX}"

    def _check_kek_location(self, kek: Kek) -> None:
        if kek.source is None:
            return
        src = kek.source.resolve()
        keys = self._dir.resolve()
        if keys == src.parent or keys in src.parents:
            raise KeyringError(
                f"KEK file {kek.source} is inside the keys directory {self._dir}: the KEK "
                "must never be stored with the keys it wraps"
            )
        if keys.parent in src.parents:
            log.warning(
                "KEK file %s is inside the store root %s: anyone holding a copy of the "
                "store holds every tenant's keys; keep the KEK outside (LoadCredential=)",
                kek.source,
                keys.parent,
            )

    def _remember(self, keys: TenantKeys, read_started: float) -> None:
        # Callers hold self._lock.
        if self._ttl > 0:
            self._cache[keys.tenant] = (read_started + self._ttl, keys)

    def _emit(self, event: str, details: dict[str, Any]) -> None:
        if self._audit is not None:
            self._audit(event, details)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Exclude this process's threads, then other processes, from mutating key files."""
        with self._lock:
            try:
                fd = os.open(self._dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                raise KeyringError(f"cannot open lock file in {self._dir}: {exc}") from exc
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                except OSError as exc:
                    if exc.errno not in _NO_LOCK_ERRNOS:
                        raise KeyringError(f"cannot lock {self._dir / LOCK_NAME}: {exc}") from exc
                    # Creation stays race-free through link(); only concurrent
                    # rotations of one tenant on several nodes can lose one.
                    if not self._warned_no_flock:
                        self._warned_no_flock = True
                        log.warning(
                            "filesystem of %s does not support flock (%s): key rotations "
                            "on several nodes at once may overwrite each other",
                            self._dir,
                            exc.strerror,
                        )
                yield
            finally:
                os.close(fd)

    def _new_record(self, tenant: str) -> _Record:
        now = _now()
        return _Record(
            keys=TenantKeys(tenant, os.urandom(SALT_SIZE), 1, {1: os.urandom(DEK_SIZE)}),
            kek_id=self._kek.key_id,
            created=now,
            epoch_created={1: now},
        )

    def _load_after_lost_race(self, tenant: str, path: Path) -> _Record:
        for wait in _LOST_RACE_WAITS_S:
            time.sleep(wait)
            rec = self._load(tenant, path)
            if rec is not None:
                return rec
        raise KeyringError(
            f"key file {path} existed when creating it, then vanished (destroyed meanwhile?)"
        )

    def _load(self, tenant: str, path: Path) -> _Record | None:
        for attempt in range(_READ_ATTEMPTS):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise KeyringError(f"cannot open key file {path}: {exc}") from exc
            try:
                with os.fdopen(fd, "rb") as f:
                    st = os.fstat(f.fileno())
                    data = f.read(_MAX_KEY_FILE + 1)
            except OSError as exc:
                raise KeyringError(f"cannot read key file {path}: {exc}") from exc
            try:
                if len(data) > _MAX_KEY_FILE:
                    raise KeyringError(f"key file {path} is larger than {_MAX_KEY_FILE} bytes")
                return self._decode(tenant, path, data)
            except KeyringError:
                if attempt + 1 < _READ_ATTEMPTS and not _still_names(path, st):
                    continue
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _decode(self, tenant: str, path: Path, data: bytes) -> _Record:
        def bad(why: str) -> KeyringError:
            return KeyringError(f"key file {path}: {why}")

        try:
            doc = json.loads(data, object_pairs_hook=_no_duplicate_keys)
        except (ValueError, RecursionError) as exc:
            raise bad(f"not a valid JSON key file ({exc})") from exc
        if not isinstance(doc, dict):
            raise bad("not a JSON object")
        fmt = doc.get("format")
        if type(fmt) is not int or fmt != FORMAT_VERSION:
            raise bad(
                f"unknown format {fmt!r}; this kvoffload reads format {FORMAT_VERSION} "
                "(upgrade kvoffload)"
            )
        if doc.keys() != _TOP_FIELDS:
            raise bad(
                f"fields {sorted(doc.keys() ^ _TOP_FIELDS)} are missing or unknown in format 1"
            )
        if doc["tenant"] != tenant:
            raise bad(f"names tenant {doc['tenant']!r}, expected {tenant!r}")
        kek_id = doc["kek_id"]
        if not isinstance(kek_id, str):
            raise bad("kek_id is not a string")
        kek = self._keks.get(kek_id)
        if kek is None:
            others = [k for k in self._keks if k != self._kek.key_id]
            also = f" (previous KEKs: {', '.join(others)})" if others else ""
            raise KeyringError(
                f"key file {path} wrapped by KEK {kek_id}, loaded KEK is {self._kek.key_id}{also}"
            )
        created = _timestamp(doc["created"], bad, "created")
        current = doc["current_epoch"]
        if type(current) is not int or not 1 <= current <= MAX_EPOCH:
            raise bad(f"current_epoch {current!r} is not an integer in 1..{MAX_EPOCH}")
        salt_doc = _fields(doc["salt"], _SALT_FIELDS, bad, "salt")
        epochs_doc = doc["epochs"]
        if not isinstance(epochs_doc, dict) or not epochs_doc:
            raise bad("epochs is not a non-empty object")
        try:
            salt = kek._unwrap(
                _b64(salt_doc["nonce"], NONCE_SIZE, bad, "salt nonce"),
                _b64(salt_doc["ct"], SALT_SIZE + TAG_SIZE, bad, "salt ct"),
                _salt_aad(tenant),
            )
        except InvalidTag as exc:
            raise bad(
                "salt fails authentication (corrupt, tampered, or from another tenant's file)"
            ) from exc
        deks: dict[int, bytes] = {}
        epoch_created: dict[int, str] = {}
        for name, entry_doc in epochs_doc.items():
            if not (name.isascii() and name.isdigit() and str(int(name)) == name):
                raise bad(f"epoch name {name!r} is not a canonical decimal integer")
            epoch = int(name)
            if not 1 <= epoch <= MAX_EPOCH:
                raise bad(f"epoch {epoch} is outside 1..{MAX_EPOCH}")
            entry = _fields(entry_doc, _EPOCH_FIELDS, bad, f"epoch {epoch}")
            epoch_created[epoch] = _timestamp(entry["created"], bad, f"epoch {epoch} created")
            try:
                deks[epoch] = kek._unwrap(
                    _b64(entry["nonce"], NONCE_SIZE, bad, f"epoch {epoch} nonce"),
                    _b64(entry["ct"], DEK_SIZE + TAG_SIZE, bad, f"epoch {epoch} ct"),
                    _dek_aad(tenant, epoch),
                )
            except InvalidTag as exc:
                raise bad(
                    f"data key of epoch {epoch} fails authentication (corrupt, tampered, "
                    "or moved from another tenant or epoch)"
                ) from exc
        if current != max(deks):
            raise bad(f"current_epoch {current} is not the newest epoch {max(deks)}")
        return _Record(
            keys=TenantKeys(tenant, salt, current, deks),
            kek_id=kek_id,
            created=created,
            epoch_created=epoch_created,
        )

    def _encode(self, rec: _Record, kek: Kek) -> bytes:
        t = rec.keys.tenant
        epochs = {
            str(e): {**kek._wrap(rec.keys.deks[e], _dek_aad(t, e)), "created": rec.epoch_created[e]}
            for e in sorted(rec.keys.deks)
        }
        doc = {
            "format": FORMAT_VERSION,
            "tenant": t,
            "kek_id": kek.key_id,
            "created": rec.created,
            "current_epoch": rec.keys.current_epoch,
            "salt": kek._wrap(rec.keys.salt, _salt_aad(t)),
            "epochs": epochs,
        }
        return (json.dumps(doc, indent=2) + "\n").encode("ascii")

    @staticmethod
    def _tmp_name(tenant: str) -> str:
        # The tenant is in the name so that destroy() finds and erases a temp
        # file a crashed writer left behind (_SCRATCH_RE).
        return f".tmp-{os.urandom(8).hex()}-{tenant}"

    def _replace(self, tenant: str, path: Path, data: bytes) -> None:
        try:
            atomic_create(path, data, mode=0o600, replace=True, tmp_name=self._tmp_name(tenant))
        except OSError as exc:
            raise KeyringError(f"cannot replace key file {path}: {exc}") from exc

    def _scratch_files(self, tenant: str) -> list[Path]:
        try:
            names = os.listdir(self._dir)
        except OSError as exc:
            raise KeyringError(f"cannot list {self._dir}: {exc}") from exc
        out = []
        for name in names:
            m = _SCRATCH_RE.fullmatch(name)
            if m is not None and m.group(1) == tenant:
                out.append(self._dir / name)
        return out

    def _finish_interrupted_erasures(self) -> None:
        try:
            names = os.listdir(self._dir)
        except OSError as exc:
            raise KeyringError(f"cannot list {self._dir}: {exc}") from exc
        graves = [self._dir / n for n in names if n.startswith(".erase-")]
        for p in graves:
            log.warning("finishing the interrupted crypto-erase of %s", p)
            self._erase(p)
        if graves:
            _fsync_dir(self._dir)

    @staticmethod
    def _erase(path: Path) -> None:
        """Overwrite a file's bytes in place with random ones, fsync, then unlink it."""
        try:
            # No O_TRUNC: the point is to overwrite the blocks holding the
            # wrapped keys, not to free them.
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return  # another process finished this erasure
        except OSError as exc:
            raise KeyringError(f"cannot erase {path}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            pos = 0
            while pos < size:
                n = min(size - pos, 1 << 20)
                pwrite_all(fd, os.urandom(n), pos)
                pos += n
            os.fsync(fd)
        except OSError as exc:
            raise KeyringError(f"cannot erase {path}: {exc}") from exc
        finally:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _still_names(path: Path, st: os.stat_result) -> bool:
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


def _fields(
    value: Any, names: frozenset[str], bad: Callable[[str], KeyringError], what: str
) -> dict[str, Any]:
    if not isinstance(value, dict) or value.keys() != names:
        raise bad(f"{what} must be an object with exactly the fields {sorted(names)}")
    return value


def _b64(value: Any, size: int, bad: Callable[[str], KeyringError], what: str) -> bytes:
    if not isinstance(value, str):
        raise bad(f"{what} is not a string")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad(f"{what} is not valid base64") from exc
    # Canonical form only, so no two files (or bit flips) encode the same bytes.
    if len(raw) != size or base64.b64encode(raw).decode("ascii") != value:
        raise bad(f"{what} is not the canonical base64 of {size} bytes")
    return raw


def _timestamp(value: Any, bad: Callable[[str], KeyringError], what: str) -> str:
    if not isinstance(value, str):
        raise bad(f"{what} is not a string")
    try:
        datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ")
    except ValueError as exc:
        raise bad(f"{what} {value!r} is not a UTC timestamp YYYY-MM-DDTHH:MM:SSZ") from exc
    return value
