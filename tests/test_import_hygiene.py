"""The worker side imports nothing from the daemon: no ``kvoffload.sidecar*``, no LMDB.

A worker process (the vLLM connector) loads ``kvoffload.client`` and, on the
direct path, ``kvoffload.client.direct`` and its GPU probe; none of them may pull in
the sidecar package (store, keyring, server) or its dependencies.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

WORKER_MODULES = [
    "kvoffload.client",
    "kvoffload.client.direct",
    "kvoffload.posix",
    "kvoffload.gpu_probe",
]


def _loaded_after(code: str) -> list[str]:
    script = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    mods: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return mods


def _forbidden(mods: list[str]) -> list[str]:
    return [
        m
        for m in mods
        if m == "kvoffload.sidecar" or m.startswith("kvoffload.sidecar.") or m == "lmdb"
    ]


@pytest.mark.parametrize("module", WORKER_MODULES)
def test_a_worker_module_loads_no_daemon_code(module: str) -> None:
    mods = _loaded_after(f"import {module}")
    assert module in mods
    assert _forbidden(mods) == []


def test_client_and_direct_together_and_the_direct_backend_choice() -> None:
    # select() runs the GPU probe (without a driver it answers at once).
    mods = _loaded_after(
        "import kvoffload.client, kvoffload.client.direct\n"
        "import os\n"
        "os.environ.pop('KVOFFLOAD_DIRECT_IO', None)\n"
        "kvoffload.client.direct.select()\n"
    )
    assert {"kvoffload.client", "kvoffload.client.direct", "kvoffload.gpu_probe"} <= set(mods)
    assert _forbidden(mods) == []


def test_the_old_probe_name_is_the_same_module() -> None:
    import kvoffload.gpu_probe

    assert kvoffload.gpu_probe is kvoffload.gpu_probe
