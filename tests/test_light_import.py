"""The worker side stays light: no LMDB, no keyring, no daemon code on import."""

from __future__ import annotations

import subprocess
import sys

WORKER_MODULES = ["kvoffload", "kvoffload.contract", "kvoffload.keys", "kvoffload.client"]
FORBIDDEN = ["lmdb", "kvoffload.sidecar", "kvoffload.store.keys.keyring", "kvoffload.store"]


def test_worker_imports_pull_no_store_or_key_code() -> None:
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in WORKER_MODULES)
        + f"bad = [m for m in {FORBIDDEN!r} if m in sys.modules]\n"
        + "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
