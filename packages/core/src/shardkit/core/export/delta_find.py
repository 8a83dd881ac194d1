"""Finding a delta's changes: this rank's part packed, span by span, over the kept one.

A delta export compares each rank's part of a bucket, in the export dtype, with the part it
exported last. Packing the whole new part first and comparing it after would allocate a second
part (1/W of the bucket, held beside the kept one). Instead the part is walked in spans of
:data:`SPAN_ELEMENTS`: each span is cast into one scratch buffer (one copy per piece it
covers), compared with the kept span eight bytes at a time, its changed words written over
the kept span while both are in cache, and the changed words' lanes worked: positions, new
values, steps. A span costs the same ops whatever its changes (about 17, each over the
span's words or its changes), so a part of 75M elements launches a few hundred, where chunks
of 2^18 took thousands. Working the lanes once per part instead, after the walk, would save
those few hundred but hold every changed word's index, new and old bits at once (24 bytes a
changed word: 0.8 bytes an element, 40% of a bf16 part, at 3.4% changed); span by span
only the changes stay. After the count the kept part *is* this export's part (what a plain bucket
sends, and what the next delta compares against), and a rank holds one part and one span,
not two parts.

Before that, a sample of the part (1/16, cast and compared, nothing written) tells a part
most of which changed (a high learning rate): it is cast straight into place, uncompared, as
a full export packs it, and the bucket moves whole (:func:`sample_is_dense`).

An export that fails after this leaves the kept part half new: the exporter then forgets it
(the next export is full), as it forgets any failed export's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardkit.core.export.axis_gathers import AxisGather
from shardkit.core.export.delta_encoding import DENSE, STEP_WIDTH, WIDTH, LocalChanges

__all__ = [
    "SAMPLE_STRIDE",
    "SAMPLE_WINDOW",
    "SMALLEST_SPAN",
    "SPAN_ELEMENTS",
    "refresh_part",
    "sample_is_dense",
]

SPAN_ELEMENTS = 1 << 22
"""Elements per span (a multiple of 8, so every span starts on an 8-byte word): 8 MiB of
bf16 scratch. On a part of 75M elements at 3.4% changed, spans of 2^22 took 0.35 s and of
2^20 0.42 s (the compare is bound by memory, not by the cache), launching a quarter of the
ops. A smaller part walks spans of 1/16 of it (2^18 elements at least): its scratch, held
during the count, stays a small share of the part it holds anyway."""
SMALLEST_SPAN = 1 << 18
"""The fewest elements a span holds (unless :data:`SPAN_ELEMENTS` is fewer)."""
SAMPLE_WINDOW = 1 << 14
"""Elements per window of the sample that tells a dense part before its comparison."""
SAMPLE_STRIDE = 1 << 18
"""One window every this many elements of the part: a sample of 1/16."""


@dataclass(frozen=True, slots=True)
class _Segment:
    """One piece's place in the part (elements): its values, then zeros to the next one."""

    first: int
    values: torch.Tensor
    """The piece's elements in the part's order, as stored (cast when copied)."""
    stop: int
    """Where the next piece starts (padding rows and the 8-byte alignment gap are zeros)."""


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
    itemsize = dtype.itemsize
    kept = part.view(dtype)
    length = kept.numel()
    segments = _segments(pieces, dtype, length)
    span = _span(length)
    scratch = torch.empty(min(span, length), dtype=dtype, device=part.device)
    if limit >= 0 and sample_is_dense(pieces, part, dtype, scratch):
        limit = -1  # nothing compared: every span is cast straight into place
    per = 8 // itemsize
    kept_words = part.view(torch.int64)
    flags = torch.empty(scratch.numel() // per, dtype=torch.bool, device=part.device)
    found: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    count = 0
    for start in range(0, length, span):
        stop = min(start + span, length)
        if count > limit:  # past the limit nothing is compared: cast straight into place
            _fill(kept[start:stop], segments, start)
            continue
        new = scratch[: stop - start]
        _fill(new, segments, start)
        now = new.view(torch.int64)  # (span / per,) words
        before = kept_words[start // per : stop // per]
        torch.ne(now, before, out=flags[: now.numel()])
        words = torch.nonzero(flags[: now.numel()]).view(-1)  # (k,) ascending
        now_words = now.index_select(0, words)
        before_words = before.index_select(0, words)
        # Whole words are written back, while the span is in cache: their unchanged lanes
        # hold the same bits either way.
        before.index_copy_(0, words, now_words)
        # A changed word holds one change at least: past the limit, no lanes are worked.
        count += words.numel()
        if count <= limit:
            lanes = _lanes(words.add_(start // per), now_words, before_words, dtype)
            count += lanes[0].numel() - words.numel()
            found.append(lanes)
    if count > limit:
        return None  # dense: the bucket moves whole; the part is refreshed all the same
    if not found:  # an empty part
        nothing = torch.empty(0, dtype=torch.int64, device=part.device)
        return LocalChanges(nothing, torch.empty(0, dtype=dtype, device=part.device), nothing, 0)
    columns = zip(*found, strict=True)
    positions, values, steps = (torch.cat(c) if len(c) > 1 else c[0] for c in columns)
    return LocalChanges(positions, values, steps, length)


def _span(length: int) -> int:
    """Elements per span of a part of ``length`` (a multiple of 8)."""
    share = max(SMALLEST_SPAN, length // 16) // 8 * 8
    return min(SPAN_ELEMENTS, share)


def _lanes(
    words: torch.Tensor, now: torch.Tensor, before: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The changed elements of the changed ``words``: positions in the part, values, steps.

    ``now`` and ``before``: the words' new and old bits.
    """
    per = 8 // dtype.itemsize
    width = WIDTH[dtype.itemsize]
    lanes_now, lanes_before = now.view(width), before.view(width)  # (k * per,)
    if per == 1:
        positions, bits_now, bits_before = words, lanes_now, lanes_before
    else:
        lanes = torch.nonzero(lanes_now != lanes_before).view(-1)  # ascending
        shift = per.bit_length() - 1  # per is 2, 4 or 8: shifts and masks, not divisions
        positions = words.index_select(0, lanes >> shift).bitwise_left_shift_(shift)
        positions.bitwise_or_(lanes & (per - 1))
        bits_now = lanes_now.index_select(0, lanes)
        bits_before = lanes_before.index_select(0, lanes)
    steps = bits_now.to(STEP_WIDTH[dtype.itemsize]).sub_(bits_before)
    return positions, bits_now.view(dtype), steps


def _segments(
    pieces: Sequence[tuple[AxisGather, torch.Tensor, int]], dtype: torch.dtype, length: int
) -> list[_Segment]:
    # A piece cut along another dim than 0 is packed (and cast) whole here, so a part holds
    # those pieces twice while it is walked: the FSDP cut is along dim 0.
    firsts = [offset // dtype.itemsize for _, _, offset in pieces]
    return [
        _Segment(first, _flat_padded(gather, piece, dtype), stop)
        for (gather, piece, _), first, stop in zip(
            pieces, firsts, [*firsts[1:], length], strict=True
        )
    ]


def _fill(out: torch.Tensor, segments: list[_Segment], start: int) -> None:
    """Elements ``start`` to ``start + out.numel()`` of the part, packed into ``out``."""
    stop = start + out.numel()
    for segment in segments:
        if segment.stop <= start or segment.first >= stop:
            continue
        lo, hi = max(segment.first, start), min(segment.stop, stop)
        valid = min(hi, segment.first + segment.values.numel())
        if valid > lo:  # the cast happens here
            out[lo - start : valid - start].copy_(
                segment.values[lo - segment.first : valid - segment.first]
            )
        if hi > max(lo, valid):  # the padding rows and the alignment gap
            out[max(lo, valid) - start : hi - start].zero_()


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
    """The piece's elements in the part's order, as stored (cast span by span later).

    A dim-0 piece is its padded part's first rows already; another cut is packed (and cast)
    whole here, since its padding sits between rows.
    """
    if gather.tensor_dim == 0 and piece.is_contiguous():
        return piece.reshape(-1)
    packed = torch.empty(gather.padded_numel, dtype=dtype, device=piece.device)
    gather.pack(piece, packed)
    return packed
