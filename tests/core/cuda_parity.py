"""CUDA parity script (run by tests/core/test_cuda.py under torchrun with NCCL).

Trains the test GPT with shardkit and with torch's fully_shard on CUDA, same seed and data,
and prints one JSON line per rank: both loss traces and the max parameter difference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.core import models
from tests.core.parity import Run, apply, full_params


def main() -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    mesh = init_device_mesh("cuda", (world,))
    traces: dict[str, list[float]] = {}
    params: dict[str, dict[str, torch.Tensor]] = {}
    for impl in ("shardkit", "torch"):
        with torch.device(device):
            model = models.build("gpt")
        apply(impl, model, mesh, Run(model="gpt"))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for step in range(5):
            x, y = models.batch("gpt", step, 2 * world)
            x, y = x.chunk(world)[rank].to(device), y.chunk(world)[rank].to(device)
            loss = models.loss_of("gpt", model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        traces[impl] = losses
        params[impl] = {k: v.cpu() for k, v in full_params(model).items()}
    diff = max(
        (params["shardkit"][k] - params["torch"][k]).abs().max().item() for k in params["torch"]
    )
    sys.stdout.write(json.dumps({"rank": rank, "traces": traces, "max_param_diff": diff}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
