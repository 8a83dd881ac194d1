"""A MkDocs hook: lists read as GitHub reads them, for pages written for GitHub.

The README, the design notes and the package READMEs that the guides include are written for
GitHub's Markdown, which Python-Markdown reads differently in two ways:

- GitHub starts a list or a table on the line right after a paragraph; Python-Markdown needs
  a blank line first, and otherwise shows the items as text of the paragraph.
- GitHub takes what is indented to the item's text (2 spaces under ``- ``) as part of the
  item: a second paragraph, a nested list, a code block. Python-Markdown wants 4 spaces, and
  otherwise ends the list there.

So the site adds the blank lines and widens the indentation of top-level items' content to 4
spaces as it reads each page (after the includes, before code blocks are taken out), instead
of every source being written twice. Code blocks outside lists are left as they are.
"""

from __future__ import annotations

import re
from typing import Any

from markdown import Extension, Markdown
from markdown.preprocessors import Preprocessor

_ITEM = re.compile(r"^(?:[-*+]|\d+\.) ")
_FENCE = re.compile(r"^\s*(```|~~~)")
# Python-Markdown's indentation of a list item's content.
_TAB = 4
# After pymdownx.snippets' includes (32) and whitespace normalisation (30); before fenced code
# blocks are stashed (25), so that the fences can still be seen here.
_PRIORITY = 29


def as_github_reads(lines: list[str]) -> list[str]:
    """``lines`` rewritten so that Python-Markdown finds the lists GitHub finds in them."""
    out: list[str] = []
    fence: str | None = None
    width = 0  # the text column of the top-level item we are in; 0 outside lists
    loose = False  # a blank line came since that item began: its items are paragraphs
    for line in lines:
        opened = _FENCE.match(line)
        unindented = bool(line.strip()) and not line[0].isspace()
        if fence is not None:
            fence = None if opened and opened.group(1) == fence else fence
        elif unindented:
            item = _ITEM.match(line)
            starts_block = item is not None or line.startswith("|")
            # GitHub's implicit break: a list or a table under a paragraph, or the next item
            # of a loose list.
            if starts_block and out and (_is_paragraph(out[-1]) or (item and loose)):
                out.append("")
            width, loose = (len(item.group(0)), False) if item else (0, False)
            fence = opened.group(1) if opened else None
        elif opened:
            fence = opened.group(1)
        elif not line.strip() and width:
            loose = True
        if width and line[:1].isspace() and width < _TAB:
            line = " " * (_TAB - width) + line
        out.append(line)
    return out


def _is_paragraph(line: str) -> bool:
    # Unindented text: not a list item, a table row, a heading, a quote or an HTML comment.
    return bool(line.strip()) and not (
        line[0].isspace() or _ITEM.match(line) or line.startswith(("|", "#", "<!--", ">"))
    )


class _AsGitHubReads(Preprocessor):  # type: ignore[misc]  # Markdown is untyped
    def run(self, lines: list[str]) -> list[str]:
        return as_github_reads(lines)


class GitHubLists(Extension):  # type: ignore[misc]  # Markdown is untyped
    """The Markdown extension that runs :func:`as_github_reads` on every page."""

    def extendMarkdown(self, md: Markdown) -> None:
        """Registers the preprocessor between the includes and the code blocks."""
        md.preprocessors.register(_AsGitHubReads(md), "github_lists", _PRIORITY)


def on_config(config: Any, **kwargs: Any) -> Any:
    """Adds the extension to the site's Markdown extensions."""
    config["markdown_extensions"].append(GitHubLists())
    return config
