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


CORE = ROOT / "core" / "src" / "shardkit" / "core"
# Process-group calls other than collectives: who we are, groups, barriers, setup.
PROCESS_GROUP_CALLS = {
    "barrier", "new_group", "get_rank", "get_world_size", "init_process_group",
    "destroy_process_group", "is_initialized", "get_backend", "get_process_group_ranks",
}  # fmt: skip


def _dist_calls(path: Path, names: set[str]) -> list[str]:
    return [
        f"{path}:{node.lineno} calls dist.{node.attr}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr in names
        and isinstance(node.value, ast.Name)
        and node.value.id == "dist"
    ]


def test_only_the_runtime_talks_to_process_groups() -> None:
    found = [
        call
        for path in CORE.rglob("*.py")
        if path.parent != CORE / "runtime"
        for call in _dist_calls(path, PROCESS_GROUP_CALLS)
    ]
    assert not found, "\n".join(found)


PRIVATE_DTENSOR = {"_local_tensor", "_spec", "DTensorSpec", "TensorMeta"}


def test_only_one_module_touches_dtensor_internals() -> None:
    found: list[str] = []
    for path in CORE.rglob("*.py"):
        if path == CORE / "runtime" / "dtensors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "torch.distributed.tensor._"
            ):
                found.append(f"{path}:{node.lineno} imports {node.module}")
            elif isinstance(node, ast.Attribute) and node.attr in PRIVATE_DTENSOR:
                found.append(f"{path}:{node.lineno} uses .{node.attr}")
            elif isinstance(node, ast.Name) and node.id in PRIVATE_DTENSOR:
                found.append(f"{path}:{node.lineno} uses {node.id}")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "DTensor"
            ):
                found.append(f"{path}:{node.lineno} calls DTensor(...) (private constructor)")
    assert not found, "\n".join(found)
