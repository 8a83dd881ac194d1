"""Finding a delta's changes: this rank's part packed, chunk by chunk, over the kept one.

A delta export compares each rank's part of a bucket, in the export dtype, with the part it
exported last. Packing the whole new part first and comparing it after would allocate a second
part (a fresh buffer of 1/W of the bucket, whose first touch costs about as much as the cast)
and stream both through memory twice. Instead the part is walked in chunks of
:data:`CHUNK_ELEMENTS`: each chunk is cast into one small scratch buffer, compared with the
kept chunk while both are in cache, and copied over it. After the count the kept part *is*
this export's part (what a plain bucket sends, and what the next delta compares against), and
a rank holds one part, not two.

An export that fails after this leaves the kept part half new: the exporter then forgets it
(the next export is full), as it forgets any failed export's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardkit.core.export.axis_gathers import AxisGather
from shardkit.core.export.delta_encoding import WIDTH, LocalChanges, changed_lanes

__all__ = ["CHUNK_ELEMENTS", "refresh_part"]

CHUNK_ELEMENTS = 1 << 18
"""Elements per chunk: the chunk, its kept twin and their flags fit a core's L2 cache (a
multiple of 4, so every chunk starts on an 8-byte word)."""


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
            # The whole chunk is copied back: one streaming copy of a chunk in cache costs
            # less than scattering its few percent of changes (index_copy_ checks each index).
            old.copy_(new)
    length = part.numel() // itemsize
    if count > limit:
        return None  # dense: the bucket moves whole; the part is refreshed all the same
    if not found:
        empty = torch.empty(0, dtype=torch.int64, device=part.device)
        return LocalChanges(empty, torch.empty(0, dtype=dtype, device=part.device), empty, length)
    positions, values, steps = (torch.cat(column) for column in zip(*found, strict=True))
    return LocalChanges(positions, values, steps, length)


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
