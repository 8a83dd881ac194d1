"""Reports as JSON: one file per rank while a run is going, one merged file afterwards.

Each rank writes ``rank-<N>.json`` on its own (no collective needed at exit, when the process
group may be gone); ``shardkit-profile`` then loads the folder and writes ``report.json`` with
every rank in it. Writes are atomic (a temporary file, then ``os.replace``) so a reader never
sees half a file, even when a rank is killed while writing.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardkit.tools.records import RankReport

__all__ = [
    "FORMAT",
    "load_merged_report",
    "load_rank_reports",
    "rank_report_path",
    "write_merged_report",
    "write_rank_report",
]

logger = logging.getLogger(__name__)

FORMAT = "shardkit-profile/1"
"""The ``format`` field of ``report.json``; bumped when the layout changes incompatibly."""

_RANK_FILE = re.compile(r"rank-(\d+)\.json")


def rank_report_path(folder: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank`` writes its report in ``folder``: ``<folder>/rank-<rank>.json``."""
    return Path(folder) / f"rank-{rank}.json"


def write_rank_report(path: str | os.PathLike[str], report: RankReport) -> Path:
    """Writes one rank's report as JSON, atomically; creates the parent folder.

    Args:
        path: The file to write, usually ``rank_report_path(folder, report.rank)``.
        report: What the rank recorded.

    Returns:
        The path written.
    """
    return _write_json(Path(path), report.to_dict())


def write_merged_report(path: str | os.PathLike[str], reports: Sequence[RankReport]) -> Path:
    """Writes every rank's report into one JSON file (``report.json``), atomically.

    The file is ``{"format": FORMAT, "world_size": W, "ranks": [<rank report>, ...]}`` with the
    ranks in order; :func:`load_merged_report` reads it back.
    """
    ordered = sorted(reports, key=lambda r: r.rank)
    merged = {
        "format": FORMAT,
        "world_size": max((r.world_size for r in ordered), default=0),
        "ranks": [r.to_dict() for r in ordered],
    }
    return _write_json(Path(path), merged)


def load_rank_reports(folder: str | os.PathLike[str]) -> list[RankReport]:
    """Loads every ``rank-<N>.json`` in a folder, sorted by rank.

    Ranks missing from the world (a rank that crashed before writing) are logged as a warning,
    not an error: a partial report still says something.

    Args:
        folder: The folder the ranks wrote into.

    Returns:
        The reports, sorted by rank; empty if the folder holds no rank files.

    Raises:
        FileNotFoundError: ``folder`` does not exist.
        ValueError: A file is not valid JSON or not a rank report (the message names it), two
            files claim the same rank, or a file's name disagrees with the rank inside it.
    """
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"no report folder at {root}")
    by_rank: dict[int, tuple[Path, RankReport]] = {}
    for path in sorted(root.iterdir()):
        match = _RANK_FILE.fullmatch(path.name)
        if match is None or not path.is_file():
            continue
        report = _load_one(path)
        if report.rank != int(match.group(1)):
            raise ValueError(f"{path} holds the report of rank {report.rank}, not its name's")
        if report.rank in by_rank:
            raise ValueError(f"{path} and {by_rank[report.rank][0]} both hold rank {report.rank}")
        by_rank[report.rank] = (path, report)
    reports = [by_rank[rank][1] for rank in sorted(by_rank)]
    _warn_if_incomplete(root, reports)
    return reports


def load_merged_report(path: str | os.PathLike[str]) -> list[RankReport]:
    """Reads a ``report.json`` written by :func:`write_merged_report`.

    Raises:
        ValueError: The file is not valid JSON or not a merged report; the message names it.
    """
    data = _read_json(Path(path))
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a merged shardkit report (format {FORMAT!r})")
    try:
        return [RankReport.from_dict(r) for r in data["ranks"]]
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path} is not a merged shardkit report: {err}") from err


def _load_one(path: Path) -> RankReport:
    data = _read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a rank report: expected a JSON object")
    try:
        return RankReport.from_dict(data)
    except (TypeError, ValueError) as err:
        # TypeError: a record with a field this version does not know (or lacks one).
        raise ValueError(f"{path} is not a rank report: {err}") from err


def _read_json(path: Path) -> Any:
    try:
        with path.open(encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    except RecursionError:  # json's parser recurses: arrays nested thousands deep
        raise ValueError(f"{path} is not valid JSON: nested too deep to read") from None


def _write_json(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # The temporary file sits next to the target so os.replace stays a rename on one file
    # system; its name does not match rank-<N>.json, so a concurrent loader skips it. Opened
    # with "x" rather than mkstemp, so the file gets the umask's mode, not owner-only.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with tmp.open("x", encoding="utf-8") as f:
            json.dump(data, f, separators=(",", ":"))  # compact: runs record a lot
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _warn_if_incomplete(folder: Path, reports: Sequence[RankReport]) -> None:
    if not reports:
        return
    worlds = sorted({r.world_size for r in reports})
    if len(worlds) > 1:
        logger.warning("%s mixes runs of world sizes %s: stale files?", folder, worlds)
    missing = sorted(set(range(max(worlds))) - {r.rank for r in reports})
    if missing:
        logger.warning("%s has no report from ranks %s of %d", folder, missing, max(worlds))
