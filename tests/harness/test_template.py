"""Workers forked from the template: the pool's own children, shardkit already imported.

The bodies below run in the workers, imported by name, so they live at module level.
"""

from __future__ import annotations

import os
import sys

import pytest

from harness.pool import get_pool, pool_starts, run_on_ranks
from harness.processes import template_process_id


def _parent_and_preloaded(rank: int, world_size: int) -> tuple[int, bool]:
    # Nothing this module imports loads shardkit.legacy: only the template does.
    return os.getppid(), "shardkit.legacy" in sys.modules


def test_workers_are_forks_of_the_template_handed_to_the_pool() -> None:
    get_pool(2).kill()
    before = len(pool_starts())
    found = run_on_ranks(2, _parent_and_preloaded)
    assert found == [(os.getpid(), True)] * 2  # waited for, killed and reaped as children
    started = pool_starts()[before:]
    assert [start.world_size for start in started] == [2]
    assert started[0].seconds > 0
    get_pool(2).kill()  # killing forked workers reaps them: nothing is left behind
    assert run_on_ranks(2, _parent_and_preloaded) == [(os.getpid(), True)] * 2


def test_the_next_tests_pool_is_forked_from_the_same_template(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run_on_ranks(2, _parent_and_preloaded)
    template = template_process_id()
    assert template is not None
    # What pytest does between two tests: its per-test variable changes. The template must
    # not be taken for stale (a new one imports torch again, about 3 s a pool start).
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/another.py::test_next (call)")
    get_pool(2).kill()
    assert run_on_ranks(2, _parent_and_preloaded) == [(os.getpid(), True)] * 2
    assert template_process_id() == template
    # A setting that modules read at import does make a new one (SHARDKIT_DEBUG_LIFETIMES).
    monkeypatch.setenv("SHARDKIT_TEMPLATE_TEST_SETTING", "1")
    get_pool(2).kill()
    run_on_ranks(2, _parent_and_preloaded)
    assert template_process_id() not in (None, template)
    monkeypatch.delenv("SHARDKIT_TEMPLATE_TEST_SETTING")
    get_pool(2).kill()  # the next test's pool comes from a template of the usual environment


def test_fresh_interpreters_where_forking_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDKIT_POOL_FORK", "0")
    get_pool(2).kill()
    try:
        assert run_on_ranks(2, _parent_and_preloaded) == [(os.getpid(), False)] * 2
    finally:
        get_pool(2).kill()  # the next test gets forked workers again
