"""Finding a delta's changes: this rank's part packed, chunk by chunk, over the kept one.

A delta export compares each rank's part of a bucket, in the export dtype, with the part it
exported last. Packing the whole new part first and comparing it after would allocate a second
part (a fresh buffer of 1/W of the bucket, whose first touch costs about as much as the cast)
and stream both through memory twice. Instead the part is walked in chunks of
:data:`CHUNK_ELEMENTS`: each chunk is cast into one small scratch buffer, compared with the
kept chunk while both are in cache, and copied over it. After the count the kept part *is*
this export's part (what a plain bucket sends, and what the next delta compares against), and
a rank holds one part, not two.

Before that, a sample of the part (1/16, cast and compared, nothing written) tells a part
most of which changed (a high learning rate): it is cast straight into place, uncompared, as
a full export packs it, and the bucket moves whole (:func:`sample_is_dense`).

An export that fails after this leaves the kept part half new: the exporter then forgets it
(the next export is full), as it forgets any failed export's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardkit.core.export.axis_gathers import AxisGather
from shardkit.core.export.delta_encoding import DENSE, WIDTH, LocalChanges, changed_lanes

__all__ = ["CHUNK_ELEMENTS", "SAMPLE_STRIDE", "SAMPLE_WINDOW", "refresh_part", "sample_is_dense"]

CHUNK_ELEMENTS = 1 << 18
"""Elements per chunk: the chunk, its kept twin and their flags fit a core's L2 cache (a
multiple of 4, so every chunk starts on an 8-byte word)."""
SAMPLE_WINDOW = 1 << 14
"""Elements per window of the sample that tells a dense part before its comparison."""
SAMPLE_STRIDE = 1 << 18
"""One window every this many elements of the part: a sample of 1/16."""


def refresh_part(
    pieces: Sequence[tuple[AxisGather, torch.Tensor, int]],
    part: torch.Tensor,
    dtype: torch.dtype,
    limit: int,
) -> LocalChanges | None:
    """Pack ``pieces`` over ``part`` in place; the changes, or None past ``limit`` of them.

    Args:
        pieces: per tensor, its gather, this rank's piece (as stored) and its byte offset in
            the part (a multiple of 8; each segment is padded to 8 bytes, padding zero).
        part: the kept part (uint8), holding the last export's values; on return, this one's.
        dtype: the export dtype (every piece's).
        limit: past this many changes the positions are not built (the bucket goes plain).
    """
    itemsize, width = dtype.itemsize, WIDTH[dtype.itemsize]
    scratch = torch.empty(CHUNK_ELEMENTS, dtype=dtype, device=part.device)
    if limit >= 0 and sample_is_dense(pieces, part, dtype, scratch):
        limit = -1  # nothing compared: every chunk is cast straight into place
    found: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    count = 0
    for gather, piece, offset in pieces:
        numel = -(-gather.padded_numel * itemsize // 8) * 8 // itemsize
        kept = part[offset : offset + numel * itemsize].view(dtype)
        flat = _flat_padded(gather, piece, dtype)
        first = offset // itemsize
        for start in range(0, numel, CHUNK_ELEMENTS):
            stop = min(start + CHUNK_ELEMENTS, numel)
            old = kept[start:stop]
            # Past the limit nothing is compared: the chunk is cast straight into place.
            new = scratch[: stop - start] if count <= limit else old
            valid = max(0, min(flat.numel(), stop) - start)
            new[:valid].copy_(flat[start : start + valid])  # the cast happens here
            new[valid:].zero_()  # the padding rows and the alignment gap
            if count > limit:
                continue
            positions, now_bits, old_bits = changed_lanes(new.view(width), old.view(width))
            count += positions.numel()
            steps = now_bits.to(torch.int64) - old_bits.to(torch.int64)
            found.append((positions + (first + start), now_bits.view(dtype), steps))
            # Only the changed elements are written back: a few percent of the chunk (a copy
            # of the whole chunk, tried, cost more: 0.63 s against 0.48 s at 150M, profiled).
            old.view(width).index_copy_(0, positions, now_bits)
    length = part.numel() // itemsize
    if count > limit:
        return None  # dense: the bucket moves whole; the part is refreshed all the same
    if not found:
        empty = torch.empty(0, dtype=torch.int64, device=part.device)
        return LocalChanges(empty, torch.empty(0, dtype=dtype, device=part.device), empty, length)
    positions, values, steps = (torch.cat(column) for column in zip(*found, strict=True))
    return LocalChanges(positions, values, steps, length)


def sample_is_dense(
    pieces: Sequence[tuple[AxisGather, torch.Tensor, int]],
    part: torch.Tensor,
    dtype: torch.dtype,
    scratch: torch.Tensor,
) -> bool:
    """Whether more than 1/``DENSE`` of a sample of the part changed (nothing is written).

    The sample: a window of ``SAMPLE_WINDOW`` elements every ``SAMPLE_STRIDE`` of the part
    (1/16), of the dim-0 pieces, cast into ``scratch`` and compared element by element. A part
    mostly changed would otherwise be compared, and its positions built, until its count
    passed the limit (at 30% changed, 40% of it); a sparse one pays 1/16 of a comparison more.
    """
    itemsize, width = dtype.itemsize, WIDTH[dtype.itemsize]
    changed = seen = 0
    for gather, piece, offset in pieces:
        if gather.tensor_dim != 0 or not piece.is_contiguous():
            continue  # packed whole before it is cast: not sampled
        flat = piece.reshape(-1)
        first = offset // itemsize
        kept = part[offset : offset + flat.numel() * itemsize].view(width)
        # The windows lie at multiples of the stride in the part, not in each tensor, so
        # that small tensors are not all sampled.
        start = -(-first // SAMPLE_STRIDE) * SAMPLE_STRIDE - first
        for at in range(start, flat.numel(), SAMPLE_STRIDE):
            stop = min(at + min(SAMPLE_WINDOW, scratch.numel()), flat.numel())
            window = scratch[: stop - at]
            window.copy_(flat[at:stop])
            changed += int(torch.count_nonzero(window.view(width) != kept[at:stop]))
            seen += stop - at
    return changed * DENSE > seen > 0


def _flat_padded(gather: AxisGather, piece: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The piece's elements in the part's order, as stored (cast chunk by chunk later).

    A dim-0 piece is its padded part's first rows already; another cut is packed (and cast)
    whole here, since its padding sits between rows.
    """
    if gather.tensor_dim == 0 and piece.is_contiguous():
        return piece.reshape(-1)
    packed = torch.empty(gather.padded_numel, dtype=dtype, device=piece.device)
    gather.pack(piece, packed)
    return packed
