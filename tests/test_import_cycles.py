"""No import circles in the core, the tools or scripts/: each one's imports at load time form a
graph with no cycle.

The graph is :mod:`tests.import_graph`'s (what a module imports as it loads).
"""

from __future__ import annotations

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


def test_a_cycle_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []
