"""Session-wide pytest configuration for shardkit's tests.

pytest finds this file in the ``tests`` package and puts the repo root on ``sys.path`` (its
"prepend" import mode), so test modules import as ``tests.<package>.test_<feature>`` and the
harness (``harness/`` at the repo root) as ``harness``, by the same names the pool's workers use.
"""

from __future__ import annotations

import os

import pytest

from harness.pool import (
    MAX_GROUPS_HELD,
    crashes_retried,
    crowded_restarts,
    group_restarts,
    shutdown_pools,
)
from tests.slow_list import LIST as SLOW_LIST
from tests.slow_list import read_slow_list, stale_names

# The lifetime checks are on in every test (the pool's workers inherit the environment, and
# shardkit reads it at import, which comes after this file): a buffer released under a
# collective in flight fails the test that does it. SHARDKIT_DEBUG_LIFETIMES=0 turns them off.
# See docs/debugging.md.
os.environ.setdefault("SHARDKIT_DEBUG_LIFETIMES", "1")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int | pytest.ExitCode) -> None:
    """Stops the multi-rank worker pools, so no worker outlives the test run."""
    shutdown_pools()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Lists the tasks that ran again because a worker crashed: each one is a defect to find.

    And counts the pools started afresh after tasks that made process groups on some ranks
    only (expected of tests of models on a subset of ranks; each costs a pool's start).
    """
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
    """Marks the tests named in ``tests/slow_tests.txt`` slow (see ``tests/slow_list.py``).

    Raises:
        pytest.UsageError: a listed name matches no test of its collected file.
    """
    listed = read_slow_list(SLOW_LIST.read_text())
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.slow)
    if any("::" in arg for arg in config.args):
        return  # tests picked by node id: the rest of their files was never collected
    stale = stale_names(listed, (item.nodeid for item in items))
    if stale:
        raise pytest.UsageError(
            "tests/slow_tests.txt names tests that do not exist (renamed? update the list): "
            + ", ".join(stale)
        )
