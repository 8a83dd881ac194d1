"""The run order by world size (tests/world_sizes.py) and the pools it lets the run shut."""

from __future__ import annotations

import pytest

from harness.pool import get_pool, keep_only_pools, run_on_ranks, task_world_sizes
from tests import world_sizes
from tests.world_sizes import (
    format_world_sizes,
    merged,
    ordered_by_world_size,
    read_world_sizes,
    sort_keys,
    still_needed,
)


def test_the_list_reads_back_what_it_writes() -> None:
    recorded = {"tests/a.py::t[x y]": (2, 4), "tests/a.py::u": (1,)}
    assert read_world_sizes(format_world_sizes(recorded)) == recorded


@pytest.mark.parametrize("line", ["tests/a.py::t", "tests/a.py::t two", "tests/a.py::t 0", "t 2"])
def test_a_line_that_is_not_a_node_id_and_world_sizes_is_refused(line: str) -> None:
    with pytest.raises(ValueError, match=r"world_sizes\.txt:1: expected"):
        read_world_sizes(line + "\n")


def test_the_checked_in_list_reads() -> None:
    recorded = read_world_sizes(world_sizes.LIST.read_text())
    assert all(sizes and sizes == tuple(sorted(sizes)) for sizes in recorded.values())


def test_tests_run_by_world_size_keeping_each_files_order() -> None:
    ids = ["f.py::a4", "f.py::b2", "f.py::c2", "g.py::a1", "g.py::b4", "h.py::plain"]
    recorded = {"f.py::a4": (4,), "f.py::b2": (2,), "f.py::c2": (2,), "g.py::a1": (1,)}
    recorded["g.py::b4"] = (4,)
    order = [ids[i] for i in ordered_by_world_size(ids, recorded)]
    assert order == ["h.py::plain", "g.py::a1", "f.py::b2", "f.py::c2", "f.py::a4", "g.py::b4"]


def test_a_test_the_list_does_not_name_stays_beside_its_neighbour() -> None:
    ids = ["f.py::new_first", "f.py::a", "f.py::new", "f.py::b", "g.py::new"]
    recorded = {"f.py::a": (2,), "f.py::b": (1, 4)}
    # Before the file's first named test: the next one's place; after one: the previous one's.
    assert sort_keys(ids, recorded) == [(2, 2), (2, 2), (2, 2), (1, 4), (0, 0)]


def test_a_run_updates_the_tests_it_ran_and_keeps_the_others() -> None:
    recorded = {"f.py::kept": (2,), "f.py::rerun": (4,), "f.py::now_without_tasks": (2,)}
    ran = {"f.py::rerun": (1, 2), "f.py::now_without_tasks": (), "f.py::new": (3,)}
    assert merged(recorded, ran) == {"f.py::kept": (2,), "f.py::rerun": (1, 2), "f.py::new": (3,)}


def test_a_pool_is_shut_only_once_no_later_test_needs_it() -> None:
    ids = ["a.py::one", "a.py::plain", "b.py::one_two", "b.py::two", "c.py::four"]
    recorded = {"a.py::one": (1,), "b.py::one_two": (1, 2), "b.py::two": (2,), "c.py::four": (4,)}
    needed = [set(sizes) for sizes in still_needed(ids, recorded)]
    assert needed == [{1, 2, 4}, {1, 2, 4}, {1, 2, 4}, {2, 4}, {4}]


def _pid(rank: int, world_size: int) -> int:
    import os

    return os.getpid()


def test_only_the_pools_kept_stay_started() -> None:
    first_w2 = run_on_ranks(2, _pid)
    run_on_ranks(1, _pid)
    shut = keep_only_pools({2})
    assert 1 in shut and 2 not in shut  # and any other started pool: 3 or 4 in a full run
    assert get_pool(1).pids == []  # shut: its next task starts it again
    assert get_pool(2).pids == first_w2  # kept warm
    assert task_world_sizes()[-2:] == (2, 1)
