"""The local path at world size 1: only the root's hooks work.

See [Note: post-backward trigger] (local tree).

Every group of a one-rank tree views its shards, so the root registers all full parameters
once per forward and takes every gradient in its end-of-backward callback. The oracles must
agree bit for bit: torch's fully_shard, a single process, and shardkit's own general path
(which an observer forces, since observers see every group's transitions).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from shardkit.core import fully_shard, subscribe
from shardkit.core.engine.state_registry import state_of
from tests.core import models
from tests.core.parity import Run, assert_parity, full_params, parity_body

_RUNS = {
    "eval_between": Run(model="gpt", steps=4, eval_each_step=True),
    "ac_inside": Run(model="gpt", steps=4, prepare="checkpoint_inside_blocks", eval_each_step=True),
    "ac_whole": Run(model="gpt", steps=4, prepare="checkpoint_whole_blocks"),
    "no_sync": Run(model="gpt", steps=3, loop="accumulate", per_rank_batch=4),
    "no_sync_keep": Run(steps=3, loop="accumulate_keep", per_rank_batch=4),
    "last_backward": Run(steps=3, loop="last_backward", per_rank_batch=4),
    "multi_forward": Run(model="gpt", steps=3, loop="multi_forward", per_rank_batch=4),
    "frozen_block": Run(steps=4, prepare="freeze_middle_block", eval_each_step=True),
    "frozen_bottom": Run(steps=4, prepare="freeze_bottom"),
}


@pytest.mark.parametrize("name", list(_RUNS))
def test_bitwise_equal_to_torch_and_single_process(name: str) -> None:
    assert_parity(run_on_ranks(1, parity_body, run=_RUNS[name]), rtol=0, atol=0)


def _paths_body(rank: int, world_size: int, observed: bool) -> dict[str, Any]:
    """Steps that stress the local path; with ``observed``, the general path does them."""
    unsubscribe = subscribe(lambda event: None) if observed else None
    model = models.build("mlp")
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    took_local = []
    losses = []
    captured: list[torch.Tensor] = []
    model.blocks[1].register_forward_hook(lambda m, a, out: captured.append(out))
    for step in range(6):
        x, y = models.batch("mlp", step, 4)
        # Steps 2 and 3 freeze a weight: requires_grad changes between steps.
        model.blocks[1].fc1.weight.requires_grad_(step not in (2, 3))
        captured.clear()
        out = model(x)
        if step == 3:
            # A backward that never reaches the root's output.
            loss = captured[0].pow(2).mean()
        elif step == 5:
            # A child called directly after a root forward that backward never uses.
            loss = model.blocks[2](torch.randn(4, 16, generator=torch.Generator().manual_seed(5)))
            loss = loss.pow(2).mean()
        else:
            loss = models.loss_of("mlp", out, y)
        took_local.append(state_of(model).ctx.local)  # type: ignore[union-attr]
        loss.backward()
        grads = {
            n: p.grad.full_tensor().clone()
            for n, p in model.named_parameters()
            if p.grad is not None
        }
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        with torch.no_grad():
            losses.append(models.loss_of("mlp", model(x), y).item())
        # The blocks' sharded parameters are registered again after the eval (the root
        # keeps its full ones, as ever: it needs them first at the next forward).
        assert all(isinstance(p, DTensor) for p in model.blocks.parameters())
    if unsubscribe is not None:
        unsubscribe()
    params = full_params(model)
    return {"losses": losses, "params": params, "last_grads": grads, "took_local": took_local}


def test_local_path_equals_the_general_path() -> None:
    fast = run_on_ranks(1, _paths_body, observed=False)[0]
    general = run_on_ranks(1, _paths_body, observed=True)[0]
    assert fast["took_local"] == [True] * 6
    assert general["took_local"] == [False] * 6
    assert fast["losses"] == general["losses"]
    for key in ("params", "last_grads"):
        assert fast[key].keys() == general[key].keys()
        for name, value in fast[key].items():
            assert torch.equal(value, general[key][name]), f"{key} {name}"
