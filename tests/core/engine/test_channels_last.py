"""channels_last parameters: accepted and trained correctly (torch's fully_shard refuses them).

A deliberate difference from torch: its fully_shard raises NotImplementedError for
non-contiguous parameters, while shardkit shards their values (the sharded copy is
contiguous) and trains them like the single process does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from harness.pool import run_on_ranks
from tests.core.parity import full_params


def _convnet() -> Any:
    torch.manual_seed(0)
    net: Any = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
    return net.to(memory_format=torch.channels_last)


def _train(model: Any, rank: int, world_size: int, global_batch: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(4):
        x = torch.randn(global_batch, 3, 8, 8, generator=torch.Generator().manual_seed(step))
        x = x.chunk(world_size)[rank]
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        if world_size > 1:
            dist.all_reduce(loss)
            loss /= world_size
        losses.append(loss.item())
    return losses


def _body(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from shardkit.core import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    with pytest.raises(NotImplementedError, match="non-contiguous parameters"):
        torch_fully_shard(_convnet(), mesh=mesh)
    ours = _convnet()
    for layer in (ours[0], ours[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(ours, mesh=mesh)
    local = _convnet()
    return {
        "ours": (_train(ours, rank, world_size, 2 * world_size), full_params(ours)),
        "local": (_train(local, 0, 1, 2 * world_size), full_params(local)),
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_channels_last_parameters_train_like_the_single_process(world_size: int) -> None:
    result = run_on_ranks(world_size, _body)[0]
    (ours, ours_params), (local, local_params) = result["ours"], result["local"]
    torch.testing.assert_close(ours, local, rtol=1e-5, atol=1e-6)
    for name, value in ours_params.items():
        torch.testing.assert_close(value, local_params[name], rtol=1e-5, atol=1e-6, msg=name)
