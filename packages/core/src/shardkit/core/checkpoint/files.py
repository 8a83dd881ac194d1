"""The files of a checkpoint directory: their checksums at save, and checking them at load.

A checkpoint is only as good as its files. A truncated ``.distcp`` or ``.metadata`` used to be
found by DCP halfway through a load, when some ranks had loaded and others not. The manager
records each file's size and SHA-256 when it saves, and checks them before it loads anything.
Ranks share the work: rank r of W handles every W-th file (``share``).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path, PurePosixPath
from typing import TypedDict

__all__ = [
    "COMPLETE",
    "FileSum",
    "checksum",
    "list_files",
    "manifest_of",
    "problems_with",
    "share",
]

# The marker a checkpoint is complete by: written last, it holds the files' manifest.
COMPLETE = "COMPLETE"

_CHUNK = 1 << 20  # bytes hashed per read
_SHA256 = re.compile("[0-9a-f]{64}")


class FileSum(TypedDict):
    """A file's size and SHA-256, as the manifest records them."""

    bytes: int
    sha256: str


def list_files(directory: Path, *, leave_out: frozenset[str]) -> list[str]:
    """Every file under ``directory`` (paths relative to it, sorted), but ``leave_out``."""
    found = (p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
    return sorted(name for name in found if name not in leave_out)


def share(names: list[str], rank: int, world_size: int) -> list[str]:
    """The names that ``rank`` handles: every ``world_size``-th, from its own index."""
    return names[rank::world_size]


def checksum(path: Path) -> FileSum:
    """The size and SHA-256 of the file at ``path``."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return FileSum(bytes=size, sha256=digest.hexdigest())


def manifest_of(marker: object) -> dict[str, FileSum] | None:
    """The files and checksums a checkpoint's ``COMPLETE`` marker records (None: saved without).

    The marker is read from storage, so it is checked before it is followed: every name must
    lie inside the checkpoint's directory (a relative path without ``..``), and every entry be a
    size and a SHA-256. Anything else raises ``ValueError`` saying what.
    """
    if not isinstance(marker, dict):
        raise ValueError("its COMPLETE marker is not a JSON object")
    files = marker.get("files")
    if files is None:
        return None
    if not isinstance(files, dict):
        raise ValueError("its COMPLETE marker's files are not a JSON object")
    for name, want in files.items():
        path = PurePosixPath(name)
        if not name or "\\" in name or path.is_absolute() or ".." in path.parts:
            raise ValueError(f"its COMPLETE marker names {name!r}, outside the checkpoint")
        if not (
            isinstance(want, dict)
            and type(want.get("bytes")) is int
            and want["bytes"] >= 0
            and isinstance(want.get("sha256"), str)
            and _SHA256.fullmatch(want["sha256"])
        ):
            detail = f"its COMPLETE marker's entry for {name!r} is not a size and a SHA-256"
            raise ValueError(detail)
    return files


def problems_with(directory: Path, expected: dict[str, FileSum]) -> list[str]:
    """What is wrong with the files ``expected`` names under ``directory`` ([] if nothing).

    The size is compared first, so a truncated file is reported without being hashed.
    """
    problems: list[str] = []
    for name, want in expected.items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        size = path.stat().st_size
        if size != want["bytes"]:
            problems.append(f"{name} holds {size} bytes, {want['bytes']} were saved (truncated?)")
        elif checksum(path)["sha256"] != want["sha256"]:
            problems.append(f"{name} does not match the checksum recorded at save (corrupt)")
    return problems
