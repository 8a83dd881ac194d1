"""A MkDocs hook: the API reference documents every public name, or the build warns.

Each page under ``docs/api/`` documents one module (its first ``::: module`` line). After the
build, every name in that module's ``__all__`` must have an anchor on the page: the object's
own heading, whose id ends with the name. A name griffe renders elsewhere (a function that
shares its name with a submodule) is documented by its own ``:::`` line on the page. The
warning names each missing one; ``mkdocs build --strict`` then fails (mkdocs.yml).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import griffe

log = logging.getLogger("mkdocs.hooks.api_coverage")

_DIRECTIVE = re.compile(r"^::: ([\w.]+)\s*$", re.MULTILINE)
_ANCHOR = re.compile(r'id="([\w.]+)"')
# Versions are plain strings, listed in __all__ for `pkg.__version__`; nothing to document.
_UNDOCUMENTED = {"__version__"}


def missing_names(module: str, anchors: set[str], search_paths: list[Path]) -> list[str]:
    """The names of ``module.__all__`` that no anchor on its page documents.

    ``__all__`` is read from the source (griffe, as mkdocstrings reads it), so the docs build
    needs no torch.
    """
    names = [str(name) for name in griffe.load(module, search_paths=search_paths).exports or []]
    return [
        name
        for name in names
        if name not in _UNDOCUMENTED
        and not any(anchor.startswith(module) and anchor.endswith(f".{name}") for anchor in anchors)
    ]


def on_post_build(config: Any, **kwargs: Any) -> None:
    """Warns for each public name that an API page leaves out."""
    docs, site = Path(config["docs_dir"]), Path(config["site_dir"])
    search_paths = sorted(Path(config["config_file_path"]).parent.glob("packages/*/src"))
    for page in sorted((docs / "api").glob("*.md")):
        directive = _DIRECTIVE.search(page.read_text())
        if directive is None:
            log.warning("%s documents no module (no '::: module' line)", page)
            continue
        built = site / "api" / page.stem / "index.html"
        anchors = set(_ANCHOR.findall(built.read_text()))
        for name in missing_names(directive.group(1), anchors, search_paths):
            log.warning("%s: %s.%s is public but not documented", page, directive.group(1), name)
