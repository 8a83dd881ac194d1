"""Nested fully_shard calls, and a list of modules sharded as one group."""

from __future__ import annotations

import pytest

from harness.pool import run_on_ranks
from tests.core.parity import Run, assert_parity, parity_body


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_list_of_modules_as_one_group(world_size: int) -> None:
    run = Run(model="gpt", wrap="grouped")
    assert_parity(run_on_ranks(world_size, parity_body, run=run))
