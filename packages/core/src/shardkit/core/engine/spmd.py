"""``fully_shard(..., dp_mesh_dims=...)``: parameters given on the whole SPMD mesh.

The mesh is then the whole mesh (data-parallel axes and, say, tensor-parallel ones), every
parameter is already a DTensor on it, and ``dp_mesh_dims`` names the data-parallel axes. The
core builds its data-parallel mesh from those axes (several names flattened into one axis, as
torch does) and gathers and reduces over it exactly as over a mesh passed alone. What the
parameters' other axes mean is the business of the extension that claims them (shardkit.tp):
the core checks only that each parameter is a DTensor on this mesh.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shardkit.core.engine.mesh_info import MeshInfo
from shardkit.core.engine.param import Sharding
from shardkit.core.extensions import ShardingExtension, SpmdMeshAxes, SpmdShardingExtension
from shardkit.core.policies import DataParallelMeshDims
from shardkit.core.runtime.device import device_for_mesh_type
from shardkit.core.runtime.groups import own_group
from shardkit.core.runtime.meshes import concatenate, flattened

__all__ = ["check_spmd_param", "spmd_mesh_info", "spmd_sharding"]


def _axis_names(dp_mesh_dims: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(shard names, replicate names) of ours or torch's ``DataParallelMeshDims``."""
    try:
        shard, replicate = dp_mesh_dims.shard, dp_mesh_dims.replicate
    except AttributeError:
        raise TypeError(
            "dp_mesh_dims must be a DataParallelMeshDims (shardkit.core's or "
            f"torch.distributed.fsdp's), got {type(dp_mesh_dims).__name__}"
        ) from None
    if shard is None and replicate is None:
        # Only reachable with torch's class, whose instances can be changed after creation.
        raise ValueError("At least one of shard or replicate must be set in dp_mesh_dims")
    ours = DataParallelMeshDims(shard=shard, replicate=replicate)  # checks torch's too
    return ours.shard_names, ours.replicate_names


def _check_names(mesh: DeviceMesh, shard: tuple[str, ...], replicate: tuple[str, ...]) -> None:
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            "mesh must have mesh_dim_names when dp_mesh_dims is provided (the data-parallel "
            "axes are named by them: init_device_mesh(..., mesh_dim_names=('dp', 'tp')))"
        )
    for name in (*shard, *replicate):
        if name not in names:
            raise ValueError(
                f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {names} "
                f"(dp_mesh_dims names shard={shard}, replicate={replicate})"
            )
    both = sorted(set(shard) & set(replicate))
    if both:
        raise ValueError(
            f"dp_mesh_dims names mesh axes {both} both to shard on and to replicate across; "
            "name each data-parallel axis once"
        )


def spmd_mesh_info(mesh: DeviceMesh, dp_mesh_dims: Any) -> MeshInfo:
    """Validate ``dp_mesh_dims`` against the whole mesh and build the data-parallel mesh.

    Raises:
        TypeError: ``dp_mesh_dims`` is not a ``DataParallelMeshDims``.
        ValueError: the mesh has no axis names, or a name is not one of them.
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard expects mesh to be a DeviceMesh, got {type(mesh).__name__}")
    shard, replicate = _axis_names(dp_mesh_dims)
    _check_names(mesh, shard, replicate)
    device = device_for_mesh_type(mesh.device_type)
    if not shard:  # replicate only: DDP-style, nothing sharded
        dp_mesh = flattened(mesh, replicate)
        axes = SpmdMeshAxes(mesh=mesh, shard=(), replicate=replicate, dp_mesh=dp_mesh)
        group = dp_mesh.get_group(0)
        size = dp_mesh.size(0)
        return MeshInfo(dp_mesh, own_group(), 0, 1, group, size, device, axes, replicate_only=True)
    shard_mesh = flattened(mesh, shard)
    if not replicate:
        axes = SpmdMeshAxes(mesh=mesh, shard=shard, replicate=(), dp_mesh=shard_mesh)
        group = shard_mesh.get_group(0)
        rank, size = shard_mesh.get_local_rank(0), shard_mesh.size(0)
        return MeshInfo(shard_mesh, group, rank, size, None, 1, device, axes)
    dp_mesh = concatenate([flattened(mesh, replicate), shard_mesh])  # (replicate, shard)
    axes = SpmdMeshAxes(mesh=mesh, shard=shard, replicate=replicate, dp_mesh=dp_mesh)
    return MeshInfo(
        dp_mesh,
        dp_mesh.get_group(1),
        dp_mesh.get_local_rank(1),
        dp_mesh.size(1),
        dp_mesh.get_group(0),
        dp_mesh.size(0),
        device,
        axes,
    )


def check_spmd_param(param: nn.Parameter, fqn: str, axes: SpmdMeshAxes) -> None:
    """Refuse a parameter that is not a DTensor on the whole mesh, before anything changes.

    Raises:
        ValueError: a plain tensor, or a DTensor on another mesh.
    """
    if not isinstance(param, DTensor):
        raise ValueError(
            "When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD "
            f"mesh (e.g. via distribute_module). Got plain tensor for parameter "
            f"'{fqn.rsplit('.', 1)[-1]}'. ({fqn}: distribute it on the mesh passed to "
            "fully_shard, Replicate() on the data-parallel axes, or pass it in ignored_params)"
        )
    if param.device_mesh != axes.mesh:
        raise ValueError(
            "Expected param's DTensor mesh to be the same mesh passed to fully_shard, but got "
            f"different mesh objects ({fqn} is a DTensor on {param.device_mesh}; fully_shard "
            f"got {axes.mesh})"
        )


def spmd_sharding(
    extension: ShardingExtension, param: nn.Parameter, fqn: str, dim: int, axes: SpmdMeshAxes
) -> Sharding:
    """Ask ``extension`` how to shard ``param``, given on the whole mesh.

    Raises:
        ValueError: the extension does not take SPMD-mesh parameters, or refused this one
            (its message first, as torch words it, then the parameter's name).
    """
    if not isinstance(extension, SpmdShardingExtension):
        raise ValueError(
            f"parameter {fqn} is claimed by {type(extension).__name__}, which does not support "
            "dp_mesh_dims (no spmd_param_spec); install shardkit-tp (pip install shardkit-tp)"
        )
    try:
        spec = extension.spmd_param_spec(param, shard_dim=dim, axes=axes)
    except ValueError as error:
        raise ValueError(f"{error} (fully_shard cannot shard parameter {fqn})") from error
    return Sharding(extension, spec)
