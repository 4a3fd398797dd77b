"""``kvoffload doctor``: what the node offers for I/O and what auto picks, as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvoffload.gpu_probe import probe
from kvoffload.store.iobackend import probe_direct
from tests.helpers.paths import REPO
from tests.helpers.stores import open_store

REPO = REPO


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    env.update(extra)
    return env


def doctor(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "--root", str(root), "doctor", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=_env(**env),
    )


def test_doctor_json_names_the_backend_auto_chose(tmp_path: Path, kek_file: Path) -> None:
    open_store(tmp_path, kek_file).close()
    proc = doctor(tmp_path / "store", "--json")
    assert proc.returncode == 0, proc.stderr
    data: dict[str, Any] = json.loads(proc.stdout)
    here = probe()
    assert data["auto"]["backend"] in ("posix", "kvikio")
    if not here.driver_present:
        assert data["auto"]["backend"] == "posix"
        assert "libcuda.so.1 not found" in data["auto"]["reason"]
        assert data["gpu"]["child"] is None  # no subprocess on a node without the driver
        assert data["gpu"]["libcuda"] is None
        assert data["direct_path"]["backend"] == "posix"
        assert "host memory" in data["direct_path"]["reason"]
    else:
        assert data["direct_path"]["backend"] == ("kvikio" if here.kvikio_usable else "posix")
    objects = data["paths"]["objects"]
    assert objects["path"] == str(tmp_path / "store" / "objects")
    assert objects["exists"] is True and objects["fs_type"]
    assert objects["o_direct"] is probe_direct(tmp_path / "store" / "objects").supported
    index = data["paths"]["index"]
    assert index["path"] == str(tmp_path / "store.index") and index["fs_type"]
    assert data["configured_io"] == "auto" and "configured" not in data
    for k in ("nvidia_fs", "libcufile_version", "kvikio", "nvidia_devices", "cuda_driver_version"):
        assert k in data["gpu"]
    if objects["o_direct"] and data["auto"]["backend"] == "posix":
        assert data["auto"]["summary"].startswith("posix (O_DIRECT writes of fsync'd objects")
    # The probe files are gone.
    assert not [p for p in (tmp_path / "store" / "objects").iterdir()]


def test_doctor_reports_an_unavailable_configured_backend_and_exits_0(
    tmp_path: Path, kek_file: Path
) -> None:
    open_store(tmp_path, kek_file).close()
    proc = doctor(tmp_path / "store", "--json", KVOFFLOAD_IO="kvikio")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["configured_io"] == "kvikio"
    if not probe().driver_present:
        assert data["configured"]["backend"] is None
        assert "libcuda.so.1 not found" in data["configured"]["error"]
        assert data["auto"]["backend"] == "posix"


def test_doctor_runs_while_the_store_is_open_and_without_a_store(
    tmp_path: Path, kek_file: Path
) -> None:
    s = open_store(tmp_path, kek_file)
    try:
        proc = doctor(tmp_path / "store")  # human output; the index lock is held by us
    finally:
        s.close()
    assert proc.returncode == 0, proc.stderr
    assert "auto chooses" in proc.stdout and "objects dir" in proc.stdout
    proc = doctor(tmp_path / "missing", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["paths"]["objects"]["exists"] is False
    assert data["paths"]["objects"]["o_direct"] is None
    assert not (tmp_path / "missing").exists()  # doctor creates nothing
