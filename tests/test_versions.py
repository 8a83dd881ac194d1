"""All four packages move in lockstep, and siblings pin each other exactly."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
SIBLINGS = {"shardkit-core", "shardkit-tp", "shardkit-legacy", "shardkit-tools"}


def _versions() -> dict[str, str]:
    versions = {}
    for about in ROOT.glob("packages/*/src/shardkit/*/__about__.py"):
        found = re.search(r'__version__ = "(.+)"', about.read_text())
        assert found is not None, f"{about}: no __version__"
        versions[about.parent.name] = found.group(1)
    return versions


def _sibling_requirements(project: dict[str, Any]) -> list[tuple[str, Requirement]]:
    """(table.key, requirement) for every shardkit requirement, required or in an extra."""
    groups: dict[str, list[str]] = {"dependencies": project.get("dependencies", [])}
    for extra, deps in project.get("optional-dependencies", {}).items():
        groups[f"optional-dependencies.{extra}"] = deps
    return [
        (where, requirement)
        for where, deps in groups.items()
        for requirement in map(Requirement, deps)
        if requirement.name.startswith("shardkit")
    ]


def test_versions_agree() -> None:
    versions = _versions()
    assert len(versions) == 4 and len(set(versions.values())) == 1, versions


def test_siblings_pin_each_other_exactly() -> None:
    version = next(iter(_versions().values()))
    checked: set[tuple[str, str]] = set()
    for pyproject in sorted(ROOT.glob("packages/*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        for where, requirement in _sibling_requirements(project):
            at = f"{pyproject.relative_to(ROOT)} [project.{where}]: {requirement}"
            assert requirement.name in SIBLINGS, f"{at}: not one of {sorted(SIBLINGS)}"
            assert str(requirement.specifier) == f"=={version}", f"{at}: pin =={version}"
            checked.add((project["name"], where))
    # Both kinds are seen: a required sibling and one in an extra (shardkit-tools[core]).
    expected = {("shardkit-tp", "dependencies"), ("shardkit-tools", "optional-dependencies.core")}
    assert expected <= checked, checked


def test_torch_is_pinned_in_constraints() -> None:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    assert "torch==2.13.0" in lines
