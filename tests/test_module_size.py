"""The core's and the tools' modules stay small: none is over ``MAX_LINES`` lines.

The house style asks for modules of one concept, about 400 lines or less; the limit leaves a
margin above that, so a module that grows past it is split by concern instead of by accident.

How to split a module that nears the bound:

- Find the concept it holds that its docstring already names (or should): a value and the
  functions on it, one step of a sequence, one kind of check. Move that concept, whole, to a
  module of its own beside it (or into the folder of its wing), with a docstring saying what
  it is, and leave a line in the original's docstring saying where it went.
- Move free functions or whole classes. Where a class's methods must go, make them functions
  taking what they need, or a helper object the class holds; never a base class or mixin made
  to shed lines, and never shorter comments or docstrings.
- A module above ``NEAR_LINES`` (30 lines below the bound) names, in its docstring, the
  concept it would give up next (``Next to split off: ...``), so the next change that grows it
  knows where to cut; better still, split it then.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[1] / "packages"
CORE = PACKAGES / "core" / "src" / "shardkit" / "core"
TOOLS = PACKAGES / "tools" / "src" / "shardkit" / "tools"
MAX_LINES = 450
NEAR_LINES = MAX_LINES - 30
NEXT_SPLIT = "Next to split off:"


def oversized(root: Path, limit: int = MAX_LINES) -> list[str]:
    """``"path: N lines"`` for each module under ``root`` longer than ``limit`` lines."""
    counts = {path: len(path.read_text().splitlines()) for path in sorted(root.rglob("*.py"))}
    return [f"{p.relative_to(root)}: {n} lines" for p, n in counts.items() if n > limit]


def near_without_next_split(root: Path, near: int = NEAR_LINES) -> list[str]:
    """Each module under ``root`` above ``near`` lines whose docstring names no next split."""
    found: list[str] = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        if len(source.splitlines()) <= near:
            continue
        docstring = ast.get_docstring(ast.parse(source)) or ""
        if NEXT_SPLIT not in docstring:
            found.append(f"{path.relative_to(root)}: {len(source.splitlines())} lines")
    return found


def test_no_core_or_tools_module_is_over_the_limit() -> None:
    assert len(list(CORE.rglob("*.py"))) > 50  # the walk sees the core's modules
    assert len(list(TOOLS.rglob("*.py"))) > 50  # and the tools'
    offenders = oversized(CORE) + oversized(TOOLS)
    assert not offenders, f"over {MAX_LINES} lines (split by concern):\n" + "\n".join(offenders)


def test_a_core_or_tools_module_near_the_limit_names_its_next_split() -> None:
    offenders = near_without_next_split(CORE) + near_without_next_split(TOOLS)
    assert not offenders, (
        f"over {NEAR_LINES} lines without {NEXT_SPLIT!r} in the module's docstring "
        "(this file's docstring says how to split):\n" + "\n".join(offenders)
    )


def test_the_check_sees_an_oversized_module(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "big.py").write_text("x = 1\n" * 6)
    (tmp_path / "small.py").write_text("x = 1\n" * 5)
    assert oversized(tmp_path, limit=5) == [f"{Path('sub') / 'big.py'}: 6 lines"]


def test_the_check_sees_a_near_module_without_its_next_split(tmp_path: Path) -> None:
    (tmp_path / "named.py").write_text(
        f'"""A module.\n\n{NEXT_SPLIT} the rest."""\n' + "x = 1\n" * 6
    )
    (tmp_path / "silent.py").write_text('"""A module."""\n' + "x = 1\n" * 6)
    (tmp_path / "small.py").write_text('"""A module."""\n' + "x = 1\n" * 3)
    assert near_without_next_split(tmp_path, near=5) == ["silent.py: 7 lines"]
