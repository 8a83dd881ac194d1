"""HSDP: a 2-D (replicate, shard) mesh matches torch and single-process training."""

from __future__ import annotations

import pytest

from harness.pool import run_on_ranks
from tests.core.parity import Run, assert_parity, parity_body


@pytest.mark.parametrize(("world_size", "shape"), [(2, (2, 1)), (2, (1, 2)), (4, (2, 2))])
def test_hsdp_matches(world_size: int, shape: tuple[int, int]) -> None:
    run = Run(model="gpt", hsdp=shape)
    assert_parity(run_on_ranks(world_size, parity_body, run=run))
