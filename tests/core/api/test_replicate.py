"""``replicate`` against torch's ``replicate_with_fsdp.replicate``: numerics, classes, errors.

Training (W=2, gloo) is bit-identical to torch's: the losses, the last step's gradients and
the parameters, for replicate alone, mixed with ``fully_shard`` both ways round, with bf16
parameters and fp32 reduction, and with gradient accumulation. DCP checkpoints move between
the two engines both ways. The modules pass torch's checks (``isinstance`` against torch's
``ReplicateModule`` and ``FSDPModule``, its registry, ``replicate.state``, its private
``_get_managed_modules``), and misuse raises torch's error types with torch's messages first.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from harness.pool import run_on_ranks
from tests.core import models
from tests.core.replicate_runs import (
    LAYOUTS,
    ReplicateRun,
    apis,
    dcp_load_body,
    dcp_save_body,
    train_body,
)
from tests.core.torch_releases import torch_has

WORLD_SIZE = 2


def _assert_bitwise(results: list[dict[str, Any]]) -> None:
    """On every rank, shardkit's trace equals torch's bit for bit."""
    for rank, traces in enumerate(results):
        ours, theirs = traces["shardkit"], traces["torch"]
        assert ours["losses"] == theirs["losses"], rank
        assert ours["kinds"] == theirs["kinds"], rank
        assert ours["grads"], "the last step's gradients were recorded"
        for part in ("grads", "params"):
            assert ours[part].keys() == theirs[part].keys(), (rank, part)
            differs = [n for n, v in ours[part].items() if not torch.equal(v, theirs[part][n])]
            assert differs == [], (rank, part, differs)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_training_is_bitwise_torchs(layout: str) -> None:
    results = run_on_ranks(WORLD_SIZE, train_body, run=ReplicateRun(layout=layout))
    _assert_bitwise(results)
    kinds = results[0]["shardkit"]["kinds"]
    # The premise: each layout replicates what it says (torch's placements, checked above).
    assert "(Replicate(),)" in kinds.values()
    assert ("(Shard(dim=0),)" in kinds.values()) == (layout != "replicate")


def test_replicate_alone_trains_as_the_single_process() -> None:
    run = ReplicateRun(model="mlp", impls=("shardkit", "local"))
    traces = run_on_ranks(WORLD_SIZE, train_body, run=run)[0]
    ours, local = traces["shardkit"], traces["local"]
    torch.testing.assert_close(ours["losses"], local["losses"], rtol=1e-5, atol=1e-6)
    for name, value in local["params"].items():
        torch.testing.assert_close(ours["params"][name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["replicate", "replicate_blocks_shard_root"])
def test_bf16_parameters_fp32_reduction_are_bitwise_torchs(layout: str) -> None:
    results = run_on_ranks(WORLD_SIZE, train_body, run=ReplicateRun(layout=layout, mixed=True))
    _assert_bitwise(results)


@pytest.mark.parametrize("layout", ["replicate", "shard_blocks_replicate_root"])
def test_gradient_accumulation_without_sync_is_bitwise_torchs(layout: str) -> None:
    run = ReplicateRun(layout=layout, accumulate=True)
    _assert_bitwise(run_on_ranks(WORLD_SIZE, train_body, run=run))


@pytest.mark.parametrize("layout", ["replicate", "replicate_blocks_shard_root"])
@pytest.mark.parametrize(("saver", "loader"), [("shardkit", "torch"), ("torch", "shardkit")])
def test_dcp_checkpoints_move_between_the_engines(
    tmp_path: Path, layout: str, saver: str, loader: str
) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(WORLD_SIZE, dcp_save_body, impl=saver, layout=layout, path=path)
    loaded = run_on_ranks(WORLD_SIZE, dcp_load_body, impl=loader, layout=layout, path=path)
    for rank, (before, after) in enumerate(zip(saved, loaded, strict=True)):
        for part in ("model", "optim"):
            assert after[part].keys() == before[part].keys(), (rank, part)
            differs = [n for n, v in before[part].items() if not torch.equal(v, after[part][n])]
            assert differs == [], (rank, part, differs)


def _state_of(api: Any, module: nn.Module) -> Any:
    """``api.state(module)``: the attribute torch's composable-API decorator adds."""
    return api.state(module)


