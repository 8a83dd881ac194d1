"""Misuse that trains nothing, silently, in torch's fully_shard: shardkit warns about it."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

from harness.pool import run_on_ranks
from tests.core import models
from tests.core.parity import Run, apply


def _optimizer_first_body(rank: int, world_size: int, optimizer_first: bool) -> dict[str, Any]:
    model = models.build("mlp")
    if optimizer_first:  # the mistake: it holds the parameters that fully_shard replaces
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    apply("shardkit", model, init_device_mesh("cpu", (world_size,)), Run(model="mlp"))
    if not optimizer_first:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = models.batch("mlp", 0, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            models.loss_of("mlp", model(x), y).backward()
            opt.step()
    return {"warnings": [str(w.message) for w in caught]}


def test_an_optimizer_built_before_fully_shard_is_warned_about_once() -> None:
    for result in run_on_ranks(2, _optimizer_first_body, optimizer_first=True):
        assert len(result["warnings"]) == 1, result
        message = result["warnings"][0]
        assert "after fully_shard" in message and "inp.weight" in message, message
    for result in run_on_ranks(2, _optimizer_first_body, optimizer_first=False):
        assert not result["warnings"], result
