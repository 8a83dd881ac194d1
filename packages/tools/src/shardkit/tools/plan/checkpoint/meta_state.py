"""A checkpoint save's layout, as the planner models it: the flat state and the core's plan.

The core plans a save on each rank alone (``core.checkpoint.local_plan.chunk_writers``): who
writes which chunk is a pure function of the flat state dict's keys, shapes, dtypes, meshes
and placements. The planner describes that state for a model built on the meta device, as
``get_state_dict(model, optimizer)`` and DCP's flattening would give it, and hands it to the
core's own :class:`SaveLayout`, so the bytes each rank writes are the core's arithmetic, not a
copy of it:

- the model's state dict: parameters are DTensors sharded on dim 0 along the FSDP axis
  (``Replicate`` on the replica axis under HSDP; under FSDP x TP the TP plan's placement on
  the tp axis, ``_StridedShard`` on the FSDP axis where both cut dim 0; a parameter the TP
  plan leaves out sends the save through DCP's planning, :func:`dcp_fallback_reason`);
  buffers are plain tensors every rank holds;
- the optimizer's state per parameter (AdamW, Adam: ``step``, a float32 scalar every rank
  holds, then ``exp_avg`` and ``exp_avg_sq`` shaped and placed like the parameter), then the
  param group's values, the keys torch's optimizer writes;
- the nesting flattened by DCP's own ``flatten_state_dict``, which fixes the keys and their
  order (the order decides which replica writes a chunk and which rank a plain value).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import TensorProperties
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from shardkit.core.checkpoint.local_plan.chunk_writers import SaveLayout, ValueLayout, mesh_key

__all__ = [
    "CHECKPOINT_OPTIMIZERS",
    "CheckpointMesh",
    "checkpoint_layout",
    "checkpoint_state",
    "dcp_fallback_reason",
]

CHECKPOINT_OPTIMIZERS: dict[str, tuple[str, ...]] = {
    "adamw": ("exp_avg", "exp_avg_sq"),
    "adam": ("exp_avg", "exp_avg_sq"),
    "sgd": (),
}
"""Optimizer -> its state tensors per parameter, shaped like it (with a ``step`` for Adam's)."""


@dataclass(frozen=True, slots=True)
class CheckpointMesh:
    """The planner's mesh, (replicas, shard, tp) with tp innermost; axes of size 1 left out."""

    replicas: int
    shard: int
    tp: int = 1

    def __post_init__(self) -> None:
        if min(self.replicas, self.shard, self.tp) < 1:
            raise ValueError(f"mesh sizes must be positive, got {self}")

    @property
    def world_size(self) -> int:
        """Ranks in all."""
        return self.replicas * self.shard * self.tp

    def ranks(self) -> np.ndarray:
        """The global rank at each mesh position (the default mesh: ranks in order)."""
        shape = [self.replicas] if self.replicas > 1 else []
        shape += [self.shard, self.tp] if self.tp > 1 else [self.shard]
        return np.arange(self.world_size, dtype=np.int64).reshape(shape)

    def placements(self, tp_dim: int | None) -> tuple[Placement, ...]:
        """A parameter's placements, in mesh order, given the dim TP shards (None: replicated)."""
        out: list[Placement] = [Replicate()] if self.replicas > 1 else []
        if self.tp == 1:
            return (*out, Shard(0))
        if tp_dim == 0:
            # Both cut dim 0: FSDP's cut is strided over TP's pieces (DTensor's convention).
            out.append(_StridedShard(0, split_factor=self.tp))
        else:
            out.append(Shard(0))
        out.append(Replicate() if tp_dim is None else Shard(tp_dim))
        return tuple(out)


class _Leaf:
    """A value of the nested state before flattening: what the layout needs of it."""

    __slots__ = ("dtype", "kind", "placements", "shape")

    def __init__(
        self,
        kind: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        placements: tuple[Placement, ...] = (),
    ) -> None:
        self.kind, self.shape, self.dtype, self.placements = kind, shape, dtype, placements


def checkpoint_state(
    model: nn.Module,
    mesh: CheckpointMesh,
    optimizer: str = "adamw",
    tp_dims: dict[str, int | None] | None = None,
) -> tuple[list[ValueLayout], dict[str, Any], dict[str, int]]:
    """The flat state: its values, its flattening's mappings, its plain values' sizes.

    The values come in DCP's order; DCP's mappings are what ``.metadata`` keeps as planner
    data; a value that is not a tensor is sized as DCP saves it (``torch.save`` of it).

    Args:
        model: the model, unsharded, on any device (meta: nothing is allocated).
        mesh: the mesh the parameters are sharded on.
        optimizer: a key of :data:`CHECKPOINT_OPTIMIZERS`.
        tp_dims: parameter FQN -> the tensor dim TP shards (None: replicated on tp).

    Raises:
        ValueError: an optimizer whose state the planner does not know.
    """
    if optimizer not in CHECKPOINT_OPTIMIZERS:
        raise ValueError(
            f"--optimizer {optimizer}: a checkpoint's state is known for "
            f"{', '.join(sorted(CHECKPOINT_OPTIMIZERS))}"
        )
    tp_dims = tp_dims or {}
    params = {id(p): name for name, p in model.named_parameters()}
    model_state: dict[str, Any] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        dtype, shape = tensor.dtype, tuple(tensor.shape)
        if id(tensor) in params and tensor.dim() > 0:
            placements = mesh.placements(tp_dims.get(key))
            model_state[key] = _Leaf("dtensor", shape, dtype, placements)
        else:
            model_state[key] = _Leaf("tensor", shape, dtype)
    moments = CHECKPOINT_OPTIMIZERS[optimizer]
    optim_state: dict[str, Any] = {}
    for name, param in model.named_parameters():
        if not moments:
            break
        shape = tuple(param.shape)
        per_param: dict[str, Any] = {"step": _Leaf("tensor", (), torch.float32)}
        placements = mesh.placements(tp_dims.get(name)) if param.dim() > 0 else ()
        kind = "dtensor" if placements else "tensor"
        for moment in moments:
            per_param[moment] = _Leaf(kind, shape, param.dtype, placements)
        optim_state[name] = per_param
    group = _param_group(optimizer, [name for name, _ in model.named_parameters()])
    nested = {"model": model_state, "optim": {"state": optim_state, "param_groups": [group]}}
    flat, mappings = flatten_state_dict(nested)
    ranks = mesh.ranks()
    mesh_id = mesh_key(ranks)
    values = [_value_layout(key, leaf, ranks, mesh_id) for key, leaf in flat.items()]
    plain_sizes = {k: _saved_size(v) for k, v in flat.items() if not isinstance(v, _Leaf)}
    return values, mappings, plain_sizes


def checkpoint_layout(
    model: nn.Module,
    mesh: CheckpointMesh,
    optimizer: str = "adamw",
    tp_dims: dict[str, int | None] | None = None,
) -> SaveLayout:
    """The core's save layout of ``model``'s and its optimizer's state on ``mesh``."""
    values, _, _ = checkpoint_state(model, mesh, optimizer, tp_dims)
    return SaveLayout.from_values(values, mesh.world_size)


def _saved_size(value: Any) -> int:
    """The bytes of ``torch.save(value)``."""
    stream = io.BytesIO()
    torch.save(value, stream)
    return stream.tell()


def dcp_fallback_reason(
    model: nn.Module, mesh: CheckpointMesh, tp_dims: dict[str, int | None] | None = None
) -> str:
    """Why the core would save this state through DCP's own planning ('' if it plans locally).

    Under FSDP x TP a parameter the TP plan leaves alone is sharded on the FSDP mesh only, a
    mesh of part of the ranks, different from rank to rank: no rank can plan the others'
    keys, and the core's first save falls back (``local_plan.save``'s ``NotPlannableLocally``).
    ``tp_dims`` holds the parameters the TP plan distributes.
    """
    if mesh.tp == 1:
        return ""
    tp_dims = tp_dims or {}
    for name, param in model.named_parameters():
        if param.dim() > 0 and name not in tp_dims:
            return (
                f"model.{name} is not in the TP plan: it is on the FSDP mesh only, "
                f"{mesh.world_size // mesh.tp} of the {mesh.world_size} ranks"
            )
    return ""


def _param_group(optimizer: str, names: list[str]) -> dict[str, Any]:
    """The param group as torch's optimizer writes it (its keys in its order), params by name."""
    probe = [nn.Parameter(torch.zeros(1))]
    built: torch.optim.Optimizer
    if optimizer == "adamw":
        built = torch.optim.AdamW(probe)
    elif optimizer == "adam":
        built = torch.optim.Adam(probe)
    else:
        built = torch.optim.SGD(probe, lr=0.1)
    group = dict(built.state_dict()["param_groups"][0])
    group["params"] = names
    return group


def _value_layout(key: str, leaf: Any, ranks: np.ndarray, mesh_id: str) -> ValueLayout:
    if not isinstance(leaf, _Leaf):
        return ValueLayout(key, "bytes")
    properties = TensorProperties(dtype=leaf.dtype)
    if leaf.kind == "tensor":
        return ValueLayout(key, "tensor", leaf.shape, properties)
    return ValueLayout(key, "dtensor", leaf.shape, properties, ranks, leaf.placements, mesh_id)
