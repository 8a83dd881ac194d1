"""Packing full gradients into a reduce-scatter's (W, S) input: row r is rank r's shards.

:class:`Packing` says which parameters one reduction carries and where each sits in a row;
three kernels write the rows, each the same bytes, each in a number of kernels that neither
the world size nor (but for views) the number of parameters changes:

- :func:`pack_dim0_grads_fused`: one ``_chunk_cat`` for the group, padding and cast included
  (torch's ``fully_shard`` packs so; from torch 2.15 a group of several gradient dtypes too);
  the engine's way on accelerators, where every kernel is a launch. On CPU its kernel is
  slower than the others.
- :func:`pack_even_dim0_grads`: one ``cat`` of (W, n) views, for even dim-0 shards that
  need no cast.
- :func:`pack_grads_rank_major`: anything else (any shard dim, uneven shards, casts, missing
  gradients as zeros, gaps): one ``_foreach_copy_`` of every piece and one ``_foreach_zero_``
  of every padding, as fast on CPU as a copy per piece (measured) and two dispatches.

The kernels know nothing about process groups. See [Note: flat group buffers].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardkit.core.engine.param import FSDPParam
from shardkit.core.runtime.buffers import ShardGeometry, rank_major_view

__all__ = ["Packing", "pack_dim0_grads_fused", "pack_even_dim0_grads", "pack_grads_rank_major"]

# torch 2.15's copy-in for a group whose gradients come in several dtypes (bf16 gradients and
# the fp32 ones of parameters tensor parallelism sums first); None before 2.15.
_CHUNK_CAT_MIXED_DTYPE: Any = getattr(torch.ops.fsdp, "chunk_cat_mixed_dtype", None)


@dataclass(frozen=True, slots=True)
class Packing:
    """Which parameters one reduction carries, and where each sits in a row of it."""

    params: tuple[FSDPParam, ...]
    offsets: tuple[int, ...]
    """Element offset of each parameter's padded shard within a row."""
    numel: int
    """S: a row's elements (one rank's padded shards, and any gaps between them)."""
    geometries: tuple[ShardGeometry, ...]
    """Each parameter's shard geometry."""
    even_dim0: bool
    """Whether every shard is dim-0, even and not empty: ``pack_even_dim0_grads`` packs them."""
    dim0_packed: bool
    """Whether every shard is dim-0 and not empty, back to back from column 0 with no gaps:
    ``pack_dim0_grads_fused`` packs them."""
    gaps_after: tuple[int, ...] = ()
    """Columns after each parameter's shard that no parameter fills (a flat-shard layout's
    alignment, and its tail): zeroed at each packing, so the reduced tensor holds zeros there.
    Empty: none anywhere."""

    @staticmethod
    def of(params: Sequence[FSDPParam]) -> Packing:
        """Lay ``params`` out one after another."""
        offsets: list[int] = []
        cursor = 0
        for p in params:
            offsets.append(cursor)
            cursor += p.geometry.shard_numel
        return Packing.at(params, offsets, cursor)

    @staticmethod
    def at(params: Sequence[FSDPParam], offsets: Sequence[int], numel: int) -> Packing:
        """Lay ``params`` out at increasing element offsets in rows of ``numel`` elements."""
        geometries = tuple(p.geometry for p in params)
        ends = [o + g.shard_numel for o, g in zip(offsets, geometries, strict=True)]
        nexts = [*offsets[1:], numel]
        gaps_after = tuple(b - a for a, b in zip(ends, nexts, strict=False))
        if offsets and (offsets[0] != 0 or min(gaps_after) < 0):
            raise ValueError(f"offsets {list(offsets)} do not lay the shards out in order")
        # An empty gradient cannot be viewed as (W, -1): the general path packs those.
        dim0 = all(g.dim == 0 and g.shard_numel for g in geometries)
        return Packing(
            tuple(params),
            tuple(offsets),
            numel,
            geometries,
            dim0 and all(g.is_even for g in geometries),
            dim0 and not any(gaps_after),
            gaps_after if any(gaps_after) else (),
        )

    def pack(
        self, grads: Sequence[torch.Tensor | None], out: torch.Tensor, *, fused: bool = False
    ) -> None:
        """Pack full gradients (None: zeros) rank-major into ``out`` (W, S), cast to its dtype.

        ``fused``: one ``_chunk_cat`` where it can (the device prefers one kernel per group).
        """
        if fused and self.dim0_packed and pack_dim0_grads_fused(grads, out):
            return
        if not (self.even_dim0 and pack_even_dim0_grads(grads, out, self.gaps_after)):
            pack_grads_rank_major(grads, self.geometries, self.offsets, out, self.gaps_after)


