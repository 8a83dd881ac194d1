"""Session-wide pytest configuration for shardkit's tests.

pytest finds this file in the ``tests`` package and puts the repo root on ``sys.path`` (its
"prepend" import mode), so test modules import as ``tests.<package>.test_<feature>`` and the
harness (``harness/`` at the repo root) as ``harness``, by the same names the pool's workers use.
"""

from __future__ import annotations

import pytest

from harness.pool import shutdown_pools


def pytest_sessionfinish(session: pytest.Session, exitstatus: int | pytest.ExitCode) -> None:
    """Stops the multi-rank worker pools, so no worker outlives the test run."""
    shutdown_pools()
