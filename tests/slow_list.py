"""The tests that the default run leaves to ``make soak``, by name: ``tests/slow_tests.txt``.

The default run (``make check``, CI) is kept under 12 minutes on the 2-core machine. A test
costs its place there by what it finds per second, so the longest ones (multi-rank scenarios
run again at W=4, torchrun launches, kill-and-resume runs, library integrations) are listed by
node id in ``slow_tests.txt`` with the seconds they took when they were measured, and
``tests/conftest.py`` marks them ``slow``: ``-m 'not slow'`` (pyproject's default) leaves them
out, ``make soak`` (``-m slow``) runs them. A list rather than decorators keeps the choice in
one place, measured in one run, where the next measurement can redo it.

A listed name that no longer matches a test of a collected file fails the collection: a
renamed test must not drift back into the default run unnoticed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

LIST = Path(__file__).with_name("slow_tests.txt")


def read_slow_list(text: str) -> dict[str, float]:
    """Node id -> seconds measured, from the list's lines (a line starting ``#`` is a comment).

    The seconds are the line's last field: a node id may hold spaces (a parameter's id).

    Raises:
        ValueError: a line is not ``<node id> <seconds>``, or names a node id twice.
    """
    listed: dict[str, float] = {}
    for number, raw, fields in node_id_lines(text):
        try:
            node_id, seconds = fields[0], float(fields[1])
        except (IndexError, ValueError):
            node_id, seconds = "", -1.0
        if "::" not in node_id or seconds < 0:
            raise ValueError(f"slow_tests.txt:{number}: expected '<node id> <seconds>': {raw!r}")
        if node_id in listed:
            raise ValueError(f"slow_tests.txt:{number}: {node_id} is listed twice")
        listed[node_id] = seconds
    return listed


def node_id_lines(text: str) -> Iterator[tuple[int, str, list[str]]]:
    """(line number, line, [node id, last field]) for each line of a list of node ids.

    Blank lines and ``#`` comments are passed over. The last field is split off at the line's
    last space: a node id may hold spaces (a parameter's id).
    """
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if line and not line.startswith("#"):
            yield number, raw, line.rsplit(None, 1)


def stale_names(listed: Iterable[str], collected: Iterable[str]) -> list[str]:
    """The listed node ids of collected files that name no collected test.

    Only files that were collected are judged, so that running one file checks its own
    entries and nothing else.
    """
    collected = set(collected)
    files = {node_id.split("::", 1)[0] for node_id in collected}
    return sorted(n for n in listed if n.split("::", 1)[0] in files and n not in collected)
