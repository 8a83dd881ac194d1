"""The world sizes each test's tasks ran at, recorded in ``tests/world_sizes.txt``, and the
test order they give.

The multi-rank tests run on warm worker pools, one per world size (``harness/pool.py``). Run in
file order, the default run switched between world sizes about 280 times in its first 780
tasks, so every pool stayed warm all the run long, and idle pools cost time: each process group
a worker holds wakes a gloo thread now and then. Ordered by the world sizes their tasks ran at
(W=1 tests first, then W=1 and 2, W=2, ..., W=4), the run goes through each world size once,
and ``tests/conftest.py`` shuts the pools that the next test does not use: one world size's
pool at a time, with about as many starts as before.

A test's world sizes cannot be known before it runs, so they are recorded: a run with
``SHARDKIT_RECORD_WORLD_SIZES=1`` writes what each test's tasks used into the list (merged
with the entries of tests that did not run). A test missing from the list (a new one) or one
that ran no task takes the place of its neighbour in its file, so a file's tests stay together
wherever the list says nothing; a stale list costs pool starts, never a result.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.slow_list import node_id_lines

LIST = Path(__file__).with_name("world_sizes.txt")
HEADER = (
    "# The world sizes each test's tasks ran at (tests/world_sizes.py): '<node id> <W>[,<W>...]'.\n"
    "# Written by a run with SHARDKIT_RECORD_WORLD_SIZES=1; tests that ran no task are left out.\n"
)

WorldSizes = tuple[int, ...]
SortKey = tuple[int, int]
_NO_TASKS: SortKey = (0, 0)


def read_world_sizes(text: str) -> dict[str, WorldSizes]:
    """Node id -> the world sizes its tasks ran at, from the list's lines.

    Raises:
        ValueError: a line is not ``<node id> <W>[,<W>...]`` with positive world sizes.
    """
    recorded: dict[str, WorldSizes] = {}
    for number, raw, fields in node_id_lines(text):
        try:
            sizes = tuple(sorted({int(w) for w in fields[1].split(",")}))
        except (IndexError, ValueError):
            sizes = ()
        if "::" not in fields[0] or not sizes or sizes[0] < 1:
            expected = "expected '<node id> <W>[,<W>...]'"
            raise ValueError(f"world_sizes.txt:{number}: {expected}: {raw!r}")
        recorded[fields[0]] = sizes
    return recorded


def format_world_sizes(recorded: Mapping[str, WorldSizes]) -> str:
    """The list's text for ``recorded``, one line a test, sorted by node id."""
    lines = [f"{node_id} {','.join(map(str, recorded[node_id]))}" for node_id in sorted(recorded)]
    return HEADER + "".join(line + "\n" for line in lines)


def sort_keys(node_ids: Sequence[str], recorded: Mapping[str, WorldSizes]) -> list[SortKey]:
    """Each test's place in the run: (smallest, largest) world size its tasks ran at.

    A test the list does not name takes its file's previous test's key (the next one's for a
    file's first tests), and a file that the list does not name at all keeps (0, 0): it runs
    first, before any pool starts.
    """
    keys: list[SortKey | None] = []
    for node_id in node_ids:
        sizes = recorded.get(node_id)
        keys.append((sizes[0], sizes[-1]) if sizes else None)
    files = [node_id.split("::", 1)[0] for node_id in node_ids]
    for order in (range(len(keys)), reversed(range(len(keys)))):
        last: tuple[str, SortKey | None] = ("", None)
        for i in order:
            if keys[i] is None and last[0] == files[i]:
                keys[i] = last[1]
            last = (files[i], keys[i])
    return [key if key is not None else _NO_TASKS for key in keys]


def ordered_by_world_size(node_ids: Sequence[str], recorded: Mapping[str, WorldSizes]) -> list[int]:
    """The positions of ``node_ids`` in run order: by world size, file order among equals.

    The sort is stable, so the tests of one file and one world size stay together and in
    their file's order (a module's fixtures are set up once per world size at most).
    """
    keys = sort_keys(node_ids, recorded)
    return sorted(range(len(node_ids)), key=lambda i: keys[i])


def still_needed(
    node_ids: Sequence[str], recorded: Mapping[str, WorldSizes]
) -> list[frozenset[int]]:
    """For each test of a run (in run order), the world sizes it or any later test ran at.

    A pool of any other world size will not be used again in the run: shutting it before
    that test costs no start.
    """
    needed: list[frozenset[int]] = []
    later: frozenset[int] = frozenset()
    for node_id in reversed(node_ids):
        later = later | frozenset(recorded.get(node_id, ()))
        needed.append(later)
    return needed[::-1]


def merged(
    recorded: Mapping[str, WorldSizes], ran: Mapping[str, WorldSizes]
) -> dict[str, WorldSizes]:
    """The list after a run: the tests that ran, as they ran; the others as they were.

    A test that ran no task this time leaves the list.
    """
    updated = {node_id: sizes for node_id, sizes in recorded.items() if node_id not in ran}
    updated.update({node_id: sizes for node_id, sizes in ran.items() if sizes})
    return updated
