"""Biases-only training (BitFit): each group reduces its trainable gradients alone, in backward.

What torch's own ``test_train_mixed_requires_grad_per_group`` checks, on shardkit's seams:
every reduction of a group whose weights are frozen carries its biases' gradients only, and
comes while autograd is still running (before the gradient reaches the model's input, not
from the end-of-backward callback), whatever ``reshard_after_forward``, with activation
checkpointing and with the weights frozen after ``fully_shard``. Torch counts calls of its
private post-backward autograd function for the second; shardkit reduces from
post-accumulate-grad hooks and never runs that function (see the engine's guide, "Where
shardkit differs"). Losses and parameters equal torch's ``fully_shard`` bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest

from harness.pool import run_on_ranks

NUM_BLOCKS, DIM = 3, 32


def _body(
    rank: int, world_size: int, reshard: bool | int, checkpointed: bool, freeze_after: bool
) -> dict[str, Any]:
    import torch
    from torch import nn
    from torch.distributed._composable.checkpoint_activation import checkpoint

    from shardkit.core import observe
    from tests.core.parity import fully_shard_of

    out: dict[str, Any] = {}
    for impl in ("torch", "shardkit"):
        torch.manual_seed(42)
        model = nn.Sequential(
            *[
                nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.ReLU(), nn.Linear(4 * DIM, DIM))
                for _ in range(NUM_BLOCKS)
            ]
        )

        def freeze_weights(model: nn.Module = model) -> None:
            for name, param in model.named_parameters():
                param.requires_grad_("bias" in name)

        if not freeze_after:
            freeze_weights()
        fs = fully_shard_of(impl)
        for block in model:
            if checkpointed:
                checkpoint(block)
            fs(block, reshard_after_forward=reshard)
        fs(model, reshard_after_forward=reshard)
        if freeze_after:
            freeze_weights()
        optim = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        events: list[tuple[str, str, int]] = []

        def on_event(event: Any, events: list[tuple[str, str, int]] = events) -> None:
            if isinstance(event, observe.CollectiveEvent) and event.kind == "reduce_scatter":
                events.append(("reduce", event.module_fqn, event.input_bytes))

        unsubscribe = observe.subscribe(on_event)
        losses: list[float] = []
        torch.manual_seed(7 + rank)
        for step in range(4):
            x = torch.randn(8, DIM, requires_grad=True)
            # The gradient of the input is the last thing autograd makes, before the end-of-
            # backward callback.
            x.register_hook(
                lambda g, step=step, events=events: events.append(("input_grad", "", step)) or g
            )
            loss = model(x).sum()
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=step % 2 == 0)
            losses.append(loss.item())
        unsubscribe()
        out[impl] = {
            "losses": losses,
            "params": [p.full_tensor() for p in model.parameters()],  # type: ignore[attr-defined]
            "events": events,
        }
    return out


@pytest.mark.parametrize(
    ("reshard", "checkpointed", "freeze_after"),
    [(True, False, False), (False, True, False), (2, False, True), (True, True, True)],
)
def test_bitfit_groups_reduce_biases_only_during_backward(
    reshard: bool | int, checkpointed: bool, freeze_after: bool
) -> None:
    world_size = 4 if reshard == 2 else 2
    bias_bytes = 4 * (4 * DIM + DIM)  # each block's two biases, fp32, unpadded (even dims)
    results = run_on_ranks(
        world_size,
        _body,
        reshard=reshard,
        checkpointed=checkpointed,
        freeze_after=freeze_after,
    )
    for result in results:
        ours, theirs = result["shardkit"], result["torch"]
        assert ours["losses"] == theirs["losses"]
        for mine, torchs in zip(ours["params"], theirs["params"], strict=True):
            assert mine.equal(torchs)
        # The oracle's collectives are not shardkit's events: its input gradients only.
        assert {kind for kind, _, _ in theirs["events"]} == {"input_grad"}
        steps = _split_by_step(ours["events"])
        assert len(steps) == 4
        for reductions, after_input_grad in steps:
            # One reduction per block, of its biases alone; none for the weightless root.
            assert sorted(fqn for fqn, _ in reductions + after_input_grad) == ["0", "1", "2"]
            assert {size for _, size in reductions + after_input_grad} == {bias_bytes}
            # In backward: the blocks above the first are reduced before autograd reaches
            # the input (the first may wait for its input's gradient, as torch's may).
            assert {fqn for fqn, _ in after_input_grad} <= {"0"}


def _split_by_step(
    events: list[tuple[str, str, int]],
) -> list[tuple[list[tuple[str, int]], list[tuple[str, int]]]]:
    """Per step: the reductions before the input's gradient, and those after it."""
    steps: list[tuple[list[tuple[str, int]], list[tuple[str, int]]]] = []
    before: list[tuple[str, int]] = []
    for kind, fqn, value in events:
        if kind == "input_grad":
            steps.append((before, []))
            before = []
        elif steps and not before and len(steps[-1][0]) + len(steps[-1][1]) < NUM_BLOCKS:
            steps[-1][1].append((fqn, value))
        else:
            before.append((fqn, value))
    assert not before, before
    return steps
