"""Model surgery after fully_shard: slicing a sharded Sequential gives a plain Sequential."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from harness.pool import run_on_ranks
from tests.core.parity import fully_shard_of


def _slice_body(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    out: dict[str, Any] = {}
    for impl in ("shardkit", "torch"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 5), nn.Linear(5, 3))
        for layer in (model[0], model[2], model[3]):
            fully_shard_of(impl)(layer, mesh=mesh)
        fully_shard_of(impl)(model, mesh=mesh)
        head: Any = model[:2]  # a pipeline stage: the first two layers
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
        out[impl] = {
            "type": type(head).__name__,
            "layer_types": [type(m).__name__ for m in head],
            "output": head(x).detach(),
        }
        first: Any = model[0]
        first.reshard()  # the sharded layer inside is still an FSDP module
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 6), nn.ReLU())
    out["local"] = plain(torch.randn(2, 4, generator=torch.Generator().manual_seed(1))).detach()
    return out


def test_slicing_a_sharded_sequential_matches_torch() -> None:
    result = run_on_ranks(2, _slice_body)[0]
    ours, theirs = result["shardkit"], result["torch"]
    assert ours["type"] == theirs["type"] == "Sequential"
    assert ours["layer_types"] == ["FSDPLinear", "ReLU"]
    assert theirs["layer_types"] == ["FSDPLinear", "ReLU"]
    assert torch.equal(ours["output"], theirs["output"])
    assert torch.equal(ours["output"], result["local"])
