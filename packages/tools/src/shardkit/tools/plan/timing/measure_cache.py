"""The planner's cache of this machine's measurements: one JSON file of keyed entries.

Measuring a machine (gloo's bandwidth, a hardware profile) takes a second or more, so the
figures are kept in a small file under ``~/.cache/shardkit``, keyed by what they depend on
(host, ranks, threads). The file is read as untrusted input: its size is capped, NaN and
Infinity are refused, the version must match and each entry is checked by the caller's
validator (a bad entry is dropped and measured again). It is written aside and renamed, so a
reader never sees half a file and a link at the path is replaced rather than followed.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["read_entries", "write_entries"]

MAX_CACHE_BYTES = 64 * 1024
"""A cache file larger than this is not read (measured again, then rewritten)."""

E = TypeVar("E")


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a measurement")  # NaN, Infinity: refused, not parsed


def read_entries(path: Path, version: int, valid: Callable[[object], E | None]) -> dict[str, E]:
    """The entries of the cache at ``path`` that ``valid`` accepts.

    ``valid`` returns the checked entry, or None to drop it. {} when the file is missing, too
    big, malformed or of another version.
    """
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_CACHE_BYTES + 1)
    except OSError:
        return {}
    if len(raw) > MAX_CACHE_BYTES:
        return {}
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: nested deep
        return {}
    if not isinstance(data, dict) or data.get("version") != version:
        return {}
    entries = data.get("entries")
    if not isinstance(entries, dict):
        return {}
    checked = {key: valid(entry) for key, entry in entries.items() if isinstance(key, str)}
    return {key: entry for key, entry in checked.items() if entry is not None}


def write_entries(path: Path, version: int, entries: dict[str, Any]) -> None:
    """Replace the cache at ``path`` with ``entries``, atomically."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    text = json.dumps({"version": version, "entries": entries}, indent=1)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
