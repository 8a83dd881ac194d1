"""A parameter that took no part in backward keeps a None gradient, as with torch's fully_shard.

Optimizers skip parameters whose gradient is None; a zero gradient would still move them
through weight decay and momentum. ``set_reduce_scatter_unused_params(True)`` asks for the
zeros instead (torch's switch for ranks whose control flow differs).
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from tests.core import models
from tests.core.parity import full_params, fully_shard_of, global_loss, rank_batch
from tests.core.torch_releases import torch_has


class TwoHeads(nn.Module):
    """A trunk and two heads; each step uses one head, so the other gets no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = models.Block(7)
        self.head_a = nn.Linear(7, 3)
        self.head_b = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor, which: str) -> torch.Tensor:
        head = self.head_a if which == "a" else self.head_b
        return cast(torch.Tensor, head(self.trunk(x)))


def _train(impl: str, rank: int, world_size: int, unused_as_zeros: bool) -> dict[str, Any]:
    torch.manual_seed(5)
    model: Any = TwoHeads()
    if impl != "local":
        mesh = init_device_mesh("cpu", (world_size,))
        fully_shard_of(impl)(model.trunk, mesh=mesh)
        fully_shard_of(impl)(model, mesh=mesh)  # both heads in the root's group
        if unused_as_zeros:
            model.set_reduce_scatter_unused_params(True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    losses: list[float] = []
    grads_none: list[bool] = []
    for step in range(4):
        x, y = rank_batch("mlp", step, rank, world_size, impl)
        loss = nn.functional.mse_loss(model(x, "a" if step % 2 == 0 else "b"), y)
        loss.backward()
        grads_none.append(model.head_b.weight.grad is None if step == 0 else False)
        opt.step()
        opt.zero_grad()
        losses.append(global_loss(loss, impl, world_size))
    return {"losses": losses, "params": full_params(model), "head_b_none": grads_none[0]}


def _body(rank: int, world_size: int, unused_as_zeros: bool) -> dict[str, Any]:
    impls = ("shardkit", "torch") if unused_as_zeros else ("shardkit", "torch", "local")
    return {impl: _train(impl, rank, world_size, unused_as_zeros) for impl in impls}


@pytest.mark.parametrize("world_size", [1, 2])
def test_unused_parameters_get_no_gradient(world_size: int) -> None:
    from harness.pool import run_on_ranks

    result = run_on_ranks(world_size, _body, unused_as_zeros=False)[0]
    for impl in ("shardkit", "torch", "local"):
        assert result[impl]["head_b_none"], impl
    for impl in ("torch", "local"):
        torch.testing.assert_close(result["shardkit"]["losses"], result[impl]["losses"])
        for name, value in result["shardkit"]["params"].items():
            torch.testing.assert_close(value, result[impl]["params"][name], msg=name)


@pytest.mark.skipif(
    not torch_has("FSDPModule.set_reduce_scatter_unused_params"),
    reason=f"torch {torch.__version__} has no set_reduce_scatter_unused_params (2.13 added it)",
)
def test_unused_parameters_reduced_as_zeros_on_request_match_torch() -> None:
    from harness.pool import run_on_ranks

    result = run_on_ranks(2, _body, unused_as_zeros=True)[0]
    ours, theirs = result["shardkit"], result["torch"]
    assert not ours["head_b_none"] and not theirs["head_b_none"]  # zeros, not None
    torch.testing.assert_close(ours["losses"], theirs["losses"])
    for name, value in ours["params"].items():
        torch.testing.assert_close(value, theirs["params"][name], msg=name)
