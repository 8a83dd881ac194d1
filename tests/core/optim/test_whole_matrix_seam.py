"""The seam's second rule: ColumnNormSGD sharded has its single-process definition's bits."""

from __future__ import annotations

import pytest

from harness.pool import run_on_ranks
from tests.core.optim.muon_runs import compare_body

STEPS = 6


@pytest.mark.parametrize("impl", ["shardkit", "torch"])
def test_column_norm_sgd_matches_its_single_process_form(impl: str) -> None:
    # Column norms sum over every row, which fully_shard cuts: a whole-matrix update.
    results = run_on_ranks(2, compare_body, impl=impl, model="mlp", steps=STEPS, ours="column_norm")
    for rank, out in enumerate(results):
        assert out["equal"] == [True] * STEPS, (rank, out["max_diff"])
        assert all(stats[2] == 2 for stats in out["stats"])
    assert sum(out["stats"][0][0] for out in results) == 8  # the MLP's 8 matrices, once each
