"""The persistent secret behind fake salts (protocol-v1.md §5.1)."""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from kvoffload.posix import atomic_create

log = logging.getLogger("kvoffload.server")

SECRET_SIZE = 32


def load_or_create_secret(path: str | os.PathLike[str]) -> bytes:
    """The persistent secret behind fake salts (protocol-v1.md §5.1), created 0600 on first use.

    It must persist: a fake salt that changed on restart would tell a prober
    the tenant is not real, since real salts never change.

    Creation is atomic: the secret is written and fsync'd under a temp name in
    the same directory, linked to its name (a link never replaces) and the
    directory fsync'd. A crash leaves no file or the whole one; of two first
    starts at once, one creates it and the other reads that one.

    A file shorter than 32 bytes can only be what a creation that crashed
    left (before this, the file was created first and written after), so no
    fake salt was ever derived from it: it is replaced atomically by a new
    secret, with a warning in the log. A longer file was not written by the
    sidecar and is refused (ValueError) with what to do.
    """
    p = Path(path)
    for _ in range(8):
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            secret = os.urandom(SECRET_SIZE)
            try:
                atomic_create(p, secret, mode=0o600)
            except FileExistsError:
                continue  # another start created it first: use that one
            return secret
        if len(data) == SECRET_SIZE:
            return data
        if len(data) > SECRET_SIZE:
            raise ValueError(
                f"{p}: server secret is {len(data)} bytes, not {SECRET_SIZE}, and was not "
                "written by the sidecar; restore the original or delete the file to have a "
                "new one created (fake salts then change once)"
            )
        _replace_torn_secret(p)
    raise RuntimeError(f"{p}: the server secret keeps changing; is another process writing it?")


def _replace_torn_secret(p: Path) -> None:
    """Replace a short secret file, unless another start (holding its lock) did already."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        st = os.fstat(fd)
        try:
            now = os.stat(p)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino) or st.st_size >= SECRET_SIZE:
            return
        log.warning(
            "%s: server secret is %d bytes, left by a start that crashed while creating it; "
            "replacing it with a new one",
            p,
            st.st_size,
        )
        atomic_create(p, os.urandom(SECRET_SIZE), mode=0o600, replace=True)
    finally:
        os.close(fd)


__all__ = ["SECRET_SIZE", "load_or_create_secret"]
