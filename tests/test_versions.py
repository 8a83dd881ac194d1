"""All four packages move in lockstep, and siblings pin each other exactly."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_versions_agree() -> None:
    versions = {}
    for about in ROOT.glob("packages/*/src/shardkit/*/__about__.py"):
        versions[about.parent.name] = re.search(r'__version__ = "(.+)"', about.read_text()).group(1)  # type: ignore[union-attr]
    assert len(versions) == 4 and len(set(versions.values())) == 1, versions
    version = next(iter(versions.values()))
    for project in ROOT.glob("packages/*/pyproject.toml"):
        deps = tomllib.loads(project.read_text())["project"]["dependencies"]
        for dep in deps:
            if dep.startswith("shardkit-"):
                assert dep.endswith(f"=={version}"), f"{project}: {dep}"


def test_torch_is_pinned_in_constraints() -> None:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    assert "torch==2.13.0" in lines
