"""reshard_after_forward: True, False and None (root keeps its parameters) match torch."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from harness.pool import run_on_ranks
from tests.core import models
from tests.core.parity import Run, assert_parity, parity_body


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("value", [True, False, None])
def test_reshard_after_forward_matches(world_size: int, value: bool | None) -> None:
    run = Run(model="gpt", shard_kwargs={"reshard_after_forward": value})
    assert_parity(run_on_ranks(world_size, parity_body, run=run))


def _states_after_forward(rank: int, world_size: int, value: bool | None) -> dict[str, bool]:
    from shardkit.core import fully_shard

    model = models.build("gpt")
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=value)
    fully_shard(model, mesh=mesh, reshard_after_forward=value)
    x, _ = models.batch("gpt", 0, 2)
    model(x).sum()
    dist.barrier()
    # Which parameters are registered unsharded (plain tensors) right after forward.
    from torch.distributed.tensor import DTensor

    return {
        "root": not isinstance(model.tok.weight, DTensor),
        "block": not isinstance(model.blocks[0].ln1.weight, DTensor),
    }


@pytest.mark.parametrize(
    ("value", "root_kept", "block_kept"),
    [(True, False, False), (False, True, True), (None, True, False)],
)
def test_what_stays_unsharded_after_forward(
    value: bool | None, root_kept: bool, block_kept: bool
) -> None:
    states = run_on_ranks(2, _states_after_forward, value=value)
    assert states[0] == {"root": root_kept, "block": block_kept}


def test_int_equal_to_world_means_true() -> None:
    run = Run(shard_kwargs={"reshard_after_forward": 2})
    assert_parity(run_on_ranks(2, parity_body, run=run))


@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_int_reshards_to_a_smaller_world(model: str) -> None:
    # W=4, keep 1/2 after forward: backward gathers within pairs of ranks.
    run = Run(model=model, shard_kwargs={"reshard_after_forward": 2})
    assert_parity(run_on_ranks(4, parity_body, run=run))


def _gather_sizes_body(rank: int, world_size: int) -> list[tuple[str, int]]:
    from shardkit.core import CollectiveEvent, fully_shard, subscribe

    model = models.build("gpt")
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=2)
    fully_shard(model, mesh=mesh)
    seen: list[tuple[str, int]] = []
    unsubscribe = subscribe(
        lambda e: seen.append((e.kind, e.group_size)) if isinstance(e, CollectiveEvent) else None
    )
    x, y = models.batch("gpt", 0, 2)
    models.loss_of("gpt", model(x), y).backward()
    unsubscribe()
    return seen


def test_int_backward_gathers_within_the_subgroup() -> None:
    seen = run_on_ranks(4, _gather_sizes_body)[0]
    gathers = [size for kind, size in seen if kind == "all_gather"]
    # Root once (size 4, kept), 2 blocks in forward (4) and again in backward (2).
    assert sorted(gathers) == [2, 2, 4, 4, 4]


def _subgroup_after_reinit(world: int) -> list[int]:
    """Train a step with reshard_after_forward=2 in a fresh (fake) world of ``world`` ranks."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardkit.core import fully_shard
    from shardkit.core.engine.state_registry import state_of
    from tests.core.engine.recording_runtime import RecordingRuntime

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        model = models.build("mlp")
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=2)
        fully_shard(model, mesh=mesh)
        state_of(model).lazy_init(runtime=RecordingRuntime())
        x, y = models.batch("mlp", 0, 2)
        models.loss_of("mlp", model(x), y).backward()  # backward gathers within the subgroup
        group = state_of(model.blocks[0]).groups[0]
        assert group is not None and group.plan.post_forward is not None
        return dist.get_process_group_ranks(group.plan.post_forward.subgroup())
    finally:
        dist.destroy_process_group()


def test_subgroups_do_not_outlive_their_process_group() -> None:
    # Tests and elastic restarts destroy the default group and make a new one: the subgroups
    # of the old world must not be handed to the new one.
    assert _subgroup_after_reinit(4) == [0, 1]
    assert _subgroup_after_reinit(4) == [0, 1]
