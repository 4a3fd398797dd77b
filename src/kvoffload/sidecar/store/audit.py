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
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self._hook is not None:
            self._hook(event, details)
