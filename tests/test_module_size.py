"""Every package's modules stay small: none is over ``MAX_LINES`` lines.

The house style asks for modules of one concept, about 400 lines or less; the limit leaves a
margin above that, so a module that grows past it is split by concern instead of by accident.
Both checks walk the sources of all four packages (the core, the tools, the tensor-parallel
adapter and the legacy FSDP compatibility layer); tests, benchmarks and docs are not walked.

How to split a module that nears the bound:

- Find the concept it holds that its docstring already names (or should): a value and the
  functions on it, one step of a sequence, one kind of check. Move that concept, whole, to a
  module of its own beside it (or into the folder of its wing), with a docstring saying what
  it is, and leave a line in the original's docstring saying where it went.
- Move free functions or whole classes. Where a class's methods must go, make them functions
  taking what they need, or a helper object the class holds; never a base class or mixin made
  to shed lines, and never shorter comments or docstrings.
- A module of ``NEXT_SPLIT_LINES`` (400) lines or more names, in its docstring, the concept it
  would give up next (``Next to split off: ...``: the concept, roughly which functions or
  classes would go, the new module's name and why the cut is clean), so the next change that
  grows it knows where to cut; better still, split it then.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[1] / "packages"
SOURCES = {
    name: PACKAGES / name / "src" for name in ("core", "tools", "tp_adapter", "legacy_fsdp_compat")
}
MAX_LINES = 450
NEXT_SPLIT_LINES = 400
NEXT_SPLIT = "Next to split off:"


def oversized(root: Path, limit: int = MAX_LINES) -> list[str]:
    """``"path: N lines"`` for each module under ``root`` longer than ``limit`` lines."""
    counts = {path: len(path.read_text().splitlines()) for path in sorted(root.rglob("*.py"))}
    return [f"{p.relative_to(root)}: {n} lines" for p, n in counts.items() if n > limit]


def without_next_split(root: Path, lines: int = NEXT_SPLIT_LINES) -> list[str]:
    """Each module under ``root`` of ``lines`` lines or more whose docstring names no next split."""
    found: list[str] = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        if len(source.splitlines()) < lines:
            continue
        docstring = ast.get_docstring(ast.parse(source)) or ""
        if NEXT_SPLIT not in docstring:
            found.append(f"{path.relative_to(root)}: {len(source.splitlines())} lines")
    return found


def test_the_walk_sees_every_package() -> None:
    counts = {name: len(list(root.rglob("*.py"))) for name, root in SOURCES.items()}
    assert counts["core"] > 50, counts  # the walk sees the core's modules
    assert counts["tools"] > 50, counts  # and the tools'
    assert counts["legacy_fsdp_compat"] > 10, counts  # and the legacy layer's
    assert counts["tp_adapter"] > 1, counts  # and the adapter's


def test_no_module_is_over_the_limit() -> None:
    offenders = [line for root in SOURCES.values() for line in oversized(root)]
    assert not offenders, f"over {MAX_LINES} lines (split by concern):\n" + "\n".join(offenders)


def test_a_module_of_400_lines_or_more_names_its_next_split() -> None:
    offenders = [line for root in SOURCES.values() for line in without_next_split(root)]
    assert not offenders, (
        f"{NEXT_SPLIT_LINES} lines or more without {NEXT_SPLIT!r} in the module's docstring "
        "(this file's docstring says how to split):\n" + "\n".join(offenders)
    )


def test_the_check_sees_an_oversized_module(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "big.py").write_text("x = 1\n" * 6)
    (tmp_path / "small.py").write_text("x = 1\n" * 5)
    assert oversized(tmp_path, limit=5) == [f"{Path('sub') / 'big.py'}: 6 lines"]


def test_the_check_sees_a_module_at_the_line_without_its_next_split(tmp_path: Path) -> None:
    (tmp_path / "named.py").write_text(
        f'"""A module.\n\n{NEXT_SPLIT} the rest."""\n' + "x = 1\n" * 6
    )
    (tmp_path / "silent.py").write_text('"""A module."""\n' + "x = 1\n" * 6)
    (tmp_path / "at_the_line.py").write_text('"""A module."""\n' + "x = 1\n" * 4)
    (tmp_path / "small.py").write_text('"""A module."""\n' + "x = 1\n" * 3)
    # the line counts: a module of exactly ``lines`` lines must name its next split
    assert without_next_split(tmp_path, lines=5) == [
        "at_the_line.py: 5 lines",
        "silent.py: 7 lines",
    ]
