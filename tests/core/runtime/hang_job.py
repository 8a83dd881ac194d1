"""Training jobs in which one rank goes astray at the end, for the hang reports.

Run under torchrun by ``test_hang_report.py`` with a small ``SHARDKIT_HANG_TIMEOUT``:

- ``extra_step`` (the default): rank 1 runs one forward and backward more than rank 0 and
  waits in the extra forward's first all-gather for a rank 0 that waits in a final barrier.
- ``skip_backward``: rank 1 skips its last backward and goes on to a collective of the
  program's own (an all-reduce of its loss), while rank 0 waits in that backward.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.core import models
from tests.core.parity import Run, apply, rank_batch

STEPS = 3


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = rank_batch("mlp", step, rank, world, "shardkit")
    models.loss_of("mlp", model(x), y).backward()
    opt.step()
    opt.zero_grad()


def extra_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """The bug the report must point at: one more forward and backward on this rank only."""
    train_step(model, opt, STEPS)


def skipped_backward(model: torch.nn.Module) -> None:
    """The bug of ``skip_backward``: a forward without its backward, then a user collective."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = rank_batch("mlp", STEPS, rank, world, "shardkit")
    loss = models.loss_of("mlp", model(x), y).detach()
    dist.all_reduce(loss)  # the program's own collective, not shardkit's


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "extra_step"
    dist.init_process_group("gloo")
    model = models.build("mlp")
    apply("shardkit", model, init_device_mesh("cpu", (dist.get_world_size(),)), Run(model="mlp"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        train_step(model, opt, step)
    if mode == "extra_step" and dist.get_rank() == 1:
        extra_step(model, opt)
    elif mode == "skip_backward":
        if dist.get_rank() == 1:
            skipped_backward(model)
        else:
            train_step(model, opt, STEPS)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
