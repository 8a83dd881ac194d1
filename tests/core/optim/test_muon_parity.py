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


@pytest.mark.parametrize(
    ("rows", "cols"), [(32, 32), (16, 48), (64, 32)], ids=["square", "wide", "tall"]
)
def test_a_bf16_block_is_updated_with_the_bits_of_torchs_whole_matrix_add(
    rows: int, cols: int
) -> None:
    # torch's Muon adds the whole update in one add_: contiguous for a square or wide matrix
    # (the vectorized kernel, one rounding), the transpose Newton-Schulz returns for a tall
    # one (the scalar kernel). A rank updates only its block, and the update block its
    # owner holds is a slice of the whole one: for TP's column blocks, rows of 8 elements,
    # shorter than a vector, which the vectorized kernel leaves to its scalar tail.
    import torch

    from shardkit.core.optim import MUON_RULE
    from shardkit.core.optim.newton_schulz import adjusted_lr

    gen = torch.Generator().manual_seed(0)
    param = torch.randn(rows, cols, generator=gen).bfloat16()
    from_newton_schulz = torch.randn(cols, rows, generator=gen).bfloat16()
    update = from_newton_schulz.T if rows > cols else from_newton_schulz.T.contiguous()
    options = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": None}
    expected = param.clone().mul_(1 - 0.02 * 0.1)
    step = adjusted_lr(0.02, None, (rows, cols))
    assert isinstance(step, float)
    expected.add_(update, alpha=-step)  # torch's Muon's add
    for block in (slice(0, 8), slice(8, 16)):  # two column blocks, as TP's RowwiseParallel cuts
        local = param[:, block].contiguous()  # a shard's local tensor is contiguous
        MUON_RULE.apply(local, update[:, block], options, (rows, cols))
        assert torch.equal(local, expected[:, block]), block
        came_back = update[:, block].contiguous()  # a block sent back by another owner
        local = param[:, block].contiguous()
        MUON_RULE.apply(local, came_back, options, (rows, cols))
        assert torch.equal(local, expected[:, block]), block
