"""Shared pieces of the checkpoint tests: shard the test GPT, train it, read state back.

Every run sees the same global batch of ``GLOBAL_BATCH`` sequences per step, whatever the world
size (each rank takes its ``GLOBAL_BATCH / W`` rows, by global rank, on FSDP and HSDP meshes
alike), so the loss of a step is the same number at any world size up to summation order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

# From the submodules: the package re-exports save and load without an __all__, which
# mypy --strict does not count as an export.
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from tests.core import models
from tests.core.parity import Run, apply

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4
LR = 1e-2
SAVE_AFTER = 2  # steps trained before the checkpoint
RESUMED = range(SAVE_AFTER, SAVE_AFTER + 3)  # the steps trained after it


def mesh_of(world_size: int, hsdp: tuple[int, int] | None = None) -> DeviceMesh:
    """A 1-D mesh over every rank, or a (replicate, shard) mesh of shape ``hsdp``."""
    if hsdp is None:
        return init_device_mesh("cpu", (world_size,))
    assert hsdp[0] * hsdp[1] == world_size, (hsdp, world_size)
    return init_device_mesh("cpu", hsdp, mesh_dim_names=("replicate", "shard"))


def sharded_gpt(impl: str, mesh: DeviceMesh, *, seed: int = 0, meta: bool = False) -> Any:
    """The test GPT, each block then the root sharded by ``impl``'s fully_shard.

    Models that a checkpoint is loaded into use another ``seed``, so that a value the load
    misses shows. With ``meta=True`` the model is built on the meta device and holds no
    values until a state dict is loaded with ``assign=True`` (as ``broadcast_from_rank0`` does).
    """
    if meta:
        with torch.device("meta"):
            model = models.build("gpt", seed=seed)
    else:
        model = models.build("gpt", seed=seed)
    apply(impl, model, mesh, Run(model="gpt"))
    return model


def adamw(model: Any) -> torch.optim.Optimizer:
    """AdamW with weight decay, so that every parameter and both moments matter."""
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def train(
    model: Any, opt: torch.optim.Optimizer, steps: range, rank: int, world_size: int
) -> list[float]:
    """Train ``steps``; returns each step's loss over the global batch (the same on all ranks)."""
    losses: list[float] = []
    for step in steps:
        x, y = models.batch("gpt", step, GLOBAL_BATCH)
        x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        loss = models.loss_of("gpt", model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    return losses


def eval_forward(model: Any) -> None:
    """One forward under ``no_grad`` and no backward: the root keeps its full parameters."""
    x, _ = models.batch("gpt", 10_000, 4)
    model.eval()
    with torch.no_grad():
        model(x)
    model.train()


def snapshot(state: Any) -> Any:
    """A copy of a state dict's tensors (DTensors stay DTensors): what a checkpoint would hold.

    Sharded state dicts alias the live parameters and moments; training on would change them.
    """
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), state)


def full_tensors(state: Any) -> Any:
    """The same tree with every DTensor gathered into a plain tensor (picklable, comparable)."""

    def full(t: torch.Tensor) -> torch.Tensor:
        value = t.full_tensor() if isinstance(t, DTensor) else t
        return value.detach().clone()

    return pytree.tree_map_only(torch.Tensor, full, state)


def model_values(model: Any) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` as a full plain tensor, by name."""
    named: dict[str, torch.Tensor] = dict(model.named_parameters())
    named.update(model.named_buffers())
    values: dict[str, torch.Tensor] = full_tensors(named)
    return values


def optim_values(model: Any, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor, full and plain, keyed ``"<param fqn>.<state key>"``."""
    names = {id(p): name for name, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for param, state in opt.state.items():
        for key, value in full_tensors(dict(state)).items():
            out[f"{names[id(param)]}.{key}"] = value
    return out


def kinds_of(tree: Any) -> set[str]:
    """The type names of the tensors in ``tree`` ({"DTensor"}, {"Tensor"}, ...)."""
    leaves = [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]
    return {type(x).__name__ for x in leaves}


def devices_of(tree: Any) -> set[str]:
    """The device types of the tensors in ``tree``."""
    leaves = [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]
    return {x.device.type for x in leaves}


def dcp_save_all(model: Any, opt: torch.optim.Optimizer, path: str) -> dict[str, Any]:
    """Save model and optimizer to ``path`` with DCP; their full values as saved."""
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return {"model": model_values(model), "optim": optim_values(model, opt)}


def dcp_load_all(model: Any, opt: torch.optim.Optimizer, path: str) -> dict[str, Any]:
    """Load model and optimizer from ``path`` with DCP; their full values as loaded."""
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp_load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return {"model": model_values(model), "optim": optim_values(model, opt)}


def save_body(
    rank: int, world_size: int, impl: str, hsdp: tuple[int, int] | None, path: str
) -> dict[str, Any]:
    """Train 2 steps, save model and optimizer to ``path`` with DCP, then train 3 more.

    Returns the losses before and after the save and the full values at the save.
    """
    model = sharded_gpt(impl, mesh_of(world_size, hsdp))
    opt = adamw(model)
    before = train(model, opt, range(SAVE_AFTER), rank, world_size)
    saved = dcp_save_all(model, opt, path)
    return {"before": before, "after": train(model, opt, RESUMED, rank, world_size), **saved}


def load_body(
    rank: int,
    world_size: int,
    impl: str,
    hsdp: tuple[int, int] | None,
    path: str,
    eval_first: bool = False,
) -> dict[str, Any]:
    """Load ``path`` into a fresh model and optimizer; returns their values and 3 steps' losses.

    With ``eval_first`` the fresh model runs an eval forward before it loads.
    """
    model = sharded_gpt(impl, mesh_of(world_size, hsdp), seed=7)
    opt = adamw(model)  # before any forward: after one, the root's full parameters show
    if eval_first:
        eval_forward(model)
    loaded = dcp_load_all(model, opt, path)
    return {
        **loaded,
        "param_kinds": kinds_of(dict(model.named_parameters())),
        "after": train(model, opt, RESUMED, rank, world_size),
    }
