"""pyproject.toml: what the package depends on, and the strictness of the test run."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def names(reqs: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~\[;]", r, maxsplit=1)[0].lower() for r in reqs}


def test_the_daemon_depends_on_neither_torch_nor_watchdog() -> None:
    project = pyproject()["project"]
    base = names(project["dependencies"])
    assert "torch" not in base and "watchdog" not in base
    extras = project["optional-dependencies"]
    assert "torch" in names(extras["torch"]) and "vllm" in names(extras["vllm"])
    assert {"coverage", "pytest-cov"} <= names(extras["test"])


def test_the_daemon_never_imports_torch() -> None:
    code = (
        "import sys, kvoffload.cli, kvoffload.sidecar.server, kvoffload.store, "
        "kvoffload.sidecar.config\n"
        "assert 'torch' not in sys.modules and 'watchdog' not in sys.modules, "
        "[m for m in sys.modules if m.split('.')[0] in ('torch', 'watchdog')][:3]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_license_is_an_spdx_string() -> None:
    data = pyproject()
    assert data["project"]["license"] == "Apache-2.0"
    (setuptools,) = [r for r in data["build-system"]["requires"] if r.startswith("setuptools")]
    assert setuptools == "setuptools>=77"


def test_pytest_is_strict_and_coverage_covers_the_package() -> None:
    data = pyproject()["tool"]
    ini = data["pytest"]["ini_options"]
    assert ini["filterwarnings"][0] == "error"
    assert "--strict-config" in ini["addopts"] and "--strict-markers" in ini["addopts"]
    assert ini["xfail_strict"] is True
    assert data["coverage"]["run"]["source"] == ["kvoffload"]
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert "--cov" in makefile and "coverage report --format=total" in makefile
