"""The oracle for ``fully_shard(..., dp_mesh_dims=...)``: shardkit, torch's, one process.

The uneven MLP of ``tp_models`` is distributed on the whole mesh with ``distribute_module``:
each parameter ``Replicate()`` on every axis but "tp", where it takes its TP plan's placement
(colwise: rows, rowwise: columns). Inputs enter as DTensors split by batch over every
data-parallel axis (each dp rank its slice of the global batch), so weight gradients are
Partial sums on those axes; outputs leave as each rank's local rows, and the loss is local.
Then ``fully_shard`` shards the model with the run's ``DataParallelMeshDims``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from tests.core.ckpt_helpers import dcp_load_all, dcp_save_all
from tests.core.parity import fully_shard_of, torch_policy
from tests.core.replicate_runs import apis
from tests.tp import tp_ckpt, tp_models
from tests.tp.tp_parity import Trace, fsdp_param_layout, full_params

Names = str | tuple[str, ...] | None


@dataclass(kw_only=True)
class SpmdRun:
    """One experiment: a mesh, its axis names, and the data-parallel axes among them."""

    mesh: tuple[int, ...] = (2, 2)
    names: tuple[str, ...] = ("dp", "tp")
    shard: Names = "dp"
    replicate: Names = None
    steps: int = 5
    per_rank_batch: int = 2
    shard_kwargs: dict[str, Any] = field(default_factory=dict)  # for every fully_shard call
    torch_dims: bool = False  # give shardkit torch's DataParallelMeshDims (drop-in)
    api: str = "fully_shard"  # or "replicate" (replicate axes only)
    impls: tuple[str, ...] = ("shardkit", "torch", "local")

    @property
    def dp_axes(self) -> tuple[str, ...]:
        """Every data-parallel axis (shard and replicate), in mesh order."""
        named = set(_names(self.shard)) | set(_names(self.replicate))
        return tuple(n for n in self.names if n in named)

    @property
    def dp_size(self) -> int:
        """Ranks that see different data."""
        return math.prod(s for s, n in zip(self.mesh, self.names, strict=True) if n in self.dp_axes)


def _names(value: Names) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else value


def mesh_dims(impl: str, run: SpmdRun) -> Any:
    """The run's ``DataParallelMeshDims``: torch's for torch (and for shardkit if asked)."""
    if impl == "torch" or run.torch_dims:
        from torch.distributed.fsdp import DataParallelMeshDims as TorchDims

        return TorchDims(shard=run.shard, replicate=run.replicate)
    from shardkit.core import DataParallelMeshDims

    return DataParallelMeshDims(shard=run.shard, replicate=run.replicate)


def _tp_placements(model: nn.Module) -> dict[str, Placement]:
    """Each parameter's placement on "tp", from the MLP's TP plan."""
    out: dict[str, Placement] = {}
    for name, style in tp_models.plan("mlp", model).items():
        if isinstance(style, ColwiseParallel):
            out |= {f"{name}.weight": Shard(0), f"{name}.bias": Shard(0)}
        elif isinstance(style, RowwiseParallel):
            out |= {f"{name}.weight": Shard(1), f"{name}.bias": Replicate()}
    return out


def distribute(model: nn.Module, mesh: DeviceMesh, run: SpmdRun) -> None:
    """Put ``model`` on the whole mesh: parameters, inputs and outputs (see the module doc)."""
    on_tp = _tp_placements(model)
    names = mesh.mesh_dim_names
    assert names is not None

    def partition(prefix: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for name, param in list(module.named_parameters(recurse=False)):
            tp = on_tp[f"{prefix}.{name}"]
            placements = [tp if axis == "tp" else Replicate() for axis in names]
            dtensor = distribute_tensor(param.detach(), mesh, placements)
            module.register_parameter(name, nn.Parameter(dtensor))

    batch: list[Placement] = [Shard(0) if a in run.dp_axes else Replicate() for a in names]

    def inputs(module: nn.Module, args: Any, mesh: DeviceMesh) -> Any:
        return tuple(DTensor.from_local(x, mesh, batch, run_check=False) for x in args)

    def outputs(module: nn.Module, out: Any, mesh: DeviceMesh) -> Any:
        return out.redistribute(placements=batch).to_local()

    distribute_module(model, mesh, partition, inputs, outputs)


def build(impl: str, run: SpmdRun, seed: int = 0) -> tuple[nn.Module, int]:
    """The MLP on the run's mesh, sharded by ``impl``; with this rank's data-parallel index."""
    mesh = init_device_mesh("cpu", run.mesh, mesh_dim_names=run.names)
    model: nn.Module = tp_models.build("mlp", seed=seed)
    distribute(model, mesh, run)
    # An equal mesh object from an earlier run in this process may come back on the
    # parameters (DTensor caches sharding decisions by mesh equality), and torch's
    # fully_shard wants the parameters' mesh object itself.
    first = next(iter(model.parameters()))
    assert isinstance(first, DTensor)
    mesh = first.device_mesh
    shard = apis(impl)[0] if run.api == "replicate" else fully_shard_of(impl)
    kwargs = dict(run.shard_kwargs, mesh=mesh, dp_mesh_dims=mesh_dims(impl, run))
    if "mp_policy" in kwargs and impl == "torch":
        kwargs["mp_policy"] = torch_policy(kwargs["mp_policy"])
    for layer in ("a", "b"):  # then the root, with "c": three groups
        shard(getattr(model, layer), **kwargs)
    shard(model, **kwargs)
    coord = mesh.get_coordinate()
    assert coord is not None
    index = 0
    for c, size, name in zip(coord, run.mesh, run.names, strict=True):
        if name in run.dp_axes:
            index = index * size + c
    return model, index


def train(
    model: nn.Module, opt: torch.optim.Optimizer, steps: range, dp: tuple[int, int]
) -> list[float]:
    """Train ``steps`` (the dp rank's slice of each global batch); each step's mean loss."""
    return tp_ckpt.train(model, opt, steps, dp, name="mlp", global_batch=2 * dp[1])


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def parity_body(rank: int, world_size: int, run: SpmdRun) -> dict[str, Trace]:
    """Runs on every rank: each implementation trains ``run.steps`` steps; their traces."""
    traces: dict[str, Trace] = {}
    for impl in run.impls:
        if impl == "local":
            model: nn.Module = tp_models.build("mlp")
            dp = (0, 1)
        else:
            model, index = build(impl, run)
            dp = (index, run.dp_size)
        steps = range(run.steps)
        losses = train(model, _sgd(model), steps, dp) if impl != "local" else _local(model, run)
        traces[impl] = {"losses": losses, "params": full_params(model), "layout": _layout(model)}
    return traces


def _layout(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each sharded parameter's mesh axes and placements, as text (empty for plain ones), and
    each group's ``mesh_info`` and parameters' sizes as code written for torch's
    ``fully_shard`` reads them."""
    out: dict[str, tuple[str, ...]] = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            out[name] = (*(p.device_mesh.mesh_dim_names or ()), *map(str, p.placements))
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):  # shardkit's modules are torch's FSDPModules
            group: Any = module._get_fsdp_state()._fsdp_param_group
            for p in group.fsdp_params:  # sizes of the TP-local part, as torch's parameters'
                out[f"{p._param_fqn}: fsdp_param"] = fsdp_param_layout(p)
            info = group.mesh_info
            dims = getattr(info, "dp_mesh_dims", None)
            if dims is None:  # torch before 2.12: its mesh-info objects have no such field
                continue
            sizes = (getattr(info, f"{axis}_mesh_size", None) for axis in ("shard", "replicate"))
            out[f"{name or '<root>'}: mesh_info"] = (
                type(info).__name__,
                *map(str, (info.mesh.mesh_dim_names, *sizes, info.is_spmd_mesh)),
                *map(str, (dims.shard_names, dims.replicate_names, info.spmd_mesh.mesh_dim_names)),
            )
    return out


