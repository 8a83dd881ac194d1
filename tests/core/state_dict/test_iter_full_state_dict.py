"""The one generator of full state dicts: every key, full values, on the coordinator or all."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harness.pool import run_on_ranks
from tests.core import models
from tests.core.parity import Run, apply, make_mesh


def _body(rank: int, world_size: int, hsdp: tuple[int, int] | None, tie: bool) -> dict[str, Any]:
    from shardkit.core import iter_full_state_dict

    name = "gpt_tied" if tie else "gpt"
    model = models.build(name, seed=3)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    run = Run(model=name, hsdp=hsdp)
    apply("shardkit", model, make_mesh(run, world_size), run)
    out: dict[str, Any] = {}
    for rank0_only in (True, False):
        items = list(iter_full_state_dict(model, rank0_only=rank0_only, cpu_offload=True))
        keys = [k for k, _ in items]
        equal = all(torch.equal(v, expected[k]) for k, v in items)
        plain = all(type(v) is torch.Tensor and v.device.type == "cpu" for _, v in items)
        out[str(rank0_only)] = (keys, equal, plain)
    out["model_keys"] = list(expected)
    return out


@pytest.mark.parametrize(
    ("world_size", "hsdp", "tie"),
    [(1, None, False), (2, None, True), (4, None, False), (4, (2, 2), False)],
)
def test_every_key_in_full_on_the_coordinator_or_everywhere(
    world_size: int, hsdp: tuple[int, int] | None, tie: bool
) -> None:
    results = run_on_ranks(world_size, _body, hsdp=hsdp, tie=tie)
    model_keys = results[0]["model_keys"]
    for rank, result in enumerate(results):
        keys, equal, plain = result["False"]
        assert sorted(keys) == sorted(model_keys) and equal and plain, rank
        keys, equal, plain = result["True"]
        if rank == 0:
            assert sorted(keys) == sorted(model_keys) and equal and plain
        else:
            assert keys == [], rank  # rank0_only: the others only send


def _sub_mesh_body(rank: int, world_size: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    from shardkit.core import fully_shard, iter_full_state_dict

    # Two independent data-parallel groups, {0, 2} and {1, 3}, as under tensor parallelism.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "other"))["dp"]
    model = models.build("mlp", seed=1)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return [k for k, _ in iter_full_state_dict(model, rank0_only=True)]


def test_the_coordinator_is_the_first_rank_of_each_data_parallel_group() -> None:
    keys = run_on_ranks(4, _sub_mesh_body)
    assert keys[0] and keys[1] == keys[0]  # ranks 0 and 1 lead their groups
    assert keys[2] == [] and keys[3] == []


def test_a_model_not_sharded_by_shardkit_is_refused() -> None:
    from shardkit.core import iter_full_state_dict

    with pytest.raises(TypeError, match="Linear is not sharded with shardkit's fully_shard"):
        next(iter_full_state_dict(torch.nn.Linear(2, 2)))
