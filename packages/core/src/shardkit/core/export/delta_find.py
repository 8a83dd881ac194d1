"""Finding a delta's changes: this rank's part packed, span by span, over the kept one.

A delta export compares each rank's part of a bucket, in the export dtype, with the part it
exported last. Packing the whole new part first and comparing it after would allocate a second
part (1/W of the bucket, held beside the kept one). Instead the part is walked in spans of
:data:`SPAN_ELEMENTS`: each span is cast into one scratch buffer (one copy per piece it
covers), compared with the kept span eight bytes at a time, its changed words written over
the kept span while both are in cache, and the changed words' lanes worked: positions, new
values, steps. A span costs the same ops whatever its changes (about 17, each over the
span's words or its changes; 19 with the cast of positions and steps to their held
widths), so a part of 75M elements launches a few hundred, where chunks
of 2^18 took thousands. Working the lanes once per part instead, after the walk, would save
those few hundred but hold every changed word's index, new and old bits at once (24 bytes a
changed word: 0.8 bytes an element, 40% of a bf16 part, at 3.4% changed); span by span
only the changes stay. After the count the kept part *is* this export's part (what a plain bucket
sends, and what the next delta compares against), and a rank holds one part and one span,
not two parts.

Before that, a sample of the part (1/16, cast and compared, nothing written) tells a part
most of which changed (a high learning rate): it is cast straight into place, uncompared, as
a full export packs it, and the bucket moves whole (``delta_sample.py``).

An export that fails after this leaves the kept part half new: the exporter then forgets it
(the next export is full), as it forgets any failed export's.

Where this rank's in-process receiver holds the last export whole (a module, a mirror), its
rows of it are the base instead (:class:`HeldRows`): compared span by span, never written, and
no part is kept (1/W of the model less, from sync to sync). What a rank holds of its changes
during the count: int32 positions (int64 past 2^31 elements), values, int8 steps: 7 bytes a
bf16 change, the spans' changes joined one field at a time (``torch.cat`` would hold them
twice).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shardkit.core.export.axis_gathers import AxisGather
from shardkit.core.export.delta_encoding import WIDTH, LocalChanges
from shardkit.core.export.delta_sample import sample_is_dense

__all__ = [
    "HeldRows",
    "SMALLEST_SPAN",
    "SPAN_ELEMENTS",
    "refresh_part",
]

SPAN_ELEMENTS = 1 << 22
"""Elements per span (a multiple of 8, so every span starts on an 8-byte word): 8 MiB of
bf16 scratch. On a part of 75M elements at 3.4% changed, spans of 2^22 took 0.35 s and of
2^20 0.42 s (the compare is bound by memory, not by the cache), launching a quarter of the
ops. On the CPU a smaller part walks spans of 1/16 of it (2^18 elements at least): its
scratch, held during the count, stays a small share of the part it holds anyway; on a GPU,
where a span costs launches and waits rather than bytes, every part walks spans of this
size (``_span``)."""
SMALLEST_SPAN = 1 << 18
"""The fewest elements a span holds (unless :data:`SPAN_ELEMENTS` is fewer)."""


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
    part: torch.Tensor | HeldRows,
    dtype: torch.dtype,
    limit: int,
) -> LocalChanges | None:
    """Pack ``pieces`` over ``part`` in place; the changes, or None past ``limit`` of them.

    Args:
        pieces: per tensor, its gather, this rank's piece (as stored) and its byte offset in
            the part (a multiple of 8; each segment is padded to 8 bytes, padding zero).
        part: the kept part (uint8), holding the last export's values; on return, this one's.
            Or the receiver's copy of this rank's rows (:class:`HeldRows`): compared, never
            written (the receiver serves it until its commit).
        dtype: the export dtype (every piece's).
        limit: past this many changes the positions are not built (the bucket goes plain).
    """
    held = part if isinstance(part, HeldRows) else None
    length = part.length if isinstance(part, HeldRows) else part.numel() // dtype.itemsize
    device = pieces[0][1].device if pieces else "cpu"
    segments = _segments(pieces, dtype, length)
    span = _span(length, device)
    scratch = torch.empty(min(span, length), dtype=dtype, device=device)
    if limit >= 0 and sample_is_dense(pieces, _kept_elements(pieces, part, dtype), scratch):
        if held is not None:
            return None  # nothing kept to refresh: the bucket moves whole
        limit = -1  # nothing compared: every span is cast straight into place
    position_dtype = _position_dtype(length)
    walk = _Walk(dtype, length, segments, held, scratch)
    if held is None:
        assert isinstance(part, torch.Tensor)
        walk.kept = part
    found: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    count = 0
    for start in range(0, length, span):
        stop = min(start + span, length)
        if count > limit:
            if held is not None:
                return None  # nothing kept to refresh: stop here
            walk.cast_into_place(start, stop)  # past the limit: nothing compared
            continue
        words, now_words, before_words = walk.changed_words(start, stop)
        # A changed word holds one change at least: past the limit, no lanes are worked.
        count += words.numel()
        if count <= limit:
            lanes = _lanes(words, now_words, before_words, dtype, start, position_dtype)
            count += lanes[0].numel() - words.numel()
            found.append(lanes)
    if count > limit:
        return None  # dense: the bucket moves whole; the part is refreshed all the same
    if not found:  # an empty part
        nothing = torch.empty(0, dtype=_position_dtype(length), device=device)
        steps = torch.empty(0, dtype=torch.int8, device=device)
        return LocalChanges(nothing, torch.empty(0, dtype=dtype, device=device), steps, 0)
    del walk, scratch  # freed before the join, whose peak is the count's
    positions, values, steps = _joined(found)
    return LocalChanges(positions, values, steps, length)


@dataclass(frozen=True, slots=True)
class HeldRows:
    """The receiver's copy of the last export, as this rank's part of one bucket.

    An in-process receiver that holds the last export whole (a module, a mirror) holds this
    rank's rows of it too: comparing with them saves keeping a part (1/W of the model).
    """

    rows: tuple[torch.Tensor, ...]
    """Per piece, in the pieces' order: the receiver's elements of this rank's rows, flat, in
    the export dtype (``piece.numel()`` of them; the part's padding is zeros, not held)."""
    length: int
    """Elements of the part (its padded layout, as a kept part would hold it)."""


@dataclass(slots=True)
class _Walk:
    """One part's walk, span by span: the new bits cast into scratch, compared with the old."""

    dtype: torch.dtype
    length: int
    segments: list[_Segment]
    held: HeldRows | None
    scratch: torch.Tensor
    kept: torch.Tensor | None = None
    """The kept part (uint8), refreshed in place; None where the receiver's rows are the base."""
    before_scratch: torch.Tensor | None = None
    """Where a span of the receiver's rows is laid out as the part's (held rows only)."""
    before_segments: list[_Segment] = field(default_factory=list)
    flags: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.flags = torch.empty(
            self.scratch.numel() // self.per, dtype=torch.bool, device=self.scratch.device
        )
        if self.held is not None:
            # The receiver's rows sit at any offset of its tensors (not always on an 8-byte
            # word) and without the part's padding: each span of them is copied into the
            # part's layout first, a copy in cache where a kept part would be 1/W of the
            # model held from sync to sync.
            self.before_scratch = torch.empty_like(self.scratch)
            self.before_segments = [
                _Segment(s.first, row, s.stop)
                for s, row in zip(self.segments, self.held.rows, strict=True)
            ]

    @property
    def per(self) -> int:
        return 8 // self.dtype.itemsize

    def cast_into_place(self, start: int, stop: int) -> None:
        assert self.kept is not None
        _fill(self.kept.view(self.dtype)[start:stop], self.segments, start)

    def changed_words(
        self, start: int, stop: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The span's changed words (ascending, in the span), their new and old bits."""
        new = self.scratch[: stop - start]
        _fill(new, self.segments, start)
        now = new.view(torch.int64)  # (span / per,) words
        if self.kept is not None:
            before = self.kept.view(torch.int64)[start // self.per : stop // self.per]
        else:
            assert self.before_scratch is not None
            old = self.before_scratch[: stop - start]
            _fill(old, self.before_segments, start)
            before = old.view(torch.int64)
        flags = self.flags[: now.numel()]
        torch.ne(now, before, out=flags)
        words = torch.nonzero(flags).view(-1)  # (k,) ascending
        now_words = now.index_select(0, words)
        before_words = before.index_select(0, words)
        if self.kept is not None:
            # Whole words are written back, while the span is in cache: their unchanged
            # lanes hold the same bits either way.
            before.index_copy_(0, words, now_words)
        return words, now_words, before_words


def _position_dtype(length: int) -> torch.dtype:
    """Positions in a part of ``length`` elements: int32 where they fit (half of int64's)."""
    return torch.int32 if length < 2**31 else torch.int64


def _joined(
    found: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The spans' changes joined, one field at a time, each span's freed once copied.

    ``torch.cat`` would hold every span's changes and the joined ones at once: twice the
    changes, the count's peak where one bucket is most of a rank's part.
    """
    columns = [list(c) for c in zip(*found, strict=True)]
    found.clear()
    joined = []
    for column in columns:
        if len(column) == 1:
            joined.append(column.pop())
            continue
        out = torch.empty(
            sum(c.numel() for c in column), dtype=column[0].dtype, device=column[0].device
        )
        at = 0
        while column:
            chunk = column.pop(0)
            out[at : at + chunk.numel()].copy_(chunk)
            at += chunk.numel()
        joined.append(out)
    positions, values, steps = joined
    return positions, values, steps


def _span(length: int, device: torch.device | str = "cpu") -> int:
    """Elements per span of a part of ``length`` on ``device`` (a multiple of 8).

    On the CPU a part under 16 full spans walks spans of 1/16 of it, so that its scratch stays
    a small share of it. On a GPU a span's cost is its launches (about 22) and its two waits
    for the device (each ``nonzero`` reads its count back), not its bytes: every part walks
    full spans there (a 64 MiB bucket's part at W=2, 16M elements: 4 spans and 8 waits, not
    16 and 32), its scratch a span's, as a large part's is on the CPU.
    """
    if torch.device(device).type != "cpu":
        return SPAN_ELEMENTS
    share = max(SMALLEST_SPAN, length // 16) // 8 * 8
    return min(SPAN_ELEMENTS, share)


def _lanes(
    words: torch.Tensor,
    now: torch.Tensor,
    before: torch.Tensor,
    dtype: torch.dtype,
    start: int,
    position_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The changed elements of the changed ``words``: positions in the part, values, steps.

    ``words``: in the span, which starts at element ``start`` of the part; ``now`` and
    ``before``: the words' new and old bits.
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
    # The step in the element's own width: the receiver adds it to the bits it holds with the
    # same wrap, so it lands on the new bits. Held as int8, saturated: a step that does not
    # fit a byte (|step| > 127) reads -128, and its new value travels instead (the encoding's
    # literal changes). With int32 positions a bf16 change holds 7 bytes, not 14.
    steps = torch.sub(bits_now, bits_before)
    if steps.element_size() > 1:
        steps = steps.clamp_(-128, 128).to(torch.int8)  # 128 wraps to -128: literal too
    return positions.to(position_dtype).add_(start), bits_now.view(dtype), steps


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


def _kept_elements(
    pieces: Sequence[tuple[AxisGather, torch.Tensor, int]],
    part: torch.Tensor | HeldRows,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Per piece, the last export's elements in the base, as integers of the element's width.

    Views: a kept part's bytes at the piece's offset, or the receiver's rows.
    """
    width = WIDTH[dtype.itemsize]
    if isinstance(part, HeldRows):
        return [rows.view(width) for rows in part.rows]
    return [
        part[offset : offset + piece.numel() * dtype.itemsize].view(width)
        for _, piece, offset in pieces
    ]
