"""The code map of docs/development.md names every module of the core and of the tools, under
its own folder, and its errands point at folders that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "packages" / "core" / "src" / "shardkit" / "core"
TOOLS = ROOT / "packages" / "tools" / "src" / "shardkit" / "tools"
PAGE = ROOT / "docs" / "development.md"
_HEADING = re.compile(r"^(?P<indent> *)(?P<folder>[a-z0-9_]+)/(\s|$)")


def core_map(page: str) -> str:
    """The core's part of the code map: from its root folder to the next package's."""
    return page[page.index("packages/core/src/shardkit/core/") : page.index("packages/tp_adapter")]


def tools_map(page: str) -> str:
    """The tools' part of the code map: from their root folder to the tests' line."""
    start = page.index("packages/tools/src/shardkit/tools/")
    return page[start : page.index("\ntests/ ", start)]


def folder_sections(map_: str) -> dict[Path, str]:
    """Each folder of the map (``engine/group``) and its lines: its heading line and every
    line below it indented deeper; the root (``.``) is what comes before the first folder."""
    lines = map_.splitlines()[1:]  # the first line is the core's own path
    sections: dict[Path, list[str]] = {Path("."): []}
    open_: list[tuple[int, Path]] = []  # (indent, folder) of the headings that enclose a line
    for line in lines:
        indent = len(line) - len(line.lstrip(" "))
        if line.strip():
            while open_ and indent <= open_[-1][0]:
                open_.pop()
        heading = _HEADING.match(line)
        if heading:
            parent = open_[-1][1] if open_ else Path(".")
            folder = parent / heading["folder"]
            open_.append((indent, folder))
            sections[folder] = []
        for _, folder in open_ or [(0, Path("."))]:
            sections[folder].append(line)
    return {folder: "\n".join(text) for folder, text in sections.items()}


def modules_missing_from_their_folder(package: Path, map_: str) -> list[str]:
    """The package's modules the map does not name under their own folder."""
    sections = folder_sections(map_)
    modules = sorted(
        p.relative_to(package)
        for p in package.rglob("*.py")
        if p.name not in ("__init__.py", "__about__.py") and "__pycache__" not in p.parts
    )
    return [
        str(module)
        for module in modules
        if re.search(rf"(?<![\w/]){re.escape(module.name)}", sections.get(module.parent, ""))
        is None
    ]


def test_the_code_map_lists_every_core_module_under_its_folder() -> None:
    map_ = core_map(PAGE.read_text())
    sections = folder_sections(map_)
    wings = {Path("runtime/watch"), Path("runtime/p2p"), Path("runtime/export")}
    assert {Path("engine"), Path("engine/group"), Path("runtime"), *wings} <= sections.keys()
    missing = modules_missing_from_their_folder(CORE, map_)
    assert not missing, f"docs/development.md's code map does not name, in their folder: {missing}"
    folders = {p.parent.relative_to(CORE) for p in CORE.rglob("*.py")} - {Path(".")}
    assert not folders - sections.keys(), "folders without a heading in the code map"


def test_the_code_map_lists_every_tools_module_under_its_folder() -> None:
    map_ = tools_map(PAGE.read_text())
    sections = folder_sections(map_)
    wings = {Path("plan/timing"), Path("plan/search"), Path("plan/apply")}
    assert {Path("track"), Path("plan"), Path("report"), *wings} <= sections.keys()
    missing = modules_missing_from_their_folder(TOOLS, map_)
    assert not missing, f"docs/development.md's code map does not name, in their folder: {missing}"
    folders = {p.parent.relative_to(TOOLS) for p in TOOLS.rglob("*.py")} - {Path(".")}
    assert not folders - sections.keys(), "folders of the tools without a heading in the code map"


def test_the_map_check_sees_a_module_named_in_another_folder() -> None:
    map_ = (
        "packages/core/src/shardkit/core/\n"
        "  api.py       the API\n"
        "  engine/      the engine\n"
        "    state.py     its state\n"
        "    group/       a group\n"
        "      plan.py      its plan\n"
        "  runtime/     the runtime: buffers.py\n"
    )
    sections = folder_sections(map_)
    assert "plan.py" in sections[Path("engine/group")]
    assert "plan.py" in sections[Path("engine")]  # a folder's section holds its sub-folders
    assert "plan.py" not in sections[Path("runtime")]
    assert "state.py" not in sections[Path("engine/group")]
    assert "buffers.py" in sections[Path("runtime")]
    assert "api.py" in sections[Path(".")] and "state.py" not in sections[Path(".")]


# The errands a newcomer runs, as docs/development.md's "Where to change what" names them:
# a phrase of the errand and the folders (of the core) the page must send them to.
ERRANDS = {
    "how a snapshot is replicated": ["snapshots/"],
    "how a group's gradients are reduced": ["engine/reduce/"],
    "what happens at a group's pre-forward": ["engine/group/", "schedule.py"],
    "a file format's reader": ["formats/"],
    "change the step check": ["runtime/watch/step_check.py", "engine/collectives_agree.py"],
    "under torch's `Join`": ["engine/join.py", "runtime/watch/collective_watch.py"],
    "outside the step's collectives": ["runtime/p2p/"],
    "the weight export's ranks gather": ["runtime/export/", "export/exporter.py"],
    "marked `set_conditional(True)`": ["engine/conditional.py", "conditional_schedule.py"],
    "change `replicate`": ["replicate_api.py", "adoption.py"],
    "how the planner searches": ["tools/plan/search/"],
    "modelled or calibrated": ["tools/plan/timing/"],
}


def test_the_errands_name_their_folders() -> None:
    page = PAGE.read_text()
    errands = page[page.index("## Where to change what") :].split("\n## ")[0]
    for phrase, places in ERRANDS.items():
        line = next((row for row in errands.splitlines() if phrase in row and row[0] == "|"), None)
        assert line is not None, f"the errand {phrase!r} is not on the page"
        for place in places:
            assert f"`{place}" in line, f"the errand {phrase!r} does not name {place}"
    rows = "\n".join(row for row in errands.splitlines() if row.startswith("|"))
    for place in re.findall(r"`([a-z0-9_/]+(?:/|\.py))`", rows):
        # ``tools/...`` is the tools' (packages/tools/src/shardkit/tools/...), ``tests/...`` the
        # repository's, the rest the core's
        roots = {"tools/": TOOLS.parent, "tests/": ROOT}
        where = next((r for s, r in roots.items() if place.startswith(s)), CORE) / place
        assert where.exists(), f"the errands name {place}, which does not exist"
