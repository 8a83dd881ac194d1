"""No import circles in the core: each module's imports at load time form a graph with no cycle.

Imports under ``if TYPE_CHECKING:`` are left out (they never run); ``from package import name``
counts as importing the submodule ``package.name`` where there is one, else the package itself
(whose ``__init__`` runs first).
"""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "packages" / "core" / "src" / "shardkit" / "core"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(CORE.parents[1]).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _load_time_imports(tree: ast.Module, modules: set[str]) -> set[str]:
    found: set[str] = set()
    for node in tree.body:  # module level only: imports inside functions run later
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found & modules


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each module of the package at ``root`` and the package's modules it imports at load."""
    paths = {_module_name(p): p for p in root.rglob("*.py")}
    names = set(paths)
    return {
        name: _load_time_imports(ast.parse(path.read_text()), names) - {name}
        for name, path in paths.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` as a path that ends where it starts, or [] if there is none."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str]:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return []
        path.append(node)
        for nxt in sorted(graph[node]):
            cycle = visit(nxt)
            if cycle:
                return cycle
        path.pop()
        done.add(node)
        return []

    for start in sorted(graph):
        cycle = visit(start)
        if cycle:
            return cycle
    return []


def test_the_core_has_no_import_cycle() -> None:
    graph = import_graph(CORE)
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100  # the parser sees imports
    cycle = find_cycle(graph)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_a_cycle_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []
