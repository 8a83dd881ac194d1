"""Post-accumulate-grad hooks on the sharded parameters run once their gradient is reduced.

Optimizer-in-backward registers one on every parameter: it steps and frees the gradient
right away. Checked against torch's fully_shard and the single process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from harness.pool import run_on_ranks
from tests.core import models
from tests.core.parity import Run, apply, full_params, global_loss, rank_batch


def _train(impl: str, rank: int, world_size: int) -> dict[str, Any]:
    model = models.build("mlp", seed=3)
    if impl != "local":
        apply(impl, model, init_device_mesh("cpu", (world_size,)), Run(model="mlp"))
    optimizers = {p: torch.optim.AdamW([p], lr=0.01) for p in model.parameters()}
    seen: list[bool] = []

    def step(param: torch.Tensor) -> None:
        seen.append(param.grad is not None)
        optimizers[param].step()
        optimizers[param].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    losses = []
    for s in range(3):
        x, y = rank_batch("mlp", s, rank, world_size, impl)
        loss = models.loss_of("mlp", model(x), y)
        loss.backward()
        losses.append(global_loss(loss, impl, world_size))
    grads_left = [p.grad is not None for p in model.parameters()]
    return {"losses": losses, "params": full_params(model), "hooks": seen, "left": grads_left}


def _body(rank: int, world_size: int) -> dict[str, Any]:
    return {impl: _train(impl, rank, world_size) for impl in ("shardkit", "torch", "local")}


@pytest.mark.parametrize("world_size", [1, 2])
def test_hooks_on_sharded_parameters_step_the_optimizer(world_size: int) -> None:
    result = run_on_ranks(world_size, _body)[0]
    ours = result["shardkit"]
    params = len(ours["left"])
    assert ours["hooks"] == [True] * 3 * params  # once per parameter per step, with a grad
    assert not any(ours["left"])  # each hook freed its gradient
    for peer in ("torch", "local"):
        torch.testing.assert_close(ours["losses"], result[peer]["losses"])
        for name, value in ours["params"].items():
            torch.testing.assert_close(value, result[peer]["params"][name], msg=name)


def _when_hooks_run(rank: int, world_size: int) -> list[str]:
    model = models.build("mlp", seed=3)
    apply("shardkit", model, init_device_mesh("cpu", (world_size,)), Run(model="mlp"))
    events: list[str] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda param: events.append("hook"))
    x, y = rank_batch("mlp", 0, rank, world_size, "shardkit")
    x = x.clone().requires_grad_()
    x.register_hook(lambda grad: events.append("input grad"))  # the last thing backward makes
    models.loss_of("mlp", model(x), y).backward()
    return events


@pytest.mark.parametrize("world_size", [1, 2])
def test_hooks_run_as_each_group_finishes_backward(world_size: int) -> None:
    # Optimizer-in-backward frees each gradient early to keep backward's peak low: the hooks
    # of the groups nearest the output run before backward reaches the input, at W=1 too
    # (where the engine otherwise takes every gradient at the end of backward).
    events = run_on_ranks(world_size, _when_hooks_run)[0]
    assert "input grad" in events and events[0] == "hook", events
