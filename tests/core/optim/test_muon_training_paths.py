"""Muon with accumulated gradients and in bf16: torch's Muon's bits, 10 steps, W=2, each engine.

What the single process is given is the sharded run's reduced gradient, whatever path made it
(``muon_paths``): so these show that Muon's state and update keep the bits when gradients are
accumulated over several backward passes (reduced each time, or only at the last with
``set_requires_gradient_sync``), when the forward runs in bf16 and the reduce in fp32, and
when the parameters, gradients and momentum are themselves bf16.
"""

from __future__ import annotations

import pytest

from harness.pool import run_on_ranks
from tests.core.optim.muon_paths import Path, paths_body

STEPS = 10

PATHS = {
    "accumulate": Path(micro=3),
    "accumulate-no-sync": Path(micro=3, no_sync=True),
    "bf16-compute-fp32-reduce": Path(mixed=True),
    "bf16-params-fp32-reduce": Path(bf16_params=True),
}


@pytest.mark.parametrize("impl", ["shardkit", "torch"])
@pytest.mark.parametrize("path", list(PATHS))
def test_muon_keeps_torch_muons_bits_on_each_training_path(impl: str, path: str) -> None:
    results = run_on_ranks(2, paths_body, impl=impl, path=PATHS[path], steps=STEPS)
    for rank, out in enumerate(results):
        assert out["equal"] == [True] * STEPS, (rank, out["max_diff"])
        assert len(out["muon"]) == 8 and all(n.startswith("blocks.") for n in out["muon"])
