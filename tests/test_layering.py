"""Dependencies point one way: core imports none of the other shardkit packages, and the
others use only what core exports in ``__all__``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import shardkit.core

ROOT = Path(__file__).resolve().parents[1] / "packages"
PACKAGES = {"core": "core", "tp_adapter": "tp", "legacy_fsdp_compat": "legacy", "tools": "tools"}
ALLOWED = {"core": set(), "tp": {"core"}, "legacy": {"core", "tp"}, "tools": {"core"}}


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
                assert module == "shardkit.core", f"{path}: import from shardkit.core only"
                missing = set(names) - set(shardkit.core.__all__)
                assert not missing, f"{path}: {missing} are not public in shardkit.core"


def test_no_namespace_init() -> None:
    # shardkit is a namespace package: no shardkit/__init__.py in any distribution.
    assert not list(ROOT.glob("*/src/shardkit/__init__.py"))


COLLECTIVES = {
    "all_gather", "all_gather_single", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_single", "reduce_scatter_tensor", "all_reduce", "all_to_all",
    "all_to_all_single", "broadcast", "gather", "scatter", "isend", "irecv", "send", "recv",
    "batch_isend_irecv",
}  # fmt: skip
# Process-group management and rank queries belong to the runtime too. The test that enforces
# it comes with the move of the remaining call sites into runtime/ (issue 9).
PROCESS_GROUP_CALLS = {
    "barrier", "new_group", "get_rank", "get_world_size", "init_process_group",
    "destroy_process_group",
}  # fmt: skip
CORE = ROOT / "core" / "src" / "shardkit" / "core"


def _dist_uses(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) for each of ``names`` taken from torch.distributed in ``source``.

    Finds ``dist.name`` under any alias of the module (``import torch.distributed as dist``,
    ``from torch import distributed``), ``torch.distributed.name``, and
    ``from torch.distributed import name``.
    """
    tree = ast.parse(source)
    aliases: set[str] = set()
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and node.level == 0:
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            found += [(node.lineno, a.name) for a in node.names if a.name in names]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            owner = ast.unparse(node.value)
            if owner in aliases or owner == "torch.distributed":
                found.append((node.lineno, node.attr))
    return sorted(found)


def test_the_dist_check_sees_every_spelling() -> None:
    source = (
        "import torch\nimport torch.distributed as d\nfrom torch import distributed\n"
        "from torch.distributed import barrier\n"
        "d.get_rank()\ndistributed.new_group([0])\ntorch.distributed.barrier()\nd.is_initialized()\n"
    )
    assert _dist_uses(source, PROCESS_GROUP_CALLS) == [
        (4, "barrier"), (5, "get_rank"), (6, "new_group"), (7, "barrier"),
    ]  # fmt: skip


def test_only_the_runtime_calls_collectives() -> None:
    for path in CORE.rglob("*.py"):
        if path == CORE / "runtime" / "collectives.py":
            continue
        for line, name in _dist_uses(path.read_text(), COLLECTIVES):
            raise AssertionError(f"{path}:{line} calls dist.{name}")
