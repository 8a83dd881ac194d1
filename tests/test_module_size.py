"""The core's modules stay small: none is over ``MAX_LINES`` lines.

The house style asks for modules of one concept, about 400 lines or less; the limit leaves a
margin above that, so a module that grows past it is split by concern instead of by accident.
"""

from __future__ import annotations

from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "packages" / "core" / "src" / "shardkit" / "core"
MAX_LINES = 450


def oversized(root: Path, limit: int = MAX_LINES) -> list[str]:
    """``"path: N lines"`` for each module under ``root`` longer than ``limit`` lines."""
    counts = {path: len(path.read_text().splitlines()) for path in sorted(root.rglob("*.py"))}
    return [f"{p.relative_to(root)}: {n} lines" for p, n in counts.items() if n > limit]


def test_no_core_module_is_over_the_limit() -> None:
    assert len(list(CORE.rglob("*.py"))) > 50  # the walk sees the core's modules
    offenders = oversized(CORE)
    assert not offenders, f"over {MAX_LINES} lines (split by concern):\n" + "\n".join(offenders)


def test_the_check_sees_an_oversized_module(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "big.py").write_text("x = 1\n" * 6)
    (tmp_path / "small.py").write_text("x = 1\n" * 5)
    assert oversized(tmp_path, limit=5) == [f"{Path('sub') / 'big.py'}: 6 lines"]
