"""torch.compile on sharded models: per block (torchtitan's way) and the whole model.

The backend is aot_eager: dynamo traces the model and AOTAutograd builds the forward and
backward graphs, which is where an FSDP's hooks matter (they must run eagerly: they unshard
through collectives). Inductor only changes the generated kernels and takes about a minute to
compile on this machine; it was checked by hand (docs/guide/core.md).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from harness.pool import run_on_ranks
from tests.core import models
from tests.core.parity import fully_shard_of, global_loss, rank_batch


def _train(impl: str, rank: int, world_size: int, where: str) -> list[float]:
    torch._dynamo.reset()  # each implementation compiles afresh
    model = models.build("gpt")
    if where == "blocks":
        for block in model.blocks:
            block.compile(backend="aot_eager")
    if impl != "local":
        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:
            fully_shard_of(impl)(block, mesh=mesh)
        fully_shard_of(impl)(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    run: Any = torch.compile(model, backend="aot_eager") if where == "model" else model
    losses = []
    for step in range(3):
        x, y = rank_batch("gpt", step, rank, world_size, impl)
        loss = models.loss_of("gpt", run(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_loss(loss, impl, world_size))
    return losses


def _body(rank: int, world_size: int, where: str) -> dict[str, list[float]]:
    return {impl: _train(impl, rank, world_size, where) for impl in ("shardkit", "torch", "local")}


@pytest.mark.parametrize("where", ["blocks", "model"])
def test_compiled_training_matches_torch(where: str) -> None:
    losses = run_on_ranks(2, _body, where=where)[0]
    assert losses["shardkit"] == losses["torch"]
    torch.testing.assert_close(losses["shardkit"], losses["local"], rtol=1e-5, atol=1e-6)
