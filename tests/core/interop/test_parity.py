"""Plain training: shardkit equals torch's fully_shard and single-process training."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from harness.pool import run_on_ranks
from shardkit.core import MixedPrecisionPolicy
from tests.core.parity import Run, Trace, assert_parity, parity_body


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_training_matches_torch_and_single_process(world_size: int, model: str) -> None:
    results = run_on_ranks(world_size, parity_body, run=Run(model=model, steps=5))
    assert_parity(results)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_bitwise_equal_to_torch(world_size: int) -> None:
    # W=3 and 4: gloo's reduce-scatter adds the ranks in its ring's order; shardkit's exchange
    # adds them in the same order (runtime/ring_order.py), so the sums round alike.
    run = Run(model="gpt", steps=5, impls=("shardkit", "torch"))
    results = run_on_ranks(world_size, parity_body, run=run)
    assert_parity(results, rtol=0, atol=0)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_root_only_sharding(world_size: int) -> None:
    results = run_on_ranks(world_size, parity_body, run=Run(wrap="root"))
    assert_parity(results)


def _accelerator_packing_body(rank: int, world_size: int, run: Run) -> dict[str, Trace]:
    # Gradients packed as on a GPU: one _chunk_cat per group, padding and casts included.
    fused = "shardkit.core.engine.reduce.reducer.prefers_fused_packing"
    with mock.patch(fused, lambda device: True):
        return parity_body(rank, world_size, run)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
def test_gradients_packed_as_on_an_accelerator_match_torch(world_size: int, mixed: bool) -> None:
    # The MLP's 3-row head pads at W=2 and W=4. Bit for bit (the rows summed in gloo's order).
    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)} if mixed else {}
    run = Run(model="mlp", steps=3, impls=("shardkit", "torch"), shard_kwargs=kwargs)
    results = run_on_ranks(world_size, _accelerator_packing_body, run=run)
    assert_parity(results, rtol=0, atol=0)
