"""Dependencies point one way: core imports none of the other shardkit packages, and the
others use only what the core's published modules export in ``__all__``."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "packages"
PACKAGES = {"core": "core", "tp_adapter": "tp", "legacy_fsdp_compat": "legacy", "tools": "tools"}
ALLOWED = {"core": set(), "tp": {"core"}, "legacy": {"core", "tp"}, "tools": {"core"}}
# The core's published modules: its API and the seams the other packages plug into.
SEAMS = {"shardkit.core", "shardkit.core.layout", "shardkit.core.extensions"}


def _shardkit_imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, imported names) for every ``shardkit.*`` import in a file."""
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardkit."):
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("shardkit.")]
    return found


@pytest.mark.parametrize("folder", list(PACKAGES))
def test_dependencies_point_one_way(folder: str) -> None:
    package = PACKAGES[folder]
    for path in (ROOT / folder / "src").rglob("*.py"):
        for module, names in _shardkit_imports(path):
            target = module.split(".")[1]
            if target == package:
                continue
            assert target in ALLOWED[package], f"{path}: {package} may not import {module}"
            if target == "core":
                assert module in SEAMS, f"{path}: import from {sorted(SEAMS)} only"
                public = importlib.import_module(module).__all__
                missing = set(names) - set(public)
                assert not missing, f"{path}: {missing} are not public in {module}"


def test_no_namespace_init() -> None:
    # shardkit is a namespace package: no shardkit/__init__.py in any distribution.
    assert not list(ROOT.glob("*/src/shardkit/__init__.py"))


COLLECTIVES = {
    "all_gather", "all_gather_single", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_single", "reduce_scatter_tensor", "all_reduce", "all_to_all",
    "all_to_all_single", "broadcast", "gather", "scatter", "isend", "irecv", "send", "recv",
    "batch_isend_irecv",
}  # fmt: skip


def test_only_the_runtime_calls_collectives() -> None:
    core = ROOT / "core" / "src" / "shardkit" / "core"
    for path in core.rglob("*.py"):
        if path == core / "runtime" / "collectives.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in COLLECTIVES
                and isinstance(node.value, ast.Name)
                and node.value.id == "dist"
            ):
                raise AssertionError(f"{path}:{node.lineno} calls dist.{node.attr}")
