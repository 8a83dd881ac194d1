"""Pure tensor operations on flat buffers: shard geometry, flat layouts, copies between them.

Nothing here knows about process groups, so all of it is testable in one process.
See [Note: flat group buffers] in docs/notes/001-flat-group-buffers.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardkit.core.runtime.chunks import chunk_rows, chunk_size

__all__ = [
    "ALIGN_BYTES",
    "FlatLayout",
    "ShardGeometry",
    "copy_out_unsharded",
    "one_copy_numel",
    "rank_major_view",
    "shard_geometry",
]

ALIGN_BYTES = 16
"""Every slot of a flat buffer starts at a multiple of this, so any dtype views it in place."""


@dataclass(frozen=True, slots=True)
class ShardGeometry:
    """How one parameter is cut into ``world`` shards along ``dim`` (torch.chunk semantics)."""

    shape: torch.Size
    """The full (unsharded) shape."""
    dim: int
    """The tensor dim that is sharded (non-negative)."""
    world: int
    """Number of shards."""
    chunk: int
    """Size of every padded shard along ``dim``: ceil(shape[dim] / world)."""

    @property
    def padded_shard_shape(self) -> torch.Size:
        """Shape of one padded shard; every rank sends this many elements."""
        dims = list(self.shape)
        dims[self.dim] = self.chunk
        return torch.Size(dims)

    @property
    def shard_numel(self) -> int:
        """Elements in one padded shard."""
        return math.prod(self.padded_shard_shape)

    @property
    def row_numel(self) -> int:
        """Elements per index of the sharded dim in one shard (dim-0 sharding only)."""
        return math.prod(self.shape[1:])

    def local_length(self, rank: int) -> int:
        """Size along ``dim`` of the real (unpadded) shard held by ``rank``."""
        return chunk_rows(self.shape[self.dim], self.world, rank)[1]

    def local_shape(self, rank: int) -> torch.Size:
        """The unpadded shard shape of ``rank``: what the DTensor's local tensor shows."""
        dims = list(self.shape)
        dims[self.dim] = self.local_length(rank)
        return torch.Size(dims)

    def local_shard(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s unpadded shard of ``full`` (a tensor of ``shape``), as a view.

        A tensor subclass is cut with ``torch.chunk``, as torch's fully_shard cuts it: some
        implement only the operators that needs (NF4 refuses a ``narrow`` that ends before
        the last row), and ``chunk``'s pieces are the same rows.
        """
        if type(full) is not torch.Tensor:
            chunks = torch.chunk(full, self.world, dim=self.dim)
            if rank < len(chunks):
                return chunks[rank]
            empty = list(self.shape)
            empty[self.dim] = 0
            return chunks[0].new_empty(empty)  # past the last row (chunk leaves no piece)
        start, length = chunk_rows(self.shape[self.dim], self.world, rank)
        return full.narrow(self.dim, start, length)

    def padded_shard(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s shard of ``full`` zero padded to ``padded_shard_shape``, flat.

        A view where no padding is needed and the shard is contiguous, else a new tensor.
        """
        shard = self.local_shard(full, rank)
        if shard.shape[self.dim] == self.chunk:
            return shard.contiguous().view(-1)
        padded = full.new_zeros(self.padded_shard_shape)
        padded.narrow(self.dim, 0, shard.shape[self.dim]).copy_(shard)
        return padded.view(-1)

    @property
    def is_even(self) -> bool:
        """Whether every rank's shard is full (no padding at all)."""
        return self.chunk * self.world == self.shape[self.dim]


def shard_geometry(shape: torch.Size, dim: int, world: int) -> ShardGeometry:
    """Geometry of ``shape`` cut into ``world`` shards along ``dim`` (``dim`` non-negative)."""
    size = shape[dim]
    return ShardGeometry(
        shape=torch.Size(shape), dim=dim, world=world, chunk=chunk_size(size, world)
    )


@dataclass(frozen=True, slots=True)
class FlatLayout:
    """Where each tensor of a group lives in one flat byte buffer.

    Offsets are aligned to 16 bytes so that any dtype can be viewed in place; a group of one
    dtype whose sizes are multiples of 16 bytes has no gaps at all.
    """

    numels: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    offsets: tuple[int, ...]
    """Byte offset of each tensor."""
    nbytes: int
    """Total bytes, including alignment gaps."""

    @staticmethod
    def build(numels: Sequence[int], dtypes: Sequence[torch.dtype]) -> FlatLayout:
        """Lay out tensors of the given sizes and dtypes one after another."""
        offsets: list[int] = []
        cursor = 0
        for numel, dtype in zip(numels, dtypes, strict=True):
            cursor = -(-cursor // ALIGN_BYTES) * ALIGN_BYTES
            offsets.append(cursor)
            cursor += numel * dtype.itemsize
        total = -(-cursor // ALIGN_BYTES) * ALIGN_BYTES
        return FlatLayout(tuple(numels), tuple(dtypes), tuple(offsets), total)

    def retyped(self, dtype: torch.dtype) -> FlatLayout:
        """The same slots at the same element offsets, in ``dtype`` (a layout of one dtype).

        A buffer of this layout and one of ``self``'s line up element for element: a cast
        between them is one copy (see :func:`one_copy_numel`). Slots keep their 16-byte
        alignment where ``dtype`` is no narrower; narrower ones may start 8 or 4 bytes in,
        which a copy does not mind.
        """
        (item,) = {d.itemsize for d in self.dtypes} or {dtype.itemsize}
        assert all(offset % item == 0 for offset in self.offsets)
        elements = [offset // item for offset in self.offsets]
        # As many elements as self holds, not rounded up to 16 bytes: an all-gather's rows
        # are laid end to end, so each byte past the last element would be sent by, and
        # kept for, every rank (W bytes of buffer each). The one copy of the group needs no
        # more, and a row of whole elements keeps the next row's views aligned.
        total = self.nbytes // item * dtype.itemsize
        return FlatLayout(
            self.numels,
            (dtype,) * len(self.numels),
            tuple(e * dtype.itemsize for e in elements),
            total,
        )

    def view(self, buffer: torch.Tensor, index: int) -> torch.Tensor:
        """The 1-D typed view of tensor ``index`` inside a uint8 ``buffer`` of this layout."""
        start = self.offsets[index]
        dtype = self.dtypes[index]
        return buffer[start : start + self.numels[index] * dtype.itemsize].view(dtype)


def one_copy_numel(src: FlatLayout, dst: FlatLayout) -> int | None:
    """Elements of one typed copy of ``src``'s buffer into ``dst``'s that copies every tensor.

    That holds when each layout has one dtype and every tensor starts at the same element
    offset in both (their gaps then line up too). A cast from fp32 shards to a bf16 all-gather
    input is then one copy instead of one per parameter. None when it does not hold.
    """
    if not src.numels or len(set(src.dtypes)) != 1 or len(set(dst.dtypes)) != 1:
        return None
    if src.numels != dst.numels:
        return None
    src_item, dst_item = src.dtypes[0].itemsize, dst.dtypes[0].itemsize
    for a, b in zip(src.offsets, dst.offsets, strict=True):
        if a % src_item or b % dst_item or a // src_item != b // dst_item:
            return None
    return src.offsets[-1] // src_item + src.numels[-1]


def rank_major_view(full: torch.Tensor, geo: ShardGeometry) -> torch.Tensor:
    """View a full (padded-to-even) tensor as (W, *padded_shard_shape), rank first."""
    split = (*geo.shape[: geo.dim], geo.world, geo.chunk, *geo.shape[geo.dim + 1 :])
    return full.reshape(split).movedim(geo.dim, 0)


def copy_out_unsharded(
    shards: Sequence[torch.Tensor], geo: ShardGeometry, out: torch.Tensor
) -> None:
    """Copy one parameter's gathered shards into its unsharded storage.

    Args:
        shards: W typed 1-D views (shard_numel each) of this parameter's padded shard, one
            per rank in rank order, wherever each arrived.
        geo: the parameter's shard geometry.
        out: the parameter's padded unsharded storage, W * shard_numel elements, 1-D.
    """
    if geo.dim == 0:
        # Rank-major rows of dim-0 shards are exactly the padded full tensor, in order.
        target = out.view(geo.world, geo.shard_numel)
        for rank, shard in enumerate(shards):
            target[rank].copy_(shard)
        return
    target = rank_major_view(out.view(geo.world * geo.shard_numel), geo)
    for rank, shard in enumerate(shards):
        target[rank].copy_(shard.view(geo.padded_shard_shape))
