"""Desync checks (SHARDKIT_DEBUG): ranks running different code are stopped, and named.

Rank 1 runs one extra micro-batch. Without the checks both torch and shardkit go on with
diverging losses and hang at the end; with them every rank raises at the first collective
where the ranks differ, naming what each was about to do, before any optimizer step uses
mismatched gradients.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

from harness.pool import run_on_ranks
from tests.core import models
from tests.core.parity import Run, apply, rank_batch

STEPS = 4
EXTRA_AT = 2  # the step (0-based) in which rank 1 runs one more micro-batch


def _extra_micro_batch_body(rank: int, world_size: int, debug: bool) -> dict[str, Any]:
    from shardkit.core import DesyncError, set_debug

    model = models.build("mlp")
    apply("shardkit", model, init_device_mesh("cpu", (world_size,)), Run(model="mlp"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    set_debug(debug)
    steps_taken = 0
    try:
        for step in range(STEPS):
            micro_batches = 2 if rank == 1 and step == EXTRA_AT else 1
            for _ in range(micro_batches):
                x, y = rank_batch("mlp", step, rank, world_size, "shardkit")
                models.loss_of("mlp", model(x), y).backward()
            opt.step()
            opt.zero_grad()
            steps_taken += 1
    except DesyncError as error:
        return {"error": str(error), "steps_taken": steps_taken}
    finally:
        set_debug(False)
    return {"error": "", "steps_taken": steps_taken}


def test_an_extra_micro_batch_on_one_rank_is_named_on_every_rank() -> None:
    results = run_on_ranks(2, _extra_micro_batch_body, debug=True)
    message = results[0]["error"]
    assert message and all(r["error"] == message for r in results), results
    # rank 0 went on to the next step's forward; rank 1 is still in the step before
    assert f"rank 0: all-gather of <root> in forward, step {EXTRA_AT + 2}" in message, message
    assert f"rank 1: all-gather of <root> in forward, step {EXTRA_AT + 1}" in message, message
    # caught before rank 1's optimizer stepped with an extra micro-batch's gradients
    assert [r["steps_taken"] for r in results] == [EXTRA_AT + 1, EXTRA_AT]


def _in_step_body(rank: int, world_size: int, debug: bool) -> list[float]:
    from shardkit.core import set_debug

    model = models.build("mlp")
    apply("shardkit", model, init_device_mesh("cpu", (world_size,)), Run(model="mlp"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    set_debug(debug)
    try:
        losses = []
        for step in range(STEPS):
            x, y = rank_batch("mlp", step, rank, world_size, "shardkit")
            loss = models.loss_of("mlp", model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses
    finally:
        set_debug(False)


def test_ranks_in_step_train_exactly_as_without_checks() -> None:
    assert run_on_ranks(2, _in_step_body, debug=True) == run_on_ranks(2, _in_step_body, debug=False)
