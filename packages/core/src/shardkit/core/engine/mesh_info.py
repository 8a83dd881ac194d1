"""What a parameter group needs to know about its device mesh."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from shardkit.core.errors import FullyShardUsageError
from shardkit.core.extensions import SpmdMeshAxes
from shardkit.core.runtime.device import device_for_mesh_type
from shardkit.core.runtime.groups import own_group

__all__ = ["MeshInfo", "mesh_info_for", "replicate_mesh_info"]


@dataclass(frozen=True, slots=True)
class MeshInfo:
    """A 1-D (FSDP) or 2-D (HSDP: replicate x shard) data-parallel mesh.

    It may also be replicate only (``replicate``, or ``dp_mesh_dims`` naming no shard axis):
    ``mesh`` is then the replicate axis and the shard group is this rank alone
    (``shard_size`` 1).
    """

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup
    shard_rank: int
    shard_size: int
    replicate_group: dist.ProcessGroup | None
    """Set for HSDP only: gradients are all-reduced over it after the reduce-scatter."""
    replicate_size: int
    device: torch.device
    spmd: SpmdMeshAxes | None = None
    """Set with ``dp_mesh_dims``: the whole SPMD mesh the parameters are DTensors on, and the
    data-parallel axes ``mesh`` was built from."""
    replicate_only: bool = False
    """Nothing sharded: parameters are ``Replicate()`` on ``mesh``, gradients all-reduced."""

    @property
    def has_shard_axis(self) -> bool:
        """False for replicate only (``replicate``, or ``dp_mesh_dims`` naming no shard axis)."""
        return not self.replicate_only

    @property
    def dp_size(self) -> int:
        """Ranks that see different data: the default gradient divide factor."""
        return self.shard_size * self.replicate_size

    @property
    def shard_mesh(self) -> DeviceMesh:
        """The mesh of the shard axis alone (the mesh itself without HSDP)."""
        names = self.mesh.mesh_dim_names
        if self.mesh.ndim == 1 or names is None:
            return self.mesh
        return self.mesh[names[-1]]

    def placements(self, shard_dim: int) -> tuple[Placement, ...]:
        """DTensor placements of a parameter sharded on ``shard_dim``."""
        if not self.has_shard_axis:
            return (Replicate(),)
        if self.replicate_group is None:
            return (Shard(shard_dim),)
        return (Replicate(), Shard(shard_dim))


def mesh_info_for(mesh: DeviceMesh) -> MeshInfo:
    """Validate ``mesh`` for fully_shard and describe it."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard expects mesh to be a DeviceMesh, got {type(mesh).__name__}")
    device = device_for_mesh_type(mesh.device_type)
    if mesh.ndim == 1:
        group = mesh.get_group(0)
        return MeshInfo(mesh, group, mesh.get_local_rank(0), mesh.size(0), None, 1, device)
    if mesh.ndim == 2:
        if mesh.mesh_dim_names is None:
            raise FullyShardUsageError(
                "Please init the 2D mesh for HSDP with mesh_dim_names specified, e.g. "
                "init_device_mesh('cpu', (2, 2), mesh_dim_names=('replicate', 'shard'))"
            )
        return MeshInfo(
            mesh,
            mesh.get_group(1),
            mesh.get_local_rank(1),
            mesh.size(1),
            mesh.get_group(0),
            mesh.size(0),
            device,
        )
    raise ValueError(
        f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}, a {mesh.ndim}-D mesh; "
        "for tensor parallelism pass the data-parallel sub-mesh, e.g. mesh['dp']"
    )


def replicate_mesh_info(mesh: DeviceMesh) -> MeshInfo:
    """Validate a 1-D ``mesh`` for ``replicate`` and describe it: replicate only.

    Raises:
        TypeError: ``mesh`` is not a DeviceMesh.
        ValueError: ``mesh`` is not 1-D (torch's words, then what to pass instead).
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"replicate expects mesh to be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(
            f"replicate expects a 1D DeviceMesh but got {mesh}; pass its replicate axis "
            "(mesh['dp']), or the whole mesh with dp_mesh_dims=DataParallelMeshDims(replicate=...)"
        )
    device = device_for_mesh_type(mesh.device_type)
    # The shard group is this rank alone: nothing is gathered, gradients are all-reduced over
    # the replicate group (the mesh's one group), as HSDP's replicate axis is.
    return MeshInfo(
        mesh, own_group(), 0, 1, mesh.get_group(0), mesh.size(0), device, replicate_only=True
    )
