"""Build demo/data/corpus.txt from the docstrings of Python standard-library modules.

The demo needs a small text corpus that we may ship. The standard library's docstrings are
PSF-licensed, already on every machine that runs the demo, and read like English prose mixed with
code, which makes a byte-level GPT learn visibly in a few dozen steps. Nothing is downloaded.

The output depends on the Python version (docstrings change between releases), so the corpus is
generated once and committed; rerun this script only to refresh it on purpose:

    .venv/bin/python demo/make_corpus.py
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

# A fixed list (not a walk of sys.stdlib_module_names): the order of the corpus must not depend on
# what a machine has installed, and some modules have side effects on import (antigravity, this).
MODULES: tuple[str, ...] = (
    "argparse",
    "collections",
    "functools",
    "itertools",
    "json",
    "pathlib",
    "re",
    "string",
    "textwrap",
    "dataclasses",
    "enum",
    "heapq",
    "bisect",
    "contextlib",
    "abc",
    "copy",
    "shutil",
    "tempfile",
    "fnmatch",
    "glob",
    "random",
    "statistics",
    "fractions",
    "decimal",
    "datetime",
    "calendar",
    "csv",
    "difflib",
    "queue",
    "threading",
    "sched",
    "shlex",
    "struct",
    "base64",
    "hashlib",
    "hmac",
    "secrets",
    "operator",
    "pprint",
    "reprlib",
    "timeit",
    "weakref",
    "warnings",
    "logging",
    "urllib.parse",
    "email.message",
    "http.client",
    "zipfile",
    "tarfile",
    "subprocess",
    "typing",
)

DEFAULT_MAX_BYTES = 300_000


def own_doc(obj: object) -> str | None:
    """The object's own docstring, cleaned; None when it has none.

    `inspect.getdoc` would inherit a base class's docstring, which would repeat the same text
    many times in the corpus, so only `__doc__` itself is read.
    """
    doc = getattr(obj, "__doc__", None)
    if not isinstance(doc, str) or not doc.strip():
        return None
    return inspect.cleandoc(doc)


def header(qualname: str, obj: object) -> str:
    """`name(signature)` when the signature is known and stable, else the bare name."""
    if not callable(obj):
        return qualname
    try:
        signature = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return qualname
    # Default values such as `<object object at 0x7f...>` would make the corpus differ per run.
    return qualname if " at 0x" in signature else qualname + signature


def entries(module: ModuleType) -> Iterator[tuple[str, str]]:
    """Yield (header, docstring) for the module, its public classes, functions and methods."""
    doc = own_doc(module)
    if doc:
        yield module.__name__, doc
    for name in sorted(vars(module)):
        obj = vars(module)[name]
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue  # private, or re-exported from elsewhere (documented there)
        if not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj)):
            continue
        qualname = f"{module.__name__}.{name}"
        doc = own_doc(obj)
        if doc:
            yield header(qualname, obj), doc
        if inspect.isclass(obj):
            for attr in sorted(vars(obj)):
                member = vars(obj)[attr]
                if attr.startswith("_") or not inspect.isfunction(member):
                    continue
                doc = own_doc(member)
                if doc:
                    yield header(f"{qualname}.{attr}", member), doc


def build_corpus(max_bytes: int) -> str:
    """Concatenate docstrings module by module until the corpus would exceed `max_bytes`."""
    seen: set[str] = set()
    parts: list[str] = []
    size = 0
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for head, doc in entries(module):
            if doc in seen:
                continue
            seen.add(doc)
            text = f"{head}\n\n{doc}\n\n\n"
            n = len(text.encode("utf-8"))
            if size + n > max_bytes:
                return "".join(parts)
            parts.append(text)
            size += n
    return "".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "data" / "corpus.txt"
    )
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES)
    args = parser.parse_args()
    out: Path = args.out
    corpus = build_corpus(args.max_bytes)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(corpus, encoding="utf-8")
    version = ".".join(str(v) for v in sys.version_info[:3])
    print(f"wrote {out} ({len(corpus.encode('utf-8')):,} bytes) from Python {version} docstrings")


if __name__ == "__main__":
    main()
