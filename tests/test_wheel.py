"""A non-editable wheel carries every module and spec, and its sidecar runs outside the repo.

Built with ``pip wheel --no-build-isolation`` from this checkout, unpacked
with ``pip install --no-deps --target`` (the dependencies come from the test
venv), and run from a directory outside the source tree with that target
first on ``sys.path``, so nothing can resolve through the editable install.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a copy of the files git would commit: a build/ left in the
    # checkout by an earlier build would otherwise smuggle stale modules in.
    tree = tmp_path_factory.mktemp("tree")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, tree / rel)
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(tree)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = out.glob("kvoffload-*.whl")
    return whl


def test_the_wheel_holds_every_module_and_spec(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {str(p.relative_to(SRC)) for p in SRC.rglob("*.py")}
    assert len(modules) > 30
    assert not modules - names, sorted(modules - names)
    packed = {n for n in names if n.endswith(".py") and not n.startswith("kvoffload-")}
    assert not packed - modules, f"modules that are not in src/: {sorted(packed - modules)}"
    data = next(n.split("/data/")[0] for n in names if ".data/data/" in n)
    for doc in [*(REPO / "docs").glob("*.md"), *(REPO / "docs" / "spec").glob("*.md")]:
        rel = doc.relative_to(REPO)
        assert f"{data}/data/share/doc/kvoffload/{rel}" in names, rel
    assert "kvoffload/py.typed" in names


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel unpacked with ``pip install --no-deps --target``."""
    target = tmp_path_factory.mktemp("site")
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
         str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    return target


#: A markdown link or image: ``[text](target)``, the target up to a space or ``)``.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)[^)]*\)")


def test_every_relative_link_in_the_installed_docs_resolves(installed: Path) -> None:
    """What the installed files link to (systemd/README.md → ../docs/shared-root.md,
    a spec → ../threat-model.md) is installed too, inside the same tree."""
    docs = sorted(installed.rglob("*.md"))
    assert any(d.name == "shared-root.md" for d in docs), docs
    broken, checked = [], 0
    for doc in docs:
        text = doc.read_text(encoding="utf-8")
        text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks link nothing
        for target in LINK.findall(text):
            path = target.split("#", 1)[0]
            if not path or re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # an anchor in the same file, or a URL
            checked += 1
            resolved = (doc.parent / path).resolve()
            if not resolved.exists() or not resolved.is_relative_to(installed.resolve()):
                broken.append(f"{doc.relative_to(installed)}: {target}")
    assert checked > 10  # the check is live: the docs do link to each other
    assert not broken, broken


def test_the_wheel_serves_outside_the_repo(installed: Path, tmp_path: Path) -> None:
    target = installed
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    env["PYTHONPATH"] = str(target)
    cli = [sys.executable, "-c", "import sys; from kvoffload.cli import main; sys.exit(main())"]
    where = subprocess.run(
        [sys.executable, "-c", "import kvoffload.sidecar.server as s; print(s.__file__)"],
        cwd=work, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert where.stdout.strip().startswith(str(target)), where.stdout + where.stderr
    unit = subprocess.run(
        [*cli, "systemd", "print", "service"], cwd=work, env=env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert unit.returncode == 0, unit.stderr
    doc = f"Documentation=file://{target}/share/doc/kvoffload/systemd/README.md"
    assert doc in unit.stdout.splitlines(), unit.stdout[:600]
    proc = subprocess.Popen(
        [*cli, "--dev", "serve"], cwd=work, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        sock = work / ".kvoffload" / "kvoffload.sock"
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the sidecar did not create its socket"
            time.sleep(0.1)
        stats = subprocess.run(
            [*cli, "--dev", "stats", "--json"], cwd=work, env=env,
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert stats.returncode == 0, stats.stderr
        assert isinstance(json.loads(stats.stdout), dict)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "DEVELOPMENT MODE" in err
