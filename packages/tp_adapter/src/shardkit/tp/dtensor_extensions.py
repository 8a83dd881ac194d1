"""FSDP1's DTensor extensions for 2D (FSDP x TP) models and their checkpoints.

FSDP1 flattens each TP rank's local tensor into its flat parameter, so a DTensor parameter
is taken apart before flattening and rebuilt around each unflattened view. Its
SHARDED_STATE_DICT cuts that local tensor again across dp: without a device mesh into a
ShardedTensor nested in one over TP (see :mod:`shardkit.tp.sharded_tensors`); with one into
a DTensor on the whole (dp..., tp) mesh, ``Shard(0)`` on the dp axis next to TP's placement.
Loading gathers such a DTensor over its dp axes back to the TP rank's local tensor.

The methods and their results are those of torch's
``torch.distributed.tensor.parallel.fsdp.DTensorExtensions``, the ``FSDPExtensions`` that
FSDP1 installs on a sub-mesh of a 2D mesh; shardkit.legacy uses this class the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from shardkit.tp.sharded_tensors import (
    ChunkGroup,
    chunk_on_dim0,
    chunk_sharded_part,
    chunk_tp_part,
    local_shards_to_load,
)
from shardkit.tp.torch_internals import ShardedTensor, TensorShard, root_mesh, waited

__all__ = ["DTensorExtensions", "DTensorMetadata"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DTensorMetadata:
    """What rebuilds a DTensor around its local tensor (FSDP1's "parameter extension")."""

    mesh: DeviceMesh
    """The DTensor's mesh."""
    placements: tuple[Placement, ...]
    """One per mesh axis."""
    shape: torch.Size
    """The global shape."""
    stride: tuple[int, ...]
    """The global strides."""


class DTensorExtensions:
    """FSDP1's hooks for DTensor parameters: flattening, and sharded state dicts of 2D models.

    Stateless: one instance serves every FSDP1 unit of a model. Unlike torch's class it takes
    no device handle; rebuilding a DTensor issues no kernel, so no stream is involved.
    """

    def pre_flatten_transform(
        self, tensor: torch.Tensor
    ) -> tuple[torch.Tensor, DTensorMetadata | None]:
        """A DTensor's local tensor and what rebuilds it; a plain tensor and None.

        The local tensor shares the DTensor's storage (the DTensor itself is left as it is).
        It is a leaf that requires grad, as FSDP1 flattens it into a trainable flat parameter;
        an integer tensor cannot, so it does not.
        """
        if not isinstance(tensor, DTensor):
            return tensor, None
        local = waited(tensor.to_local()).detach()
        local.requires_grad_(local.is_floating_point() or local.is_complex())
        metadata = DTensorMetadata(
            mesh=tensor.device_mesh,
            placements=tuple(tensor.placements),
            shape=tensor.shape,
            stride=tuple(tensor.stride()),
        )
        return local, metadata

    def post_unflatten_transform(
        self, tensor: torch.Tensor, param_extension: DTensorMetadata
    ) -> torch.Tensor:
        """The DTensor around ``tensor`` (no copy), as ``param_extension`` describes it.

        Autograd flows through to ``tensor``; a gradient that reaches it from a collective is
        waited for first, so FSDP1's reduce-scatter never reads an unfinished one.
        """
        result = DTensor.from_local(
            tensor,
            param_extension.mesh,
            param_extension.placements,
            run_check=False,
            shape=param_extension.shape,
            stride=param_extension.stride,
        )
        if tensor.requires_grad:
            tensor.register_hook(waited)
        return result

    def chunk_tensor(
        self,
        tensor: torch.Tensor,
        rank: int,
        world_size: int,
        num_devices_per_node: int,
        pg: dist.ProcessGroup,
        device: torch.device | None = None,
    ) -> torch.Tensor:
        """FSDP1's sharded state-dict value without a device mesh: a ShardedTensor.

        A plain tensor is cut on dim 0 across ``pg``; a tensor-parallel DTensor or a
        ShardedTensor has its local part cut so and nested inside a ShardedTensor that says
        where that part lies.

        Args:
            tensor: the unflattened parameter (or optimizer state).
            rank: this rank's index in ``pg``.
            world_size: ``pg``'s size.
            num_devices_per_node: accelerators per host (names the devices on one).
            pg: the data-parallel process group.
            device: the device the shards are named on (default: ``pg``'s).

        Raises:
            ValueError: a DTensor not on a 1-axis mesh, or a ShardedTensor with other than
                one local shard.
        """
        chunks = ChunkGroup(
            rank=rank,
            world_size=world_size,
            num_devices_per_node=num_devices_per_node,
            group=pg,
            device=device,
        )
        if isinstance(tensor, ShardedTensor):
            return chunk_sharded_part(tensor, chunks)
        if isinstance(tensor, DTensor):
            return chunk_tp_part(tensor, chunks)
        return chunk_on_dim0(tensor, chunks)

    def chunk_dtensor(self, tensor: torch.Tensor, rank: int, device_mesh: DeviceMesh) -> DTensor:
        """FSDP1's sharded state-dict value with a device mesh: a DTensor on the root mesh.

        A copy, sharded on dim 0 across dp. A plain tensor is ``Shard(0)`` on the root mesh's
        first axis and replicated on the others; a tensor-parallel DTensor is ``Shard(0)`` on
        the axis before TP's, keeps its TP placement on the last and is replicated on the
        rest (HSDP x TP: ``(Replicate(), Shard(0), tp)``).

        Args:
            tensor: a full tensor, the same on every rank, or a DTensor on the TP axis.
            rank: unused; FSDP1 passes it.
            device_mesh: FSDP1's data-parallel mesh, sliced from a root mesh of 2+ axes.

        Raises:
            ValueError: ``device_mesh`` is not part of a mesh of 2 or more axes, or
                ``tensor`` is a DTensor that is not on that mesh's last axis.
        """
        del rank  # every rank's place comes from the mesh
        mesh = root_mesh(device_mesh)
        if mesh.ndim < 2:
            raise ValueError(
                f"FSDP x TP state dicts need the data-parallel mesh {device_mesh.mesh_dim_names} "
                f"sliced from a mesh of 2 or more axes; its root mesh has {mesh.ndim}"
            )
        rest: list[Placement] = [Replicate()] * (mesh.ndim - 1)
        if isinstance(tensor, DTensor):
            _check_on_last_axis(tensor, mesh)
            tp = tensor.placements[0]
            start, target = [*rest, tp], [*rest[:-1], Shard(0), tp]
            local = waited(tensor.to_local())
        else:
            # A parameter TP left alone: every rank holds all of it.
            start, target = [Replicate(), *rest], [Shard(0), *rest]
            local = tensor
        shape, stride = tensor.shape, tensor.stride()
        whole = DTensor.from_local(
            local.detach().clone(), mesh, start, run_check=False, shape=shape, stride=stride
        )
        return whole.redistribute(mesh, target)

    def pre_load_state_dict_transform(
        self, tensor: torch.Tensor
    ) -> tuple[torch.Tensor, list[TensorShard]]:
        """The ShardedTensor that holds this rank's data in a loaded value, and its shards.

        Raises:
            TypeError: ``tensor`` is not a ShardedTensor.
        """
        return local_shards_to_load(tensor)

    def all_gather_dtensor(self, tensor: DTensor, parent_mesh: DeviceMesh | None) -> torch.Tensor:
        """``tensor`` gathered over every axis but the last (TP): this TP rank's local tensor.

        Raises:
            ValueError: ``tensor`` is not on ``parent_mesh``.
        """
        if parent_mesh != tensor.device_mesh:
            raise ValueError(
                f"a DTensor on the mesh {tensor.device_mesh} cannot be gathered over the "
                f"data-parallel axes of {parent_mesh}: it must lie on that (root) mesh"
            )
        target = [Replicate()] * (tensor.device_mesh.ndim - 1) + [tensor.placements[-1]]
        return waited(tensor.redistribute(tensor.device_mesh, target).to_local())


def _check_on_last_axis(tensor: DTensor, mesh: DeviceMesh) -> None:
    names = mesh.mesh_dim_names
    on = tensor.device_mesh
    # Equal to the root's last axis, not necessarily sliced from this root object: torch may
    # hand back an equal TP mesh sliced from another root of the same ranks and names.
    if names is None or on != mesh[names[-1]]:
        raise ValueError(
            f"a DTensor on the mesh {on} is not tensor-parallel on the last axis of {mesh}: "
            "FSDP x TP state dicts keep TP on the root mesh's last axis"
        )
