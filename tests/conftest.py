"""Session-wide pytest configuration for shardkit's tests.

pytest finds this file in the ``tests`` package and puts the repo root on ``sys.path`` (its
"prepend" import mode), so test modules import as ``tests.<package>.test_<feature>`` and the
harness (``harness/`` at the repo root) as ``harness``, by the same names the pool's workers use.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

from harness.pool import (
    MAX_GROUPS_HELD,
    crashes_retried,
    crowded_restarts,
    group_restarts,
    keep_only_pools,
    pool_starts,
    pools_shut_between_world_sizes,
    shutdown_pools,
    task_world_sizes,
)
from tests import world_sizes
from tests.slow_list import LIST as SLOW_LIST
from tests.slow_list import read_slow_list, stale_names

# The lifetime checks are on in every test (the pool's workers inherit the environment, and
# shardkit reads it at import, which comes after this file): a buffer released under a
# collective in flight fails the test that does it. SHARDKIT_DEBUG_LIFETIMES=0 turns them off.
# See docs/debugging.md.
os.environ.setdefault("SHARDKIT_DEBUG_LIFETIMES", "1")


# The world sizes recorded in tests/world_sizes.txt, and those each test of this run used.
_RECORDED = world_sizes.read_world_sizes(world_sizes.LIST.read_text())
_RAN: dict[str, world_sizes.WorldSizes] = {}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int | pytest.ExitCode) -> None:
    """Stops the multi-rank worker pools, so no worker outlives the test run.

    With SHARDKIT_RECORD_WORLD_SIZES=1, writes the world sizes this run's tests used into
    tests/world_sizes.txt (see tests/world_sizes.py).
    """
    shutdown_pools()
    if os.environ.get("SHARDKIT_RECORD_WORLD_SIZES") == "1":
        updated = world_sizes.merged(_RECORDED, _RAN)
        world_sizes.LIST.write_text(world_sizes.format_world_sizes(updated))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    """A test's duration without the worker pools it started (see pytest_terminal_summary).

    A pool starts on the first task of its world size and again after a task that left its
    ranks unfit; that cost is the harness's, not the test's, and charging it to whichever test
    came next made the slow list a list of first tests. ``--durations`` shows each test's own
    time; the start-up total is printed beside it.
    """
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if call.when == "teardown":
        used = task_world_sizes()[item.stash.get(_TASKS_SEEN, 0) :]
        _RAN[item.nodeid] = tuple(sorted(set(used)))
    starts = pool_starts()
    seen = item.stash.get(_STARTS_SEEN, 0)
    item.stash[_STARTS_SEEN] = len(starts)
    spent = sum(start.seconds for start in starts[seen:])
    if spent:
        report.duration = max(report.duration - spent, 0.0)
        report.user_properties.append(("pool_start_s", round(spent, 3)))


_STARTS_SEEN = pytest.StashKey[int]()
_TASKS_SEEN = pytest.StashKey[int]()
_STILL_NEEDED = pytest.StashKey[frozenset[int]]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Where this test's pool starts and tasks begin (the makereport hook counts from here).

    Shuts the idle pools of world sizes that neither this test nor any later one used when
    they were recorded: the run being ordered by world size, each pool is shut once the run
    has moved past it (tests/world_sizes.py says why), and no pool starts again for that.
    """
    item.stash[_STARTS_SEEN] = len(pool_starts())
    item.stash[_TASKS_SEEN] = len(task_world_sizes())
    still_needed = item.stash.get(_STILL_NEEDED, None)
    if still_needed is not None:
        keep_only_pools(set(still_needed))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Lists the tasks that ran again because a worker crashed: each one is a defect to find.

    Prints the worker pools' start-up total (left out of the tests' durations), and counts the
    pools started afresh after tasks that made process groups on some ranks only (expected of
    tests of models on a subset of ranks; each costs a pool's start).
    """
    starts = pool_starts()
    if starts:
        by_world = {
            w: [s for s in starts if s.world_size == w]
            for w in sorted({s.world_size for s in starts})
        }
        parts = ", ".join(
            f"W={w}: {len(found)} in {sum(s.seconds for s in found):.1f} s"
            for w, found in by_world.items()
        )
        terminalreporter.write_line(
            f"worker pools: {len(starts)} start(s), {sum(s.seconds for s in starts):.1f} s in all "
            f"({parts}); not counted in the tests' durations"
        )
    if shut := pools_shut_between_world_sizes():
        terminalreporter.write_line(
            f"{len(shut)} idle pool(s) shut where the run moved on to other world sizes "
            "(tests/world_sizes.py)"
        )
    restarts = group_restarts()
    if restarts:
        terminalreporter.write_line(
            f"{len(restarts)} pool(s) started afresh after tasks that made process groups on "
            f"some ranks only (first: {restarts[0]})"
        )
    if crowded := crowded_restarts():
        terminalreporter.write_line(
            f"{len(crowded)} pool(s) started afresh holding over {MAX_GROUPS_HELD} process groups"
        )
    crashes = crashes_retried()
    if not crashes:
        return
    terminalreporter.section("worker crashes retried (see docs/development.md, Tests)")
    for crash in crashes:
        terminalreporter.write_line(crash.report())
    terminalreporter.write_line(f"{len(crashes)} task(s) ran again after a worker crashed")


@pytest.hookimpl(tryfirst=True)  # before ``-m 'not slow'`` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the tests named in ``tests/slow_tests.txt`` slow (see ``tests/slow_list.py``),
    and orders the tests by the world sizes their tasks ran at (``tests/world_sizes.py``;
    SHARDKIT_TEST_ORDER=file keeps the files' order).

    Raises:
        pytest.UsageError: a listed name matches no test of its collected file.
    """
    listed = read_slow_list(SLOW_LIST.read_text())
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.slow)
    if os.environ.get("SHARDKIT_TEST_ORDER") != "file":
        order = world_sizes.ordered_by_world_size([item.nodeid for item in items], _RECORDED)
        items[:] = [items[i] for i in order]
        needed = world_sizes.still_needed([item.nodeid for item in items], _RECORDED)
        for item, sizes in zip(items, needed, strict=True):
            item.stash[_STILL_NEEDED] = sizes
    if any("::" in arg for arg in config.args):
        return  # tests picked by node id: the rest of their files was never collected
    stale = stale_names(listed, (item.nodeid for item in items))
    if stale:
        raise pytest.UsageError(
            "tests/slow_tests.txt names tests that do not exist (renamed? update the list): "
            + ", ".join(stale)
        )
