"""Pure tensor operations on flat buffers: shard geometry, copy-out and gradient packing.

Nothing here knows about process groups, so all of it is testable in one process.
See [Note: flat group buffers] in docs/notes/001-flat-group-buffers.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "ALIGN_BYTES",
    "FlatLayout",
    "RowSplit",
    "ShardGeometry",
    "copy_out_unsharded",
    "one_copy_numel",
    "pack_even_dim0_grads",
    "pack_grads_rank_major",
    "rank_major_view",
    "row_split",
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
        return max(0, min(self.chunk, self.shape[self.dim] - rank * self.chunk))

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
        start = min(rank * self.chunk, self.shape[self.dim])
        return full.narrow(self.dim, start, self.local_length(rank))

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
    return ShardGeometry(shape=torch.Size(shape), dim=dim, world=world, chunk=-(-size // world))


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


@dataclass(frozen=True, slots=True)
class RowSplit:
    """How one all-gathered row of dim-0 shards splits into the unsharded buffer in one copy.

    Rank r's padded dim-0 shard of a parameter is the slice ``[r * n, (r + 1) * n)`` of its
    padded full tensor (n: shard_numel), and a row holds one such shard per parameter, so a
    whole row goes to its W-th of the unsharded buffer with one ``torch.split_with_sizes_copy``
    instead of one ``copy_`` (and two views) per parameter. Alignment gaps between slots of
    the row are pieces too, copied to a scratch tensor nobody reads.
    See [Note: flat group buffers].
    """

    dtype: torch.dtype
    """The one dtype of every slot, in the row and in the unsharded buffer."""
    world: int
    """Rows gathered: the shards' world size."""
    sizes: tuple[int, ...]
    """Elements of each piece of a typed row, in row order; they sum to the whole row."""
    starts: tuple[int | None, ...]
    """Per piece: the element offset in the typed unsharded buffer of rank 0's shard (rank
    r's is ``start + r * size``), or None for a gap."""

    def outputs(self, unsharded: torch.Tensor) -> list[list[torch.Tensor]]:
        """The ``out=`` views of each rank's copy: slices of ``unsharded`` (uint8) and scratch.

        Made once and reused: they stay valid while ``unsharded`` keeps its storage object,
        whose memory may be freed and re-allocated in between (see [Note: unsharded storage]).
        """
        typed = unsharded.view(self.dtype)
        gaps = [n for n, start in zip(self.sizes, self.starts, strict=True) if start is None]
        # Every rank's copy writes its gaps to the same scratch: nothing ever reads them.
        scratch = iter(
            torch.empty(sum(gaps), dtype=self.dtype, device=unsharded.device).split(gaps)
        )
        gap_views = [next(scratch) if start is None else None for start in self.starts]
        outs: list[list[torch.Tensor]] = []
        for rank in range(self.world):
            row: list[torch.Tensor] = []
            for n, start, gap in zip(self.sizes, self.starts, gap_views, strict=True):
                if start is None:
                    assert gap is not None
                    row.append(gap)
                else:
                    row.append(typed[start + rank * n : start + (rank + 1) * n])
            outs.append(row)
        return outs

    def copy(self, rows: Sequence[torch.Tensor], outputs: Sequence[list[torch.Tensor]]) -> None:
        """Copy each uint8 row (rank order) into its ``outputs`` (from :meth:`outputs`)."""
        for row, outs in zip(rows, outputs, strict=True):
            torch.split_with_sizes_copy(row.view(self.dtype), self.sizes, out=outs)


