"""Optimizer state in FSDP1's forms, both ways.

Saving turns ``optim.state_dict()`` (keyed by position, each state tensor a DTensor shaped
like its parameter) into FSDP1's: keyed by parameter name, each tensor full (FULL) or this
rank's shard (SHARDED: a ShardedTensor, or a DTensor with a device mesh), scalars such as
``step`` as they are, every param group's hyperparameters kept. Loading goes back: each
value becomes this rank's shard as a DTensor like its parameter, keyed by the position this
optimizer gives the parameter, ready for ``optim.load_state_dict``.

Tensors are converted one at a time, in the same order on every rank (a full tensor is
gathered with a collective), so no rank holds more than one full tensor beyond the result.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from shardkit.legacy.comm import broadcast, broadcast_object
from shardkit.legacy.optim_keys import names_by_param
from shardkit.legacy.sharded_state_dict import chunk_2d, chunk_like, local_of_loaded
from shardkit.legacy.torch_compat import ShardedTensor

__all__ = ["SaveForm", "load_ready", "named_state", "receive_from_first"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SaveForm:
    """What FSDP1's optimizer state dict should look like."""

    full: bool
    """Full tensors (FULL) or this rank's shards (SHARDED)."""
    rank0_only: bool = False
    """FULL only: the other ranks get an empty dict."""
    offload_to_cpu: bool = True
    """Tensors on the CPU."""
    use_dtensor: bool = False
    """SHARDED only: DTensors instead of ShardedTensors."""
    two_d_mesh: DeviceMesh | None = None
    """SHARDED of a 2D (FSDP x TP) model: the data-parallel mesh FSDP1's extension shards on."""


def _is_sharded(value: object) -> bool:
    return isinstance(value, DTensor) and any(
        p.is_shard() and value.device_mesh.size(axis) > 1 for axis, p in enumerate(value.placements)
    )


def _saved(value: Any, form: SaveForm) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if isinstance(value, DTensor) and not _is_sharded(value):
        value = value.to_local()  # NO_SHARD: every rank holds it whole
    elif isinstance(value, DTensor):
        if form.full:
            value = value.full_tensor()
        elif form.two_d_mesh is not None:
            value = chunk_2d(value.full_tensor(), value, form.two_d_mesh)
        elif not form.use_dtensor:
            value = chunk_like(value.full_tensor(), value)
        else:
            value = value.detach()
    else:
        value = value.detach().clone()  # `step`: never the live tensor the optimizer bumps
    return value.cpu() if form.offload_to_cpu else value


