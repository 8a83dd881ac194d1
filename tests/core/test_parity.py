"""Plain training: shardkit equals torch's fully_shard and single-process training."""

from __future__ import annotations

import pytest

from harness.pool import run_on_ranks
from tests.core.parity import Run, assert_parity, parity_body


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_training_matches_torch_and_single_process(world_size: int, model: str) -> None:
    results = run_on_ranks(world_size, parity_body, run=Run(model=model, steps=5))
    assert_parity(results)


@pytest.mark.parametrize("world_size", [2])
def test_bitwise_equal_to_torch_at_two_ranks(world_size: int) -> None:
    run = Run(model="gpt", steps=5, impls=("shardkit", "torch"))
    results = run_on_ranks(world_size, parity_body, run=run)
    assert_parity(results, rtol=0, atol=0)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_root_only_sharding(world_size: int) -> None:
    results = run_on_ranks(world_size, parity_body, run=Run(wrap="root"))
    assert_parity(results)
