"""The key-encryption key (KEK) that wraps the tenants' secrets in key files.

Part of the keyring (``kvoffload.store.keys.keyring`` re-exports everything
here); ``docs/spec/keys-v1.md`` specifies the KEK file and the KEK id. ::

    Kek           a 32-byte KEK read from a credential file outside the store
                  (systemd LoadCredential=), or a development KEK generated on demand
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
from pathlib import Path

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvoffload.errors import KeyringError

from ...posix import atomic_create, fsync_dir

__all__ = ["KEK_SIZE", "NONCE_SIZE", "Kek"]

# The keyring's logger, as before the KEK code moved here: logging
# configurations that name it keep catching these warnings.
log = logging.getLogger("kvoffload.store.keys.keyring")

KEK_SIZE = 32
NONCE_SIZE = 12

_KEK_ID_PERSON = b"kvo-kek-id"
_MAX_KEK_FILE = 4096
_HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")


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
    def generate_dev(cls, path: str | os.PathLike[str], *, banner: bool = True) -> Kek:
        """Create a random KEK file (mode 0600) for development, or load the existing one.

        Safe against a concurrent creator: the file is written under a temp name
        and linked into place, so a loser loads the winner's complete file.
        ``banner``: the loud multi-line warning (the sidecar, once at start);
        without it a one-line reminder (the short-lived CLI commands).
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
        if not banner:
            log.warning(
                "development KEK %s (id %s) %s: not for production",
                p,
                kek.key_id,
                "was just generated" if created else "in use",
            )
            return kek
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
