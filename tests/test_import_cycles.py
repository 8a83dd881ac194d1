"""No import circles in the core, the tools or scripts/: each one's imports at load time form a
graph with no cycle.

The graph is :mod:`tests.import_graph`'s (what a module imports as it loads).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.import_graph import CORE, REPO, SCRIPTS, TOOLS, import_graph


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


# Each tree, the folder its dotted names start from (None: import_graph's default), and the
# least modules and arrows its graph has: a graph far smaller means the parser missed imports.
TREES = {
    "core": (CORE, None, 50, 100),
    "tools": (TOOLS, None, 30, 60),
    "scripts": (SCRIPTS, REPO, 5, 2),
}


@pytest.mark.parametrize("tree", list(TREES))
def test_no_import_cycle(tree: str) -> None:
    root, top, least_modules, least_arrows = TREES[tree]
    graph = import_graph(root, top)
    assert len(graph) > least_modules and sum(map(len, graph.values())) > least_arrows
    cycle = find_cycle(graph)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("tree", list(TREES))
def test_no_import_cycle_even_through_imports_inside_functions(tree: str) -> None:
    # An import inside a function closes its circle only when the function runs; the circle
    # is there all the same (a module that needs the package that loads it). Type-only
    # imports never run, and are left out.
    root, top, _, _ = TREES[tree]
    cycle = find_cycle(import_graph(root, top, late=True))
    assert not cycle, "import cycle (through a function's import): " + " -> ".join(cycle)


def test_the_late_graph_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    package = tmp_path / "src" / "shardkit" / "probe"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from shardkit.probe.a import f\n")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from shardkit.probe.b import B\n"
        "def f():\n    from shardkit.probe import f as g\n    return g\n"
    )
    (package / "b.py").write_text("B = 1\n")
    assert import_graph(package)["shardkit.probe.a"] == set()
    late = import_graph(package, late=True)
    assert late["shardkit.probe.a"] == {"shardkit.probe"}  # not b: a type-only import
    assert find_cycle(late) == ["shardkit.probe", "shardkit.probe.a", "shardkit.probe"]


def test_a_cycle_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []
