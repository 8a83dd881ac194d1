"""Test harness: a session-wide pool of gloo worker processes for multi-rank tests.

Import the API from its modules: ``tests.harness.pool.run_on_ranks`` and
``tests.harness.compare.assert_all_equal``. This file stays empty so that a worker importing
``tests.harness.worker`` pulls in nothing it does not need.
"""
