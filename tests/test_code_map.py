"""The code map of docs/development.md names every module of the core."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "packages" / "core" / "src" / "shardkit" / "core"


def test_the_code_map_lists_every_core_module() -> None:
    page = (ROOT / "docs" / "development.md").read_text()
    map_ = page[page.index("packages/core/src/shardkit/core/") : page.index("packages/tp_adapter")]
    modules = sorted(
        p.relative_to(CORE)
        for p in CORE.rglob("*.py")
        if p.name not in ("__init__.py", "__about__.py") and "__pycache__" not in p.parts
    )
    missing = [str(m) for m in modules if m.name not in map_]
    assert not missing, f"docs/development.md's code map does not name: {missing}"
    folders = {m.parent for m in modules if m.parent != Path(".")}
    assert all(f"{folder}/" in map_ for folder in folders)
