"""The LMCache tier: LMCache 0.5.6's real MP server with kvoffload's L2 plugin, a real
sidecar process. Runs in .venv-lmcache (make pytest-lmcache); skipped elsewhere."""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..sidecar_proc import DevSidecar, dev_sidecar
from .mp_server import MPServer, Worker, plugin_spec

#: Without LMCache (kvoffload's own venv) this folder holds no tests to collect.
collect_ignore_glob = [] if importlib.util.find_spec("lmcache") else ["test_*.py"]

#: The policy the plugin runs with: two tenants by salt, unsalted requests to
#: "default", and any other salt not cached.
TENANTS = {"alice": "alice", "bob": "bob", "": "default"}


@pytest.fixture(scope="module")
def sidecar() -> Iterator[DevSidecar]:
    with dev_sidecar() as sc:
        yield sc


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvo-lmc-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def mp_server(sidecar: DevSidecar, workdir: Path) -> Iterator[MPServer]:
    spec = plugin_spec(socket=str(sidecar.socket_path), tenants=TENANTS, default_tenant=None)
    srv = MPServer(workdir, [spec]).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def worker(mp_server: MPServer) -> Iterator[Worker]:
    w = Worker(mp_server.url)
    try:
        yield w
    finally:
        w.close()
