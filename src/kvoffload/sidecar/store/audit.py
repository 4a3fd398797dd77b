"""The store's audit log: ``<index_dir>/audit.jsonl``, one JSON object a line.

Purges and key events (the keyring writes through the same log) are appended
and fsync'd before the call returns, so they leave a trace even if the
process crashes next.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import StoreIOError

log = logging.getLogger("kvoffload.store")


class AuditLog:
    """Append-only, fsync'd audit records; ``hook`` (the server's) sees each one too."""

    def __init__(
        self, path: Path, hook: Callable[[str, dict[str, Any]], None] | None = None
    ) -> None:
        self.path = path
        self._hook = hook

    def __call__(self, event: str, details: dict[str, Any]) -> None:
        entry = {"ts": time.time(), "event": event, **details}
        line = json.dumps(entry, sort_keys=True)
        log.info("audit: %s", line)
        # Append-only, fsync'd: a purge or revocation must leave a trace even if we crash next.
        # 0600 whatever the umask: tenant names and their create/purge events.
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            with open(fd, "a", encoding="utf-8") as f:
                if os.fstat(fd).st_mode & 0o077:
                    os.fchmod(fd, 0o600)
                f.write(line + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:  # a full or failing disk: one clear error, not a traceback
            raise StoreIOError(
                f"writing the audit log {self.path} failed: {exc}", exc.errno
            ) from exc
        if self._hook is not None:
            self._hook(event, details)