def named_state(
    model: nn.Module,
    params: Sequence[torch.Tensor],
    osd: Mapping[str, Any],
    form: SaveForm,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """``osd`` (keyed by position in ``params``) keyed by names, in FSDP1's form.

    Every rank must call it (full tensors are gathered).

    Raises:
        KeyError: a state entry's position has no parameter, or its parameter no name.
    """
    names = names_by_param(model)
    receives = not form.rank0_only or dist.get_rank(group) == 0
    state: dict[str, Any] = {}
    for position in sorted(osd["state"]):
        name = _name_of(params, position, names)
        entry = {key: _saved(value, form) for key, value in osd["state"][position].items()}
        state[name] = entry
    if not receives:
        return {}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}}
        | {"params": [_name_of(params, i, names) for i in g["params"]]}
        for g in osd["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def _name_of(params: Sequence[torch.Tensor], position: int, names: dict[int, str]) -> str:
    if position >= len(params):
        raise KeyError(f"optimizer state entry {position}: the optimizer has no such parameter")
    name = names.get(id(params[position]))
    if name is None:
        raise KeyError(f"optimizer state entry {position}: its parameter is not one of the model's")
    return name


def _loaded(value: Any, param: torch.Tensor) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if not isinstance(value, ShardedTensor | DTensor) and value.shape != param.shape:
        # A scalar (`step`): its own copy. FSDP1 gives every parameter of a flat parameter
        # the same step tensor, and optim.load_state_dict keeps it, so each step would
        # count once per parameter.
        return value.detach().clone()
    if not isinstance(param, DTensor):
        return value
    if isinstance(value, ShardedTensor):
        local = local_of_loaded(value, param)
        return DTensor.from_local(
            local.to(param.to_local().device),
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    if isinstance(value, DTensor):
        if value.device_mesh == param.device_mesh and value.placements == param.placements:
            return value
        value = value.full_tensor()
    if value.shape != param.shape:
        return value  # a state of its own shape
    full = value.to(param.to_local().device)
    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)


def load_ready(
    model: nn.Module, optim: torch.optim.Optimizer, osd: Mapping[str, Any]
) -> dict[str, Any]:
    """Name-keyed ``osd`` (full or sharded) as ``optim.load_state_dict`` takes it.

    Raises:
        KeyError: a name in ``osd`` is not a parameter of ``optim``.
        ValueError: one of ``optim``'s param groups has no counterpart in ``osd``.
    """
    names = names_by_param(model)
    positions: dict[str, tuple[int, torch.Tensor]] = {}
    for position, param in enumerate(p for g in optim.param_groups for p in g["params"]):
        positions[names.get(id(param), f"<unnamed {position}>")] = (position, param)
    state: dict[int, Any] = {}
    for name in sorted(osd["state"]):
        if name not in positions:
            raise KeyError(
                f"optimizer state for {name!r}: no such parameter in the optimizer (its "
                f"parameters are {sorted(positions)[:5]}...)"
            )
        position, param = positions[name]
        state[position] = {k: _loaded(v, param) for k, v in osd["state"][name].items()}
    return {"state": state, "param_groups": _groups_for(optim, osd, positions)}


def _groups_for(
    optim: torch.optim.Optimizer,
    osd: Mapping[str, Any],
    positions: dict[str, tuple[int, torch.Tensor]],
) -> list[dict[str, Any]]:
    # optim.load_state_dict pairs saved positions with its own in order: each of its groups
    # takes the hyperparameters of the saved group holding its parameters.
    by_id = {id(param): name for name, (_, param) in positions.items()}
    saved = [(set(g["params"]), g) for g in osd["param_groups"]]
    groups: list[dict[str, Any]] = []
    start = 0
    for index, group in enumerate(optim.param_groups):
        mine = [by_id[id(p)] for p in group["params"]]
        match = next((g for names, g in saved if mine and mine[0] in names), None)
        if match is None:
            raise ValueError(
                f"optimizer param group {index} (first parameter {mine[:1]}) has no "
                "counterpart in the loaded optimizer state dict"
            )
        hyper = {k: v for k, v in match.items() if k != "params"}
        groups.append({**hyper, "params": list(range(start, start + len(mine)))})
        start += len(mine)
    return groups


def receive_from_first(
    osd: Mapping[str, Any] | None, group: dist.ProcessGroup | None = None
) -> dict[str, Any]:
    """The first rank's full, name-keyed ``osd`` on every rank, one tensor at a time.

    Every rank must call it; only the first rank's ``osd`` is read.
    """
    first = dist.get_rank(group) == 0
    if first and osd is None:
        raise ValueError("the first rank must pass the full optimizer state dict")
    skeleton = broadcast_object(_skeleton(osd) if first else None, group)
    assert isinstance(skeleton, dict)
    state: dict[str, Any] = {}
    for name in sorted(skeleton["state"]):
        entry: dict[str, Any] = {}
        for key, value in skeleton["state"][name].items():
            if isinstance(value, _TensorSpec):
                tensor = (
                    osd["state"][name][key].detach().clone()
                    if first and osd is not None
                    else torch.empty(value.shape, dtype=value.dtype)
                )
                broadcast(tensor, group)
                value = tensor
            entry[key] = value
        state[name] = entry
    return {"state": state, "param_groups": skeleton["param_groups"]}


@dataclass(frozen=True, slots=True)
class _TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


def _skeleton(osd: Mapping[str, Any] | None) -> dict[str, Any]:
    assert osd is not None
    state = {
        name: {
            k: _TensorSpec(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v
            for k, v in entry.items()
        }
        for name, entry in osd["state"].items()
    }
    return {"state": state, "param_groups": osd["param_groups"]}
