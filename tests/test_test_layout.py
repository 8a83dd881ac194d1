"""Test modules import support modules, never each other.

A helper kept in a test module ties its importers to that module's tests (an imported
``test_*`` function is even collected twice) and hides what is shared. Shared helpers go in a
support module of their folder instead (``tests/core/models.py``, ``parity.py``, ...).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Test modules are what pytest collects: python_files in pyproject.toml.
TEST_PREFIXES = ("test_", "bench_")


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every module the file imports, ``from a import b`` giving a.b."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def _is_test_module(dotted: str) -> bool:
    return dotted.split(".")[-1].startswith(TEST_PREFIXES)


def test_no_test_module_imports_another() -> None:
    offenders: list[str] = []
    for folder in ("tests", "benchmarks", "harness"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, module in _imported_modules(path):
                if _is_test_module(module):
                    offenders.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not offenders, "\n".join(offenders)


def test_the_check_sees_a_test_module_import(tmp_path: Path) -> None:
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "from tests.core.interop import test_parity\nimport tests.core.api.test_errors\n"
    )
    modules = [module for _, module in _imported_modules(probe) if _is_test_module(module)]
    assert modules == ["tests.core.interop.test_parity", "tests.core.api.test_errors"]
