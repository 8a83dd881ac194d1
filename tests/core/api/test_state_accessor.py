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
from shardkit.core.torch_facing.view import TorchFacingState
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
    assert isinstance(ours["ours"], TorchFacingState)


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: Any) -> Any:
        return self.out_proj(self.in_proj(x))


def _groups_of(state: Any) -> list[Any]:
    """A state's groups: ``_fsdp_param_groups`` (torch 2.13), else ``_fsdp_param_group``."""
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = state._fsdp_param_group
    return [group] if group is not None else []


def _lazy_init_names(fs: Any, mesh: DeviceMesh) -> dict[str, Any]:
    """What torch's lazy-init tests read: roots, every state in order, FQNs of modules, params.

    As ``test_fully_shard_is_root`` and ``test_fully_shard_module_and_param_fqns`` of torch's
    ``test_fully_shard_init.py`` read them (the model is theirs).
    """
    model = nn.Sequential(_MLP(), _MLP())
    fs(model[0].in_proj, mesh=mesh)
    fs(model[0].out_proj, mesh=mesh)
    fs(model, mesh=mesh)
    root = fs.state(model)
    before = root._is_root
    root._lazy_init()
    groups = {
        group._module_fqn: sorted(p._param_fqn for p in group.fsdp_params)
        for state in root._state_ctx.all_states
        for group in _groups_of(state)
    }
    singular = fs.state(model[0].in_proj)._fsdp_param_group
    return {
        "before": before,
        "roots": [fs.state(m)._is_root for m in (model, model[0].in_proj, model[0].out_proj)],
        "groups": groups,
        "singular": singular._module_fqn if singular is not None else None,
        "all_states": [
            state is fs.state(m)
            for state, m in zip(
                root._state_ctx.all_states, (model, *model[0].children()), strict=True
            )
        ],
    }


def test_lazy_init_names_read_as_torchs(mesh: DeviceMesh) -> None:
    theirs = _lazy_init_names(torch_fully_shard, mesh)
    assert theirs["groups"][""] == ["1.in_proj.bias", "1.in_proj.weight", "1.out_proj.bias",
                                    "1.out_proj.weight"]  # fmt: skip
    assert theirs["all_states"] == [True, True, True]
    assert _lazy_init_names(shardkit.core.fully_shard, mesh) == theirs


def test_torchs_fully_shard_state_finds_the_view(mesh: DeviceMesh) -> None:
    # torch's pipelining binds torch's fully_shard at import, before any patch_torch.
    model = nn.Sequential(nn.Linear(4, 4))
    ours: Any = shardkit.core.fully_shard
    sharded: Any = ours(model, mesh=mesh)
    view = ours.state(model)
    theirs: Any = torch_fully_shard
    assert theirs.state(model) is view and sharded._get_fsdp_state() is view
    with pytest.raises(AttributeError, match=r"TorchFacingState\._training_state: shardkit"):
        _ = view._training_state
    group = view._fsdp_param_groups[0]
    assert not hasattr(group, "_all_gather_stream")
    with pytest.raises(
        AttributeError, match=r"TorchFacingGroup\._all_reduce_hook_stream: shardkit"
    ):
        group._all_reduce_hook_stream = None
    group._all_reduce_hook = print  # served: the group's own option
    assert group._all_reduce_hook is print


def _comm_ctx_sharing(fs: Any, share: Any, mesh: DeviceMesh) -> list[bool]:
    """Which roots' ``_comm_ctx`` is the first's, two of three roots sharing (before forward)."""
    roots = [fs(nn.Sequential(nn.Linear(4, 4)), mesh=mesh) for _ in range(3)]
    share(roots[:2])
    first = roots[0]._get_fsdp_state()._comm_ctx
    return [root._get_fsdp_state()._comm_ctx is first for root in roots]


def test_comm_ctx_tells_roots_that_share_one_as_torchs(mesh: DeviceMesh) -> None:
    # torch 2.15's pipeline schedules read it to refuse stages sharing one context.
    from torch.distributed.fsdp import share_comm_ctx as torch_share

    theirs = _comm_ctx_sharing(torch_fully_shard, torch_share, mesh)
    assert theirs == [True, True, False]
    assert (
        _comm_ctx_sharing(shardkit.core.fully_shard, shardkit.core.share_comm_ctx, mesh) == theirs
    )


def _refusals(fs: Any, mesh: DeviceMesh) -> list[str]:
    """torch's two lazy-init refusals, as its ``test_fully_shard_init.py`` provokes them."""
    messages = []
    model = nn.Sequential(_MLP(), _MLP())
    fs(model[0].in_proj, mesh=mesh)
    fs(model[0].out_proj, mesh=mesh)
    fs(model, mesh=mesh)
    fs.state(model[0].in_proj)._lazy_init()  # a child initialized first, as its own root
    with pytest.raises(RuntimeError) as second_root:
        fs.state(model)._lazy_init()
    messages.append(str(second_root.value))
    listed = nn.Sequential(_MLP(), _MLP())
    fs([listed[0], listed[1]], mesh=mesh)
    with pytest.raises(RuntimeError) as two_modules:
        fs.state(listed[0])._lazy_init()
    messages.append(str(two_modules.value))
    return messages


def test_lazy_init_refuses_what_torchs_refuses(mesh: DeviceMesh) -> None:
    theirs = _refusals(torch_fully_shard, mesh)
    ours = _refusals(shardkit.core.fully_shard, mesh)
    # torch's test_fully_shard_double_lazy_init and test_fully_shard_multi_module_root:
    assert (
        theirs[0]
        == ours[0]
        == (
            "FSDP state has already been lazily initialized for 0.in_proj\n"
            "FSDP requires running forward through the root module first"
        )
    )
    assert theirs[1].startswith("FSDP requires a single root module but got ")
    assert ours[1].startswith("FSDP requires a single root module but got ")
