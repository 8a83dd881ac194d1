"""The one module of shardkit.tp that touches torch's private distributed API.

Combining the data-parallel mesh with the tensor-parallel mesh into one SPMD mesh, the
strided placement that says "sharded on TP first, then on dp", and waiting on a functional
collective's result have no public API in torch 2.13. Keeping each use here means a torch
upgrade that changes them breaks one file.
"""

from __future__ import annotations

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Shard
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["concatenate_meshes", "is_shard_on", "root_mesh", "strided_shard", "waited"]


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose axes are those of ``meshes``, in order (all slices of one root mesh).

    Raises:
        RuntimeError: the meshes come from different root meshes, or they overlap.
    """
    return DeviceMesh._concatenate(meshes)


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh that ``mesh`` was sliced from (itself if it was not)."""
    return mesh._get_root_mesh()


def strided_shard(dim: int, split_factor: int) -> Placement:
    """Shard ``dim`` across an axis after ``split_factor`` shards were taken on later axes."""
    return _StridedShard(dim, split_factor=split_factor)


def is_shard_on(placement: Placement, dim: int) -> bool:
    """Whether ``placement`` shards tensor dim ``dim`` (plainly or strided)."""
    return isinstance(placement, Shard | _StridedShard) and placement.dim == dim


def waited(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself once a functional collective that produced it has finished."""
    if isinstance(tensor, AsyncCollectiveTensor):
        return tensor.wait()
    return tensor
