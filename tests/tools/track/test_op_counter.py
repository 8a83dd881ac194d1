"""OpCounter: the operators a step dispatches, and those that launch kernels."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from shardkit.core import fully_shard
from shardkit.tools import OpCounter


def test_it_counts_by_name_and_leaves_views_out_of_launches() -> None:
    x = torch.ones(4, 4)
    with OpCounter() as ops:
        y = x.view(16)  # a view: no kernel
        z = torch.empty(3)  # an allocation: no kernel
        (y * 2).sum()
    assert ops.by_op["aten.view"] == 1 and ops.by_op["aten.mul"] == 1
    assert ops.total == 4
    assert ops.launches == 2  # mul and sum
    assert ops.top(1)[0][1] == 1
    assert z.numel() == 3


def test_counts_add_up_over_blocks_and_nothing_is_counted_outside() -> None:
    ops = OpCounter()
    with ops:
        torch.ones(2) + 1
    torch.ones(2) + 1
    with ops:
        torch.ones(2) + 1
    assert ops.by_op["aten.add"] == 2


@pytest.fixture
def fake_world_of_64() -> Iterator[None]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=64)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _step_ops(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> OpCounter:
    def step() -> None:
        model(torch.randn(8, 64)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # the first step builds what later steps reuse
    with OpCounter() as ops:
        step()
    return ops


def test_the_guides_example_counts_a_step_on_the_fake_group(fake_world_of_64: None) -> None:
    # docs/guide/tools.md, OpCounter: four Linear layers, each its own group, at W=64.
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))
    for layer in model:
        fully_shard(layer, mesh=init_device_mesh("cpu", (64,)))
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    ops = _step_ops(model, optimizer)
    # Each layer gathers in forward and again in backward, and reduces once.
    # 8 the groups' (as many at W=64), and the step check's one where backward ends.
    assert ops.by_op["c10d._allgather_base_"] == 8 + 1
    assert ops.by_op["c10d._reduce_scatter_base_"] == 4
    assert ops.by_op["aten.split_with_sizes_copy"] == 8  # one copy-out per gather, not 64
    assert 0 < ops.launches < ops.total
