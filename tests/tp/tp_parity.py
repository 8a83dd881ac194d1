"""The differential oracle for FSDP x TP: shardkit, torch's fully_shard + TP, one process.

Every implementation builds the same model from one seed and sees the same global batch each
step. Distributed runs apply the TP plan on the "tp" axis of one global mesh, then
``fully_shard`` each block and the root on the data-parallel axes; each data-parallel rank
takes its slice of the batch (TP ranks of one dp group see the same slice).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from tests.core.parity import fully_shard_of, torch_policy
from tests.core.prepare import Checkpointed
from tests.tp import tp_models

Trace = dict[str, Any]  # {"losses": list[float], "params": dict[str, Tensor]}


@dataclass(kw_only=True)
class TPRun:
    """One FSDP x TP experiment."""

    model: str = "mlp"
    mesh: tuple[int, ...] = (2, 2)  # (dp, tp) or (dp_replicate, dp_shard, tp)
    steps: int = 5
    per_rank_batch: int = 2
    shard_kwargs: dict[str, Any] = field(default_factory=dict)  # for every fully_shard call
    checkpoint: bool = False  # activation checkpointing around each block
    impls: tuple[str, ...] = ("shardkit", "torch", "local")


def global_mesh(run: TPRun) -> DeviceMesh:
    """The (dp, tp) or (dp_replicate, dp_shard, tp) mesh."""
    names = ("dp", "tp") if len(run.mesh) == 2 else ("dp_replicate", "dp_shard", "tp")
    return init_device_mesh("cpu", run.mesh, mesh_dim_names=names)


def dp_mesh_of(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel axes of the global mesh: what ``fully_shard`` gets."""
    names = mesh.mesh_dim_names
    assert names is not None
    return mesh["dp"] if names[0] == "dp" else mesh["dp_replicate", "dp_shard"]


def dp_rank_and_size(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's index among the data-parallel ranks, and their number."""
    coord = mesh.get_coordinate()
    assert coord is not None
    sizes = mesh.shape[:-1]
    index = 0
    for c, size in zip(coord[:-1], sizes, strict=True):
        index = index * size + c
    return index, int(torch.tensor(sizes).prod())


def build_sharded(impl: str, run: TPRun, mesh: DeviceMesh, seed: int = 0) -> nn.Module:
    """The run's model with its TP plan on the "tp" axis, then sharded on the dp axes."""
    model: nn.Module = tp_models.build(run.model, seed=seed)
    tp_models.parallelize(run.model, model, mesh["tp"])
    _checkpoint_blocks(model, run)
    shard_blocks_and_root(impl, model, dp_mesh_of(mesh), run.shard_kwargs)
    return model


def shard_blocks_and_root(
    impl: str, model: nn.Module, dp_mesh: DeviceMesh, shard_kwargs: dict[str, Any]
) -> None:
    """``fully_shard`` each block, then the root, by ``impl`` (policies translated for torch)."""
    shard = fully_shard_of(impl)
    kwargs = dict(shard_kwargs, mesh=dp_mesh)
    if "mp_policy" in kwargs and impl != "shardkit":
        kwargs["mp_policy"] = torch_policy(kwargs["mp_policy"])
    for block in getattr(model, "blocks", []):
        shard(block, **kwargs)
    shard(model, **kwargs)


def _checkpoint_blocks(model: nn.Module, run: TPRun) -> None:
    if run.checkpoint:
        blocks = getattr(model, "blocks")  # noqa: B009  (typed as Any)
        for i in range(len(blocks)):
            blocks[i] = Checkpointed(blocks[i])


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full plain tensor (a collective for DTensors)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        value = p.full_tensor() if isinstance(p, DTensor) else p
        out[name.replace(".inner", "")] = value.detach().clone().float()
    return out


def train(impl: str, run: TPRun, rank: int, world_size: int) -> Trace:
    """Train one implementation for ``run.steps`` SGD-momentum steps; its trace."""
    if impl == "local":
        model = tp_models.build(run.model)
        _checkpoint_blocks(model, run)
        dp_rank, dp_size = 0, 1
        global_batch = run.per_rank_batch * _dp_size(run)
    else:
        mesh = global_mesh(run)
        model = build_sharded(impl, run, mesh)
        dp_rank, dp_size = dp_rank_and_size(mesh)
        global_batch = run.per_rank_batch * dp_size
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses: list[float] = []
    for step in range(run.steps):
        x, y = tp_models.batch(run.model, step, global_batch)
        x, y = x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]
        with (
            loss_parallel()
            if run.model == "sp_loss_parallel" and impl != "local"
            else nullcontext()
        ):
            loss = tp_models.loss_of(run.model, model(x), y)
            loss.backward()
        if isinstance(loss, DTensor):
            loss = loss.full_tensor()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        if impl != "local":
            dist.all_reduce(value)  # TP ranks repeat their dp group's loss: the mean is right
            value /= world_size
        losses.append(value.item())
    trace: Trace = {"losses": losses, "params": full_params(model)}
    if impl != "local":
        trace["fsdp_params"] = fsdp_param_fields(model)
    return trace


def assert_same_fsdp_params(results: list[dict[str, Trace]]) -> None:
    """Every rank's ``fsdp_params`` fields read alike on shardkit and on torch's engine."""
    for rank, traces in enumerate(results):
        assert traces["shardkit"]["fsdp_params"] == traces["torch"]["fsdp_params"], rank


def fsdp_param_fields(model: nn.Module) -> list[tuple[str, ...]]:
    """What code written for torch's ``fully_shard`` reads of each group's parameters: under
    TP, sizes of the TP-local part, and whether the parameter was a DTensor."""
    out: list[tuple[str, ...]] = []
    for module in model.modules():
        if isinstance(module, FSDPModule):  # shardkit's modules are torch's FSDPModules
            group: Any = module._get_fsdp_state()._fsdp_param_group
            for p in group.fsdp_params:
                out.append((p._param_fqn, *fsdp_param_layout(p), str(p.mp_policy.param_dtype)))
    return out


def fsdp_param_layout(p: Any) -> tuple[str, ...]:
    """One of a group's ``fsdp_params``: its sizes, placement and kind, as text."""
    shapes = (p._orig_size, p.sharded_size, p.padded_sharded_param_size)
    fields = (*shapes, p.fsdp_placement, p.is_dtensor, p._sharded_param_data.shape)
    return tuple(map(str, fields))


def _dp_size(run: TPRun) -> int:
    return int(torch.tensor(run.mesh[:-1]).prod())


def parity_body(rank: int, world_size: int, run: TPRun) -> dict[str, Trace]:
    """Runs on every rank: every implementation of ``run``, one after another."""
    return {impl: train(impl, run, rank, world_size) for impl in run.impls}
