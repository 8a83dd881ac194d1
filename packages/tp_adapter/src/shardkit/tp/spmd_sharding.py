"""``fully_shard(..., dp_mesh_dims=...)``: parameters already DTensors on the whole SPMD mesh.

After ``distribute_module`` (or a TP plan applied on the whole mesh) a parameter is one
DTensor on, say, the (dp, tp) mesh: ``Replicate()`` on the data-parallel axes, its TP
placements on the others. ``fully_shard`` then shards each rank's local tensor across the
data-parallel shard axis, as it shards a TP-local tensor given on a separate dp mesh:

- the sharded parameter keeps the mesh and the non-dp placements; the dp shard axis becomes
  ``Shard(dim)``, or ``_StridedShard(dim, split_factor=...)`` when axes to its right already
  cut that dim (they cut first: the core shards their local part). Several shard axes are one
  flattened axis of the sharded parameter's mesh (HSDP: the (replicate, shard) mesh there);
- the unsharded parameter is the parameter's own DTensor again (mesh and placements);
- gradients are settled on the non-dp axes only: a ``Partial`` on a dp axis is the sum the
  core's reduce-scatter and all-reduce compute, so it is left to them.

torch's ``fully_shard`` builds the same placements, so checkpoints interchange. See
[Note: tensor parallelism] in docs/notes/009-tensor-parallelism.md.
"""

from __future__ import annotations

import math

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from shardkit.core.extensions import ParamShardingSpec, SpmdMeshAxes
from shardkit.tp.torch_internals import concatenate_meshes, is_shard_on, strided_shard

__all__ = ["settled_placements", "spmd_param_spec"]


def spmd_param_spec(param: nn.Parameter, shard_dim: int, axes: SpmdMeshAxes) -> ParamShardingSpec:
    """Describe ``param``, a DTensor on ``axes.mesh``, sharded along ``shard_dim`` on dp.

    Raises:
        ValueError: not ``Replicate()`` on a data-parallel axis, or a ``Partial`` elsewhere.
    """
    assert isinstance(param, DTensor), "the core passes DTensors on the whole mesh only"
    mesh = axes.mesh
    names = mesh.mesh_dim_names
    assert names is not None, "the core refuses a mesh without axis names"
    placements = tuple(param.placements)
    shard_axes = [names.index(n) for n in axes.shard]
    replicate_axes = [names.index(n) for n in axes.replicate]
    _check_replicated(placements, names, shard_axes, "shard")
    _check_replicated(placements, names, replicate_axes, "replicate")
    dp_axes = tuple(sorted(shard_axes + replicate_axes))
    partial = [names[i] for i, p in enumerate(placements) if p.is_partial() and i not in dp_axes]
    if partial:
        raise ValueError(
            f"a parameter with placements {placements} is a partial sum on axes {partial}; "
            "parameters must be Shard or Replicate on the non-data-parallel axes"
        )
    sharded = list(placements)
    for axis in shard_axes:
        sharded[axis] = _dp_shard(placements, mesh, axis, shard_dim)
    sharded_mesh, sharded_placements = _sharded_layout(axes, tuple(sharded))
    return ParamShardingSpec(
        local=param.to_local().detach(),
        shard_dim=shard_dim,
        sharded_mesh=sharded_mesh,
        sharded_placements=sharded_placements,
        unsharded_mesh=mesh,
        unsharded_placements=placements,
        global_shape=param.shape,
        global_stride=tuple(param.stride()),
        dp_axes=dp_axes,
    )


def _check_replicated(
    placements: tuple[Placement, ...], names: tuple[str, ...], axes: list[int], role: str
) -> None:
    for axis in axes:
        if not isinstance(placements[axis], Replicate):
            raise ValueError(
                f"Expected Replicate() on DP {role} dim '{names[axis]}' (index {axis}) but got "
                f"{placements[axis]}: with dp_mesh_dims, parameters are distributed on the "
                "whole mesh replicated on its data-parallel axes, and fully_shard shards them"
            )


def _dp_shard(
    placements: tuple[Placement, ...], mesh: DeviceMesh, axis: int, dim: int
) -> Placement:
    """The placement of dp shard ``axis``: strided when axes to its right cut ``dim`` too."""
    split = math.prod(
        mesh.size(j) for j in range(axis + 1, mesh.ndim) if is_shard_on(placements[j], dim)
    )
    return strided_shard(dim, split) if split > 1 else Shard(dim)


def _sharded_layout(
    axes: SpmdMeshAxes, placements: tuple[Placement, ...]
) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The sharded parameter's mesh and placements.

    One shard axis: the whole mesh. Several: they are one flattened axis of the data-parallel
    mesh, which takes the place of the first of them (with HSDP's replicate axis before it);
    the other axes stay as they are.
    """
    mesh = axes.mesh
    names = mesh.mesh_dim_names
    assert names is not None
    if len(axes.shard) <= 1:
        return mesh, placements
    hsdp = bool(axes.replicate)
    meshes: list[DeviceMesh] = []
    out: list[Placement] = []
    first = min(names.index(n) for n in axes.shard)
    for axis, name in enumerate(names):
        if axis == first:
            meshes.append(axes.dp_mesh)
            out += [Replicate(), placements[axis]] if hsdp else [placements[axis]]
        elif name not in axes.shard and not (hsdp and name in axes.replicate):
            meshes.append(mesh[name])
            out.append(placements[axis])
    return concatenate_meshes(meshes), tuple(out)


def settled_placements(
    grad: tuple[Placement, ...], spec: ParamShardingSpec
) -> tuple[Placement, ...]:
    """Where a gradient placed as ``grad`` must be before the core reduces its local tensor.

    The parameter's placements, except on data-parallel axes (``spec.dp_axes``), where the
    gradient keeps its own: the core's reduction over them sums a ``Partial`` there.
    """
    return tuple(
        g if axis in spec.dp_axes else p
        for axis, (g, p) in enumerate(zip(grad, spec.unsharded_placements, strict=True))
    )
