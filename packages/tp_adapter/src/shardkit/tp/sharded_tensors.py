"""FSDP1's SHARDED_STATE_DICT values without a device mesh: ShardedTensors cut on dim 0.

FSDP1 saves each parameter as this rank's dim-0 chunk, in ``torch.chunk``'s cut, held by a
ShardedTensor over the data-parallel group. A tensor-parallel parameter is cut the same way,
but what dp cuts is this TP rank's part of it: that chunk is nested inside an outer
ShardedTensor over the TP group, whose one local shard says where the part lies in the whole
tensor. DCP's default planner flattens the nesting when it saves and loads.

The outer metadata is FSDP1's: it must cover the whole tensor, yet only this rank's shard is
real, so it lists this rank first and gives the other boxes to one other TP rank.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from shardkit.tp.torch_internals import (
    ShardedTensor,
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
    TensorShard,
    default_device_type,
    process_group_of,
    sharded_tensor,
    waited,
)

__all__ = [
    "ChunkGroup",
    "chunk_on_dim0",
    "chunk_sharded_part",
    "chunk_tp_part",
    "local_shards_to_load",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkGroup:
    """Where dim-0 chunks go: FSDP1's arguments to ``chunk_tensor``."""

    rank: int
    """This rank's index in ``group``."""
    world_size: int
    """How many chunks to cut: ``group``'s size."""
    num_devices_per_node: int
    """Accelerators per host: names the device a shard lies on (unused on CPU)."""
    group: dist.ProcessGroup
    """The data-parallel process group."""
    device: torch.device | None = None
    """The device shards are named on (default: ``group``'s own device type)."""

    def placements(self, count: int) -> list[str]:
        """The remote-device names of the first ``count`` chunks: global rank and device."""
        kind = self.device.type if self.device is not None else default_device_type(self.group)
        names: list[str] = []
        for index in range(count):
            rank = dist.get_global_rank(self.group, index)
            device = kind if kind == "cpu" else f"{kind}:{rank % self.num_devices_per_node}"
            names.append(f"rank:{rank}/{device}")
        return names


def chunk_on_dim0(tensor: torch.Tensor, chunks: ChunkGroup) -> ShardedTensor:
    """``tensor`` cut on dim 0 across the group: this rank's chunk (a copy) and where all lie.

    Ranks past the last chunk (dim 0 shorter than the group) hold no shard.
    """
    tensor = tensor.detach()
    pieces = tensor.chunk(chunks.world_size, dim=0)
    starts = itertools.accumulate((piece.size(0) for piece in pieces[:-1]), initial=0)
    rest = [0] * (tensor.dim() - 1)
    boxes = [
        ShardMetadata([start, *rest], list(piece.shape), placement)
        for start, piece, placement in zip(
            starts, pieces, chunks.placements(len(pieces)), strict=True
        )
    ]
    local: list[TensorShard] = []
    if chunks.rank < len(pieces):
        # A contiguous copy: the only layout ShardedTensor takes. FSDP1 names the local shard
        # by the rank it was given, its index in the group.
        mine = pieces[chunks.rank].clone(memory_format=torch.contiguous_format)
        offsets = boxes[chunks.rank].shard_offsets
        local = [TensorShard.from_tensor_and_offsets(mine, offsets, chunks.rank)]
    properties = TensorProperties(
        dtype=tensor.dtype,
        layout=tensor.layout,
        requires_grad=False,
        memory_format=torch.contiguous_format,
        pin_memory=tensor.is_pinned(),
    )
    metadata = ShardedTensorMetadata(boxes, tensor.shape, properties)
    return sharded_tensor(local, metadata, chunks.group)