def pack_grads_rank_major(
    grads: Sequence[torch.Tensor | None],
    geometries: Sequence[ShardGeometry],
    offsets: Sequence[int],
    out: torch.Tensor,
    gaps_after: Sequence[int] = (),
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
        gaps_after: columns after each parameter's shard to zero (a flat-shard layout's
            alignment); empty: none.
    """
    targets: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    zeros: list[torch.Tensor] = []
    gaps = list(gaps_after) or [0] * len(offsets)
    for grad, geo, offset, gap in zip(grads, geometries, offsets, gaps, strict=True):
        # narrow, not slicing: an index covering a whole dim dispatches nothing, which would
        # make the count of operations depend on the sizes (narrow always dispatches).
        block = out.narrow(1, offset, geo.shard_numel)
        if grad is None:
            zeros.append(block)
        elif geo.is_even:
            targets.append(block.view(geo.world, *geo.padded_shard_shape))
            sources.append(rank_major_view(grad, geo))
        else:
            _uneven_dim0_pieces(grad, geo, block, (targets, sources, zeros))
        if gap:
            zeros.append(out.narrow(1, offset + geo.shard_numel, gap))
    _copy_all(targets, sources)
    if zeros:
        torch._foreach_zero_(zeros)


def _uneven_dim0_pieces(
    grad: torch.Tensor,
    geo: ShardGeometry,
    block: torch.Tensor,
    into: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]],
) -> None:
    """The copies and zeroings that pack a dim-0 shard whose last ranks are short.

    Rank r's padded shard is elements ``[r * n, (r + 1) * n)`` of the flat gradient (n:
    shard_numel) where those exist: the ranks with a whole shard take one piece together,
    the one cut short (there is one: the shard is uneven) another, and the padding after it
    is zeroed. The same pieces whatever the world size, some of them empty.
    """
    targets, sources, zeros = into
    flat = grad.reshape(-1)
    n, world = geo.shard_numel, geo.world
    whole, rest = divmod(flat.numel(), n)
    targets.append(block.narrow(0, 0, whole))
    sources.append(flat.narrow(0, 0, whole * n).view(whole, n))
    short = block[whole]
    targets.append(short.narrow(0, 0, rest))
    sources.append(flat.narrow(0, whole * n, rest))
    zeros.append(short.narrow(0, rest, n - rest))
    zeros.append(block.narrow(0, whole + 1, world - whole - 1))


def _copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for every i: one dispatch where foreach can do it."""
    if not targets:
        return
    plain = all(type(s) is torch.Tensor for s in sources)
    recorded = torch.is_grad_enabled() and any(s.requires_grad for s in sources)
    if plain and not recorded:
        torch._foreach_copy_(targets, sources)
        return
    # Tensor subclasses and gradients that autograd records (a create_graph backward)
    # are copied one by one, as copy_ knows how.
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source)


def pack_even_dim0_grads(
    grads: Sequence[torch.Tensor | None],
    out: torch.Tensor,
    gaps_after: Sequence[int] = (),
) -> bool:
    """Pack like :func:`pack_grads_rank_major` with one ``cat``: even dim-0 shards, no cast.

    A gradient of an even dim-0 shard viewed as (W, shard_numel) has rank r's shard as row
    r, so the (W, S) buffer is their concatenation along dim 1. The caller vouches for the
    geometries: every one dim-0, even and non-empty, in order from column 0, filling
    ``out``'s rows.

    Args:
        grads: full gradients, one per parameter, in the order of their columns.
        out: the (W, S) reduce-scatter input, typed in the reduce dtype.
        gaps_after: columns of zeros after each gradient (a flat-shard layout's alignment);
            empty: none anywhere.

    Returns:
        False, having written nothing, where the general path must pack: a missing
        gradient (sent as zeros), a cast (``cat``'s casting path measured slower than
        copies: 2.3 against 2.0 ms a backward of the FSDP1 script's groups), a tensor
        subclass, or one that autograd records (``out=`` ops refuse those).
    """
    world = out.shape[0]
    parts: list[torch.Tensor] = []
    for grad in grads:
        if grad is None or type(grad) is not torch.Tensor or grad.dtype != out.dtype:
            return False
        parts.append(grad.reshape(world, -1))  # a view unless the gradient is not contiguous
    if torch.is_grad_enabled() and any(part.requires_grad for part in parts):
        return False
    gaps = list(gaps_after) or [0] * len(parts)
    if any(gaps):
        parts = _with_zero_columns(parts, gaps, out)
    torch.cat(parts, dim=1, out=out)
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


def pack_dim0_grads_fused(grads: Sequence[torch.Tensor | None], out: torch.Tensor) -> bool:
    """Pack like :func:`pack_grads_rank_major` with one ``_chunk_cat`` for the whole group.

    ``_chunk_cat`` cuts each gradient into W chunks along dim 0, zero pads the short ones and
    writes chunk r of every gradient, one after another and cast to ``out``'s dtype, into row
    r: exactly the rank-major packing of dim-0 shards, even or not, in one kernel on CUDA (on
    CPU its kernel is slower than ``cat``, so the engine uses it on accelerators only). The
    caller vouches that every shard is dim-0 and that the shards fill ``out``'s rows with no
    gaps.

    Returns:
        False, having written nothing, where it cannot: a missing gradient, a tensor
        subclass, one that autograd records, or gradients of several dtypes before torch
        2.15 (from 2.15 on, torch's ``fsdp::chunk_cat_mixed_dtype`` packs those as torch's
        ``fully_shard`` does: on CUDA one kernel per dtype, casting as it copies).
    """
    parts: list[torch.Tensor] = []
    for grad in grads:
        if grad is None or type(grad) is not torch.Tensor:
            return False
        parts.append(grad)
    if not parts:
        return False
    mixed = len({part.dtype for part in parts}) != 1
    if mixed and _CHUNK_CAT_MIXED_DTYPE is None:
        return False
    if torch.is_grad_enabled() and any(part.requires_grad for part in parts):
        return False
    if mixed:
        _CHUNK_CAT_MIXED_DTYPE(parts, dim=0, num_chunks=out.shape[0], out=out)
    else:
        torch._chunk_cat(parts, 0, out.shape[0], out=out)
    return True
