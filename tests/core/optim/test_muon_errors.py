"""What Muon refuses, as torch's Muon does, and the placements it cannot place."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.placement_types import _StridedShard

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


def _placed_body(rank: int, world_size: int, how: str) -> str:
    """What Muon says of a matrix placed as ``how`` says ("" where it takes it)."""
    mesh = init_device_mesh("cpu", (world_size,))
    if how == "hsdp":
        model = nn.Sequential(nn.Linear(4, 6, bias=False))
        names = ("replicate", "shard")
        fully_shard(model, mesh=init_device_mesh("cpu", (1, world_size), mesh_dim_names=names))
        params = list(model.named_parameters())
    else:
        # A sum of rows on each rank; rows cut as if a later axis had cut them first (none has).
        placement = {"partial": Partial(), "strided": _StridedShard(0, split_factor=3)}[how]
        local = torch.ones(4 if how == "partial" else 2, 4)
        matrix = DTensor.from_local(
            local, mesh, [placement], run_check=False, shape=torch.Size((4, 4)), stride=(4, 1)
        )
        params = [("blocks.0.mlp.weight", nn.Parameter(matrix))]
    try:
        Muon(params)
    except NotImplementedError as e:
        return str(e)
    return ""


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("hsdp", ""),  # taken now: tests/core/optim/test_muon_placements.py steps it
        ("partial", "blocks.0.mlp.weight: placement Partial(sum) on mesh axis 0"),
        ("strided", "blocks.0.mlp.weight: placement _StridedShard(dim=0, sf=3) on mesh axis 0"),
    ],
)
def test_placements_muon_cannot_place_are_refused_by_name(how: str, message: str) -> None:
    for text in run_on_ranks(2, _placed_body, how=how):
        assert text.startswith(message) if message else text == "", text


def test_a_stack_of_stacks_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"moe\.w: a whole-matrix optimizer takes 2-D .* 3-D"):
        Muon([("moe.w", nn.Parameter(torch.ones(2, 2, 3, 4)))])
