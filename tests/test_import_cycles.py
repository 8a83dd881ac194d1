"""No import circles in the core, the tools or scripts/: each one's imports at load time form a
graph with no cycle, and so do all its imports, type-only ones included, but for the circles
listed in ``TYPE_ONLY_CIRCLES``.

The graph is :mod:`tests.import_graph`'s (what a module imports as it loads).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.import_graph import CORE, REPO, SCRIPTS, TOOLS, import_graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Every circle of ``graph``: each set of modules that reach each other (its strongly
    connected components of more than one module), in sorted order."""
    found: list[frozenset[str]] = []
    reaches = {node: _reachable(graph, node) for node in graph}
    for node in sorted(graph):
        circle = frozenset(n for n in reaches[node] if node in reaches[n]) | {node}
        if len(circle) > 1 and circle not in found:
            found.append(circle)
    return found


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    queue = [start]
    while queue:
        for nxt in graph[queue.pop()] - seen:
            seen.add(nxt)
            queue.append(nxt)
    return seen


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


# The circles that type-only imports (under ``if TYPE_CHECKING:``) may still close, each with
# why it stays. A module that needs another's type only to annotate depends on it all the
# same: a circle through one is a knot in the design, untied with a Protocol below both (as
# ``engine/root_context.RootState`` is for the engine's helpers) or by moving the type down.
# None is left; a new one fails, as does an entry here whose circle is gone.
TYPE_ONLY_CIRCLES: dict[str, list[frozenset[str]]] = {
    "core": [],
    "tools": [],
    "scripts": [],
}


@pytest.mark.parametrize("tree", list(TREES))
def test_no_import_cycle_even_through_type_only_imports(tree: str) -> None:
    root, top, _, _ = TREES[tree]
    graph = import_graph(root, top, late=True, typing=True)
    found = circles(graph)
    new = [
        " -> ".join(find_cycle(_within(graph, c)))
        for c in found
        if c not in TYPE_ONLY_CIRCLES[tree]
    ]
    assert not new, "import cycle (type-only imports counted): " + "; ".join(new)
    gone = [sorted(c) for c in TYPE_ONLY_CIRCLES[tree] if c not in found]
    assert not gone, f"listed in TYPE_ONLY_CIRCLES but no longer a circle: {gone}"


def _within(graph: dict[str, set[str]], modules: frozenset[str]) -> dict[str, set[str]]:
    return {m: graph[m] & modules for m in modules}


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


def test_the_typing_graph_sees_a_type_only_circle(tmp_path: Path) -> None:
    package = tmp_path / "src" / "shardkit" / "probe"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from shardkit.probe.b import B\nA = 1\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from shardkit.probe.a import A\nelse:\n    import shardkit.probe\n"
        "B = 1\n"
    )
    assert import_graph(package)["shardkit.probe.b"] == {"shardkit.probe"}  # the else: runs
    assert not circles(import_graph(package, late=True))
    typing = import_graph(package, typing=True)
    assert typing["shardkit.probe.b"] == {"shardkit.probe", "shardkit.probe.a"}
    assert circles(typing) == [frozenset({"shardkit.probe.a", "shardkit.probe.b"})]


def test_a_cycle_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_every_circle_is_found_once() -> None:
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": set(), "d": {"e"}, "e": {"f"}, "f": {"d", "a"}}
    assert circles(graph) == [frozenset("ab"), frozenset("def")]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
