"""ignored_params: left alone (not sharded, not reduced), like torch's."""

from __future__ import annotations

import pytest

from harness.pool import run_on_ranks
from tests.core.parity import Run, assert_parity, parity_body

IGNORED = ("blocks.0.norm.weight", "head.bias")


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ignored_params_match_torch(world_size: int) -> None:
    run = Run(ignored=IGNORED, impls=("shardkit", "torch"))
    results = run_on_ranks(world_size, parity_body, run=run)
    assert_parity(results, ignored=IGNORED)
    for name in IGNORED:
        # Not reduced: each rank trained its own copy on its own data.
        if world_size > 1:
            assert not results[0]["shardkit"]["params"][name].equal(
                results[1]["shardkit"]["params"][name]
            )