def _classes_body(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed._composable import replicate_with_fsdp as torchs
    from torch.distributed._composable.contract import _get_registry
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_managed_modules

    from shardkit.core import FSDPModule, ReplicateModule, fully_shard, replicate
    from shardkit.core.torch_facing.view import TorchFacingState

    model = models.build("mlp")
    for block in model.blocks[:2]:
        replicate(block)
    fully_shard(model.blocks[2])
    # A call on the root would leave out what replicate and fully_shard manage.
    managed = set(_get_managed_modules((model,)))
    left_out = {m for b in model.blocks for m in b.modules()}
    replicate(model)
    x, y = models.batch("mlp", 0, 2)
    models.loss_of("mlp", model(x), y).backward()
    cls = type(model)
    view = _state_of(torchs.replicate, model)
    return {
        "class": cls.__name__,
        "ours": isinstance(model, ReplicateModule) and isinstance(model, FSDPModule),
        "torchs": isinstance(model, torchs.ReplicateModule) and isinstance(model, TorchFSDPModule),
        "original": cls.__mro__[cls._orig_cls_mro_index] is models.MLPNet,
        "sharded_block_is_replicate": isinstance(model.blocks[2], torchs.ReplicateModule),
        "registries": [sorted(_get_registry(m) or ()) for m in (model, *model.blocks)],
        "composable": [torchs.is_composable_with_replicate(b) for b in model.blocks],
        # torch's replicate.state (the pipelining stage's read) and ours give the one view.
        "torch_state": isinstance(view, TorchFacingState) and view is _state_of(replicate, model),
        "states": len(view._state_ctx.all_states),
        "fully_shard_state": _state_of(fully_shard, model) is None
        and _state_of(torch_fully_shard, model) is None,
        "left_out": managed.isdisjoint(left_out),
        "rest_managed": {model, *model.inp.modules(), *model.norm.modules()} <= managed,
    }


def test_modules_pass_torchs_checks() -> None:
    for result in run_on_ranks(WORLD_SIZE, _classes_body):
        assert result["class"] == "ReplicateMLPNet"
        assert result["ours"] and result["torchs"] and result["original"]
        assert not result["sharded_block_is_replicate"]
        assert result["registries"] == [
            ["replicate"],
            ["replicate"],
            ["replicate"],
            ["fully_shard"],
        ]
        assert result["composable"] == [True, True, False]
        assert result["torch_state"] and result["states"] == 4
        assert result["fully_shard_state"]
        # What replicate and fully_shard manage is left out, as torch's registry and its
        # table of states say.
        assert result["left_out"]
        assert result["rest_managed"]


class _MLP(nn.Module):
    """torch's test MLP (``common_fsdp.MLP``): two Linears, a buffer if asked."""

    def __init__(self, dim: int, with_buffer: bool = False) -> None:
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        if with_buffer:
            self.register_buffer("buffer", torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.in_proj(x))  # type: ignore[no-any-return]


def _managed_modules_body(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed._composable import replicate_with_fsdp as torchs
    from torch.distributed.fsdp._fully_shard._fsdp_init import (
        _get_managed_modules,
        _get_managed_states,
    )
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    from shardkit.core import fully_shard, replicate

    # torch's test_managed_modules_nested_fully_shard_and_replicate, on shardkit's APIs.
    model = nn.Sequential(*[_MLP(8) for _ in range(3)])
    replicate(model[0])
    fully_shard(model[2])
    managed = _get_managed_modules((model,))
    expected = [*model[1].modules(), model]
    # test_managed_states_nested_fully_shard: what a call on the root would take.
    stateful = nn.Sequential(*[_MLP(8, with_buffer=True) for _ in range(2)])
    fully_shard(stateful[0])
    params, buffers = _get_managed_states(_get_managed_modules((stateful,)))
    # test_replicate_transformer_managed_modules: replicate's own lookup, before and after.
    tower = nn.Sequential(*[_MLP(8) for _ in range(3)])

    def replicate_managed() -> int:
        if "is_composable_fn" not in inspect.signature(_get_managed_modules).parameters:
            return -1  # torch's lookup takes replicate's tests from 2.13 on
        modules = _get_managed_modules(
            (tower,),
            is_composable_fn=torchs.is_composable_with_replicate,
            get_state_fn=torchs._get_module_replicate_state,
        )
        return len(modules)

    before = replicate_managed()
    replicate(tower[0])
    fully_shard(tower[1])
    replicate(tower)
    stand_in: Any = _get_module_fsdp_state(model[2])
    return {
        "nested": len(managed) == len(expected) and set(managed) == set(expected),
        "states": (set(params), set(buffers))
        == (set(stateful[1].parameters()), set(stateful[1].buffers())),
        "replicate_lookup": (before, replicate_managed()),
        "tower_rest": 1 + len(list(tower[2].modules())),
        "stand_in_reads_the_view": stand_in._fsdp_param_groups[0]._module_fqn == "",
        "replicate_state": isinstance(
            torchs._get_module_replicate_state(tower[0]), torchs._ReplicateState
        ),
    }


def test_torchs_managed_modules_leave_out_shardkits_modules() -> None:
    for result in run_on_ranks(WORLD_SIZE, _managed_modules_body):
        assert result["nested"] and result["states"]
        if result["replicate_lookup"] != (-1, -1):  # torch's lookup takes replicate's tests
            assert result["replicate_lookup"] == (10, result["tower_rest"])
        assert result["stand_in_reads_the_view"] and result["replicate_state"]


def _raised(call: Any) -> tuple[list[str], str]:
    try:
        call()
    except Exception as error:  # the error is the result
        return [c.__name__ for c in type(error).__mro__], str(error).splitlines()[0]
    return [], "no error"


def _errors_body(rank: int, world_size: int, impl: str) -> dict[str, tuple[list[str], str]]:
    from torch.distributed.device_mesh import init_device_mesh

    replicate, fully_shard = apis(impl)
    once, sharded = nn.Linear(4, 4), nn.Linear(4, 4)
    replicate(once)
    fully_shard(sharded)
    mesh_2d = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "tp"))
    raised = {
        "twice": _raised(lambda: replicate(once)),
        "after_fully_shard": _raised(lambda: replicate(sharded)),
        "container": _raised(lambda: replicate(nn.ModuleList([nn.Linear(4, 4)]))),
        "mesh_2d": _raised(lambda: replicate(nn.Linear(4, 4), mesh=mesh_2d)),
    }
    if torch_has("DataParallelMeshDims"):  # torch's, which its replicate takes, from 2.12 on
        from torch.distributed.fsdp import DataParallelMeshDims

        dims = DataParallelMeshDims(shard="dp")
        raised["shard_dims"] = _raised(
            lambda: replicate(nn.Linear(4, 4), mesh=mesh_2d, dp_mesh_dims=dims)
        )
    return raised


