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


@pytest.mark.parametrize("impl", ["shardkit", "torch"])
@pytest.mark.parametrize("rounds", [2, 4])
def test_exchange_rounds_keep_the_bits(impl: str, rounds: int) -> None:
    # Each owner's matrices in rounds: every round's rows leave at once, a round's updates go
    # back while the owner works on the next. The same bits; two collectives a round (rounds
    # that no owner has a matrix in are left out).
    results = run_on_ranks(2, compare_body, impl=impl, model="gpt", steps=STEPS, rounds=rounds)
    for rank, out in enumerate(results):
        assert out["equal"] == [True] * STEPS, (rank, out["max_diff"])
        assert all(2 < stats[2] <= 2 * rounds for stats in out["stats"])


def _zero_rounds_body(rank: int, world_size: int) -> str:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from shardkit.core import fully_shard
    from shardkit.core.optim import Muon

    model = torch.nn.Linear(4, 6, bias=False)
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    muon = Muon(model.parameters())
    muon.exchange_rounds = 0
    model(torch.ones(2, 4)).sum().backward()
    try:
        muon.step()
    except ValueError as e:  # before any collective: every rank alike, none left waiting
        return str(e)
    return "stepped"


def test_exchange_rounds_below_one_refused_on_every_rank() -> None:
    errors = run_on_ranks(2, _zero_rounds_body)
    assert errors == ["exchange_rounds must be at least 1, not 0"] * 2
