"""Bad FSDP x TP input: a clear error naming the parameter, and the model left as it was."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from harness.pool import run_on_ranks
from shardkit.core import FSDPModule, fully_shard
from tests.core.parity import assert_parity
from tests.tp import tp_models
from tests.tp.tp_parity import TPRun, parity_body

MeshChoice = Callable[[DeviceMesh], DeviceMesh | None]

MISTAKES: dict[str, MeshChoice] = {
    # The default mesh: every rank, no axis names.
    "no mesh": lambda mesh: None,
    # A dp mesh over the whole world: it overlaps the TP axis.
    "dp over the world": lambda mesh: init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)),
    # A dp axis taken from another layout of the ranks, where it crosses this TP axis.
    "another global mesh": lambda mesh: init_device_mesh(
        "cpu", (2, 2), mesh_dim_names=("tp", "dp")
    )["dp"],
    "the tp axis": lambda mesh: mesh["tp"],
    "the whole (dp, tp) mesh": lambda mesh: mesh,
}


def _refusals(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out: dict[str, Any] = {}
    for label, choose in MISTAKES.items():
        model = tp_models.build("mlp")
        tp_models.parallelize("mlp", model, mesh["tp"])
        before = {name: p for name, p in model.named_parameters()}
        try:
            fully_shard(model, mesh=choose(mesh))
            out[label] = "accepted"
        except ValueError as error:
            unchanged = not isinstance(model, FSDPModule) and all(
                p is before[name] for name, p in model.named_parameters()
            )
            out[label] = (str(error), unchanged)
    return out


def test_meshes_that_do_not_fit_are_refused_before_any_change() -> None:
    found = run_on_ranks(4, _refusals)[0]
    for label in MISTAKES:
        assert found[label] != "accepted", label
        message, unchanged = found[label]
        assert unchanged, label
        assert message.startswith("fully_shard cannot shard parameter a.weight"), message
    assert "no axis names" in found["no mesh"][0]
    assert "not slices of one global mesh" in found["dp over the world"][0]
    assert "not slices of one global mesh" in found["another global mesh"][0]
    assert "overlaps the tensor-parallel mesh" in found["the tp axis"][0]
    assert "overlaps the tensor-parallel mesh" in found["the whole (dp, tp) mesh"][0]


def _plan_after_fully_shard(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = tp_models.build("mlp")
    fully_shard(model, mesh=mesh["dp"])
    before = {name: (p, p.placements) for name, p in model.named_parameters()}
    try:
        tp_models.parallelize("mlp", model, mesh["tp"])
        message = "accepted"
    except ValueError as error:
        message = str(error)
    unchanged = all(
        p is before[name][0] and p.placements == before[name][1]
        for name, p in model.named_parameters()
    )
    # The model still trains as a 1D FSDP model.
    x, y = tp_models.batch("mlp", 0, 2)
    nn.functional.mse_loss(model(x), y).backward()
    grads = all(p.grad is not None for p in model.parameters())
    return {"message": message, "unchanged": unchanged, "grads": grads}


def test_a_tp_plan_after_fully_shard_is_refused_and_changes_nothing() -> None:
    # torch's parallelize_module refuses to redistribute the dp DTensors onto the TP mesh.
    found = run_on_ranks(4, _plan_after_fully_shard)[0]
    assert "Cannot distribute a DTensor with device mesh" in found["message"]
    assert found["unchanged"] and found["grads"]


def test_int_reshard_after_forward_with_tp_parameters_trains() -> None:
    # torch's fully_shard fails here (its post-forward reshard does not handle TP DTensors);
    # shardkit keeps 1/2 of the TP-local tensors and regathers in pairs.
    run = TPRun(
        model="mlp",
        mesh=(4, 1),
        shard_kwargs={"reshard_after_forward": 2},
        impls=("shardkit", "local"),
    )
    assert_parity(run_on_ranks(4, parity_body, run=run))
