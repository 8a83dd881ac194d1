"""What Muon refuses, as torch's Muon does, and the shardings it takes in a later part."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from harness.pool import run_on_ranks
from shardkit.core import fully_shard
from shardkit.core.optim import Muon


def _matrix() -> nn.Parameter:
    return nn.Parameter(torch.ones(4, 3))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, "Learning rate should be >= 0 but is: -1.0"),
        ({"momentum": -0.5}, "momentum should be >= 0 but is: -0.5"),
        ({"weight_decay": -0.1}, "weight decay should be >= 0 but is: -0.1"),
        ({"adjust_lr_fn": "other"}, "Adjust learning rate function other is not supported"),
        ({"ns_steps": 100}, "Number of steps must be less than 100"),
        ({"ns_coefficients": (1.0, 2.0)}, "Coefficients must be a tuple of exactly 3 values"),
        ({"lr": torch.ones(2)}, "Tensor lr must be 1-element"),
    ],
)
def test_muon_refuses_what_torch_refuses(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Muon([_matrix()], **kwargs)


def test_the_defaults_are_torch_muons() -> None:
    ours = Muon([_matrix()]).defaults
    theirs = torch.optim.Muon([_matrix()]).defaults
    assert ours == {k: v for k, v in theirs.items() if k in ours}
    assert set(theirs) - set(ours) <= {"maximize", "foreach", "differentiable", "fused"}


def test_a_vector_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"norm\.bias: a whole-matrix optimizer takes 2-D"):
        Muon([("norm.bias", nn.Parameter(torch.ones(3)))])


def test_a_bad_group_added_later_is_not_kept() -> None:
    opt = Muon([_matrix()])
    with pytest.raises(ValueError):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(3))]})
    with pytest.raises(ValueError):
        opt.add_param_group({"params": [_matrix()], "ns_steps": 200})
    assert len(opt.param_groups) == 1


def _unsupported_body(rank: int, world_size: int, how: str) -> str:
    model = nn.Sequential(nn.Linear(4, 6, bias=False))
    if how == "hsdp":
        mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh)
    else:
        fully_shard(
            model,
            mesh=init_device_mesh("cpu", (world_size,)),
            shard_placement_fn=lambda p: Shard(1),
        )
    try:
        Muon(model.named_parameters())
    except NotImplementedError as e:
        return str(e)
    return ""


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("hsdp", "0.weight: sharded over a 2-D mesh (1, 2)"),
        ("shard1", "0.weight: placement Shard(dim=1)"),
    ],
)
def test_shardings_of_a_later_part_are_refused_by_name(how: str, message: str) -> None:
    for text in run_on_ranks(2, _unsupported_body, how=how):
        assert text.startswith(message), text