def _local(model: nn.Module, run: SpmdRun) -> list[float]:
    """The single process on the global batch (``run.dp_size`` ranks' worth)."""
    opt = _sgd(model)
    losses: list[float] = []
    for step in range(run.steps):
        x, y = tp_models.batch("mlp", step, 2 * run.dp_size)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


SAVE_AFTER = 2
RESUMED = range(SAVE_AFTER, SAVE_AFTER + 2)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def save_body(rank: int, world_size: int, impl: str, run: SpmdRun, path: str) -> dict[str, Any]:
    """Train, save model and optimizer with DCP, train on; the losses and the saved values."""
    model, index = build(impl, run)
    dp = (index, run.dp_size)
    opt = _adamw(model)
    train(model, opt, range(SAVE_AFTER), dp)
    saved = dcp_save_all(model, opt, path)
    return {"after": train(model, opt, RESUMED, dp), **saved}


def load_body(rank: int, world_size: int, impl: str, run: SpmdRun, path: str) -> dict[str, Any]:
    """Load ``path`` into a fresh model (another seed) and optimizer; values and losses after."""
    model, index = build(impl, run, seed=7)
    opt = _adamw(model)
    loaded = dcp_load_all(model, opt, path)
    return {**loaded, "after": train(model, opt, RESUMED, (index, run.dp_size))}


def full_state_dict_body(rank: int, world_size: int, runs: list[SpmdRun]) -> list[bool]:
    """Per run: whether shardkit's and DCP's full state dicts are the single model's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from shardkit.core import iter_full_state_dict

    found: list[bool] = []
    for run in runs:
        model, _ = build("shardkit", run)
        ours = dict(iter_full_state_dict(model, rank0_only=False, cpu_offload=True))
        options = StateDictOptions(full_state_dict=True)
        dcp: dict[str, Any] = dict(get_model_state_dict(model, options=options))
        expected = tp_models.build("mlp").state_dict()
        found.append(
            all(torch.equal(ours[k], v) and torch.equal(dcp[k], v) for k, v in expected.items())
        )
    return found
