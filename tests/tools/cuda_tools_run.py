"""The trackers on CUDA (NCCL): run under torchrun by tests/tools/test_cuda_tools.py.

Prints one JSON line per rank with what the trackers saw of two shardkit training steps.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from shardkit.core import fully_shard
from shardkit.tools import Category, Profiler
from tests.core import models


def main() -> None:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = models.build("gpt").cuda()
    mesh = init_device_mesh("cuda", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i: int) -> None:
        x, y = models.batch("gpt", i, 2 * world)
        x, y = x[2 * rank : 2 * rank + 2].cuda(), y[2 * rank : 2 * rank + 2].cuda()
        opt.zero_grad()
        models.loss_of("gpt", model(x), y).backward()
        opt.step()

    step(0)
    with Profiler(model, optimizers=[opt]) as prof:
        step(1)
        step(2)
    torch.cuda.synchronize()
    report = prof.rank_report()
    assert report.memory is not None and report.comm is not None
    peak = report.memory.peak.by_category
    record = {
        "rank": rank,
        "device": report.memory.device,
        "kinds": sorted({c.kind for c in report.collectives}),
        "sent_per_step": [s.sent_bytes for s in report.comm.steps],
        "unsharded_peak": peak[Category.UNSHARDED_PARAMS],
        "activations_peak": peak[Category.ACTIVATIONS],
        "allocator": report.memory.allocator,
    }
    sys.stdout.write(json.dumps(record) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
