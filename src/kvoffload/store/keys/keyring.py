"""Per-tenant secrets (salt and data keys), wrapped by a key-encryption key.

``docs/spec/keys-v1.md`` is the normative description of the key files; this
module implements it with ``kek`` (the KEK) and ``keyfile`` (the file format),
whose names it re-exports. ::

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

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvoffload.contract import TENANT_RE
from kvoffload.errors import KeyringError

from ...errors import StoreError
from ...layouts.objkey import derive_object_key
from ...posix import atomic_create, pwrite_all

if TYPE_CHECKING:
    from ...layouts.store_root import LayoutInfo
    from ...layouts.v1 import ObjectHeader

from .kek import KEK_SIZE, Kek, _fsync_dir
from .kek import NONCE_SIZE as NONCE_SIZE  # unused here, re-exported
from .keyfile import (
    DEK_SIZE,
    FORMAT_VERSION,
    MAX_EPOCH,
    SALT_SIZE,
    TenantKeys,
    _now,
    _Record,
    _UnknownKek,
    decode_record,
    encode_record,
)
from .keyfile import TAG_SIZE as TAG_SIZE  # unused here, re-exported

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

#: At most one re-read of the KEK file per this many seconds (key files wrapped by
#: a KEK this keyring does not hold: a rotation on another node).
KEK_REREAD_INTERVAL_S = 5.0
#: At most one re-read of a tenant's key file per this many seconds, for objects
#: sealed under an epoch newer than the cached keys know (:meth:`Keyring.aead_for`).
KEY_REREAD_INTERVAL_S = 1.0

KEY_SUFFIX = ".key"
LOCK_NAME = ".lock"

AuditHook = Callable[[str, dict[str, Any]], None]

# Tenant ids may contain '-' and '.', so the random part comes first and the
# tenant is everything after it: a prefix match can never catch "acme-2" for "acme".
_SCRATCH_RE = re.compile(r"\.(?:tmp|erase)-[0-9a-f]{16}-(.+)")
_MAX_KEY_FILE = 16 * 2**20
# A reader that opened a key file just before a destroy renamed and overwrote
# it reads random bytes; it retries when the name no longer points at that inode.
_READ_ATTEMPTS = 3
# After losing a creation race the winner's file is there by definition, but an
# NFS client may still hold a negative lookup for it for a moment.
_LOST_RACE_WAITS_S = (0.0, 0.05, 0.1, 0.2, 0.4)
_NO_LOCK_ERRNOS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})


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
        self._kek_checked = float("-inf")
        #: tenant -> when :meth:`aead_for` last re-read its key file.
        self._rereads: dict[str, float] = {}
        self._kek_lock = threading.Lock()
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
        with self._lock:
            now = self._clock()
            hit = self._cache.get(tenant)
            if hit is not None and now < hit[0]:
                return hit[1]
            self._cache.pop(tenant, None)
            rec = self._load(tenant, self._path(tenant))
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
                        encode_record(fresh, self._kek),
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

    def aead_for(self, tenant: str, tk: TenantKeys | None) -> Callable[[int], AESGCM | None]:
        """The tenant's data key per epoch, from ``tk`` (the cached keys); an epoch
        newer than those (another process or node rotated the DEK since they were
        read) re-reads the key file, at most once per :data:`KEY_REREAD_INTERVAL_S`
        per tenant, rather than make a valid object look corrupt."""

        def lookup(epoch: int) -> AESGCM | None:
            keys = self._keys_with(tenant, tk, epoch)
            return keys.aead(epoch) if keys is not None else None

        return lookup

    def object_aead_for(
        self, tenant: str, tk: TenantKeys | None
    ) -> Callable[[ObjectHeader], AESGCM | None]:
        """The AEAD of each object sealed under its own key (keys-v1.md §14), derived
        from the DEK of its epoch as :meth:`aead_for` finds it; None without one."""

        def lookup(h: ObjectHeader) -> AESGCM | None:
            key = self.object_key(tenant, tk, h)
            return AESGCM(key) if key is not None else None

        return lookup

    def object_key(self, tenant: str, tk: TenantKeys | None, h: ObjectHeader) -> bytes | None:
        """``K_obj`` of the object ``h`` describes (keys-v1.md §14), or None where the
        tenant has no DEK of its epoch (purged, never created, unknown epoch)."""
        keys = self._keys_with(tenant, tk, h.key_epoch)
        dek = keys.deks.get(h.key_epoch) if keys is not None else None
        return derive_object_key(dek, h) if dek is not None else None

    def _keys_with(self, tenant: str, tk: TenantKeys | None, epoch: int) -> TenantKeys | None:
        """``tk``, or the key file re-read where ``epoch`` is newer than ``tk`` knows."""
        if tk is None:
            return None
        if epoch in tk.deks or epoch <= tk.current_epoch:
            return tk
        now = self._clock()
        with self._lock:
            last = self._rereads.get(tenant, float("-inf"))
            reread = now - last >= KEY_REREAD_INTERVAL_S
            if reread:
                self._rereads[tenant] = now
        if reread:
            self.forget(tenant)
        return self.get(tenant)  # re-read, or what another thread just read

    def forget(self, tenant: str) -> None:
        """Drop the tenant's cached keys: the next use reads its key file again
        (another node purged it: stop decrypting now, not at the cache bound)."""
        with self._lock:
            self._cache.pop(tenant, None)

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

    def problems(self) -> dict[str, str]:
        """Tenants whose key file cannot be read or unwrapped, with why (one line each).

        A corrupt key file is that tenant's problem only: its chunks miss, every
        other tenant is served; fsck and inspect report it here.
        """
        out: dict[str, str] = {}
        for tenant in self.tenants():
            try:
                self.get(tenant)
            except KeyringError as exc:
                out[tenant] = str(exc)
        return out

    def kek_ids_on_disk(self) -> set[str]:
        """The ``kek_id`` fields of the key files that parse (nothing is unwrapped):
        which KEKs this store's keys were wrapped by, for a store whose root does
        not record its KEK id yet. Unreadable or corrupt files are skipped."""
        ids: set[str] = set()
        for tenant in self.tenants():
            try:
                with open(self._path(tenant), "rb") as f:
                    doc = json.loads(f.read(_MAX_KEY_FILE))
            except (OSError, ValueError):
                continue
            kid = doc.get("kek_id") if isinstance(doc, dict) else None
            if isinstance(kid, str):
                ids.add(kid)
        return ids

    def check_store_kek(self, layout: LayoutInfo, root: Path) -> None:
        """:class:`StoreError` unless this keyring's KEK is the store's (layout-v1.md §2):
        the id ``layout.json`` records, or the one an unfinished rotation replaces;
        in a root that records none yet, an id its key files name (or none do).
        Unwraps nothing: ``kvoffload config check`` runs it before a start."""
        ours = self._kek.key_id
        if layout.kek_id is None:
            on_disk = self.kek_ids_on_disk()
            if on_disk and ours not in on_disk:
                raise StoreError(
                    f"the KEK given (id {ours}) is not this store's KEK: its key files are "
                    f"wrapped by KEK id {', '.join(sorted(on_disk))}; give the sidecar that KEK"
                )
        elif ours not in (layout.kek_id, layout.kek_id_previous):
            raise StoreError(
                f"the KEK given (id {ours}) is not this store's KEK (id {layout.kek_id}, "
                f"recorded in {root / 'layout.json'}); give the sidecar that KEK"
            )

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
            self._replace(tenant, path, encode_record(rotated, self._kek))
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
                    self._replace(tenant, path, encode_record(rec, new_kek))
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
                return decode_record(tenant, path, data, self._keks, self._kek.key_id)
            except _UnknownKek:
                # Rotated by another node of a shared root: this node's KEK file
                # may hold the new KEK already (the operator's roll-out).
                if self._pick_up_kek():
                    return decode_record(tenant, path, data, self._keks, self._kek.key_id)
                if attempt + 1 < _READ_ATTEMPTS and not _still_names(path, st):
                    continue
                raise
            except KeyringError:
                if attempt + 1 < _READ_ATTEMPTS and not _still_names(path, st):
                    continue
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _pick_up_kek(self) -> bool:
        """Re-read the KEK file this keyring's KEK came from (at most once per
        :data:`KEK_REREAD_INTERVAL_S`); a KEK it does not hold yet becomes the
        current one, the former ones still read. Whether one was picked up."""
        source = self._kek.source
        now = self._clock()
        if source is None or now - self._kek_checked < KEK_REREAD_INTERVAL_S:
            return False
        self._kek_checked = now
        try:
            fresh = Kek.from_file(source)
        except KeyringError as exc:
            log.warning("re-reading the KEK file after a rotation elsewhere: %s", exc)
            return False
        # Not self._lock: get() holds it around _load (it is not reentrant).
        with self._kek_lock:
            if fresh.key_id in self._keks:
                return False
            previous = self._kek.key_id
            self._keks = {fresh.key_id: fresh, **self._keks}
            self._kek = fresh
        self._cache = {}
        log.warning(
            "KEK %s picked up from %s (key files rotated away from KEK %s elsewhere)",
            fresh.key_id,
            source,
            previous,
        )
        return True

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
