"""Frozen parameters mixed with trainable ones, and tied (shared) parameters."""

from __future__ import annotations

import pytest

from harness.pool import run_on_ranks
from tests.core.parity import Run, assert_parity, parity_body


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_frozen_params_match(world_size: int) -> None:
    run = Run(prepare="freeze_first_block")
    assert_parity(run_on_ranks(world_size, parity_body, run=run))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_tied_embedding_and_head_match(world_size: int) -> None:
    run = Run(model="gpt_tied")
    assert_parity(run_on_ranks(world_size, parity_body, run=run))


@pytest.mark.parametrize("prepare", ["freeze_bottom", "freeze_middle_block"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_whole_frozen_groups_match(world_size: int, prepare: str) -> None:
    # Groups with no gradient: one backward never reaches, one it only passes through.
    run = Run(prepare=prepare)
    assert_parity(run_on_ranks(world_size, parity_body, run=run))


@pytest.mark.parametrize("world_size", [1, 2])
def test_frozen_weights_beside_trainable_adapters_match(world_size: int) -> None:
    # A group's last gradient (an adapter's) comes before backward is done with its frozen
    # weights: it must stay gathered until the gradients of its inputs are made.
    run = Run(prepare="lora_above_first_block")
    assert_parity(run_on_ranks(world_size, parity_body, run=run))
