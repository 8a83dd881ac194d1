"""shardkit's Muon (and torch's AdamW beside it) on sharded models: torch's Muon's bits."""

from __future__ import annotations

import pytest

from harness.pool import run_on_ranks
from tests.core.optim.muon_runs import compare_body

STEPS = 6


@pytest.mark.parametrize("impl", ["shardkit", "torch"])
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_muon_matches_torch_muon_step_for_step(impl: str, model: str) -> None:
    # The MLP's head has 3 rows (uneven at W=2); the GPT's blocks give two matrices of each
    # shape, batched on their owners.
    results = run_on_ranks(2, compare_body, impl=impl, model=model, steps=STEPS)
    for rank, out in enumerate(results):
        assert out["equal"] == [True] * STEPS, (rank, out["max_diff"])
        assert all(stats[2] == 2 for stats in out["stats"])  # two collectives a step


@pytest.mark.parametrize("impl", ["shardkit", "torch"])
def test_one_matrix_on_two_ranks(impl: str) -> None:
    # Fewer matrices than ranks, 5 rows over 2: rank 0 owns it, rank 1 only sends and receives.
    results = run_on_ranks(2, compare_body, impl=impl, model="one", steps=STEPS)
    assert [out["equal"] for out in results] == [[True] * STEPS] * 2
    updates = [[stats[0] for stats in out["stats"]] for out in results]
    assert updates == [[1] * STEPS, [0] * STEPS]
