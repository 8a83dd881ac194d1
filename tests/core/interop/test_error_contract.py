"""torch's error contract: each user error raises the exception type torch raises, with torch's
wording of the problem, so code written against torch's fully_shard catches ours too.

Both implementations run in this process on the fake process-group backend (4 "ranks").
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard

import shardkit.core
from tests.core.fake_group import fake_mesh

WORLD = 4


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    with fake_mesh(WORLD) as mesh:
        yield mesh


class _Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.p


def _twice(fs: Any, mesh: DeviceMesh) -> None:
    m = nn.Linear(4, 4)
    fs(m, mesh=mesh)
    fs(m, mesh=mesh)


def _deepcopy(fs: Any, mesh: DeviceMesh) -> None:
    m = nn.Linear(4, 4)
    fs(m, mesh=mesh)
    copy.deepcopy(m)


def _container(fs: Any, mesh: DeviceMesh) -> None:
    fs(nn.ModuleList([nn.Linear(4, 4)]), mesh=mesh)


def _unnamed_2d_mesh(fs: Any, mesh: DeviceMesh) -> None:
    fs(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (2, 2)))


def _mesh_3d(fs: Any, mesh: DeviceMesh) -> None:
    fs(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "b", "c")))


def _forward_on_meta(fs: Any, mesh: DeviceMesh) -> None:
    with torch.device("meta"):
        m = nn.Linear(4, 4)
    fs(m, mesh=mesh)
    m(torch.randn(2, 4))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.in_proj(x)
        return out


def _forward_on_meta_nested(fs: Any, mesh: DeviceMesh) -> None:
    # The root owns no parameter: the first group to gather is layers.0's, whose parameters
    # torch names from the root.
    with torch.device("meta"):
        m = nn.Sequential(_Block(), _Block())
    for block in m:
        fs(block, mesh=mesh)
    fs(m, mesh=mesh)
    m(torch.randn(2, 4))


def _uneven_dim1(fs: Any, mesh: DeviceMesh) -> None:
    fs(nn.Linear(5, 5), mesh=mesh, shard_placement_fn=lambda p: Shard(p.dim() - 1))


def _invalid_dim(fs: Any, mesh: DeviceMesh) -> None:
    fs(nn.Linear(4, 4), mesh=mesh, shard_placement_fn=lambda p: Shard(3))


def _scalar_param(fs: Any, mesh: DeviceMesh) -> None:
    fs(_Scalar(), mesh=mesh)


# (case, torch's exception type, torch's wording that ours must contain as well)
CASES: list[tuple[Callable[[Any, DeviceMesh], None], type[BaseException], str]] = [
    (_twice, AssertionError, "Each distinct composable distributed API can only be applied"),
    (_deepcopy, AssertionError, "FSDP does not support deepcopy"),
    (_container, ValueError, "fully_shard does not support containers that do not implement"),
    (_unnamed_2d_mesh, AssertionError, "init the 2D mesh for HSDP with mesh_dim_names"),
    (_mesh_3d, ValueError, "fully_shard expects a 1D or 2D DeviceMesh but got"),
    (_forward_on_meta, RuntimeError, "still on meta device: ['weight', 'bias']"),
    (_forward_on_meta_nested, RuntimeError, "meta device: ['0.in_proj.weight', '0.in_proj.bias']"),
    (_uneven_dim1, NotImplementedError, "FSDP does not support uneven sharding on dim 1"),
    (_invalid_dim, AssertionError, "Shard dim 3 is invalid for 2D tensor: torch.Size([4, 4])"),
    (_scalar_param, ValueError, "fully_shard doesn't support scalar parameters. Change p"),
]


@pytest.mark.parametrize(("case", "kind", "wording"), CASES, ids=[c[0].__name__ for c in CASES])
def test_same_exception_type_and_wording_as_torch(
    mesh: DeviceMesh, case: Callable[[Any, DeviceMesh], None], kind: type, wording: str
) -> None:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    messages = []
    for fs in (torch_fully_shard, shardkit.core.fully_shard):
        with pytest.raises(kind) as raised:
            case(fs, mesh)
        assert wording in str(raised.value), (fs.__module__, str(raised.value))
        messages.append(str(raised.value))
    # Code matching on torch's message finds it first in ours: torch's first line, word for
    # word, before anything shardkit adds (its hints come after).
    torchs, ours = messages
    assert ours.startswith(torchs.split("\n")[0]), (torchs, ours)


def test_our_errors_are_also_the_natural_types() -> None:
    # A user error is also a ValueError or RuntimeError, whatever torch's type is.
    assert issubclass(shardkit.core.FullyShardUsageError, ValueError)
    assert issubclass(shardkit.core.InvalidShardDimError, ValueError)
    assert issubclass(shardkit.core.UnevenShardingError, ValueError)
    assert issubclass(shardkit.core.UnsupportedCopyError, RuntimeError)
