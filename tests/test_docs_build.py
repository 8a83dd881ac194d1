"""The docs site's build helpers (scripts/docs/): how they rewrite what the sources say.

The site itself is built by `make docs` (strict, in CI); these check the rewriting alone.
"""

from __future__ import annotations

from scripts.docs.github_lists import as_github_reads
from scripts.docs.griffe_roles import markdown_of_roles


def _read(text: str) -> str:
    return "\n".join(as_github_reads(text.split("\n")))


def test_a_list_or_table_under_a_paragraph_starts_there() -> None:
    assert _read("Tested:\n- one\n- two") == "Tested:\n\n- one\n- two"
    assert _read("The table:\n| a |\n|---|") == "The table:\n\n| a |\n|---|"


def test_a_paragraph_of_several_lines_stays_one() -> None:
    text = "a line\nthe next line\n  an indented one"
    assert _read(text) == text


def test_an_items_content_is_indented_as_python_markdown_wants() -> None:
    # A tight list stays tight; what is indented to the item's text becomes part of the item.
    assert _read("- one\n  more\n- two") == "- one\n    more\n- two"
    assert _read("1. one\n   more") == "1. one\n    more"
    assert _read("- one\n\n  ```python\n  x = 1\n  ```") == (
        "- one\n\n    ```python\n    x = 1\n    ```"
    )


def test_after_a_loose_item_the_next_item_is_a_paragraph_of_its_own() -> None:
    assert _read("- one\n\n  again\n- two") == "- one\n\n    again\n\n- two"


def test_code_outside_lists_is_left_alone() -> None:
    text = "- item\n```\n  - not an item\nand: not a paragraph\n| nor a table\n```"
    assert _read(text) == text


def test_sphinx_roles_become_code() -> None:
    text = "see :class:`~shardkit.tools.Profiler`, :func:`plan` and :py:meth:`a.b`"
    assert markdown_of_roles(text) == "see `Profiler`, `plan` and `a.b`"