def chunk_tp_part(tensor: DTensor, chunks: ChunkGroup) -> ShardedTensor:
    """This TP rank's part of ``tensor``, cut across dp, inside a ShardedTensor over TP.

    Raises:
        ValueError: ``tensor`` lives on a mesh of more than one axis.
    """
    mesh = tensor.device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"a DTensor on the {mesh.ndim}-axis mesh {mesh.mesh_dim_names} cannot be chunked for "
            "FSDP1's sharded state dict: only tensor-parallel DTensors (a 1-axis mesh) can"
        )
    part = waited(tensor.to_local())
    inner = chunk_on_dim0(part, chunks)
    group = mesh.get_group()
    me = mesh.get_local_rank()
    boxes = _part_boxes(tensor, mesh.size())
    # See the module docstring: this rank, then one other rank for the boxes it does not hold.
    # Global ranks: the outer ShardedTensor's group is the TP group, which names its members so.
    holders = [dist.get_global_rank(group, me)]
    if len(boxes) > 1:
        holders += [dist.get_global_rank(group, 1 if me == 0 else 0)] * (len(boxes) - 1)
    device = part.device
    outer = [
        ShardMetadata(offsets, sizes, f"rank:{holder}/{device}")
        for (offsets, sizes), holder in zip(boxes, holders, strict=True)
    ]
    mine_offsets, mine_sizes = boxes[me] if len(boxes) > 1 else boxes[0]
    mine = ShardMetadata(mine_offsets, mine_sizes, f"rank:{holders[0]}/{device}")
    properties = TensorProperties(dtype=tensor.dtype, layout=tensor.layout, requires_grad=False)
    metadata = ShardedTensorMetadata(outer, tensor.shape, properties)
    return sharded_tensor([TensorShard(inner, mine)], metadata, group)


def _part_boxes(tensor: DTensor, parts: int) -> list[tuple[list[int], list[int]]]:
    """(offsets, sizes) of each TP rank's part, in ``torch.chunk``'s cut; one if replicated."""
    placement = tensor.placements[0]
    shape = list(tensor.shape)
    if not isinstance(placement, Shard):
        return [([0] * len(shape), shape)]
    dim = placement.dim
    step = -(-shape[dim] // parts)  # ceil: torch.chunk's chunk size, as DTensor cuts
    boxes: list[tuple[list[int], list[int]]] = []
    for index in range(parts):
        start = min(step * index, shape[dim])
        offsets = [0] * len(shape)
        offsets[dim] = start
        sizes = list(shape)
        sizes[dim] = min(step, shape[dim] - start)
        boxes.append((offsets, sizes))
    return boxes


def chunk_sharded_part(tensor: ShardedTensor, chunks: ChunkGroup) -> ShardedTensor:
    """The one local shard of ``tensor``, cut across dp, inside a copy of ``tensor``'s layout.

    Raises:
        ValueError: ``tensor`` holds other than one local shard here.
    """
    shards = tensor.local_shards()
    if len(shards) != 1:
        raise ValueError(
            f"a ShardedTensor with {len(shards)} local shards on this rank cannot be chunked "
            "for FSDP1's sharded state dict: it needs exactly one"
        )
    inner = chunk_on_dim0(shards[0].tensor, chunks)
    metadata = copy.deepcopy(tensor.metadata())
    metadata.tensor_properties.requires_grad = False
    mine = copy.deepcopy(shards[0].metadata)
    return sharded_tensor([TensorShard(inner, mine)], metadata, process_group_of(tensor))


def local_shards_to_load(tensor: torch.Tensor) -> tuple[torch.Tensor, list[TensorShard]]:
    """The ShardedTensor that holds this rank's data, and its local shards.

    A nested ShardedTensor (a tensor-parallel parameter) gives its inner one.

    Raises:
        TypeError: ``tensor`` is not a ShardedTensor.
    """
    if not isinstance(tensor, ShardedTensor):
        raise TypeError(
            f"FSDP1's sharded state dict holds ShardedTensors here, not {type(tensor).__name__}"
        )
    shards = tensor.local_shards()
    if len(shards) == 1 and isinstance(shards[0].tensor, ShardedTensor):
        inner = shards[0].tensor
        return inner, inner.local_shards()
    return tensor, shards
