"""Gradient accumulation (no sync), several forwards before one backward."""

from __future__ import annotations

import pytest

from harness.pool import run_on_ranks
from tests.core.parity import Run, assert_parity, parity_body


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_no_sync_accumulation_matches(world_size: int) -> None:
    run = Run(model="gpt", loop="accumulate", per_rank_batch=4)
    assert_parity(run_on_ranks(world_size, parity_body, run=run))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_several_forwards_one_backward(world_size: int) -> None:
    run = Run(model="gpt", loop="multi_forward", per_rank_batch=4)
    assert_parity(run_on_ranks(world_size, parity_body, run=run))
