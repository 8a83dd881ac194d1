"""Checkpoint bodies for the FSDP x TP tests: train the SP model, save with DCP, load elsewhere.

A layout is a mesh shape: (dp, tp), (dp_replicate, dp_shard, tp), or (W,) for plain FSDP over
W ranks with no TP. Every layout sees the same global batch per step (each data-parallel rank
takes its slice), so a step's loss is the same number in every layout up to summation order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from tests.core.ckpt_helpers import dcp_load_all, dcp_save_all
from tests.tp import tp_models
from tests.tp.tp_parity import (
    TPRun,
    build_sharded,
    dp_rank_and_size,
    global_mesh,
    shard_blocks_and_root,
)

GLOBAL_BATCH = 4
SAVE_AFTER = 2
RESUMED = range(SAVE_AFTER, SAVE_AFTER + 2)


def build(impl: str, layout: tuple[int, ...], seed: int = 0) -> tuple[nn.Module, int, int]:
    """The SP model in ``layout`` by ``impl``; with its data-parallel rank and size."""
    if len(layout) == 1:  # plain FSDP, no TP
        model: nn.Module = tp_models.build("sp", seed=seed)
        shard_blocks_and_root(impl, model, init_device_mesh("cpu", layout), {})
        return model, dist.get_rank(), layout[0]
    run = TPRun(model="sp", mesh=layout)
    mesh = global_mesh(run)
    return build_sharded(impl, run, mesh, seed=seed), *dp_rank_and_size(mesh)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: range,
    dp: tuple[int, int],
    *,
    name: str = "sp",
    global_batch: int = GLOBAL_BATCH,
) -> list[float]:
    """Train ``steps`` of the ``name`` model; each step's mean loss over the global batch."""
    dp_rank, dp_size = dp
    losses: list[float] = []
    for step in steps:
        x, y = tp_models.batch(name, step, global_batch)
        x, y = x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(total)
            total /= dist.get_world_size()
        losses.append(total.item())
    return losses


def save_body(
    rank: int, world_size: int, impl: str, layout: tuple[int, ...], path: str
) -> dict[str, Any]:
    """Train, save model and optimizer with DCP, train on; the losses and the saved values."""
    model, *dp = build(impl, layout)
    opt = adamw(model)
    before = train(model, opt, range(SAVE_AFTER), (dp[0], dp[1]))
    saved = dcp_save_all(model, opt, path)
    return {"before": before, "after": train(model, opt, RESUMED, (dp[0], dp[1])), **saved}


def load_body(
    rank: int, world_size: int, impl: str, layout: tuple[int, ...], path: str
) -> dict[str, Any]:
    """Load ``path`` into a fresh model and optimizer in ``layout``; values and losses after."""
    model, *dp = build(impl, layout, seed=7)
    opt = adamw(model)
    loaded = dcp_load_all(model, opt, path)
    return {**loaded, "after": train(model, opt, RESUMED, (dp[0], dp[1]))}
