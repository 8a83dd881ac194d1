"""A session-wide pool of gloo worker processes, for multi-rank tests and benchmarks.

It lives at the repo root, beside ``tests/`` and ``benchmarks/``, because both use it; its own
tests are in ``tests/harness/``.

Import the API from its modules: ``harness.pool.run_on_ranks`` and
``harness.compare.assert_all_equal``. This file stays empty so that a worker importing
``harness.worker`` pulls in nothing it does not need.
"""
