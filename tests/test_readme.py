"""The README is a landing page: short, its links resolve, and it gives the two commands.

The guide itself lives in docs/ (the MkDocs site); `make docs` checks the links between its
pages (mkdocs --strict), and this test the README's, which no docs build reads.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 150

# [text](target): the target up to a closing parenthesis, without a title.
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(text: str) -> list[str]:
    """The link targets of a Markdown text that point into the repository (no URL, no anchor)."""
    targets = (target.split("#", 1)[0] for target in _LINK.findall(text))
    return [target for target in targets if target and "://" not in target]


def test_the_readme_is_a_landing_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; the guide is docs/"


def test_every_relative_link_of_the_readme_resolves() -> None:
    links = relative_links(README.read_text())
    assert "docs/getting-started.md" in links  # the way into the guide
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_readme_gives_the_two_commands_and_what_ci_runs() -> None:
    text = README.read_text()
    assert "`make demo`" in text and "`make check`" in text
    # CI (.ci/run) runs the README's test command: they must name the same one.
    assert "make check" in (ROOT / ".ci" / "run").read_text()


def test_links_are_found_with_and_without_anchors() -> None:
    text = "[a](docs/a.md#part) [b](https://example.org/x) [c](#local) [d](notes/d.md)"
    assert relative_links(text) == ["docs/a.md", "notes/d.md"]
