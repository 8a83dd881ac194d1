"""model.to(dtype) after fully_shard: the shards, the gathers and the gradients follow."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from tests.core import models
from tests.core.parity import Run, apply, full_params, global_loss, rank_batch


def _train(impl: str, rank: int, world_size: int, dtype: torch.dtype, warm: bool) -> dict[str, Any]:
    model = models.build("mlp", seed=7)
    if impl != "local":
        apply(impl, model, init_device_mesh("cpu", (world_size,)), Run(model="mlp"))
    if warm:  # a step before the move: lazy init done, the root's full parameters kept
        x, y = models.batch("mlp", 99, 2 * world_size)
        model(x.chunk(world_size)[rank]).sum().backward()
        model.zero_grad()
    model.to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(3):
        x, y = rank_batch("mlp", step, rank, world_size, impl)
        out = model(x.to(dtype))
        loss = torch.nn.functional.mse_loss(out, y.to(dtype))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_loss(loss, impl, world_size))
    dtypes = {str(p.dtype) for p in model.parameters()}
    local_dtypes = {
        str(p.to_local().dtype) if hasattr(p, "to_local") else str(p.dtype)
        for p in model.parameters()
    }
    return {
        "losses": losses,
        "params": full_params(model),
        "dtypes": dtypes | local_dtypes,
    }


def _body(rank: int, world_size: int, dtype: torch.dtype) -> dict[str, Any]:
    out = {i: _train(i, rank, world_size, dtype, False) for i in ("shardkit", "torch", "local")}
    # torch's fully_shard fails here ("mat1 and mat2 must have the same dtype"): only ours and
    # the single process are compared.
    out["shardkit_warm"] = _train("shardkit", rank, world_size, dtype, True)
    out["local_warm"] = _train("local", rank, world_size, dtype, True)
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_to_float64_after_fully_shard_trains_in_float64(world_size: int) -> None:
    from harness.pool import run_on_ranks

    result = run_on_ranks(world_size, _body, dtype=torch.float64)[0]
    for ours, peer in (
        ("shardkit", "torch"),
        ("shardkit", "local"),
        ("shardkit_warm", "local_warm"),
    ):
        assert result[ours]["dtypes"] == {"torch.float64"}
        torch.testing.assert_close(result[ours]["losses"], result[peer]["losses"])
        for name, value in result[ours]["params"].items():
            torch.testing.assert_close(value, result[peer]["params"][name], msg=name)
