"""requires_grad changed after fully_shard is followed, as torch's fully_shard follows it.

Users freeze and unfreeze layers between phases (fine-tuning schedules, LoRA): a parameter
frozen after wrapping gets no gradient and stays put; one unfrozen after wrapping trains.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from tests.core import models
from tests.core.parity import Run, apply, assert_parity, full_params, global_loss, rank_batch


def _set_trainable(model: Any, phase: int) -> None:
    # Phase 0: a weight and a bias frozen inside groups that keep other trainable parameters.
    # Phase 1: the weight trains again, the whole of another block is frozen.
    model.blocks[0].fc1.weight.requires_grad_(phase == 1)
    model.head.bias.requires_grad_(False)
    for p in model.blocks[1].parameters():
        p.requires_grad_(phase == 0)


def _train(impl: str, rank: int, world_size: int) -> dict[str, Any]:
    model = models.build("mlp", seed=2)
    if impl != "local":
        apply(impl, model, init_device_mesh("cpu", (world_size,)), Run(model="mlp"))
    # Weight decay moves any parameter that gets a gradient, zero or not: only those that
    # really train may change.
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    losses: list[float] = []
    for step in range(6):
        _set_trainable(model, phase=step // 3)
        x, y = rank_batch("mlp", step, rank, world_size, impl)
        loss = models.loss_of("mlp", model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_loss(loss, impl, world_size))
    return {"losses": losses, "params": full_params(model)}


def _body(rank: int, world_size: int) -> dict[str, Any]:
    return {impl: _train(impl, rank, world_size) for impl in ("shardkit", "torch", "local")}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_requires_grad_set_after_fully_shard_is_followed(world_size: int) -> None:
    from harness.pool import run_on_ranks

    results = run_on_ranks(world_size, _body)
    assert_parity(results)
    start = models.build("mlp", seed=2).state_dict()
    final = results[0]["shardkit"]["params"]
    assert torch.equal(final["head.bias"], start["head.bias"])  # frozen throughout
    assert not torch.equal(final["blocks.0.fc1.weight"], start["blocks.0.fc1.weight"])
