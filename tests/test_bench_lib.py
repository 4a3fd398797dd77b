"""The benchmark scripts share scripts/benchlib and never import one another.

What README's "Benchmarks" promises, checked on the source: no script imports
another script (by ``import``, ``importlib`` or a file path), none edits
``sys.path`` to reach a sibling, and ``lmcache_peer.py``, which runs in
LMCache's own venv, loads no kvoffload code (nor anything of kvoffload's
venv that LMCache's lacks) through the library.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
SCRIPT_NAMES = {p.stem for p in SCRIPTS.glob("*.py")}
#: These two reach the test helpers under tests/ (a JuiceFS volume, the frame
#: catalogue), not another script: the repository root goes on sys.path.
REACH_TESTS = {"bench_shared.py", "record_frames.py"}


def _sources() -> list[Path]:
    return sorted([*SCRIPTS.glob("*.py"), *(SCRIPTS / "benchlib").glob("*.py")])


def _imported_scripts(path: Path) -> list[str]:
    """The sibling scripts ``path`` imports, at any depth (lazy imports too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in SCRIPT_NAMES]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module.split(".")[0] in SCRIPT_NAMES:
                found.append(node.module)
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "spec_from_file_location"):
                found.append(f"{name}(...) at line {node.lineno}")
    return found


def _edits_sys_path(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("insert", "append", "extend")
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "path"
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "sys"
        ):
            return True
    return False


def test_no_script_imports_another_script() -> None:
    offenders = {p.name: got for p in _sources() if (got := _imported_scripts(p))}
    assert offenders == {}


def test_no_script_edits_sys_path_to_reach_a_sibling() -> None:
    editing = {p.name for p in _sources() if _edits_sys_path(p)}
    assert editing <= REACH_TESTS


def test_the_checks_see_a_sibling_import_and_a_path_edit(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import sys\nsys.path.insert(0, '.')\n"
        "def f():\n    import bench_store as bs\n    from bench_io import Row\n"
        "    import importlib\n    return importlib.import_module('bench_sidecar')\n",
        encoding="utf-8",
    )
    assert _imported_scripts(bad) == ["bench_store", "bench_io", "import_module(...) at line 7"]
    assert _edits_sys_path(bad)


def test_the_lmcache_peer_loads_no_kvoffload_code() -> None:
    """Imported as its venv runs it (scripts/ first on sys.path), it loads only the
    kvoffload-free part of the library."""
    probe = (
        "import sys\n"
        f"sys.path.insert(0, {str(SCRIPTS)!r})\n"
        "import lmcache_peer\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('kvoffload', 'rich', 'cryptography', 'xxhash', 'msgspec', 'lmdb'))\n"
        "lib = sorted(m for m in sys.modules if m.startswith('benchlib'))\n"
        "print(bad, lib)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[] ['benchlib', 'benchlib.method']", out.stderr