def row_split(
    row_layout: FlatLayout,
    geometries: Sequence[tuple[int, ShardGeometry]],
    layout: FlatLayout,
) -> RowSplit | None:
    """The one-copy split of rows laid out by ``row_layout`` into ``layout``'s buffer, if any.

    It exists when every slot with bytes in the row is one of ``geometries``, all of them are
    dim-0 shards of one world size, and every slot has one dtype in both layouts. None
    otherwise (dim != 0 shards are not contiguous per rank; a hook's slot would be copied to
    scratch whole): then each parameter is copied on its own.
    """
    by_index = dict(geometries)
    if not by_index or any(n and i not in by_index for i, n in enumerate(row_layout.numels)):
        return None
    dtypes = {row_layout.dtypes[i] for i in by_index} | {layout.dtypes[i] for i in by_index}
    worlds = {geo.world for geo in by_index.values()}
    if len(dtypes) != 1 or len(worlds) != 1 or any(g.dim != 0 for g in by_index.values()):
        return None
    (dtype,), (world,) = dtypes, worlds
    item = dtype.itemsize
    sizes: list[int] = []
    starts: list[int | None] = []
    cursor = 0  # typed elements of the row covered so far
    for i in sorted(by_index, key=lambda i: row_layout.offsets[i]):
        n = by_index[i].shard_numel
        if not n:
            continue
        if row_layout.numels[i] != n or layout.numels[i] < world * n:
            return None
        gap = row_layout.offsets[i] // item - cursor
        if gap:
            sizes.append(gap)
            starts.append(None)
        sizes.append(n)
        starts.append(layout.offsets[i] // item)
        cursor += gap + n
    tail = row_layout.nbytes // item - cursor
    if tail:
        sizes.append(tail)
        starts.append(None)
    return RowSplit(dtype, world, tuple(sizes), tuple(starts))


def pack_grads_rank_major(
    grads: Sequence[torch.Tensor | None],
    geometries: Sequence[ShardGeometry],
    offsets: Sequence[int],
    out: torch.Tensor,
) -> None:
    """Write full gradients into a (W, S) buffer whose row r holds rank r's padded shards.

    This is the input of the reduce-scatter: row r goes to rank r. A missing gradient is sent
    as zeros so that every rank issues the same collective. Casting to ``out``'s dtype happens
    in the copy.

    Args:
        grads: full gradients (or None), one per parameter.
        geometries: the shard geometry of each parameter.
        offsets: element offset of each parameter within a row of ``out``.
        out: the (W, S) reduce-scatter input, typed in the reduce dtype.
    """
    for grad, geo, offset in zip(grads, geometries, offsets, strict=True):
        block = out[:, offset : offset + geo.shard_numel]
        if grad is None:
            block.zero_()
        elif geo.is_even:
            block.view(geo.world, *geo.padded_shard_shape).copy_(rank_major_view(grad, geo))
        else:
            _pack_uneven_dim0(grad, geo, block)


def pack_even_dim0_grads(
    grads: Sequence[torch.Tensor | None],
    out: torch.Tensor,
    gaps_after: Sequence[int] = (),
) -> bool:
    """Pack like :func:`pack_grads_rank_major`, for even dim-0 shards only, with fewer ops.

    A gradient of an even dim-0 shard viewed as (W, shard_numel) has rank r's shard as row
    r, so the (W, S) buffer is their concatenation along dim 1: one ``torch.cat`` where no
    gradient needs a cast. Where one does, one copy per gradient of that flat (W, n) view:
    measured faster than ``cat``'s casting path (bf16 gradients into fp32 rows, the FSDP1
    script's groups: 2.0 ms against 2.3 ms a backward), and still without the general path's
    per-shape views. The caller vouches for the geometries: every one dim-0, even and
    non-empty, in order from column 0, filling ``out``'s rows.

    Args:
        grads: full gradients, one per parameter, in the order of their columns.
        out: the (W, S) reduce-scatter input, typed in the reduce dtype.
        gaps_after: columns of zeros after each gradient (a flat-shard layout's alignment);
            empty: none anywhere.

    Returns:
        False, having written nothing, where the general path must pack: a missing
        gradient (sent as zeros), a tensor subclass, or one that autograd records
        (``out=`` ops refuse those).
    """
    world = out.shape[0]
    parts: list[torch.Tensor] = []
    for grad in grads:
        if grad is None or type(grad) is not torch.Tensor:
            return False
        parts.append(grad.reshape(world, -1))  # a view unless the gradient is not contiguous
    if torch.is_grad_enabled() and any(part.requires_grad for part in parts):
        return False
    gaps = list(gaps_after) or [0] * len(parts)
    if all(part.dtype == out.dtype for part in parts):
        if any(gaps):
            parts = _with_zero_columns(parts, gaps, out)
        torch.cat(parts, dim=1, out=out)
        return True
    column = 0
    for part, gap in zip(parts, gaps, strict=True):
        width = part.shape[1]
        out[:, column : column + width].copy_(part)
        column += width
        if gap:
            out[:, column : column + gap].zero_()
            column += gap
    return True


def _with_zero_columns(
    parts: list[torch.Tensor], gaps: Sequence[int], out: torch.Tensor
) -> list[torch.Tensor]:
    """``parts`` with a (W, gap) block of zeros after each that has a gap, for one ``cat``."""
    spaced: list[torch.Tensor] = []
    for part, gap in zip(parts, gaps, strict=True):
        spaced.append(part)
        if gap:
            spaced.append(out.new_zeros(out.shape[0], gap))
    return spaced


def _pack_uneven_dim0(grad: torch.Tensor, geo: ShardGeometry, block: torch.Tensor) -> None:
    """Rank-major packing for a dim-0 shard whose last ranks are short (zero padded)."""
    flat = grad.reshape(-1)
    row = geo.row_numel
    for rank in range(geo.world):
        length = geo.local_length(rank) * row
        start = rank * geo.chunk * row
        if length:
            block[rank, :length].copy_(flat[start : start + length])
        if length < geo.shard_numel:
            block[rank, length:].zero_()
