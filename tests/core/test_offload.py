"""CPUOffloadPolicy: trains like torch's, and pin_memory=True works on a CPU-only build."""

from __future__ import annotations

import pytest

from harness.pool import run_on_ranks
from shardkit.core import CPUOffloadPolicy
from tests.core.parity import Run, assert_parity, parity_body


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_cpu_offload_matches_single_process(world_size: int) -> None:
    # torch's own CPUOffloadPolicy(pin_memory=True) fails on a CPU-only build; ours does not,
    # so the oracle here is single-process training (and torch with pin_memory=False).
    run = Run(shard_kwargs={"offload_policy": CPUOffloadPolicy()}, impls=("shardkit", "local"))
    assert_parity(run_on_ranks(world_size, parity_body, run=run))


@pytest.mark.parametrize("world_size", [2])
def test_cpu_offload_unpinned_matches_torch(world_size: int) -> None:
    run = Run(
        shard_kwargs={"offload_policy": CPUOffloadPolicy(pin_memory=False)},
        impls=("shardkit", "torch"),
    )
    assert_parity(run_on_ranks(world_size, parity_body, run=run), rtol=0, atol=0)
