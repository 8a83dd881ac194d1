"""Newton-Schulz on a batch of one shape keeps the bits of one matrix at a time.

Owners batch matrices of one shape; a batched kernel that rounds otherwise would give some
matrices other bits than torch's Muon. The CPU's bf16 baddbmm did, for a seed in ten or so:
the seeds below caught it (``newton_schulz._BATCHED_DEVICES``).
"""

from __future__ import annotations

import pytest
import torch

from shardkit.core.optim.newton_schulz import (
    DEFAULT_NS_COEFFICIENTS,
    orthogonalize,
    orthogonalize_batch,
)


@pytest.mark.parametrize("shape", [(16, 16), (64, 16), (16, 64), (48, 16)])
def test_a_batch_has_the_bits_of_one_at_a_time(shape: tuple[int, int]) -> None:
    differs = []
    for seed in range(64):
        matrices = torch.randn(2, *shape, generator=torch.Generator().manual_seed(seed))
        batched = orthogonalize_batch(matrices, DEFAULT_NS_COEFFICIENTS, 5, 1e-7)
        one_by_one = [orthogonalize(m, DEFAULT_NS_COEFFICIENTS, 5, 1e-7) for m in matrices]
        if not all(torch.equal(b, o) for b, o in zip(batched, one_by_one, strict=True)):
            differs.append(seed)
    assert differs == []
