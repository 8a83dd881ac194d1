"""Activation checkpointing inside sharded blocks, and around them."""

from __future__ import annotations

import pytest

from harness.pool import run_on_ranks
from tests.core.parity import Run, assert_parity, parity_body


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("where", ["checkpoint_inside_blocks", "checkpoint_whole_blocks"])
def test_activation_checkpointing_matches(world_size: int, where: str) -> None:
    run = Run(model="gpt", prepare=where)
    assert_parity(run_on_ranks(world_size, parity_body, run=run))
