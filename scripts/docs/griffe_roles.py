"""A griffe extension for the docs site: Sphinx roles in docstrings shown as code.

The packages' docstrings name other objects the Sphinx way (:class:`Profiler`,
:func:`~shardkit.core.fully_shard`), which Markdown would show with the role's colons. Each
role becomes a code span of the name as a reader would write it: the last part only where
the target starts with ``~``, as Sphinx shows it. Loaded by mkdocstrings (mkdocs.yml).
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def markdown_of_roles(text: str) -> str:
    """Rewrites every Sphinx cross-reference role in ``text`` as a Markdown code span."""

    def code_span(match: re.Match[str]) -> str:
        shortened, target = match.group(1), match.group(2)
        return f"`{target.rsplit('.', 1)[-1] if shortened else target}`"

    return _ROLE.sub(code_span, text)


class SphinxRolesAsCode(Extension):
    """Rewrites the roles of each object's docstring once griffe has loaded the packages."""

    def on_object(self, *, obj: Object, **kwargs: Any) -> None:
        """Rewrites ``obj``'s own docstring (members get their own call)."""
        if obj.docstring is not None:
            obj.docstring.value = markdown_of_roles(obj.docstring.value)
