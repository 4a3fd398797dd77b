"""kvoffload.errors: one tree holds every public exception of the package."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import subprocess
import sys

import kvoffload
from kvoffload import errors


def _package_exceptions() -> dict[str, type[BaseException]]:
    """Every public exception class reachable from any kvoffload module."""
    found: dict[str, type[BaseException]] = {}
    for mod in pkgutil.walk_packages(kvoffload.__path__, "kvoffload."):
        if mod.name.endswith(".__main__"):  # runs its program when imported
            continue
        try:
            module = importlib.import_module(mod.name)
        except ImportError as exc:  # an optional engine (vllm) absent in this venv
            assert exc.name is not None and not exc.name.startswith("kvoffload"), exc
            continue
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__.startswith("kvoffload")
                and not name.startswith("_")
            ):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def _tree_lines() -> list[str]:
    """The drawing: the indented block after ``::`` in the module docstring."""
    body = (errors.__doc__ or "").split("::", 1)[1].split("\n\n")
    return [line for line in body[1].splitlines() if line.startswith("    ")]


def _tree_names() -> list[str]:
    return [re.findall(r"([A-Z]\w+)", line)[0] for line in _tree_lines()]


def test_every_exception_of_the_package_is_in_the_tree() -> None:
    drawn = set(_tree_names())
    found = _package_exceptions()
    assert len(found) >= 25
    for qual, cls in found.items():
        assert cls.__module__ == "kvoffload.errors", f"{qual} is defined outside kvoffload.errors"
        assert cls.__name__ in drawn, f"{qual} is missing from the tree in kvoffload.errors"
        assert issubclass(cls, errors.KVOffloadError) or cls is errors.KVOffloadError, qual


def test_the_tree_draws_the_real_hierarchy() -> None:
    """Each drawn child sits under the parent the drawing shows, and names a real class."""
    stack: list[tuple[int, type[BaseException]]] = []
    count = 0
    for line in _tree_lines():
        m = re.match(r"^([│ ├└─]*)([A-Z]\w+)", line)
        assert m, line
        depth = len(m.group(1))
        cls = getattr(errors, m.group(2))
        while stack and stack[-1][0] >= depth:
            stack.pop()
        if stack:
            assert cls.__bases__[0] is stack[-1][1], f"{cls.__name__} drawn under {stack[-1][1]}"
        stack.append((depth, cls))
        count += 1
    assert count == len(set(errors.__all__) - {"ErrorCode", "KVOffloadConfigError"})


def test_old_import_paths_still_name_the_same_classes() -> None:
    from kvoffload.contract import ContractError  # type: ignore[attr-defined]
    from kvoffload.errors import StoreFull
    from kvoffload.layouts import CorruptObject
    from kvoffload.protocol import ErrorCode, ProtocolError  # type: ignore[attr-defined]

    assert ContractError is errors.ContractError
    assert CorruptObject is errors.CorruptObject
    assert ProtocolError is errors.ProtocolError and ErrorCode is errors.ErrorCode
    assert StoreFull is errors.StoreFull


def test_errors_imports_the_standard_library_only() -> None:
    """Loaded as a lone file, the module pulls in nothing outside the standard library."""
    code = (
        "import importlib.util, sys; before = set(sys.modules); "
        f"spec = importlib.util.spec_from_file_location('lone_errors', {errors.__file__!r}); "
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod); "
        "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
        "bad = sorted(new - set(sys.stdlib_module_names)); print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
