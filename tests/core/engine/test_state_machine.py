"""The group state machine in one process: a recording runtime in place of c10d.

The fake process-group backend gives a mesh of two "ranks" in this process; the runtime
handed to the root's lazy init records every collective instead of running it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from shardkit.core import StateTransitionEvent, fully_shard, subscribe
from shardkit.core.engine.state_registry import state_of
from shardkit.core.state_machines import ShardedState, TrainingState
from tests.core import models
from tests.core.engine.recording_runtime import RecordingRuntime
from tests.core.fake_group import fake_mesh


@pytest.fixture
def fake_world() -> Iterator[Any]:
    with fake_mesh(2) as mesh:
        yield mesh


def _sharded_mlp(mesh: Any) -> Any:
    model = models.build("mlp", seed=0)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def test_one_step_issues_the_collectives_in_order(fake_world: Any) -> None:
    model = _sharded_mlp(fake_world)
    runtime = RecordingRuntime()
    state_of(model).lazy_init(runtime=runtime)
    events: list[tuple[str, str]] = []
    unsubscribe = subscribe(
        lambda e: (
            events.append((e.module_fqn, e.what)) if isinstance(e, StateTransitionEvent) else None
        )
    )
    try:
        x, y = models.batch("mlp", 0, 2)
        models.loss_of("mlp", model(x), y).backward()
    finally:
        unsubscribe()
    gathers = [label for kind, label, _ in runtime.calls if kind == "all_gather"]
    reductions = [label for kind, label, _ in runtime.calls if kind == "reduce_scatter"]
    blocks = ["blocks.0", "blocks.1", "blocks.2"]
    # Forward gathers each group once; backward gathers the resharded blocks again, last first
    # (the root kept its parameters: reshard_after_forward=None).
    assert gathers == ["<root>", *blocks, *reversed(blocks)]
    # One reduction per group, in backward order, the root's last.
    assert reductions == [*reversed(blocks), "<root>"]
    assert not any(kind == "all_reduce" for kind, _, _ in runtime.calls)
    block0 = [what for fqn, what in events if fqn == "blocks.0"]
    # In backward, blocks.1's pre-backward prefetches blocks.0: its unshard comes first.
    assert block0 == [
        "unshard", "pre_forward", "reshard", "post_forward",
        "unshard", "pre_backward", "post_backward", "reshard",
    ]  # fmt: skip
    for module in (model, *model.blocks):
        group = state_of(module).groups[0]
        assert group is not None
        assert group.training_state is TrainingState.IDLE
        assert group.sharded_state is ShardedState.SHARDED
    # Each reduction was finished and assigned as a sharded gradient of the shard's shape.
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert param.grad.to_local().shape == param.to_local().shape, name


def test_a_wrong_transition_names_the_module(fake_world: Any) -> None:
    model = _sharded_mlp(fake_world)
    state_of(model).lazy_init(runtime=RecordingRuntime())
    group = state_of(model.blocks[1]).groups[0]
    assert group is not None
    group.training_state = TrainingState.POST_BACKWARD
    with pytest.raises(RuntimeError, match=r"in blocks\.1: TrainingState POST_BACKWARD -> FORWARD"):
        group.training_state = TrainingState.FORWARD


def test_a_backward_without_sync_ends_each_group_once(fake_world: Any) -> None:
    """Its gradients are kept for the next backward at its own end: the end-of-backward
    callback leaves them, where it used to end every group a second time (a walk over its
    parameters that did nothing). The backward that syncs reduces each group once."""
    model = _sharded_mlp(fake_world)
    runtime = RecordingRuntime()
    state_of(model).lazy_init(runtime=runtime)
    ends: list[str] = []
    unsubscribe = subscribe(
        lambda e: (
            ends.append(e.module_fqn)
            if isinstance(e, StateTransitionEvent) and e.what == "post_backward"
            else None
        )
    )
    groups = ["<root>", "blocks.0", "blocks.1", "blocks.2"]
    try:
        for step, sync in enumerate((False, False, True)):
            model.set_requires_gradient_sync(sync)
            x, y = models.batch("mlp", step, 2)
            models.loss_of("mlp", model(x), y).backward()
            assert sorted(ends) == groups, (sync, ends)
            ends.clear()
    finally:
        unsubscribe()
    reductions = [label for kind, label, _ in runtime.calls if kind == "reduce_scatter"]
    assert sorted(reductions) == groups
    for name, param in model.named_parameters():
        assert param.grad is not None, name
