"""The one module of shardkit.tp that touches torch's private distributed API.

Combining the data-parallel mesh with the tensor-parallel mesh into one SPMD mesh, the
strided placement that says "sharded on TP first, then on dp", and waiting on a functional
collective's result have no public API in torch 2.13; nor has ShardedTensor, the value type of
FSDP1's SHARDED_STATE_DICT without a device mesh, which lives in ``torch.distributed._shard``.
Keeping each use here means a torch upgrade that changes them breaks one file.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed import distributed_c10d
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)
from torch.distributed._shard.sharded_tensor.shard import Shard as TensorShard
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Shard
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = [
    "ShardMetadata",
    "ShardedTensor",
    "ShardedTensorMetadata",
    "TensorProperties",
    "TensorShard",
    "concatenate_meshes",
    "default_device_type",
    "is_shard_on",
    "process_group_of",
    "root_mesh",
    "sharded_tensor",
    "strided_shard",
    "waited",
]


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose axes are those of ``meshes``, in order (all slices of one root mesh).

    Raises:
        RuntimeError: the meshes come from different root meshes, or they overlap.
    """
    # The meshes' rank tensors are real: under a FakeTensorMode (memory estimation on fake
    # tensors, as torchtitan's) the mode would take the concatenation's index arithmetic
    # on them and fail it, as if the meshes did not fit together.
    with unset_fake_temporarily():
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


def sharded_tensor(
    local_shards: list[TensorShard],
    metadata: ShardedTensorMetadata,
    group: dist.ProcessGroup,
) -> ShardedTensor:
    """A ShardedTensor from this rank's shards and the metadata of all, with no communication.

    Every rank passes the same ``metadata``; nothing checks that they agree.
    """
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, sharded_tensor_metadata=metadata, process_group=group, init_rrefs=False
    )


def process_group_of(tensor: ShardedTensor) -> dist.ProcessGroup:
    """The process group ``tensor`` is sharded over."""
    group = tensor._process_group
    assert isinstance(group, dist.ProcessGroup)
    return group


def default_device_type(group: dist.ProcessGroup) -> str:
    """The device type of ``group``: its one backend's, or "cpu" when it has several.

    FSDP1 asks the deprecated ``_get_pg_default_device``, which answers the same (and warns).
    """
    return distributed_c10d._get_object_coll_device(group)
