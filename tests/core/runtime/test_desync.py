"""Desync checks (SHARDKIT_DEBUG): ranks running different code are stopped, and named.

Rank 1 runs one extra micro-batch. Without the checks both torch and shardkit go on with
diverging losses and hang at the end; with them every rank raises at the first collective
where the ranks differ, naming what each was about to do, before any optimizer step uses
mismatched gradients. The same holds where the ranks' next collectives differ in size or
kind (one rank skips a backward, or reduces no gradients), and the process group stays usable.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from harness.pool import run_on_ranks
from tests.core import models
from tests.core.parity import Run, apply, make_mesh, rank_batch

STEPS = 4
EXTRA_AT = 2  # the step (0-based) in which rank 1 runs one more micro-batch


def _extra_micro_batch_body(
    rank: int, world_size: int, debug: bool, replicas: bool = False
) -> dict[str, Any]:
    """``replicas``: HSDP with every rank a replica (no shards: all-reduces only)."""
    from shardkit.core import DesyncError, set_debug

    model = models.build("mlp")
    run = Run(model="mlp", hsdp=(world_size, 1) if replicas else None)
    apply("shardkit", model, make_mesh(run, world_size), run)
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


def test_an_extra_micro_batch_is_named_before_an_all_reduce_runs() -> None:
    # HSDP replicas reduce gradients with gloo's all-reduce, which tags cannot keep apart: the
    # fingerprints are compared before it is issued.
    results = run_on_ranks(2, _extra_micro_batch_body, debug=True, replicas=True)
    message = results[0]["error"]
    assert message and all(r["error"] == message for r in results), results
    assert f"rank 0: all-reduce of blocks.2 in backward, step {EXTRA_AT + 2}" in message, message
    assert f"rank 1: all-reduce of blocks.2 in backward, step {EXTRA_AT + 1}" in message, message
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


SKIP_AT = 1  # the step (0-based) whose backward and optimizer step rank 1 leaves out


class Widening(nn.Module):
    """Layers of different sizes, each its own group: any two of their all-gathers differ."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(7, 16), nn.Linear(16, 32), nn.Linear(32, 3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


def _one_rank_differs_body(
    rank: int, world_size: int, how: str, reset: bool = False
) -> dict[str, Any]:
    """Rank 1 differs in step SKIP_AT: 'skip_backward' (no backward, no optimizer step) or
    'no_sync' (its gradients are not reduced: no reduce-scatters). ``reset``: then every rank
    calls ``reset_iter_state()``, the documented recovery after an exception mid-step."""
    from shardkit.core import DesyncError, set_debug

    torch.manual_seed(0)
    model: Any = Widening()  # an FSDPModule once sharded
    apply("shardkit", model, init_device_mesh("cpu", (world_size,)), Run(model="mlp"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    set_debug(True)
    error = ""
    try:
        for step in range(STEPS):
            differs = rank == 1 and step == SKIP_AT
            model.set_requires_gradient_sync(not (differs and how == "no_sync"))
            x, y = rank_batch("mlp", step, rank, world_size, "shardkit")
            loss = models.loss_of("mlp", model(x), y)
            if differs and how == "skip_backward":
                continue  # rank 1 goes on to the next forward
            loss.backward()
            opt.step()
            opt.zero_grad()
    except DesyncError as caught:
        error = str(caught)
    reset_error = ""
    try:
        if reset:
            model.reset_iter_state()
    except DesyncError as caught:
        reset_error = str(caught)
    finally:
        set_debug(False)
    # After the error, a new model on the same process group trains with checks, in step.
    losses = _in_step_body(rank, world_size, debug=True)
    return {"error": error, "reset_error": reset_error, "losses": losses}


# What each rank was about to run when rank 1 differed: ``skip_backward``: rank 0's next
# collective is the backward all-gather of the last layer, rank 1's the forward all-gather of
# the first (another size; a gloo receive paired with a longer message aborts the process).
# ``no_sync``: rank 1 skips its reduce-scatters, and rank 0 issued another all-gather before
# waiting on the one where the ranks differ, leaving a fingerprint exchange unmatched.
SIDES = {
    "skip_backward": (
        "rank 0: all-gather of blocks.2 in backward",
        "rank 1: all-gather of blocks.0 in forward",
    ),
    "no_sync": (
        "rank 0: reduce-scatter of blocks.2 in backward",
        "rank 1: all-gather of blocks.0 in backward",
    ),
}


@pytest.mark.parametrize("how", list(SIDES))
def test_a_rank_out_of_step_is_named_on_every_rank_then_training_goes_on(how: str) -> None:
    # The collectives where the ranks differ never exchange data; messages the error left
    # unmatched do not pair with the next model's, which trains as without checks.
    results = run_on_ranks(2, _one_rank_differs_body, how=how)
    message = results[0]["error"]
    assert message and all(r["error"] == message for r in results), results
    for side in SIDES[how]:
        assert f"{side}, step {SKIP_AT + 1} (#" in message, message
    expected = run_on_ranks(2, _in_step_body, debug=False)
    assert [r["losses"] for r in results] == expected


@pytest.mark.parametrize("how", list(SIDES))
def test_a_reset_after_a_desync_never_waits_on_a_collective_left_behind(how: str) -> None:
    # no_sync: rank 0 issued an all-gather after the reduce-scatter where the ranks differ,
    # which rank 1 never issues; the reset finishes what is in flight and must drop it, not
    # wait for it (nor raise again).
    results = run_on_ranks(2, _one_rank_differs_body, timeout_s=60, how=how, reset=True)
    message = results[0]["error"]
    assert message and all(r["error"] == message for r in results), results
    assert not any(r["reset_error"] for r in results), results
    for side in SIDES[how]:
        assert f"{side}, step {SKIP_AT + 1} (#" in message, message
    expected = run_on_ranks(2, _in_step_body, debug=False)
    assert [r["losses"] for r in results] == expected


def _rank_dependent_policy_body(rank: int, world_size: int) -> str:
    """Rank 0 keeps the middle layer in fp32, the other ranks cast it to bf16 like the rest."""
    from shardkit.core import DesyncError, MixedPrecisionPolicy, fully_shard, set_debug

    torch.manual_seed(0)
    model = Widening()
    middle = set(map(id, model.blocks[1].parameters()))
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        param_dtype_override_fn=lambda p: p.dtype if rank == 0 and id(p) in middle else None,
    )
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)), mp_policy=policy)
    set_debug(True)
    try:
        model(torch.randn(4, 7)).float().sum().backward()
    except DesyncError as caught:
        return str(caught)
    finally:
        set_debug(False)
    return ""


def test_a_policy_that_depends_on_the_rank_is_named_not_a_hang() -> None:
    # Without checks, as with torch, the ranks' all-gathers differ in size and the job hangs
    # (or gloo aborts a process); with them every rank names the group and the likely cause.
    results = run_on_ranks(2, _rank_dependent_policy_body)
    message = results[0]
    assert message and all(r == message for r in results), results
    assert "disagree on what one collective carries" in message, message
    assert "all-gather of <root> in forward, step 1 (#1," in message, message
    assert "param_dtype_override_fn whose answer depends on the rank" in message, message
