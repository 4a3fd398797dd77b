"""The shape of the package (``../shared/ARCHITECTURE.md``), checked so that it does not rot.

Every import counts, wherever it is written: at module level, inside a
function (lazy), or under ``TYPE_CHECKING``. From the import graph of
``src/kvoffload`` this asserts:

1. the direction rules: the engine (``store``) never imports the daemon, the
   CLI, the client, the protocol or the router; the daemon (``sidecar``)
   reaches the engine through its door only (``kvoffload.store`` and
   ``kvoffload.store.api``, never its internals, never ``layouts``); the
   router, the client, the protocol and the foundations import neither;
2. no import circle of any kind;
3. no module over :data:`MAX_MODULE_LINES` lines.

The checker runs on a deliberately broken package too, so a rule that
stopped finding violations would fail here.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_MODULE_LINES = 700

#: Subpackages (or top-level modules) each part may never import.
_NEVER_ENGINE_OR_DAEMON = {"sidecar", "store", "cli", "testing"}
FORBIDDEN: dict[str, set[str]] = {
    "store": {"sidecar", "cli", "client", "protocol", "transport", "router", "integrations"}
    | {"events", "testing"},
    "sidecar": {"cli", "client", "router", "integrations", "layouts", "testing"},
    "router": _NEVER_ENGINE_OR_DAEMON | {"client", "integrations"},
    "client": _NEVER_ENGINE_OR_DAEMON | {"router", "integrations"},
    "protocol": _NEVER_ENGINE_OR_DAEMON | {"client", "router", "integrations", "events"},
    "transport": _NEVER_ENGINE_OR_DAEMON | {"client", "router", "integrations", "events"},
    "events": _NEVER_ENGINE_OR_DAEMON | {"client", "router", "integrations", "protocol"},
    "layouts": _NEVER_ENGINE_OR_DAEMON | {"client", "router", "integrations", "protocol"},
    "integrations": {"sidecar", "store", "cli"},
}
#: The foundations every part may use; they import only each other.
FOUNDATIONS = {
    "errors", "units", "posix", "contract", "keys", "staging", "envvars", "tokenizer_hash",
    "gpu_probe",
}  # fmt: skip
#: What the daemon may import of the engine: its door.
ENGINE_DOOR = {"kvoffload.store", "kvoffload.store.api"}


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int


def modules(src: Path) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for p in sorted(src.rglob("*.py")):
        parts = list(p.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def imports(src: Path) -> Iterator[Edge]:
    """Every import of a module of the package by another, lazy and type-only included.

    ``from pkg import name`` is an edge to ``pkg.name`` where that is a module,
    else to ``pkg``; importing a module does not count its parent packages."""
    mods = modules(src)
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    up = base[: len(base) - (node.level - 1)]
                    mod = ".".join(up + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [
                    f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names
                ]
            else:
                continue
            for t in targets:
                if t in mods and t != name:
                    yield Edge(name, t, node.lineno)


def part(module: str) -> str:
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else ""


def direction_violations(edges: list[Edge]) -> list[str]:
    bad = []
    for e in edges:
        a, b = part(e.importer), part(e.imported)
        if a == b:
            continue
        why = None
        if b in FORBIDDEN.get(a, ()):
            why = f"{a} never imports {b}"
        elif a in FOUNDATIONS and b not in FOUNDATIONS:
            why = f"the foundation {a} imports only foundations"
        elif a == "sidecar" and b == "store" and e.imported not in ENGINE_DOOR:
            why = "the daemon reaches the engine through kvoffload.store(.api) only"
        if why:
            bad.append(f"{e.importer}:{e.line} imports {e.imported}: {why}")
    return bad


def circles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.importer, set()).add(e.imported)
        graph.setdefault(e.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def long_modules(src: Path) -> list[str]:
    return [
        f"{p.relative_to(src)}: {n} lines"
        for p in sorted(src.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    ]


# ---------------------------------------------------------------------------


def test_imports_follow_the_direction_rules() -> None:
    assert sorted(set(direction_violations(list(imports(SRC))))) == []


def test_there_is_no_import_circle_of_any_kind() -> None:
    assert circles(list(imports(SRC))) == []


def test_no_module_is_longer_than_the_limit() -> None:
    assert long_modules(SRC) == []


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / "kvoffload" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


@pytest.fixture
def broken(tmp_path: Path) -> Path:
    """A package that breaks each rule once, each time a different way."""
    return _write(
        tmp_path,
        {
            "__init__.py": "",
            "errors.py": "",
            "store/__init__.py": "",
            "store/api.py": "",
            "store/index.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from ..sidecar import ports\n"  # type-only, upwards
            ),
            "sidecar/__init__.py": "",
            "sidecar/ports.py": "from ..store import api\n",  # allowed: the door
            "sidecar/events.py": "def f():\n    from kvoffload.store.index import X\n",  # lazy
            "sidecar/a.py": "from . import b\n",
            "sidecar/b.py": "def g():\n    from .a import h\n",  # a circle through a lazy import
            "router/__init__.py": "import kvoffload.sidecar.ports\n",
        },
    )


def test_the_checks_find_deliberate_violations(broken: Path) -> None:
    edges = list(imports(broken))
    bad = direction_violations(edges)
    assert any("kvoffload.store.index:3 imports kvoffload.sidecar.ports" in b for b in bad), bad
    assert any("kvoffload.sidecar.events:2 imports kvoffload.store.index" in b for b in bad), bad
    assert any("kvoffload.router:1 imports kvoffload.sidecar.ports" in b for b in bad), bad
    assert not any(b.startswith("kvoffload.sidecar.ports") for b in bad), bad
    assert ["kvoffload.sidecar.a", "kvoffload.sidecar.b"] in circles(edges)
    (broken / "kvoffload" / "store" / "big.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert long_modules(broken) == [f"kvoffload/store/big.py: {MAX_MODULE_LINES + 1} lines"]


# -- the tests' own shape: they mirror src/ and share helpers, never each other ---------

TESTS = Path(__file__).resolve().parent


def imports_between_test_modules(root: Path) -> list[str]:
    """Every import of a ``test_*`` module by another module under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.rsplit(".", 1)[-1].startswith("test_"):
                    found.append(f"{path.relative_to(root)}:{node.lineno} imports {name}")
    return found


def test_test_modules_never_import_each_other(tmp_path: Path) -> None:
    # Shared helpers live in tests/helpers (and the tier folders' own helper
    # modules), fixtures in conftest.py; a test module is never a library.
    assert imports_between_test_modules(TESTS) == []
    # The check finds a deliberate violation.
    (tmp_path / "test_a.py").write_text("def helper() -> None: ...\n")
    (tmp_path / "test_b.py").write_text("def f() -> None:\n    from .test_a import helper\n")
    assert imports_between_test_modules(tmp_path) == ["test_b.py:2 imports test_a"]


def test_the_engine_and_daemon_tests_mirror_src() -> None:
    # The engine's and the daemon's tests live in folders named after them.
    for part in ("store", "sidecar", "protocol", "client", "cli", "events"):
        assert (TESTS / part / "__init__.py").is_file(), part
    assert not sorted(TESTS.glob("test_store*.py")), "engine tests belong in tests/store"
    assert not sorted(TESTS.glob("test_server*.py")), "daemon tests belong in tests/sidecar"
