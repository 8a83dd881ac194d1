"""``fully_shard.state(module)``, as torch's: the state of the call that manages ``module``.

torch's composable-API decorator gives its ``fully_shard`` a ``state`` function; code and tests
written for torch (its own ``test_fully_shard_state``) read a module's FSDP state through it.
Both implementations run here on the fake process group, on models of the same shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import shardkit.core
from shardkit.core.engine.fsdp_state import FSDPState
from tests.core.fake_group import fake_mesh

WORLD = 2


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    with fake_mesh(WORLD) as mesh:
        yield mesh


def _states(fs: Any, mesh: DeviceMesh) -> dict[str, Any]:
    """What ``fs.state`` says about a model sharded block by block, one list call, the root."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    before = fs.state(model)
    fs(model[0], mesh=mesh)
    fs([model[1], model[2]], mesh=mesh)
    fs(model, mesh=mesh)
    states = [fs.state(m) for m in (model, *model)]
    return {
        "before": before,
        "unmanaged": fs.state(model[3]),
        "distinct": len({id(s) for s in states if s is not None}),
        "list_shares_one": states[2] is states[3],
        "every_call_has_one": all(s is not None for s in states[:4]),
        "ours": states[0],
    }


def test_state_reads_each_calls_state_as_torchs(mesh: DeviceMesh) -> None:
    theirs = _states(torch_fully_shard, mesh)
    ours = _states(shardkit.core.fully_shard, mesh)
    assert theirs["before"] is None and theirs["unmanaged"] is None
    expected = {k: v for k, v in theirs.items() if k != "ours"}
    assert {k: v for k, v in ours.items() if k != "ours"} == expected
    assert expected["distinct"] == 3 and expected["list_shares_one"]
    assert isinstance(ours["ours"], FSDPState)
