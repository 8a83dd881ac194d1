"""A package's import graph at load time: which of its modules each module imports as it loads.

Imports under ``if TYPE_CHECKING:`` are left out (they never run), and so are imports inside
functions (they run later) unless asked for (``late=True``); ``from package import name``
counts as importing the submodule ``package.name`` where there is one, else the package
itself (whose ``__init__`` runs first).
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


def _statements(tree: ast.Module, late: bool) -> list[ast.stmt]:
    """The import statements that run: at module level, or (``late``) anywhere.

    Never those under ``if TYPE_CHECKING:``.
    """
    if not late:  # module level only: imports inside functions run later
        return [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
    type_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for statement in node.body
        for inner in ast.walk(statement)
    }
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in type_only
    ]


def _imports(tree: ast.Module, modules: set[str], late: bool) -> set[str]:
    found: set[str] = set()
    for node in _statements(tree, late):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found & modules


def import_graph(root: Path, top: Path | None = None, *, late: bool = False) -> dict[str, set[str]]:
    """Each module of the package at ``root`` and the package's modules it imports at load.

    ``late``: imports inside functions too (those that run after load), for circles that only
    close when a function runs; type-only imports never count.

    ``top`` is the folder the dotted names start from: by default two above ``root``, the
    ``src/`` of a ``src/shardkit/<package>`` layout (``shardkit.core.engine``); the repository
    root for ``scripts/`` (``scripts.gpu_chunks``).
    """
    top = root.parents[1] if top is None else top
    paths = {_module_name(p, top): p for p in root.rglob("*.py")}
    names = set(paths)
    return {
        name: _imports(ast.parse(path.read_text()), names, late) - {name}
        for name, path in paths.items()
    }
