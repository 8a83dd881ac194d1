"""What ``shard_placement_fn`` returns, read: a dim, and the mesh a parameter is sharded on.

A parameter is placed by ``Shard(dim)``, by None (``Shard(0)``), or, from torch 2.13 on, by
torch's ``ShardPlacementResult(placement, mesh_info)``: a placement on a mesh of its own. One
``fully_shard`` call may then hold several parameter groups, one per mesh (a block's dense
weights on the data-parallel mesh, its routed experts on an expert-sharding mesh). Torch's
mesh descriptions are read here, once per object, into the engine's ``MeshInfo``; the
grouping itself is ``engine.sharding.collect_params``'s. See [Note: per-parameter meshes].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from shardkit.core.engine.mesh_info import MeshInfo, mesh_info_for
from shardkit.core.engine.sharding import Placed, PlaceFn
from shardkit.core.errors import InvalidPlacementError
from shardkit.core.torch_facing.fsdp_classes import (
    TORCH_FSDP_MESH_INFO,
    TORCH_HSDP_MESH_INFO,
    TORCH_SHARD_PLACEMENT_RESULT,
)

__all__ = ["placement_resolver"]


def placement_resolver(
    shard_placement_fn: Callable[[nn.Parameter], Any] | None, default: MeshInfo
) -> PlaceFn:
    """``shard_placement_fn`` as the engine asks it: (parameter, name) -> ``Placed``.

    ``default``: the call's own mesh. Each distinct ``mesh_info`` object a result names
    becomes one ``MeshInfo`` object, so parameters that share the one share the other.

    Raises (from the returned function):
        InvalidPlacementError: a result of another type, or a result's ``mesh_info`` that is
            no FSDPMeshInfo on a DeviceMesh of the shape its type says.
        ValueError: a result's mesh on another device type than the call's mesh.
        NotImplementedError: a result's mesh with ``dp_mesh_dims`` on either side.
    """
    read: dict[int, tuple[object, MeshInfo]] = {}  # id -> (torch's object, kept alive; ours)

    def place(param: nn.Parameter, name: str) -> Placed:
        result: Any = shard_placement_fn(param) if shard_placement_fn is not None else None
        if result is None or isinstance(result, Shard):
            return Placed(None if result is None else result.dim, default)
        if TORCH_SHARD_PLACEMENT_RESULT is None or not isinstance(
            result, TORCH_SHARD_PLACEMENT_RESULT
        ):
            raise InvalidPlacementError(
                f"Invalid shard_placement_fn result: {result!r}. shard_placement_fn must return "
                f"Shard(dim), None or a ShardPlacementResult for {name}"
            )
        placement, torch_info = result.placement, result.mesh_info
        if placement is not None and not isinstance(placement, Shard):
            raise InvalidPlacementError(
                f"shard_placement_fn returned a ShardPlacementResult for {name} whose placement "
                f"is {placement!r}; it must be Shard(dim) or None"
            )
        entry = read.get(id(torch_info))
        if entry is None:
            entry = (torch_info, _mesh_info_of(torch_info, name, default))
            read[id(torch_info)] = entry
        return Placed(None if placement is None else placement.dim, entry[1])

    return place


def _mesh_info_of(info: object, name: str, default: MeshInfo) -> MeshInfo:
    """Torch's ``FSDPMeshInfo`` / ``HSDPMeshInfo`` as the engine's ``MeshInfo``, validated."""
    where = f"the ShardPlacementResult shard_placement_fn returned for {name}"
    if TORCH_FSDP_MESH_INFO is None or not isinstance(info, TORCH_FSDP_MESH_INFO):
        raise InvalidPlacementError(
            f"{where} has a mesh_info of type {type(info).__name__}; it must be an "
            "FSDPMeshInfo or HSDPMeshInfo (torch.distributed.fsdp._fully_shard._fsdp_common)"
        )
    mesh = getattr(info, "mesh", None)
    if not isinstance(mesh, DeviceMesh):
        raise InvalidPlacementError(
            f"{where} has a mesh_info whose mesh is a {type(mesh).__name__}, not a DeviceMesh"
        )
    if default.spmd is not None or getattr(info, "dp_mesh_dims", None) is not None:
        raise NotImplementedError(
            f"{where}: a mesh of its own is not supported with dp_mesh_dims (SPMD meshes); "
            "pass the expert mesh's data-parallel sub-mesh without dp_mesh_dims"
        )
    hsdp = TORCH_HSDP_MESH_INFO is not None and isinstance(info, TORCH_HSDP_MESH_INFO)
    # The engine's meshes are 1-D (shard) or 2-D (replicate, shard), as torch's DTensor
    # placements for a plain parameter assume: any other axes would have no placement.
    axes = (getattr(info, "replicate_mesh_dim", None), getattr(info, "shard_mesh_dim", None))
    if hsdp:
        ok = mesh.ndim == 2 and axes == (0, 1)
        needs = "an HSDPMeshInfo needs a 2-D mesh with replicate_mesh_dim=0, shard_mesh_dim=1"
    else:
        ok = mesh.ndim == 1 and axes == (None, 0)
        needs = "an FSDPMeshInfo needs a 1-D mesh with shard_mesh_dim=0"
    if not ok:
        raise InvalidPlacementError(
            f"{where} has an {type(info).__name__} on a {mesh.ndim}-D mesh with "
            f"replicate_mesh_dim={axes[0]}, shard_mesh_dim={axes[1]}; {needs}"
        )
    if mesh.device_type != default.mesh.device_type:
        raise ValueError(
            f"{where} has a mesh on {mesh.device_type}, the fully_shard call's mesh is on "
            f"{default.mesh.device_type}; one call's parameters live on one device"
        )
    return mesh_info_for(mesh)
