"""What the tests know about the C twins: which extensions setup.py builds, which modules choose
a twin (``logstore.twins.c_twin``), and which test modules import one of those.

Everything is read from the source, never listed by hand, so it cannot go stale
(``built_twin`` is how a twin test gets the C function it compares):

- ``extension_names()``: the ``Extension("...")`` names in setup.py.
- ``choosing_modules()``: the files of ours that call ``c_twin(...)``, with the extension each
  asks for.
- ``uses_twins(test_file)``: whether a test file (or a conftest.py above it) imports, directly
  or through any chain of our modules (imports inside functions included), a module that
  chooses a twin. CI's second pass, with ``QMQ_NO_EXTENSIONS=1``, runs those of them that are
  unit tests (``pytest --twin-users``, tests/conftest.py).

``python -m tests.twins --check-built`` exits 1 naming every extension of setup.py that cannot
be imported (.ci/run runs it after the install, so a C twin cannot be skipped silently).
"""

from __future__ import annotations

import ast
import functools
import importlib
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def extension_names() -> list[str]:
    """The module names of the C extensions setup.py builds, in its order."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    return [node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Extension"
            and node.args and isinstance(node.args[0], ast.Constant)]


def _our_python_files() -> list[Path]:
    """Every module of the packages we ship (not the tests' or the benchmarks')."""
    packages = [p.parent for p in ROOT.glob("*/__init__.py")
                if p.parent.name not in ("tests", "bench")]
    return sorted(path for package in packages for path in package.rglob("*.py"))


@functools.cache
def choosing_modules() -> dict[Path, list[str]]:
    """Every file of ours that calls ``c_twin("<extension>", ...)``, with those extensions
    (cached: do not change the answer)."""
    found: dict[Path, list[str]] = {}
    for path in _our_python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "c_twin"
                    and node.args and isinstance(node.args[0], ast.Constant)):
                found.setdefault(path, []).append(node.args[0].value)
    return found


def _module_file(name: str) -> Path | None:
    parts = name.split(".")
    for candidate in (ROOT.joinpath(*parts).with_suffix(".py"),
                      ROOT.joinpath(*parts, "__init__.py")):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def _imported_files(path: Path) -> frozenset[Path]:
    """The files of ours that ``path`` imports anywhere in it, with their packages'
    __init__.py files (importing ``a.b.c`` runs ``a`` and ``a.b`` first)."""
    package = ".".join(path.relative_to(ROOT).parent.parts) if path.is_relative_to(ROOT) else ""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            for end in range(1, len(parts) + 1):
                module = _module_file(".".join(parts[:end]))
                if module is not None:
                    found.add(module)
    return frozenset(found)


@functools.cache
def _reaches_a_twin(path: Path) -> bool:
    targets = set(choosing_modules())
    seen, stack = set(), [path]
    while stack:
        current = stack.pop()
        if current in targets:
            return True
        if current not in seen:
            seen.add(current)
            stack.extend(_imported_files(current))
    return False


def uses_twins(test_file: Path) -> bool:
    """True when ``test_file`` or a conftest.py of its directories imports, through any chain
    of our modules, a module that chooses a C twin."""
    test_file = test_file.resolve()
    conftests = [parent / "conftest.py" for parent in test_file.parents
                 if parent.is_relative_to(ROOT) and (parent / "conftest.py").is_file()]
    return any(_reaches_a_twin(path) for path in [test_file, *conftests])


def in_second_pass(test_file: Path) -> bool:
    """True for the test files CI runs again with ``QMQ_NO_EXTENSIONS=1``: unit tests that use
    twins. The unit tests drive every twin function through the storage classes directly; the
    integration tests wrap the same calls in servers and would double the pass's time."""
    return test_file.resolve().is_relative_to(ROOT / "tests" / "unit") and uses_twins(test_file)


def built_twin(module: str, name: str) -> Any | None:
    """``name`` of the C extension ``module`` as built, imported directly (so the twin tests
    compare it with its Python twin even under ``QMQ_NO_EXTENSIONS``); None if not built."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return None


def unbuilt_extensions() -> list[str]:
    """'<extension>: <why>' for every extension of setup.py that cannot be imported."""
    missing = []
    for name in extension_names():
        try:
            importlib.import_module(name)
        except ImportError as exc:
            missing.append(f"{name}: {exc}")
    return missing


if __name__ == "__main__":
    if sys.argv[1:] != ["--check-built"]:
        sys.exit("usage: python -m tests.twins --check-built")
    unbuilt = unbuilt_extensions()
    for line in unbuilt:
        print(f"C extension not built: {line}", file=sys.stderr)
    sys.exit(1 if unbuilt else 0)
