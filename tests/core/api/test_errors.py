"""Bad input: a clear error naming the module or parameter, and nothing half-sharded."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from harness.pool import run_on_ranks
from tests.core import models


def _untouched(
    model: nn.Module, before: dict[str, tuple[nn.Parameter, torch.Tensor]], cls: type
) -> bool:
    """The model's class, parameter objects and values are exactly as they were."""
    if type(model) is not cls:
        return False
    for name, p in model.named_parameters():
        original, value = before[name]
        if p is not original:
            return False
        if not p.is_meta and not isinstance(p, DTensor) and not p.equal(value):
            return False
    return True


def _expect_error(
    model: nn.Module, call: Callable[[], Any], match: str, exc: type[Exception] = ValueError
) -> str:
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    cls = type(model)
    try:
        call()
    except exc as error:
        message = str(error)
        if match not in message:
            return f"message {message!r} lacks {match!r}"
        if not _untouched(model, before, cls):
            return f"model changed after the error {message!r}"
        return "ok"
    return "no error raised"


def _errors_body(rank: int, world_size: int) -> dict[str, str]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from shardkit.core import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    out: dict[str, str] = {}

    m: Any = models.MLPNet()
    fully_shard(m.blocks[0], mesh=mesh)
    out["twice"] = _expect_error(
        m.blocks[0].fc1, lambda: fully_shard(m.blocks[0], mesh=mesh), "already been applied"
    )

    t: Any = models.MLPNet()
    torch_fully_shard(t.blocks[0], mesh=mesh)
    out["torch_managed"] = _expect_error(
        t.blocks[1], lambda: fully_shard(t, mesh=mesh), "already managed by torch's FSDP"
    )

    mesh3 = init_device_mesh("cpu", (1, 1, world_size), mesh_dim_names=("a", "b", "c"))
    m = models.MLPNet()
    out["mesh_3d"] = _expect_error(m, lambda: fully_shard(m, mesh=mesh3), "3-D mesh")

    mesh2 = init_device_mesh("cpu", (1, world_size))
    m = models.MLPNet()
    out["hsdp_no_names"] = _expect_error(m, lambda: fully_shard(m, mesh=mesh2), "mesh_dim_names")

    m = models.MLPNet()
    out["placement_dim"] = _expect_error(
        m, lambda: fully_shard(m, mesh=mesh, shard_placement_fn=lambda p: Shard(5)), "inp.weight"
    )

    m = models.MLPNet()
    m.register_parameter("temperature", nn.Parameter(torch.tensor(1.0)))
    out["zero_dim"] = _expect_error(m, lambda: fully_shard(m, mesh=mesh), "temperature")

    m = models.MLPNet()
    out["int_reshard"] = _expect_error(
        m, lambda: fully_shard(m, mesh=mesh, reshard_after_forward=3), "must divide"
    )

    m = models.MLPNet()
    m.head.weight = nn.Parameter(torch.empty(3, 16, device="meta"))
    out["devices"] = _expect_error(m, lambda: fully_shard(m, mesh=mesh), "one device")

    m = models.MLPNet()
    m.blocks[1].fc1.weight = m.blocks[0].fc1.weight  # shared by two groups
    fully_shard(m.blocks[0], mesh=mesh)
    out["shared_two_groups"] = _expect_error(
        m.blocks[1], lambda: fully_shard(m.blocks[1], mesh=mesh), "fc1.weight"
    )

    m = models.MLPNet()
    out["container"] = _expect_error(
        m.blocks, lambda: fully_shard(m.blocks, mesh=mesh), "container"
    )

    m = models.MLPNet()
    out["uneven_dim1"] = (
        _expect_error(
            m,
            lambda: fully_shard(
                m, mesh=mesh, shard_placement_fn=lambda p: Shard(-1) if p.dim() > 1 else None
            ),
            "divisible",
        )
        if world_size == 4
        else "ok"
    )

    # After all of those, a valid call still works on a fresh model.
    m = models.MLPNet()
    fully_shard(m, mesh=mesh)
    m(torch.randn(2, 5, 7)).sum().backward()
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_bad_input_raises_clearly_and_changes_nothing(world_size: int) -> None:
    results = run_on_ranks(world_size, _errors_body)
    failures = {case: verdict for case, verdict in results[0].items() if verdict != "ok"}
    assert not failures, failures
