"""A package's import graph at load time: which of its modules each module imports as it loads.

Imports under ``if TYPE_CHECKING:`` are left out (they never run) unless asked for
(``typing=True``: a module that names another's types depends on it all the same), and so are
imports inside functions (they run later) unless asked for (``late=True``); ``from package
import name`` counts as importing the submodule ``package.name`` where there is one, else the
package itself (whose ``__init__`` runs first).
Shared by the structure tests: no import cycle (the core, the tools, scripts/), no arrow from a
published seam into the engine.
"""

from __future__ import annotations

import ast
from pathlib import Path

__all__ = ["CORE", "REPO", "SCRIPTS", "TOOLS", "import_graph"]

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "packages" / "core" / "src" / "shardkit" / "core"
TOOLS = REPO / "packages" / "tools" / "src" / "shardkit" / "tools"
SCRIPTS = REPO / "scripts"  # imported as ``scripts.<name>`` from the repository root


def _module_name(path: Path, top: Path) -> str:
    parts = list(path.relative_to(top).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _statements(tree: ast.Module, late: bool, typing: bool) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that count: those that run as the module loads (outside every
    function, in any block), with ``late`` those inside functions too, with ``typing`` those
    under ``if TYPE_CHECKING:`` too (its ``else:`` runs, and always counts)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST, in_function: bool, type_only: bool) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            if (late or not in_function) and (typing or not type_only):
                found.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for statement in node.body:
                visit(statement, in_function, True)
            for statement in node.orelse:
                visit(statement, in_function, type_only)
        else:
            inside = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            for child in ast.iter_child_nodes(node):
                visit(child, inside, type_only)

    visit(tree, False, False)
    return found


def _imports(tree: ast.Module, modules: set[str], late: bool, typing: bool) -> set[str]:
    found: set[str] = set()
    for node in _statements(tree, late, typing):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found & modules


def import_graph(
    root: Path, top: Path | None = None, *, late: bool = False, typing: bool = False
) -> dict[str, set[str]]:
    """Each module of the package at ``root`` and the package's modules it imports at load.

    ``late``: imports inside functions too (those that run after load), for circles that only
    close when a function runs. ``typing``: imports under ``if TYPE_CHECKING:`` too, for the
    circles that a module closes by naming a type (they never run, but the two modules still
    depend on each other).

    ``top`` is the folder the dotted names start from: by default two above ``root``, the
    ``src/`` of a ``src/shardkit/<package>`` layout (``shardkit.core.engine``); the repository
    root for ``scripts/`` (``scripts.gpu_chunks``).
    """
    top = root.parents[1] if top is None else top
    paths = {_module_name(p, top): p for p in root.rglob("*.py")}
    names = set(paths)
    return {
        name: _imports(ast.parse(path.read_text()), names, late, typing) - {name}
        for name, path in paths.items()
    }
