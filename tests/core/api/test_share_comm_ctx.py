"""share_comm_ctx: pipeline stages (each its own FSDP root) share one communication context."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from harness.pool import run_on_ranks
from tests.core import models
from tests.core.parity import full_params, fully_shard_of, global_loss, rank_batch


def _stages() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(4)
    first = nn.Sequential(nn.Linear(7, 16), models.Block(16))
    second = nn.Sequential(models.Block(16), nn.Linear(16, 3))
    return first, second


def _train(impl: str, rank: int, world_size: int, when: str) -> dict[str, Any]:
    first, second = _stages()
    stages: list[Any] = [first, second]
    if impl != "local":
        mesh = init_device_mesh("cpu", (world_size,))
        for stage in stages:
            fully_shard_of(impl)(stage[1], mesh=mesh)
            fully_shard_of(impl)(stage, mesh=mesh)
    share: Any = None
    if impl == "shardkit":
        from shardkit.core import share_comm_ctx

        share = share_comm_ctx
    elif impl == "torch":
        from torch.distributed.fsdp import share_comm_ctx as torch_share_comm_ctx

        share = torch_share_comm_ctx
    if share is not None and when == "before":
        share(stages)
    params = [*first.parameters(), *second.parameters()]
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    losses = []
    for step in range(4):
        if share is not None and when == "after" and step == 1:
            share(stages)  # after lazy init: the second root switches over
        x, y = rank_batch("mlp", step, rank, world_size, impl)
        loss = nn.functional.mse_loss(second(first(x)), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_loss(loss, impl, world_size))
    out: dict[str, Any] = {"losses": losses, "params": full_params(nn.ModuleList(stages))}
    if impl == "shardkit":
        from shardkit.core.engine.state_registry import state_of

        a, b = (state_of(s).ctx for s in stages)
        out["shared"] = a is not None and b is not None and a.comm is b.comm
    return out


def _body(rank: int, world_size: int, when: str) -> dict[str, Any]:
    return {i: _train(i, rank, world_size, when) for i in ("shardkit", "torch", "local")}


@pytest.mark.parametrize("when", ["before", "after"])
def test_stages_sharing_one_context_train_as_torch(when: str) -> None:
    result = run_on_ranks(2, _body, when=when)[0]
    assert result["shardkit"]["shared"]
    for peer in ("torch", "local"):
        torch.testing.assert_close(result["shardkit"]["losses"], result[peer]["losses"])
        for name, value in result["shardkit"]["params"].items():
            torch.testing.assert_close(value, result[peer]["params"][name], msg=name)


def test_only_fsdp_modules_are_accepted() -> None:
    from shardkit.core import share_comm_ctx

    with pytest.raises(ValueError, match="Expects list of FSDPModules but got Linear"):
        share_comm_ctx([nn.Linear(2, 2)])