def test_misuse_raises_torchs_errors() -> None:
    ours = run_on_ranks(WORLD_SIZE, _errors_body, impl="shardkit")[0]
    theirs = run_on_ranks(WORLD_SIZE, _errors_body, impl="torch")[0]
    for case, (their_types, their_line) in theirs.items():
        our_types, our_line = ours[case]
        assert their_types[0] in our_types, (case, our_types, their_types)
        # torch's first line, then (on the same line or the next) what shardkit adds.
        prefix = their_line.split(" DeviceMesh(")[0].split(": ModuleList(")[0]
        assert our_line.startswith(prefix), (case, our_line, their_line)


def _fully_shard_after_replicate_body(rank: int, world_size: int) -> tuple[list[str], str]:
    from shardkit.core import fully_shard, replicate

    module = nn.Linear(4, 4)
    replicate(module)
    return _raised(lambda: fully_shard(module))


def test_fully_shard_after_replicate_is_refused() -> None:
    # torch's fully_shard would manage nothing of such a module (replicate's modules are not
    # composable with it): shardkit refuses it by name, as torch's replicate the other order.
    types, line = run_on_ranks(WORLD_SIZE, _fully_shard_after_replicate_body)[0]
    assert "RuntimeError" in types
    assert line.startswith(
        "Cannot apply `fully_shard()` on a Module already managed by `replicate`"
    )


def _patched_body(rank: int, world_size: int) -> dict[str, Any]:
    import shardkit.core as sk
    from shardkit.core.torch_facing.fsdp_classes import TorchFacing

    with sk.patched_torch():
        from torch.distributed._composable.replicate_with_fsdp import (
            ReplicateModule,
            is_composable_with_replicate,
            replicate,
        )

        model = models.build("mlp")
        replicate(model)
        patched = (replicate, ReplicateModule, is_composable_with_replicate)
    from torch.distributed._composable import replicate_with_fsdp as after

    restored = (after.replicate, after.ReplicateModule, after.is_composable_with_replicate)
    return {
        "patched": [getattr(o, "__module__", "") for o in patched],
        "engine": isinstance(model, TorchFacing),
        "restored": [o.__module__ for o in restored],
    }


def test_patch_torch_serves_replicate_and_unpatch_restores_it() -> None:
    result = run_on_ranks(WORLD_SIZE, _patched_body)[0]
    assert result["patched"] == ["shardkit.core.replicate_api"] * 3
    assert result["engine"]
    assert result["restored"] == ["torch.distributed._composable.replicate_with_fsdp"] * 3
