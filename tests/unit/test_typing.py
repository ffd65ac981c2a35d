"""The package is typed (PEP 561): ``py.typed`` ships with ``qmq``, ``sdk`` and ``wire``, the
client packages type-check, and a client written against the public API sees no ``Any``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TYPED_PACKAGES = ("qmq", "sdk", "wire")

# The client program is checked with disallow_any_expr: a field of the public API typed Any
# (a ReceivedMessage field, a Receipt, a decorator) is an error there. The packages themselves
# are checked with mypy's defaults.
MYPY_CONFIG = """\
[mypy]
ignore_missing_imports = True
[mypy-typed_client]
disallow_any_expr = True
disallow_untyped_defs = True
"""


def test_every_client_package_ships_a_py_typed_marker() -> None:
    missing = [package for package in TYPED_PACKAGES if not (ROOT / package / "py.typed").exists()]
    assert missing == []
    pyproject = (ROOT / "pyproject.toml").read_text()
    for package in TYPED_PACKAGES:
        assert f'{package} = ["py.typed"' in pyproject, f"{package}/py.typed is not package data"


def test_the_client_packages_and_a_client_of_the_public_api_type_check(tmp_path: Path) -> None:
    pytest.importorskip("mypy", reason="mypy is in the test extras")
    config = tmp_path / "mypy.ini"
    config.write_text(MYPY_CONFIG)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(config), "--cache-dir",
         str(tmp_path / "cache"), "sdk", "wire", "qmq/__init__.py", "qmq/sync.py",
         "tests/typing/typed_client.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_error_names_type_checkers_read_are_exactly_the_errors_a_client_may_catch() -> None:
    import qmq
    import sdk
    from wire import errors

    assert errors.__all__ == [cls.__name__ for cls in errors.ERRORS]
    assert set(errors.__all__) <= set(sdk.__all__) and set(sdk.__all__) <= set(qmq.__all__)
    assert all(getattr(qmq, name) is getattr(errors, name) for name in errors.__all__)
