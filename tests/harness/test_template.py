"""Workers forked from the template: the pool's own children, shardkit already imported.

The bodies below run in the workers, imported by name, so they live at module level.
"""

from __future__ import annotations

import os
import sys

import pytest

from harness.pool import get_pool, pool_starts, run_on_ranks


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


def test_fresh_interpreters_where_forking_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDKIT_POOL_FORK", "0")
    get_pool(2).kill()
    try:
        assert run_on_ranks(2, _parent_and_preloaded) == [(os.getpid(), False)] * 2
    finally:
        get_pool(2).kill()  # the next test gets forked workers again
