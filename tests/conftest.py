"""Session-wide pytest configuration for shardkit's tests.

pytest finds this file in the ``tests`` package and puts the repo root on ``sys.path`` (its
"prepend" import mode), so test modules import as ``tests.<package>.test_<feature>`` and the
harness (``harness/`` at the repo root) as ``harness``, by the same names the pool's workers use.
"""

from __future__ import annotations

import os

import pytest

from harness.pool import shutdown_pools

# The lifetime checks are on in every test (the pool's workers inherit the environment, and
# shardkit reads it at import, which comes after this file): a buffer released under a
# collective in flight fails the test that does it. SHARDKIT_DEBUG_LIFETIMES=0 turns them off.
# See docs/debugging.md.
os.environ.setdefault("SHARDKIT_DEBUG_LIFETIMES", "1")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int | pytest.ExitCode) -> None:
    """Stops the multi-rank worker pools, so no worker outlives the test run."""
    shutdown_pools()
